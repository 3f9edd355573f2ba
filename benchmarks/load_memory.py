"""Peak host memory while loading a ~1 GB checkpoint, as a multiple of the loaded weights' bytes.

    python benchmarks/load_memory.py [--out benchmarks/results/load-memory] [--quantize]

Writes a synthetic Llama-shaped checkpoint (random weights, 3 shards + index json) once in
bf16 and once in fp32, then loads each with ``nt.load_model(folder, dtype="bf16")`` in a
fresh subprocess, so the imports and the writing do not blur the measurement.

Peak (``ratio_vmhwm``, the headline): the kernel's high-water mark of the process's
resident set (``VmHWM`` in /proc/self/status), reset just before loading by writing 5 to
/proc/self/clear_refs, minus ``VmRSS`` at that moment. RSS counts anonymous memory and
touched file-backed pages alike, so weights read through mmap count too. Cross-checks:
``ru_maxrss`` (same kernel counter, but it cannot be reset and after exec it still holds the
parent's peak, so it is an upper bound) and a thread sampling ``VmRSS`` every 2 ms. The
ratio divides the growth by the bytes of the loaded (bf16) weights: 1.0 is one copy; the
target is at most 1.3. ``ratio_after_touch`` is RSS after reading every weight once, which
exposes weights that are only mapped, not loaded.

``--quantize`` loads with ``quantize=`` the seven projections (QLoRA's NF4 base, quantized
tensor by tensor as it is read) and writes ``load_memory_qlora.json`` / ``.log``. The
ratio is still over the bf16 weight bytes, and the target is at most 0.75: what the
model holds (NF4 parts plus the dense embeddings, head and norms) is 0.46 of them here,
and the rest is one weight in flight with torchao's quantization temporaries (about 6x
that weight's bf16 bytes, and never under 64 MiB: it compares up to 1M values with the
16 NF4 levels at once). ``ratio_vs_loaded`` divides by what the model holds instead.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HF_CONFIG = {  # Llama-shaped, about 0.49 B parameters: ~1 GB in bf16
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 2048,
    "intermediate_size": 5632, "num_hidden_layers": 8, "num_attention_heads": 16,
    "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
}
SHARDS = 3
MiB = 1 << 20


def status_kib() -> dict[str, int]:
    """The memory lines of /proc/self/status, in KiB."""
    lines = Path("/proc/self/status").read_text().splitlines()
    return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in lines)
            if k.startswith(("Vm", "Rss"))}


def write_checkpoint(folder: Path, dtype_name: str) -> int:
    """Write config.json, SHARDS shards and the index; one shard in memory at a time."""
    import torch
    from safetensors.torch import save_file

    from nbtune.models import CausalLM, ModelConfig

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({**HF_CONFIG, "torch_dtype": str(dtype)[6:]}))
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in CausalLM(ModelConfig.from_hf(HF_CONFIG)).state_dict().items()}
    total = sum(s.numel() for s in shapes.values()) * dtype.itemsize
    weight_map, shard, shard_bytes, index = {}, {}, 0, 1
    gen = torch.Generator().manual_seed(0)
    for i, (key, shape) in enumerate(shapes.items()):
        shard[key] = torch.empty(shape, dtype=dtype).normal_(0.0, 0.02, generator=gen)
        shard_bytes += shard[key].nbytes
        if shard_bytes >= total / SHARDS or i == len(shapes) - 1:
            name = f"model-{index:05d}-of-{SHARDS:05d}.safetensors"
            save_file(shard, str(folder / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, shard_bytes, index = {}, 0, index + 1
    assert index - 1 == SHARDS, f"wrote {index - 1} shards"
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


def measure(folder: str, dtype: str, quantize: bool = False) -> dict:
    """Run in the fresh subprocess: load, and report RSS growth and tensor sharing."""
    import torch

    import nbtune as nt
    from nbtune.memory.accounting import storage_bytes
    from nbtune.peft import is_nf4
    from nbtune.techniques import LORA_TARGETS

    peak_sampled = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak_sampled[0] = max(peak_sampled[0], status_kib()["VmRSS"])
            time.sleep(0.002)

    reset = True
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    except OSError:
        reset = False  # then VmHWM is the process's lifetime peak (still >= the load's)
    before = status_kib()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    model = nt.load_model(folder, dtype=dtype, quantize=LORA_TARGETS if quantize else ())
    seconds = time.perf_counter() - started
    done.set()
    sampler.join()
    after = status_kib()
    maxrss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.no_grad():  # read every weight once: lazily mapped pages would show up now
        for p in model.parameters():
            (p.quantized_data if is_nf4(p) else p).sum()
    touched = status_kib()
    # No duplicates: every state-dict entry is a parameter's own tensor; tied ones share it.
    params = {id(p) for p in model.parameters()}
    state = model.state_dict(keep_vars=True)
    dense = [t for t in state.values() if not is_nf4(t)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in dense}
    # an NF4 weight's element_size is its dtype's: weight_bytes stays the bf16 bytes
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    loaded_bytes = storage_bytes(model.parameters())
    grow = lambda kib: kib * 1024 / weight_bytes  # noqa: E731
    return {
        "dtype_loaded": dtype, "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "weight_bytes": weight_bytes, "load_seconds": round(seconds, 2), "vmhwm_reset": reset,
        "rss_before_mib": before["VmRSS"] / 1024,
        "peak_growth_mib": (after["VmHWM"] - before["VmRSS"]) / 1024,
        "ratio_vmhwm": round(grow(after["VmHWM"] - before["VmRSS"]), 3),
        "ratio_ru_maxrss": round(grow(maxrss_kib - before["VmRSS"]), 3),
        "ratio_sampled": round(grow(peak_sampled[0] - before["VmRSS"]), 3),
        "ratio_after_load": round(grow(after["VmRSS"] - before["VmRSS"]), 3),
        "ratio_after_touch": round(grow(touched["VmRSS"] - before["VmRSS"]), 3),
        "rss_file_after_touch_mib": touched["RssFile"] / 1024,
        "state_dict_tensors_are_parameters": all(id(t) in params for t in state.values()),
        "tied_or_shared_storages": len(dense) - len(storages),
        "unique_storage_bytes": storage_bytes(state.values()),
        "nf4_tensors": sum(map(is_nf4, model.parameters())),
        "loaded_bytes": loaded_bytes,
        "ratio_vs_loaded": round((after["VmHWM"] - before["VmRSS"]) * 1024 / loaded_bytes, 3),
    }


def machine() -> dict:
    import huggingface_hub
    import safetensors
    import torch

    mem = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return {"cpu_count": os.cpu_count(), "affinity_cpus": len(os.sched_getaffinity(0)),
            "ram_gib": round(int(mem["MemTotal"].split()[0]) / 2**20, 1),
            "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "safetensors": safetensors.__version__,
            "huggingface_hub": huggingface_hub.__version__}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "load-memory"))
    parser.add_argument("--quantize", action="store_true",
                        help="load the projections as NF4 (QLoRA's base) while reading")
    parser.add_argument("--measure", nargs=2, metavar=("FOLDER", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure, quantize=args.quantize)))
        return 0
    name = "load_memory_qlora" if args.quantize else "load_memory"
    log, results = [], []

    def say(line: str) -> None:
        print(line, flush=True)
        log.append(line)

    say(f"$ {' '.join(['python', *sys.argv])}")
    with tempfile.TemporaryDirectory(prefix="nbtune-load-") as tmp:
        for source in ("bf16", "fp32"):
            folder = Path(tmp) / source
            started = time.perf_counter()
            total = write_checkpoint(folder, source)
            say(f"wrote {source} checkpoint: {total / MiB:.0f} MiB in {SHARDS} shards "
                f"({time.perf_counter() - started:.0f} s)")
            child = subprocess.run([sys.executable, __file__, "--measure", str(folder), "bf16"]
                                   + ["--quantize"] * args.quantize, capture_output=True, text=True)
            if child.returncode:
                sys.exit(f"measuring {source} failed:\n{child.stderr}")
            result = {"source_dtype": source, "checkpoint_bytes": total,
                      **json.loads(child.stdout.strip().splitlines()[-1])}
            results.append(result)
            say(json.dumps(result))
            for file in folder.iterdir():  # free the disk before writing the next one
                file.unlink()
    summary = {
        "benchmark": name, "command": " ".join(["python", *sys.argv]),
        "target_ratio": 0.75 if args.quantize else 1.3, "config": HF_CONFIG, "shards": SHARDS,
        "machine": machine(),
        "ratios": {f"{r['source_dtype']}->bf16": r["ratio_vmhwm"] for r in results},
        "results": results,
    }
    if args.quantize:
        from nbtune.techniques import LORA_TARGETS

        summary["quantized"] = "NF4 (torchao, blocks 64/256): " + ", ".join(LORA_TARGETS)
        summary["ratios_vs_loaded"] = {f"{r['source_dtype']}->bf16": r["ratio_vs_loaded"]
                                       for r in results}
    say(json.dumps({"benchmark": name, "ratios": summary["ratios"],
                    **({"ratios_vs_loaded": summary["ratios_vs_loaded"]} if args.quantize else {}),
                    "peak_growth_mib": {r["source_dtype"]: round(r["peak_growth_mib"]) for r in results},
                    "weight_mib": round(results[0]["weight_bytes"] / MiB)}))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / f"{name}.log").write_text("\n".join(log) + "\n")
    ok = all(r["ratio_vmhwm"] <= summary["target_ratio"] for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
