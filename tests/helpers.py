"""Small builders shared by the tests: a tiny demo-shaped session on a few rows, a torchrun job."""

import os
import subprocess
import sys

import pytest
import torch

import nbtune as nt
from nbtune.data import load_examples
from nbtune.session import demo_data_file


def slow_after(n: int, cases: list) -> list:
    """Parametrized cases, the first ``n`` in the fast tier and the rest marked slow: the
    developers' loop keeps each test's main cases, CI's whole suite runs every one."""
    return [case if i < n else pytest.param(*(case if isinstance(case, tuple) else (case,)),
                                            marks=pytest.mark.slow)
            for i, case in enumerate(cases)]


def demo_pairs(n: int = 64, split: str = "train") -> list[dict]:
    """Preference pairs from the demo's rows: the row's answer chosen, that answer reversed
    with a "!" after it rejected (always a different text)."""
    import json

    rows = [json.loads(line) for line in open(demo_data_file(split))][:n]
    return [{"prompt": row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else ""),
             "chosen": row["output"], "rejected": row["output"][::-1] + "!"} for row in rows]


def overlap(prompts, completions, chosen, **_):
    """A GRPO reward: the share of the chosen answer's characters the completion uses."""
    return [len(set(c) & set(a)) / len(set(a)) for c, a in zip(completions, chosen)]


def letters(prompts, completions, **_):
    """A GRPO reward: the share of the completion's characters that are ASCII letters."""
    return [sum(ch.isascii() and ch.isalpha() for ch in c) / max(len(c), 1) for c in completions]


def brevity(prompts, completions, **_):
    """A GRPO reward: shorter is better."""
    return [-len(c) / 16 for c in completions]


GRPO_BASE = dict(batch_size=2, max_completion=16, generations=4)  # small_session's GRPO shape
# The random demo model rarely writes its end-of-text byte; GRPO tests end a completion at any
# of these too, so that completions have several lengths (as a trained model's do)
TEST_STOPS = frozenset(range(32, 64))


def small_session(**changes) -> "nt.Session":
    """The embedded default on 64 training rows, short sequences: fast and deterministic.
    Given an ``objective`` (even "sft"), the rows are 64 preference pairs (``demo_pairs``);
    under "grpo" their prompts, rewarded by ``letters``, ``overlap`` and ``brevity`` (weight 0.5), each
    completion ended at a ``TEST_STOPS`` byte too, in ``GRPO_BASE``'s shape unless changed."""
    import copy

    from nbtune.data import examples_from
    from nbtune.run import factory

    base = dict(batch_size=4, seq_len=96, lr=1e-3)
    if changes.get("objective") == "grpo":
        base.update(GRPO_BASE)
    base.update(changes)
    objective = base.pop("objective", "sft")  # set once the rows are pairs
    torch.manual_seed(0)
    spec = factory.demo_spec(**base, device="cpu")  # Session.demo's, on 64 of its rows (or pairs):
    spec.train = (examples_from(demo_pairs()) if "objective" in changes  # the other rows are
                  else load_examples(demo_data_file("train"))[:64])  # not tokenized (0.3 s a build)
    if "objective" in changes:
        spec.heldout = examples_from(demo_pairs(16, "heldout"))
    session = nt.Session._of(factory.build(spec))
    if objective == "grpo":
        session.rewards = [letters, overlap, (brevity, 0.5)]
        session.data.tokenizer = copy.copy(session.data.tokenizer)
        session.data.tokenizer.stop_ids = session.data.tokenizer.stop_ids | TEST_STOPS
    if objective != "sft":
        session.set(objective=objective)
    return session


def tiny_llama(folder, tie: bool, **save):
    """A tiny random transformers Llama saved to ``folder`` (the reference for parity tests)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-5, tie_word_embeddings=tie)
    torch.manual_seed(1)
    ref = transformers.LlamaForCausalLM(config).eval()
    ref.save_pretrained(folder, **save)
    return ref


def param_bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def torchrun(run_file, out, *flags, ranks: int = 2):
    """`nbtune train run_file` on ``ranks`` gloo ranks; must succeed."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", str(ranks), "-m", "nbtune", "train", str(run_file),
                           "--out", str(out), *flags],
                          capture_output=True, text=True, timeout=600, env={**os.environ})
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    return done


def returns_of(monkeypatch, module, name: str) -> list:
    """Every value ``module.name`` returns from now on (the function still runs), in order."""
    made = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(module, name, spy)
    return made
