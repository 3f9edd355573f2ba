"""Hugging Face folders in and out: config.json + *.safetensors (never pickle)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Callable, Collection

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .. import files
from ..atomic import write_atomically  # noqa: F401  (checkpoint.py imports it from here)
from ..peft import DenseWeights, has_lora, to_nf4
from .config import ModelConfig
from .decoder import CausalLM
from .filling import check_finite, empty_model, fill_model, release_freed_heap

# safetensors dtype names -> torch (https://github.com/huggingface/safetensors, format spec)
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
              "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_ST_NAMES = {dtype: name for name, dtype in _ST_DTYPES.items()}
CAST_CHUNK_BYTES = 16 << 20  # source bytes read per step when casting: the only transient copy
# Saved weights are written in files of at most this many bytes (or one larger tensor), one
# file at a time: safetensors takes a file's tensors whole (and moves CUDA ones to the host
# together), so an export holds one part on the host, not the model (16 GB at 8B in bf16).
PART_BYTES = 1 << 30


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = files.read_json(index, "safetensors index", "index_bytes").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise files.FileRefused(f"{index} has no weight_map of tensor names to file names: "
                                    "it is damaged. Download the checkpoint again.")
        shards = [files.inside(folder, s, "weight shard", links=True)
                  for s in sorted(set(weight_map.values()))]
        absent = [s.name for s in shards if not s.exists()]
        if absent:
            raise FileNotFoundError(f"{index} names shards that are not there: {', '.join(absent)}. "
                                    "Download or copy the whole checkpoint.")
    else:
        shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        hint = (f" It holds {', '.join(pickles)}: nbtune never loads pickle files; convert "
                "them to safetensors first.") if pickles else ""
        raise FileNotFoundError(f"No *.safetensors weights in {folder}.{hint}")
    for shard in shards:
        files.regular_file(shard, "safetensors", "weights_bytes")
    return shards


def _entries(file: Path) -> list[tuple[str, torch.dtype, tuple[int, ...], int]]:
    """(name, dtype, shape, byte offset) of each tensor in a safetensors file, in file order.

    ``safe_open`` validates the file (header, offsets, length). The offsets are read from
    the header here because the library hands out mmap-backed tensors: every page read
    through them stays in this process's RSS until the file is unmapped, which would add
    up to a whole shard on top of the loaded weights.
    """
    try:
        with safe_open(str(file), framework="pt") as shard:
            shard.keys()
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"Cannot read {file}: the file is damaged or not safetensors "
                         f"({err}). Download or save it again.") from err
    header.pop("__metadata__", None)
    entries = []
    for key, info in header.items():
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{key} in {file.name} is stored as {info['dtype']}, which nbtune "
                             f"does not load (it reads {', '.join(_ST_DTYPES)}).")
        entries.append((key, _ST_DTYPES[info["dtype"]], tuple(info["shape"]),
                        8 + size + info["data_offsets"][0]))
    return sorted(entries, key=lambda entry: entry[3])


def _read_into(f, target: torch.Tensor) -> None:
    """Fill a contiguous tensor's bytes from the file's current position (plain reads)."""
    view = memoryview(target.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):  # one read() returns at most ~2 GiB
        count = f.readinto(view[done:])
        if not count:
            raise ValueError(f"Cannot read {f.name}: it ends early, so it is damaged. "
                             "Download or save it again.")
        done += count


def _read_tensor(f, offset: int, src: torch.dtype, shape: tuple[int, ...],
                 dtype: torch.dtype, buffer: list, key: str = "") -> torch.Tensor:
    """One tensor read straight into its final dtype, with no full source-dtype copy.

    Plain reads go through the page cache, which the kernel may drop, not this process's
    memory. Without a cast the bytes land in the result itself; with one they pass through
    ``buffer[0]`` (uint8, made on the first cast), chunk by chunk. The caller keeps one buffer
    for the whole load: a
    fresh one per tensor leaves holes in the heap that outlive the load (+50% measured).
    ``key``: check the stored values (before any cast) are finite, naming it in the error.
    """
    out = torch.empty(shape, dtype=dtype, device="cpu")
    flat = out.view(-1)
    f.seek(offset)
    if src == dtype:
        _read_into(f, flat)
        if key:
            check_finite(key, flat, f.name)
        return out
    if buffer[0] is None:
        buffer[0] = torch.empty(CAST_CHUNK_BYTES, dtype=torch.uint8, device="cpu")
    chunk = buffer[0].view(src)
    step = chunk.numel()
    for start in range(0, flat.numel(), step):
        part = chunk[: min(step, flat.numel() - start)]
        _read_into(f, part)
        if key:
            check_finite(key, part, f.name)
        flat[start:start + part.numel()].copy_(part)
    return out


def load_folder(folder: Path, dtype: torch.dtype, device, quantize: Collection[str] = ()) -> CausalLM:
    """A resolved HF folder's model: see ``load_model``."""
    config = ModelConfig.from_file(folder / "config.json")
    model, quantized, expected = empty_model(config, quantize)
    loaded: dict[str, torch.Tensor] = {}
    for key, tensor in folder_weights(folder, config, expected, dtype, device):
        if key in quantized:
            tensor = to_nf4(tensor, key)  # the dense copy is freed here...
            release_freed_heap()  # ...and its pages handed back to the system
        loaded[key] = tensor
    return fill_model(model, loaded, quantized, expected, str(folder))


# Where a multimodal checkpoint keeps its language model: the Hub's files (and transformers'
# saves) under language_model.model., transformers' modules under model.language_model.
_LANGUAGE_MODEL = (("language_model.model.", "model."), ("model.language_model.", "model."),
                   ("language_model.lm_head.", "lm_head."))


def decoder_key(key: str, config: ModelConfig) -> str | None:
    """The decoder's name of a stored tensor, or None for one it does not read (a multimodal
    checkpoint's vision tower and projector)."""
    if not config.multimodal:
        return key
    for stored, ours in _LANGUAGE_MODEL:
        if key.startswith(stored):
            return ours + key[len(stored):]
    return "lm_head.weight" if key == "lm_head.weight" else None


def _per_expert(entry: tuple, config: ModelConfig) -> list[tuple]:
    """transformers 5's fused experts of a layer ([experts, 2 x width, hidden] gate_up_proj,
    [experts, hidden, width] down_proj) as the Hub's one weight per expert and projection:
    each a run of rows in the file, read where it lies. Any other entry as it is (one of
    another shape is then refused by name, before anything is made of it)."""
    key, dtype, shape, begin = entry
    layer, found, name = key.rpartition(".experts.")
    d, width = config.hidden_size, config.moe_intermediate_size
    fused = {"gate_up_proj": (config.num_experts, 2 * width, d), "down_proj": (config.num_experts, d, width)}
    if not found or not config.num_experts or fused.get(name) != tuple(shape):
        return [entry]
    experts, rows, cols = shape
    size = rows * cols * dtype.itemsize
    if name == "down_proj":
        return [(f"{layer}.experts.{e}.down_proj.weight", dtype, (rows, cols), begin + e * size)
                for e in range(experts)]
    half = rows // 2
    return [(f"{layer}.experts.{e}.{part}.weight", dtype, (half, cols), begin + e * size + i * size // 2)
            for e in range(experts) for i, part in enumerate(("gate_proj", "up_proj"))]


def folder_weights(folder: Path, config: ModelConfig, expected: dict, dtype: torch.dtype,
                   device: str | torch.device, rows: Callable[[str], tuple[int, int] | None] | None = None):
    """(name, tensor in ``dtype`` on ``device``) for each weight of a safetensors folder, one
    at a time; every file's names and shapes are checked against ``expected`` first.

    ``rows(name)``: the range of the weight's first dimension to read (a rank's share), or
    None for all of it. A row-major tensor's rows are one run of bytes, so only they are read."""
    buffer = [None]  # the cast's chunk, made if a weight is stored in another dtype
    for file in _weight_files(folder):
        entries = [(decoder_key(key, config), *rest) for key, *rest in _entries(file)]
        entries = [part for entry in entries if entry[0] is not None for part in _per_expert(entry, config)]
        for key, *_ in entries:
            if key not in expected and not (key == "lm_head.weight" and config.tie_word_embeddings):
                raise ValueError(
                    f"{file.name} holds {key!r}, which a {config.model_type} model with this "
                    "config.json does not have: config and weights disagree.")
        with open(file, "rb", buffering=0) as f:
            for key, src_dtype, shape, begin in entries:
                if key not in expected:
                    continue  # some tied checkpoints still store the head
                if shape != tuple(expected[key].shape):
                    raise ValueError(
                        f"{key} in {file.name} has shape {shape} but config.json "
                        f"implies {tuple(expected[key].shape)}: config and weights disagree.")
                if not src_dtype.is_floating_point:
                    raise ValueError(f"{key} in {file} is stored as {src_dtype} integers, but model "
                                     "weights are floating point: the file is damaged or not "
                                     "these weights. Download it again.")
                start, stop = (rows(key) if rows is not None else None) or (0, shape[0])
                row_bytes = math.prod(shape[1:]) * src_dtype.itemsize
                part = (stop - start, *shape[1:])
                yield key, _read_tensor(f, begin + start * row_bytes, src_dtype, part, dtype,
                                        buffer, key).to(device)


def dense_weights(model: CausalLM) -> DenseWeights:
    """The weights a saved folder holds (HF names, NF4 dequantized, adapters folded in), made
    as they are written; without the tied head (safetensors refuses shared storage)."""
    weights = DenseWeights(model)
    if model.config.tie_word_embeddings:
        weights.drop("lm_head.weight")
    return weights


def write_weights(tmp: Path, weights: DenseWeights) -> None:
    """``weights`` into ``tmp`` as safetensors files of at most ``PART_BYTES``, cut and named as
    huggingface_hub cuts them (one ``model.safetensors`` for a small model; else
    ``model-0000k-of-0000n.safetensors`` and the index transformers reads), each file's
    weights made, moved to the host, written and freed before the next."""
    from huggingface_hub import split_state_dict_into_shards_factory

    # the descriptions are meta tensors: sized by shape and dtype, none sharing storage
    split = split_state_dict_into_shards_factory(
        weights.described, filename_pattern="model{suffix}.safetensors", max_shard_size=PART_BYTES,
        get_storage_size=lambda t: t.numel() * t.element_size(), get_storage_id=lambda t: None)
    for name, keys in split.filename_to_tensors.items():
        part = {key: weights.make(key).to("cpu") for key in keys}
        save_file(part, str(tmp / name), metadata={"format": "pt"})
        del part
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def stream_safetensors(path: Path, weights, metadata: dict | None = None) -> None:
    """``weights`` (``described`` and ``make``: ``peft.AdapterWeights``, ``peft.DenseWeights``)
    as one safetensors file, a tensor at a time: the header first (each name, dtype, shape
    and place, from ``described``), then each tensor made, moved to the host and written in
    turn. safetensors' own writer takes a file's tensors together; a PEFT adapter must be one
    file, and across ranks every adapter would then be gathered to rank 0's host at once."""
    header, offset = ({"__metadata__": metadata} if metadata else {}), 0
    for key, meta in weights.described.items():
        size = meta.numel() * meta.element_size()
        header[key] = {"dtype": _ST_NAMES[meta.dtype], "shape": list(meta.shape),
                       "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for key, meta in weights.described.items():
            tensor = weights.make(key).to("cpu").contiguous()
            if tensor.shape != meta.shape or tensor.dtype != meta.dtype:
                raise RuntimeError(f"{key} was made {tensor.dtype} {tuple(tensor.shape)}, described "
                                   f"{meta.dtype} {tuple(meta.shape)}.")
            f.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
            del tensor


def write_hf_folder(folder: str | os.PathLike, weights: DenseWeights, config: ModelConfig,
                    tokenizer=None) -> Path:
    """Atomically write ``weights`` as a folder transformers loads (``write_weights``)."""
    hf_config = config.to_hf()
    hf_config["torch_dtype"] = str(next(iter(weights.described.values())).dtype).removeprefix("torch.")

    def write(tmp: Path) -> None:
        write_weights(tmp, weights)
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        if tokenizer is not None:
            tokenizer.save(tmp)

    return write_atomically(folder, write)


def save_model(model: CausalLM, folder: str | os.PathLike, tokenizer=None) -> Path:
    """Write ``model`` (and its tokenizer) as a Hugging Face folder that transformers loads.

    Args:
        model: The model to write.
        folder: Where (made or replaced atomically).
        tokenizer: Its tokenizer, written beside it.

    Returns:
        The folder written.
    """
    if has_lora(model):
        raise ValueError("The model still carries LoRA layers; merge them first "
                         "(nbtune.peft.merge_lora) to save full weights.")
    return write_hf_folder(folder, dense_weights(model), model.config, tokenizer)
