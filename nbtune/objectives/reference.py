"""A frozen copy of the model, the reference of ``dpo`` and ``ipo`` under full finetuning
(``reference="copy"``, or ``"copy_host"``): the weights as they were when the preference
objective started, run each step without gradients. Full finetuning has no adapters to
switch off, so the reference is either these weights kept (here) or their log-probs kept
(``reference="precomputed"``, which cannot score held-out pairs).

``copy`` keeps them on the device (the weights twice there). ``copy_host`` keeps them in
host memory (pinned on CUDA) and brings each layer to the device as the reference forward
reaches it, then drops it: one layer's weights on the device beside the model, and a host
to device copy of the whole model each step.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch import nn

from ..memory.accounting import storage_bytes
from ..models.decoder import CausalLM
from ..state import full_weights

COPIES = ("copy", "copy_host")  # the references that are a frozen copy of the weights


class FrozenCopy:
    """The reference model of a full finetune (see the module's docstring). ``model`` runs
    the forward; ``store`` is where its weights live, ``device`` where they compute."""

    def __init__(self, model: CausalLM, device: torch.device, store: torch.device) -> None:
        self.model, self.device, self.store = model, torch.device(device), torch.device(store)
        self._hooks = _streaming_hooks(model, self.device) if self.store != self.device else []

    @classmethod
    def of(cls, weights: dict[str, torch.Tensor], config, device, host: bool,
           store: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "FrozenCopy":
        """A copy of ``weights`` (``state.full_weights``: the tied head once) of a ``config``
        model, on ``device`` or (``host``) in host memory, pinned when the device is a GPU, in
        ``dtype`` if given. ``store`` overrides where the host keeps it (the estimator: off the
        device it counts)."""
        device = torch.device(device)
        store = torch.device(store if store is not None else "cpu" if host else device)
        with torch.device("meta"):
            model = CausalLM(config)
        mine = model.state_dict()
        unknown = sorted(set(weights) - set(mine))
        missing = sorted(set(mine) - set(weights) - ({"lm_head.weight"} if config.tie_word_embeddings else set()))
        if unknown or missing:
            raise ValueError(f"The reference copy's weights do not match the model: "
                             f"{(unknown or missing)[:3]} {'unknown' if unknown else 'missing'}.")
        wrong = next((name for name, value in weights.items() if value.shape != mine[name].shape), None)
        if wrong is not None:
            raise ValueError(f"The reference copy's weight {wrong!r} is {tuple(weights[wrong].shape)}, "
                             f"but the model's is {tuple(mine[wrong].shape)}: load a state of this model.")
        pin = host and device.type == "cuda" and store.type == "cpu"
        copied = {}
        for name, value in weights.items():
            value = value.detach().to(store, dtype if dtype is not None and value.is_floating_point()
                                      else value.dtype, copy=True)
            copied[name] = value.pin_memory() if pin else value
        model.load_state_dict(copied, strict=False, assign=True)
        model.tie_weights()
        model.requires_grad_(False)
        return cls(model.eval(), device, store)

    def weights(self) -> dict[str, torch.Tensor]:
        """Its weights by name, as ``state.full_weights`` gives a model's (for a checkpoint)."""
        return full_weights(self.model)

    def placed(self, host: bool, dtype: torch.dtype) -> "FrozenCopy":
        """This copy kept on the device or in host memory, in ``dtype`` (the model's, which a
        run may change): itself when already so."""
        same = self.device.type == "cpu" or (self.store != self.device) == host  # (a CPU's host is its device)
        if same and self.model.model.embed_tokens.weight.dtype == dtype:
            return self
        return FrozenCopy.of(self.weights(), self.model.config, self.device, host, dtype=dtype)

    @contextlib.contextmanager
    def scoring(self):
        """While a batch's hidden states are scored: a streamed copy's head stays on the device
        (the loss takes it once a piece), so it crosses once, not once a piece."""
        if self.store == self.device:
            yield
            return
        head = self.model.lm_head
        stored = head._parameters["weight"]
        head._parameters["weight"] = stored.to(self.device, non_blocking=True)
        try:
            yield
        finally:
            head._parameters["weight"] = stored

    def device_bytes(self) -> int:
        """What it keeps on the device (none in host memory)."""
        if self.store != self.device:
            return 0
        return storage_bytes(self.model.parameters(), set())


def _streaming_hooks(model: CausalLM, device: torch.device) -> list:
    """Hooks that bring each part's weights (the embedding, each layer, the norm, the head) to
    ``device`` as the forward reaches it and let them go after: the host copy stays as it is
    (each module reads a device copy in place of its stored parameter while the part runs)."""
    def bring(part, args):
        release(part)  # (nothing left from a forward that raised)
        part._stored = [(m, name, p) for m in part.modules() for name, p in m._parameters.items() if p is not None]
        for m, name, p in part._stored:
            m._parameters[name] = p.to(device, non_blocking=True)

    def release(part, *_):
        for m, name, p in part.__dict__.pop("_stored", ()):
            m._parameters[name] = p

    parts: list[nn.Module] = [model.model.embed_tokens, *model.model.layers, model.model.norm, model.lm_head]
    return [hook for part in parts for hook in (part.register_forward_pre_hook(bring),
                                                part.register_forward_hook(release, always_call=True))]

def copy_for(held: FrozenCopy | None, t, model: CausalLM, device, *, weights: dict | None = None,
             ranks: bool = False, previous=None, trained: bool = False) -> FrozenCopy | None:
    """The frozen copy ``t``'s reference needs (None unless ``copy`` or ``copy_host``):
    ``held`` placed where ``t`` asks; else one made of ``weights`` (a saved state's) or of
    ``model``'s as they are now, the weights the objective starts from. Refused on ranks, and
    where the weights it would copy were trained since against ``previous`` techniques'
    precomputed log-probs (all that is left of the weights the objective started from)."""
    if t.reference_kind not in COPIES:
        return None
    if ranks:
        raise ValueError(f"reference={t.reference_kind!r} is not yet made for several ranks (the "
                         "copy would be sharded too): use reference='precomputed'.")
    host, dtype = t.reference_kind == "copy_host", model.model.embed_tokens.weight.dtype
    if weights is None and held is not None:
        return held.placed(host, dtype)
    if weights is None and previous is not None and previous.reference_kind == "precomputed" and trained:
        raise ValueError(f"reference={t.reference_kind!r} copies the weights the preference objective "
                         "started from, but they were trained since (the precomputed log-probs are "
                         "all that is left of them): keep reference='precomputed', or set "
                         "objective='sft' and back to start again from the weights as they are.")
    if weights is not None:  # a saved state's: each weight of the model's dtype (names, shapes: ``of``)
        mine = full_weights(model)
        wrong = next((k for k, v in weights.items() if k in mine and v.dtype != mine[k].dtype), None)
        if wrong is not None:
            raise ValueError(f"The reference copy's weight {wrong!r} is {weights[wrong].dtype}, but the "
                             f"model's is {mine[wrong].dtype}: load a state saved by this run.")
    return FrozenCopy.of(full_weights(model) if weights is None else weights, model.config, device, host)


def precomputed(cached: tuple | None, stream, t, model: nn.Module, data, device, *, base: bool,
                trained_against: bool) -> tuple[tuple, str | None]:
    """``reference="precomputed"``: ``stream``'s pairs scored once by the model as it is when
    the objective starts (``base``: the reference a run had so far, the model with its
    adapters off, or the ``model`` given is a frozen copy),
    as (key, [pairs, 2] log-probs) to keep, and what to tell the user (None when ``cached``
    still holds them). Once steps were trained against it, the weights it came from may be
    gone: a change that needs it again is refused."""
    from .preference import reference_logps

    key = (t.seq_len, len(stream.samples), id(data.train))
    if cached is not None and cached[0] == key:
        return cached, None
    if cached is not None and trained_against and not base:
        raise ValueError(f"seq_len={t.seq_len} (or other rows) needs the reference's log-probs "
                         "again, but the reference was the weights when the preference "
                         "objective started, trained since: keep "
                         f"seq_len={cached[0][0]}, or save those weights first and "
                         "start from them.")
    started = time.perf_counter()
    values = reference_logps(model, stream.samples, data.pad_id, t.batch_size, device,
                             max(t.chunked_loss, 1), base=base)
    return (key, values), (f"Reference log-probs of {len(values):,} pairs computed in "
                           f"{time.perf_counter() - started:.1f} s, kept on the host "
                           f"({values.numel() * 4:,} bytes): no reference forward in the steps.")


def restore_logps(stream, state: dict, t) -> None:
    """A saved precomputed reference back onto ``stream`` (the weights it was computed from
    may be gone), checked against its pairs; a state without one keeps the stream's own."""
    values = state.get("reference_logps")
    if values is None:
        return
    if t.reference_kind != "precomputed" or tuple(values.shape) != (len(stream.samples), 2):
        raise ValueError(f"The state's precomputed reference holds {tuple(values.shape)} log-probs, "
                         f"but this run has {len(stream.samples)} pairs with reference="
                         f"{t.reference_kind!r}: resume with the same data and techniques.")
    stream.reference_logps = values.float()
