"""Resident memory of each rank while it loads and steps, against one process doing the same.

    python benchmarks/rank_memory.py [--out benchmarks/results/rank-memory] [--ranks 1,2,4]
                                     [--methods lora,full,qlora] [--save merged]

Writes a random Llama-shaped model (by default about 287 M parameters, fp32: 1.07 GiB,
untied, in 3 safetensors files: 24 layers of Llama-3.1-8B's proportions, the embedding and
head 6 % of it as at 8B; ``--layers 10 --vocab 32000`` makes one whose embedding and head
are 37 %) and a run file that trains it for one step (a global batch of 4 x 128 tokens of the
tiny demo's rows), then runs ``nbtune train`` on it in one process and under ``torchrun
--standalone --nproc_per_node N`` for each N, one job at a time, each process measuring
itself (``--worker``):

* ``bare``: its resident set (``VmRSS``) once torch and nbtune are imported and, on ranks,
  the gloo group is up: what every rank holds before it touches the model;
* ``loading``: the kernel's high-water mark of the resident set (``VmHWM``, reset just before
  by writing 5 to /proc/self/clear_refs) while the run is built (the model read, transformed,
  sharded), minus ``bare``;
* ``run``: the same high-water mark over the whole job (building, the step, the save the run
  file asks for), minus ``bare``;
* ``tracked``: the step's peak of live tensors as nbtune's tracker measured it on that rank
  (``metrics.jsonl``): what the tensors hold, without what the C library keeps of freed
  blocks and gloo's own buffers, which RSS counts.

The headline is each rank's ``run`` over one process's ``run`` (``ratio``). RSS counts file
pages read through mmap as well as the process's own memory, so a weight file mapped whole
would show up here. Results: ``rank_memory.json`` and ``rank_memory.log`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HF_CONFIG = {  # Llama-shaped, about 287 M parameters (1.07 GiB in fp32); --layers, --vocab
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 1024,
    "intermediate_size": 2816, "num_hidden_layers": 24, "num_attention_heads": 16,
    "num_key_value_heads": 4, "vocab_size": 8000, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
}
TECHNIQUES = {
    "lora": "method: lora, lora_rank: 8",
    "full": "method: full",
    "qlora": "method: qlora, lora_rank: 8",
}
RUN = ("model: {model}\ndata: {{train: {data}}}\n"
       "techniques: {{{techniques}, batch_size: 4, seq_len: 128, lr: 1.0e-4}}\n"
       "run: {{steps: 1, evaluate: false, save: [{save}]}}\ndistributed: {{{sharding}}}\n")
MiB = 1 << 20


def status_kib() -> dict[str, int]:
    lines = Path("/proc/self/status").read_text().splitlines()
    return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in lines)
            if k.startswith(("Vm", "Rss"))}


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current VmRSS


def write_model(folder: Path, config: dict) -> int:
    """config.json, the demo's byte tokenizer and 3 safetensors files of random weights."""
    import torch
    from safetensors.torch import save_file

    from nbtune.models import CausalLM, ModelConfig
    from nbtune.models.tiny import byte_tokenizer

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))
    byte_tokenizer().save(folder)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in CausalLM(ModelConfig.from_hf(config)).state_dict().items()}
    keys, total = list(shapes), sum(s.numel() for s in shapes.values()) * 4
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for index, part in enumerate((keys[i::3] for i in range(3)), 1):
        name = f"model-{index:05d}-of-00003.safetensors"
        save_file({k: torch.empty(shapes[k]).normal_(0.0, 0.02, generator=gen) for k in part},
                  str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


def worker(run_file: str, out: str, report: str) -> None:
    """One process of the job: bare, then ``nbtune train`` with the building marked."""
    import nbtune  # noqa: F401  (the bare process has nbtune imported)
    import nbtune.cli.main as cli
    from nbtune.run import factory as runs
    from nbtune.distributed import Parallel

    parallel = Parallel.from_env()  # the group up before measuring, as a bare rank has it
    bare = status_kib()["VmRSS"]
    marks = {}
    for name in ("from_config",):
        real = getattr(runs, name)

        def built(*args, real=real, **kwargs):
            reset_peak()
            result = real(*args, **kwargs)
            marks["loading"] = status_kib()["VmHWM"]
            marks["after_loading"] = status_kib()["VmRSS"]
            return result
        setattr(runs, name, built)
    reset_peak()
    started = time.perf_counter()
    code = cli.main(["train", run_file, "--out", out])
    seconds = time.perf_counter() - started
    rank = parallel.rank if parallel is not None else 0
    metrics = Path(out) / ("metrics.jsonl" if rank == 0 else f"metrics.rank{rank}.jsonl")
    step = json.loads(metrics.read_text().splitlines()[0]) if metrics.exists() else {}
    result = {"rank": rank, "code": code, "seconds": round(seconds, 1), "bare_mib": bare / 1024,
              "tracked_mib": step.get("peak_bytes", 0) / 2**20,
              "loading_mib": (marks["loading"] - bare) / 1024,
              "after_loading_mib": (marks["after_loading"] - bare) / 1024,
              "run_mib": (max(status_kib()["VmHWM"], marks["loading"]) - bare) / 1024}
    Path(f"{report}.rank{rank}").write_text(json.dumps(result))


def job(run_file: Path, out: Path, ranks: int) -> list[dict]:
    report = out.with_suffix(".report")
    command = [sys.executable, __file__, "--worker", str(run_file), str(out), str(report)]
    if ranks > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", str(ranks), *command[1:]]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    rows = [json.loads(Path(f"{report}.rank{r}").read_text()) for r in range(ranks)]
    if any(row["code"] for row in rows):
        sys.exit(f"{' '.join(command)} ended with {[row['code'] for row in rows]}:\n{done.stdout[-2000:]}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "rank-memory"))
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--methods", default="lora,full,qlora")
    parser.add_argument("--save", default="", help="what the run saves at its end (hf, merged, gguf)")
    parser.add_argument("--sharding", default="", help="the run file's distributed settings, as "
                        "YAML fields (shard_embeddings: true)")
    parser.add_argument("--layers", type=int, default=HF_CONFIG["num_hidden_layers"])
    parser.add_argument("--vocab", type=int, default=HF_CONFIG["vocab_size"])
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    import torch

    from nbtune.demos import data_file

    log, results = [], []

    def say(line: str) -> None:
        print(line, flush=True)
        log.append(line)

    say(f"$ {' '.join(['python', *sys.argv])}")
    if args.sharding:
        say(f"distributed: {{{args.sharding}}}")
    say(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    with tempfile.TemporaryDirectory(prefix="nbtune-ranks-") as tmp:
        model = Path(tmp) / "model"
        config = {**HF_CONFIG, "num_hidden_layers": args.layers, "vocab_size": args.vocab}
        total = write_model(model, config)
        say(f"model: {total / MiB:.0f} MiB of fp32 weights in 3 files ({config})")
        for method in args.methods.split(","):
            run_file = Path(tmp) / f"{method}.yaml"
            run_file.write_text(RUN.format(model=model, data=data_file("tiny", "train"),
                                           techniques=TECHNIQUES[method], save=args.save,
                                           sharding=args.sharding))
            one = None
            for ranks in map(int, args.ranks.split(",")):
                rows = job(run_file, Path(tmp) / f"{method}-{ranks}", ranks)
                one = one or rows[0]
                for row in rows:
                    row.update(method=method, ranks=ranks,
                               ratio=round(row["run_mib"] / one["run_mib"], 3),
                               loading_ratio=round(row["loading_mib"] / one["loading_mib"], 3),
                               tracked_ratio=round(row["tracked_mib"] / one["tracked_mib"], 3))
                    say(f"{method:5} {ranks} ranks  rank {row['rank']}: bare {row['bare_mib']:4.0f} MiB, "
                        f"loading +{row['loading_mib']:5.0f} ({row['loading_ratio']:.2f}x), run "
                        f"+{row['run_mib']:5.0f} ({row['ratio']:.2f}x), step's tensors "
                        f"{row['tracked_mib']:5.0f} MiB ({row['tracked_ratio']:.2f}x), {row['seconds']} s")
                results.extend(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rank_memory.json").write_text(json.dumps(
        {"command": " ".join(["python", *sys.argv]), "config": config, "weight_bytes": total,
         "results": results}, indent=2))
    (out / "rank_memory.log").write_text("\n".join(log) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
