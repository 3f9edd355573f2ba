"""lm-evaluation-harness on a session's model: ``SessionLM`` is an lm-eval language model
(log-likelihoods batched, each continuation's log-probabilities taken from the final hidden
states of its own positions only; generation through nbtune's KV cache; LoRA adapters on, as
trained so far), and ``run`` scores lm-eval tasks with lm-eval's own ``simple_evaluate``:
the registry's (MMLU, GSM8K, ...) or the user's own YAML tasks over local files
(``include_path``).

Sequences start with BOS, as nbtune's training rows do; longer ones keep their last
``max_length`` tokens. lm-eval is an extra: ``pip install 'nbtune[eval]'``."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from .data.rows import with_bos
from .generate import generate_ids

try:
    from lm_eval.api.model import LM
except ImportError:  # the extra is missing: ``run`` says how to install it
    LM = object


class _Stop(Exception):
    """A stop string appeared in the text written so far."""


class SessionLM(LM):
    """A model and tokenizer as lm-eval's ``LM``: ``loglikelihood``, ``loglikelihood_rolling``
    and ``generate_until``."""

    def __init__(self, model, tokenizer, *, batch_size: int = 8, max_length: int | None = None,
                 progress: bool = True) -> None:
        if LM is object:
            raise ImportError("lm-eval is not installed: pip install 'nbtune[eval]' (lm-eval).")
        super().__init__()
        self.model, self.tok, self.batch_size = model, tokenizer, batch_size
        self.max_length = max_length or model.config.max_position_embeddings
        self.progress = progress
        self.device_ = next(model.parameters()).device
        # what starts a sequence with no context (a rolling window's first token predicts from it)
        self.prefix = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id

    # ---- log-likelihoods ----------------------------------------------------------------

    def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation ids, encoded whole so the boundary tokenizes as in running
        text, split where the context's own tokens end (lm-eval's rule, as its HF model does:
        a context's trailing spaces go to the continuation)."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.tok.encode(context + continuation)
        n = len(self.tok.encode(context))
        return with_bos(self.tok, whole[:n]) or [self.prefix], whole[n:]

    @torch.no_grad()
    def score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Each (context ids, continuation ids): the continuation's summed log-probability and
        whether greedy decoding gives it, in batches of ``batch_size`` (longest first)."""
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
        out: list[tuple[float, bool] | None] = [None] * len(pairs)
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(order), self.batch_size):
                picked = order[start:start + self.batch_size]
                rows = []
                for i in picked:
                    context, continuation = pairs[i]
                    seq = (context + continuation)[-(self.max_length + 1):]
                    rows.append((seq[:-1], len(continuation)))
                longest = max(len(ids) for ids, _ in rows)
                ids = torch.full((len(rows), longest), self.tok.pad_id, dtype=torch.long)
                for r, (seq, _) in enumerate(rows):
                    ids[r, :len(seq)] = torch.tensor(seq)
                hidden = self.model.hidden_states(ids.to(self.device_))  # right padding: causal
                for r, (i, (seq, n)) in enumerate(zip(picked, rows)):
                    at = torch.arange(len(seq) - n, len(seq), device=self.device_)
                    logps = torch.log_softmax(self.model.lm_head(hidden[r, at]).float(), dim=-1)
                    target = torch.tensor(pairs[i][1], device=self.device_)
                    total = logps.gather(-1, target[:, None]).sum().item()
                    out[i] = (total, bool((logps.argmax(-1) == target).all()))
        finally:
            self.model.train(was_training)
        return out

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return self.score([self._pair(*request.args[:2]) for request in requests])

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """A whole text's log-likelihood: every token predicted once, in windows of
        ``max_length`` each read from the window's first token (lm-eval's disjoint windows)."""
        out = []
        for request in requests:
            ids = [self.prefix] + self.tok.encode(request.args[0])
            windows = [(ids[s:s + 1], ids[s + 1:s + 1 + self.max_length])
                       for s in range(0, len(ids) - 1, self.max_length)]
            out.append(sum(total for total, _ in self.score(windows)))
        return out

    # ---- generation ---------------------------------------------------------------------

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context continued greedily (or sampled where the task asks) through the KV
        cache, stopped at the model's stop tokens or the task's ``until`` strings."""
        out = []
        was_training = self.model.training
        self.model.eval()
        try:
            for request in requests:
                context, options = request.args[0], dict(request.args[1] or {})
                until = options.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                budget = int(options.get("max_gen_toks", 256))
                temperature = float(options.get("temperature", 0.0)) if options.get("do_sample") else 0.0
                ids = with_bos(self.tok, self.tok.encode(context))[-max(1, self.max_length - budget):]
                written: list[int] = []

                def watch(so_far: list[int]) -> None:
                    written[:] = so_far
                    if until and any(stop in self.tok.decode(so_far) for stop in until):
                        raise _Stop
                try:
                    generate_ids(self.model, ids, max_new_tokens=budget, stop_ids=self.tok.stop_ids,
                                 temperature=temperature, on_token=watch)
                except _Stop:
                    pass
                text = self.tok.decode(written)
                for stop in until:
                    text = text.split(stop)[0]
                out.append(text)
        finally:
            self.model.train(was_training)
        return out


_MANAGERS: dict = {}  # lm-eval's task index takes seconds to build (15k tasks): one per folder state


def _manager(TaskManager, include_path):
    """lm-eval's task index with ``include_path``'s tasks, remade when a file in it changes."""
    folder = Path(include_path) if include_path is not None else None
    state = (str(folder), tuple(sorted((str(p), p.stat().st_mtime_ns) for p in folder.rglob("*")
                                       if p.is_file()))) if folder is not None and folder.is_dir() else str(folder)
    if state not in _MANAGERS:
        _MANAGERS.clear()
        _MANAGERS[state] = TaskManager(include_path=str(folder) if folder is not None else None)
    return _MANAGERS[state]


def run(model, tokenizer, tasks, *, limit=None, num_fewshot: int | None = None,
        include_path=None, batch_size: int = 8, max_length: int | None = None) -> dict:
    """lm-eval's ``simple_evaluate`` on ``tasks`` (registry names or tasks in ``include_path``,
    a folder of YAML task files); returns ``{task: {metric: value}}`` (lm-eval's "results")."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ImportError("benchmark() runs lm-evaluation-harness, which is not installed: "
                          "pip install 'nbtune[eval]' (lm-eval).") from None
    tasks = [tasks] if isinstance(tasks, str) else list(tasks)
    manager = _manager(TaskManager, include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(f"lm-eval knows no task {', '.join(map(repr, unknown))}"
                         f"{' in ' + str(include_path) + ' or' if include_path else ''} in its registry: "
                         "check the name (lm-eval ls tasks lists them), or give the folder of your task "
                         "YAML as include_path=.")
    with _own_generators():  # lm-eval seeds random, numpy and torch: the caller's go on as they were
        results = lm_eval.simple_evaluate(
            model=SessionLM(model, tokenizer, batch_size=batch_size, max_length=max_length), tasks=tasks,
            num_fewshot=num_fewshot, limit=limit, task_manager=manager, log_samples=False,
            bootstrap_iters=0, verbosity="ERROR")
    return {task: {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "alias"}
            for task, metrics in results["results"].items()}


def flat(results: dict) -> dict[str, float]:
    """lm-eval's results as tracker names: ``benchmark/TASK/METRIC`` (its filter kept where it
    has one: gsm8k's ``exact_match/strict-match`` and ``exact_match/flexible-extract``)."""
    out = {}
    for task, metrics in results.items():
        for name, value in metrics.items():
            metric, _, kept = name.partition(",")
            out[f"benchmark/{task}/{metric}" + (f"/{kept}" if kept and kept != "none" else "")] = float(value)
    return out


@contextlib.contextmanager
def _own_generators():
    """Put Python's, numpy's and torch's random generators back as they were."""
    import random

    import numpy

    states = (random.getstate(), numpy.random.get_state(), torch.random.get_rng_state(),
              torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    try:
        yield
    finally:
        random.setstate(states[0])
        numpy.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        if states[3] is not None:
            torch.cuda.set_rng_state_all(states[3])
