"""Small builders shared by the tests: a tiny demo-shaped session on a few rows, a torchrun job."""

import os
import subprocess
import sys

import torch

import nbtune as nt
from nbtune.data import load_examples
from nbtune.session import demo_data_file


def demo_pairs(n: int = 64, split: str = "train") -> list[dict]:
    """Preference pairs from the demo's rows: the row's answer chosen, that answer reversed
    with a "!" after it rejected (always a different text)."""
    import json

    rows = [json.loads(line) for line in open(demo_data_file(split))][:n]
    return [{"prompt": row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else ""),
             "chosen": row["output"], "rejected": row["output"][::-1] + "!"} for row in rows]


def small_session(**changes) -> "nt.Session":
    """The embedded default on 64 training rows, short sequences: fast and deterministic.
    Given an ``objective`` (even "sft"), the rows are 64 preference pairs (``demo_pairs``)."""
    from nbtune.data import examples_from

    rows = (examples_from(demo_pairs()) if "objective" in changes
            else load_examples(demo_data_file("train"))[:64])
    base = dict(batch_size=4, seq_len=96, lr=1e-3)
    base.update(changes)
    objective = base.pop("objective", "sft")  # set once the rows are pairs
    torch.manual_seed(0)
    session = nt.Session.demo(**base, device="cpu")
    session.data.train = rows
    if "objective" in changes:
        session.data.heldout = examples_from(demo_pairs(16, "heldout"))
    session.trainer.stream, _ = session.data.stream(session.techniques)
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
