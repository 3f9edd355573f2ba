"""Optimizer factory: what ``Techniques.optimizer`` names, over the trainable parameters.

Plain torch AdamW / SGD, bitsandbytes' 8-bit and paged AdamW, torchao's 8-bit and 4-bit
AdamW; any of them stepped inside backward (``optimizer_in_backward``); torch AdamW / SGD
with their state in CPU memory (``cpu_offload_optimizer``, CUDA only). bitsandbytes and
torchao are imported only when chosen: both are slow to import and print on import.

Every optimizer built here has a ``state_dict()`` whose state entries map names to plain
tensors or JSON scalars, which is what training checkpoints store (safetensors + JSON).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping
from functools import partial
from itertools import chain
from typing import Callable

import torch
from torch import nn
# torch internal: leaving the dispatch modes around an optimizer step in backward, and telling
# tensor subclasses (NF4, quantized state) apart. If they change, the estimator's fake step and
# the quantized optimizers' state dicts break (tests/predict/test_estimate.py, tests/test_optim.py).
from torch.utils._python_dispatch import (_disable_current_modes, is_in_torch_dispatch_mode,
                                          is_traceable_wrapper_subclass)

from .techniques import Techniques

_BITSANDBYTES = {"adamw8bit": "AdamW8bit", "paged_adamw8bit": "PagedAdamW8bit",
                 "paged_adamw": "PagedAdamW"}
_TORCHAO = {"ao_adamw8bit": "AdamW8bit", "ao_adamw4bit": "AdamW4bit"}


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    seen, out = set(), []
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def build_optimizer(model: nn.Module, techniques: Techniques) -> torch.optim.Optimizer:
    """The optimizer ``techniques`` asks for over the model's trainable parameters."""
    params = trainable_parameters(model)
    if techniques.cpu_offload_optimizer:
        return _cpu_offload_optimizer(params, techniques)
    make = optimizer_factory(techniques)
    return OptimizerInBackward(params, make) if techniques.optimizer_in_backward else make(params)


def optimizer_factory(techniques: Techniques) -> Callable[[list], torch.optim.Optimizer]:
    """A function that builds the named optimizer over a list of parameters."""
    name = techniques.optimizer
    kwargs = dict(lr=techniques.lr, weight_decay=techniques.weight_decay)
    if name == "adamw":
        # fused: one kernel per step, no list-wide temporaries (foreach holds one more copy of
        # every weight at the step, the peak once checkpointing has shrunk the activations) and
        # faster, on CUDA and on CPU alike (DESIGN.md: 1908 against 2378 MiB on the 125M shape).
        return partial(torch.optim.AdamW, **kwargs, fused=True)
    if name == "sgd":
        return partial(torch.optim.SGD, **kwargs)
    if name in _BITSANDBYTES:
        from .quiet import import_quietly

        base = getattr(import_quietly("bitsandbytes.optim"), _BITSANDBYTES[name])
        return partial(type(base.__name__, (_FlatBitsandbytesState, base), {}), **kwargs)
    if name in _TORCHAO:
        from .quiet import import_quietly

        base = getattr(import_quietly("torchao.optim"), _TORCHAO[name])
        return partial(type(base.__name__, (_TorchaoFloatLrFlatState, base), {}), **kwargs)
    raise ValueError(f"optimizer {name!r} is not built by this version.")


class _FlatBitsandbytesState:
    """bitsandbytes' 8-bit state in the flat, unshared form checkpoints store.

    bitsandbytes nests quantized state one level down (to hide it from FSDP); its own
    ``load_state_dict`` accepts it flat too. All parameters share two constant lookup tables,
    and safetensors refuses shared storage, so each entry carries a copy (1 KiB), and loading
    shares them again.
    """

    def state_dict(self) -> dict:
        out = super().state_dict()
        for entry in out["state"].values():
            entry.update(entry.pop(self._FSDP_WRAPPED_QUANT_STATE_KEY, {}))
            entry.update({k: entry[k].clone() for k in ("qmap1", "qmap2") if k in entry})
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for param, state in self.state.items():
            for key, table in (("qmap1", "dynamic"), ("qmap2", "udynamic")):
                if key in state:
                    state[key] = self.name2qmap[table] = self.name2qmap[table].to(param.device)


class _TorchaoFloatLrFlatState:
    """torchao's low-bit AdamW with a float lr, stepping outside dispatch modes, flat state_dict.

    torchao keeps ``lr`` as a tensor (an input of its compiled step, so a new value does not
    recompile) and refuses a float; the session sets floats each step and checkpoints write
    param groups as JSON, so the tensor exists only inside ``step``. ``torch.compile`` refuses
    to trace under a Python dispatch mode, and the CPU memory tracker is one, so the step runs
    outside it (the tracker's post-step hook still files the state it made). Quantized state is
    a tensor subclass: ``state_dict`` spells it as its plain parts (codes, scale, qmap) plus
    ``signed``, and ``load_state_dict`` rebuilds it as torchao would.
    """

    def add_param_group(self, param_group: dict) -> None:
        torch.optim.Optimizer.add_param_group(self, param_group)  # skips torchao's lr -> tensor

    @torch.no_grad()
    def step(self, closure=None):
        lrs = [group["lr"] for group in self.param_groups]
        for group in self.param_groups:
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32)
        try:
            with _outside_dispatch_modes():
                return super().step(closure)
        finally:
            for group, lr in zip(self.param_groups, lrs):
                group["lr"] = lr

    def state_dict(self) -> dict:
        out = super().state_dict()
        out["state"] = {index: _spelled_out(entry) for index, entry in out["state"].items()}
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        plain, parts = {}, {}
        for index, entry in state_dict["state"].items():
            plain[index] = {k: v for k, v in entry.items() if "." not in k}
            for key in entry.keys() - plain[index].keys():
                name, part = key.split(".", 1)
                parts.setdefault((index, name), {})[part] = entry[key]
        super().load_state_dict({**state_dict, "state": plain})
        params = dict(zip(chain.from_iterable(g["params"] for g in state_dict["param_groups"]),
                          chain.from_iterable(g["params"] for g in self.param_groups)))
        for (index, name), tensors in parts.items():
            param = params[index]
            buffer = self._new_buffer(param, tensors.pop("signed"))
            for part, value in tensors.items():
                getattr(buffer, part).copy_(value)
            self.state[param][name] = buffer


def _outside_dispatch_modes():
    return _disable_current_modes() if is_in_torch_dispatch_mode() else contextlib.nullcontext()


def _spelled_out(entry: dict) -> dict:
    """A torchao state entry with each quantized tensor replaced by its plain parts."""
    out = {}
    for name, value in entry.items():
        if is_traceable_wrapper_subclass(value):
            parts, _ = value.__tensor_flatten__()
            out.update({f"{name}.{part}": getattr(value, part) for part in parts})
            out[f"{name}.signed"] = value.signed
        else:
            out[name] = value
    return out


class _ChainedState(Mapping):
    """Several optimizers' ``state`` seen as one parameter -> state mapping (read only)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self._optimizers = optimizers

    def __getitem__(self, param):
        for opt in self._optimizers:
            if param in opt.state:
                return opt.state[param]
        raise KeyError(param)

    def __iter__(self):
        return chain.from_iterable(opt.state for opt in self._optimizers)

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self._optimizers)

    def values(self):  # linear, where Mapping's would look each key up again
        return [s for opt in self._optimizers for s in opt.state.values()]


class OptimizerInBackward(torch.optim.Optimizer):
    """Steps each parameter from its post-accumulate-grad hook, then drops its gradient.

    torch's "optimizer step in backward" recipe: one optimizer per parameter, so at most one
    gradient is alive at a time instead of all of them. ``step`` and ``zero_grad`` do nothing
    (the work happened in backward), so the ordinary training loop runs unchanged.
    ``param_groups`` are the inner optimizers' own groups (setting ``group["lr"]`` reaches
    them), ``state`` is a view of their states, and ``state_dict`` numbers the parameters as
    one optimizer over all of them would. The hooks hold the wrapper weakly, so a dropped
    wrapper stops stepping; ``release_optimizer`` removes them.

    It subclasses ``Optimizer`` so that LR schedulers and the memory tracker accept it, but
    (like torchao's CPUOffloadOptimizer) does not run ``Optimizer.__init__``: the groups and
    state it would keep are the inner optimizers'.
    """

    def __init__(self, params: list[nn.Parameter], make: Callable[[list], torch.optim.Optimizer]):
        self.optimizers = [make([p]) for p in params]
        self.defaults = self.optimizers[0].defaults if self.optimizers else {}
        # Called with a weight right before its update (the undo copy takes it then); the
        # count of updates made tells a failed step whether any weight was written.
        self.before_step: Callable[[nn.Parameter], None] | None = None
        self.stepped = 0
        owner = weakref.ref(self)
        self._hooks = [p.register_post_accumulate_grad_hook(partial(_step_in_backward, owner, i))
                       for i, p in enumerate(params)]

    @property
    def param_groups(self) -> list[dict]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    @property
    def state(self) -> Mapping:
        return _ChainedState(self.optimizers)

    def step(self, closure=None):
        if closure is not None:  # the closure's backward does the stepping
            with torch.enable_grad():
                return closure()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # each gradient was dropped right after its step

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError("OptimizerInBackward takes its parameters at construction.")

    def state_dict(self) -> dict:
        state, groups = {}, []
        for i, opt in enumerate(self.optimizers):
            inner = opt.state_dict()  # its one parameter is number 0
            if 0 in inner["state"]:
                state[i] = inner["state"][0]
            groups.append({**inner["param_groups"][0], "params": [i]})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        groups = state_dict["param_groups"]
        if len(groups) != len(self.optimizers) or any(len(g["params"]) != 1 for g in groups):
            raise ValueError(f"The state has {len(groups)} parameter groups; this optimizer in "
                             f"backward has one per parameter, {len(self.optimizers)}.")
        for opt, group in zip(self.optimizers, groups):
            (index,) = group["params"]
            entry = state_dict["state"].get(index)
            opt.load_state_dict({"state": {} if entry is None else {0: entry},
                                 "param_groups": [{**group, "params": [0]}]})

    def release(self) -> None:
        for hook in self._hooks:
            hook.remove()
        for opt in self.optimizers:
            opt.state.clear()
        self._hooks, self.optimizers = [], []


def _step_in_backward(owner: weakref.ref, index: int, param: nn.Parameter) -> None:
    wrapper = owner()
    if wrapper is not None and wrapper.optimizers:
        if wrapper.before_step is not None:
            wrapper.before_step(param)
        wrapper.stepped += 1
        wrapper.optimizers[index].step()
        param.grad = None


def _cpu_offload_optimizer(params: list[nn.Parameter], techniques: Techniques):
    """torchao's CPUOffloadOptimizer over torch AdamW or SGD: state and step on the CPU."""
    if not params[0].is_cuda:
        raise ValueError(
            f"cpu_offload_optimizer moves optimizer state from a CUDA device to the CPU (torchao's "
            f"CPUOffloadOptimizer); these parameters are on {params[0].device}, where the state is "
            f"already in CPU memory: turn cpu_offload_optimizer off.")
    if techniques.optimizer not in ("adamw", "sgd"):
        raise ValueError("cpu_offload_optimizer wraps a torch optimizer: choose optimizer='adamw' "
                         "or 'sgd'.")
    from .quiet import import_quietly

    CPUOffloadOptimizer = import_quietly("torchao.optim").CPUOffloadOptimizer

    class Offloaded(CPUOffloadOptimizer):
        """Adds what the session needs: ``state`` (all inner optimizers') and ``release``,
        which removes the gradient hooks torchao registers and keeps no handle to."""

        def inner(self) -> list[torch.optim.Optimizer]:
            return [*self.optim_dict.values(), *([self.d_opt] if self.d_opt is not None else [])]

        @property
        def state(self) -> Mapping:
            return _ChainedState(self.inner())

        def release(self) -> None:
            # torch internal: a tensor's post-accumulate-grad hooks by key (torchao's offload
            # optimizer returns no handles). If it changes, a released CPU-offload optimizer
            # keeps stepping from its hooks (CUDA only; tests/test_optim.py on CPU stand-ins).
            for param, key in self.hook_keys:
                param._post_accumulate_grad_hooks.pop(key, None)
            for opt in self.inner():
                opt.state.clear()
            self.optim_dict, self.param_d2h_map, self.d_opt, self.hook_keys = {}, {}, None, []

    def keys_of(p):
        return set(p._post_accumulate_grad_hooks or {})

    before = {p: keys_of(p) for p in params}
    cls = torch.optim.AdamW if techniques.optimizer == "adamw" else torch.optim.SGD
    opt = Offloaded(params, cls, lr=techniques.lr, weight_decay=techniques.weight_decay)
    opt.hook_keys = [(p, key) for p in params for key in keys_of(p) - before[p]]  # release() drops them
    return opt


def release_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Detach an optimizer from the model and drop its state, before it is replaced.

    An optimizer stepped in backward (or offloaded) is hooked onto the parameters: left
    there, it would keep stepping and keep its state alive through the model. Clearing the
    state also frees it while something else (a notebook variable) still holds the optimizer.
    """
    if hasattr(optimizer, "release"):
        optimizer.release()
    else:
        optimizer.state.clear()
