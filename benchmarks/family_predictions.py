"""What the newer families need on one 24 GB card, predicted (no GPU: the estimator runs the
real step on fake tensors): QLoRA in bf16, batch 1 of 2,048 tokens, activation checkpointing
and an 8-piece loss (the README's and notebook 04's settings), then the longest context the
same settings fit on an RTX 3090 (``nt.longest_context``).

    python benchmarks/family_predictions.py     # writes benchmarks/results/families/predictions.json
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GiB = 2 ** 30
MODELS = ("gemma-3-1b", "gemma-3-4b", "gemma-3-12b", "gemma-3-27b", "phi-4-mini", "phi-4",
          "qwen3-30b-a3b")
UNSLOTH_30B_GB = 17.5  # Qwen's Unsloth guide: "Unsloth only needs 17.5 GB of VRAM to fine-tune
# 30B-A3B" (4-bit, max_seq_length 2048, the router not trained; batch and rank not stated):
# https://qwen.readthedocs.io/en/latest/training/unsloth.html
SETTINGS = dict(method="qlora", dtype="bf16", activation_checkpointing=True, chunked_loss=8,
                batch_size=1, seq_len=2048)


def gib(n: int) -> float:
    return round(n / GiB, 2)


def main() -> None:
    import torch

    import nbtune as nt
    from nbtune.models.presets import preset_config
    from nbtune.techniques import DEFAULT_LORA_TARGETS

    started = time.perf_counter()
    t = nt.Techniques(**SETTINGS)
    rows = []
    for name in MODELS:
        clock = time.perf_counter()
        guess = nt.estimate(name, t, device="cuda")
        seconds = round(time.perf_counter() - clock, 1)
        longest = nt.longest_context(name, "RTX 3090", t)
        rows.append({"model": name, "parameters": preset_config(name).num_parameters,
                     "predicted_gib": gib(guess.peak), "host_gib": gib(guess.host.peak),
                     "fits_24gb_card": guess.peak <= 24 * 10**9, "estimate_seconds": seconds,
                     "longest_context_rtx3090": longest.tokens, "longest_limit": longest.limit})
        print(f"{name:12} {rows[-1]['predicted_gib']:6.2f} GiB on the card, host "
              f"{rows[-1]['host_gib']:5.2f} GiB ({seconds} s); longest on an RTX 3090: "
              f"{longest.tokens:,} tokens ({longest.limit})", flush=True)
    worst = nt.estimate("qwen3-30b-a3b", t, device="cuda", routing="worst")
    experts = nt.estimate("qwen3-30b-a3b", t.replace(lora_targets=DEFAULT_LORA_TARGETS + ("experts",)),
                          device="cuda")
    moe = {"qwen3_30b_a3b_worst_routing_gib": gib(worst.peak), "unsloth_30b_a3b_gb": UNSLOTH_30B_GB,
           "qwen3_30b_a3b_experts_adapted_gib": gib(experts.peak),
           "qwen3_235b_a22b_ranks": cards_for("qwen3-235b-a22b", t, 80)}
    print(f"qwen3-30b-a3b with every token to the same experts: {moe['qwen3_30b_a3b_worst_routing_gib']} GiB; "
          f"with the experts adapted too: {moe['qwen3_30b_a3b_experts_adapted_gib']} GiB")
    print(f"qwen3-235b-a22b on 80 GB cards: {moe['qwen3_235b_a22b_ranks']}")
    result = {"command": "python benchmarks/family_predictions.py", "torch": torch.__version__,
              "machine": platform.machine(), "settings": SETTINGS, "models": rows, "moe": moe,
              "moe_speed_cpu": dispatch_speed(), "seconds": round(time.perf_counter() - started, 1)}
    out = ROOT / "benchmarks" / "results" / "families" / "predictions.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['seconds']} s; written to {out.relative_to(ROOT)}")


def cards_for(name: str, t, card_gb: int) -> dict:
    """The fewest cards of ``card_gb`` whose FSDP2 ranks each fit the step (batch 1 a rank)."""
    import nbtune as nt
    from nbtune.predict.budgets import required, usable

    for n in (1, 2, 4, 8):
        guess = nt.estimate(name, t.replace(batch_size=n), device="cuda", ranks=n)
        if required(guess) <= usable(card_gb * 10**9):
            return {"cards": n, "per_card_gib": gib(guess.peak), "host_per_machine_gib": gib(guess.host.peak)}
    return {"cards": None}


def dispatch_speed(steps: int = 5) -> dict:
    """A training step's tokens a second on this CPU: a small mixture of experts (16 experts,
    each token to 2) against the dense model that does the same work per token (one MLP as wide
    as the two experts), both fp32 with AdamW, 4 rows of 256 tokens. The experts run one after
    another on their sorted runs of tokens; the gap is that loop and the sorting."""
    import torch

    import nbtune as nt
    from nbtune.models.config import ModelConfig
    from nbtune.models.decoder import CausalLM
    from nbtune.models.tiny import byte_tokenizer

    torch.manual_seed(0)
    shape = dict(vocab_size=259, hidden_size=256, num_layers=6, num_heads=4, num_kv_heads=4,
                 head_dim=64, max_position_embeddings=512)
    models = {"moe": ModelConfig(**shape, model_type="qwen3_moe", intermediate_size=512, num_experts=16,
                                 num_experts_per_tok=2, moe_intermediate_size=256, qk_norm=True,
                                 router_aux_loss_coef=0.001),
              "dense": ModelConfig(**shape, model_type="qwen3", intermediate_size=512, qk_norm=True)}
    rows = [{"instruction": "Repeat: " + "abc " * 30, "output": "abc " * 30}] * 16
    out = {}
    for label, config in models.items():
        model = CausalLM(config)
        model.reset_parameters()
        s = nt.Session(model, byte_tokenizer(), rows, techniques=nt.Techniques(
            batch_size=4, seq_len=256, lr=1e-3), device="cpu")
        s.echo = False
        s.step()  # warm
        reports = [s.step() for _ in range(steps)]
        out[label] = round(sum(r.tokens for r in reports) / sum(r.seconds for r in reports))
    out["ratio"] = round(out["moe"] / out["dense"], 2)
    print(f"CPU step, tokens/s: mixture of experts {out['moe']:,}, dense of equal work {out['dense']:,} "
          f"({out['ratio']}x)")
    return out


if __name__ == "__main__":
    main()
