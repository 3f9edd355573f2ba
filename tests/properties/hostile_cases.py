"""Hostile and damaged files, crafted here (never downloaded), one function a case.

Each case writes its files into a fresh folder and hands them to nbtune the way a user
would. ``run(name)`` reports what happened: refused (nbtune's error, its message), or
accepted (what the case checked), and whether any payload ran (its marker file exists).
test_hostile.py runs each in a forked child with a memory cap and a time limit and checks
the exact outcome listed in ``CASES``.
"""

from __future__ import annotations

import json
import math
import os
import struct
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

import nbtune as nt
from nbtune.models import CausalLM
from nbtune.models.config import ModelConfig

CASES: dict[str, tuple] = {}  # name -> (function, expected outcome, words the message holds)
MARKER = "PAYLOAD_RAN"


def case(outcome: str, *words: str):
    """``outcome``: "refused:ErrorName" (nbtune's error, with ``words`` in its message;
    "{folder}" stands for the case's folder) or "accepted"."""
    def register(fn):
        CASES[fn.__name__] = (fn, outcome, words)
        return fn
    return register


def run(name: str) -> dict:
    folder = Path(tempfile.mkdtemp(prefix=f"hostile-{name}-"))
    fn, _, _ = CASES[name]
    try:
        result = {"outcome": "accepted", "detail": fn(folder)}
    except AssertionError as err:  # the case's own check of an accepted file failed
        result = {"outcome": "wrong", "message": str(err)}
    except Exception as err:
        result = {"outcome": "refused", "error": type(err).__name__,
                  "module": type(err).__module__, "message": str(err)}
    result["folder"] = str(folder)
    result["payload_ran"] = any(folder.rglob(MARKER)) or (Path(tempfile.gettempdir()) / MARKER).exists()
    shutil.rmtree(folder, ignore_errors=True)  # the case's files, its symlinks not followed
    return result


# ---- builders ---------------------------------------------------------------------------

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 64,
          "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}


def model_folder(folder: Path, **config) -> tuple[Path, dict]:
    """A tiny valid model folder (config.json + model.safetensors); returns it and its weights."""
    path = folder / "model"
    path.mkdir()
    hf = {**CONFIG, **config}
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.from_hf(CONFIG))
    model.reset_parameters()
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(hf))
    return path, state


def with_config(folder: Path, **changes) -> Path:
    path, _ = model_folder(folder)
    hf = json.loads((path / "config.json").read_text())
    hf.update(changes)
    (path / "config.json").write_text(json.dumps(hf))
    return path


def payload_pickle(marker: Path) -> bytes:
    """A pickle that, if anything unpickles it, writes ``marker``."""
    import pickle

    class Payload:
        def __reduce__(self):
            return (Path.write_text, (marker, "ran"))
    return pickle.dumps(Payload())


def gguf_bytes(entries: list[bytes], tensors: list[tuple[str, list[int], int, int]],
               data: bytes = b"", counts: tuple[int, int] | None = None) -> bytes:
    """A GGUF file built by hand, so each field can be wrong: ``entries`` are encoded
    key/value records, ``tensors`` (name, dims, ggml type, offset)."""
    def string(text: str) -> bytes:
        raw = text.encode()
        return struct.pack("<Q", len(raw)) + raw
    n_tensors, n_entries = counts or (len(tensors), len(entries))
    out = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_entries) + b"".join(entries)
    for name, dims, kind, offset in tensors:
        out += string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        out += struct.pack("<IQ", kind, offset)
    out += b"\0" * ((-len(out)) % 32)
    return out + data


def kv_string(key: str, value: str) -> bytes:
    k, v = key.encode(), value.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", 8) + struct.pack("<Q", len(v)) + v


def kv_u32(key: str, value: int) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<II", 4, value)


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


# ---- model folders: config.json -------------------------------------------------------

@case("refused:ConfigError", "config.json", "not valid JSON")
def config_not_json(folder):
    path, _ = model_folder(folder)
    (path / "config.json").write_text('{"model_type": "llama",,}')
    nt.load_model(path)


@case("refused:ConfigError", "config.json", "nests deeper")
def config_nested_deep(folder):
    path, _ = model_folder(folder)
    (path / "config.json").write_text("[" * 200_000 + "]" * 200_000)
    nt.load_model(path)


@case("refused:ConfigError", "config.json", "limit")
def config_huge(folder):
    path, _ = model_folder(folder)
    with open(path / "config.json", "w") as f:
        f.write('{"pad": "' + "x" * (5 << 20) + '"}')
    nt.load_model(path)


@case("refused:ConfigError", "config.json", "pipe")
def config_is_a_fifo(folder):
    path, _ = model_folder(folder)
    (path / "config.json").unlink()
    fifo(path / "config.json")
    nt.load_model(path)


@case("refused:ConfigError", "config.json", "device")
def config_links_to_dev_zero(folder):
    path, _ = model_folder(folder)
    (path / "config.json").unlink()
    (path / "config.json").symlink_to("/dev/zero")
    nt.load_model(path)


@case("refused:ConfigError", "config.json", "num_hidden_layers", "limit")
def config_absurd_layer_count(folder):
    nt.load_model(with_config(folder, num_hidden_layers=10**9))


@case("refused:ConfigError", "config.json", "hidden_size", "limit")
def config_absurd_hidden_size(folder):
    nt.load_model(with_config(folder, hidden_size=10**8, head_dim=8))


@case("refused:ConfigError", "config.json", "vocab_size", "limit")
def config_absurd_vocab(folder):
    nt.estimate(with_config(folder, vocab_size=10**12))


@case("refused:ConfigError", "config.json", "rope_theta")
def config_negative_rope_theta(folder):
    nt.load_model(with_config(folder, rope_theta=-10000.0))


@case("refused:ConfigError", "config.json", "rope_theta")
def config_nan_rope_theta(folder):
    path = with_config(folder)
    text = (path / "config.json").read_text().replace('"rope_theta": 10000.0', '"rope_theta": NaN')
    (path / "config.json").write_text(text)
    nt.load_model(path)


@case("refused:ConfigError", "config.json", "low_freq_factor")
def config_rope_scaling_without_factors(folder):
    nt.load_model(with_config(folder, rope_scaling={"rope_type": "llama3", "factor": 8.0}))


@case("refused:ConfigError", "config.json", "rms_norm_eps")
def config_zero_rms_eps(folder):
    nt.load_model(with_config(folder, rms_norm_eps=0))


@case("refused:ConfigError", "config.json", "head_dim")
def config_head_dim_is_text(folder):
    nt.load_model(with_config(folder, head_dim="8"))


@case("refused:ConfigError", "config.json", "JSON object")
def config_is_a_list(folder):
    path, _ = model_folder(folder)
    (path / "config.json").write_text("[1, 2]")
    nt.load_model(path)


@case("refused:ConfigError", "config.json", "UTF-8")
def config_not_utf8(folder):
    path, _ = model_folder(folder)
    (path / "config.json").write_bytes(b'{"model_type": "ll\xffama"}')
    nt.load_model(path)


@case("accepted")
def config_with_remote_code_is_not_run(folder):
    """auto_map names a modeling file that writes the marker when imported: never imported."""
    path = with_config(folder, auto_map={"AutoModelForCausalLM": "modeling_evil.EvilModel"})
    (path / "modeling_evil.py").write_text(f"open({str(path / MARKER)!r}, 'w').write('ran')\n")
    model = nt.load_model(path)
    return {"parameters": sum(p.numel() for p in model.parameters())}


# ---- model folders: weights -------------------------------------------------------------

@case("accepted")
def weights_valid_folder_loads_exactly(folder):
    path, state = model_folder(folder)
    model = nt.load_model(path)
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items()), "weights differ from the file"
    return {"tensors": len(state)}


@case("refused:FileRefused", "outside")
def weights_index_points_outside(folder):
    path, state = model_folder(folder)
    (folder / "stolen.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    (path / "model.safetensors").unlink()
    index = {"weight_map": {k: "../stolen.safetensors" for k in state}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    nt.load_model(path)


@case("refused:FileRefused", "not a file name inside")
def weights_index_absolute_path(folder):
    path, state = model_folder(folder)
    index = {"weight_map": {k: str(path / "model.safetensors") for k in state}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    nt.load_model(path)


@case("refused:FileRefused", "weight_map")
def weights_index_without_map(folder):
    path, _ = model_folder(folder)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": [1, 2]}))
    nt.load_model(path)


@case("refused:FileRefused", "not valid JSON")
def weights_index_not_json(folder):
    path, _ = model_folder(folder)
    (path / "model.safetensors.index.json").write_text("{")
    nt.load_model(path)


@case("accepted")
def weights_file_links_into_a_cache(folder):
    """Weights that link elsewhere, as snapshot_download(local_dir=...) links into its cache,
    load exactly (they must parse as safetensors; a template link out is refused instead)."""
    path, state = model_folder(folder)
    (path / "model.safetensors").rename(folder / "blob")
    (path / "model.safetensors").symlink_to(folder / "blob")
    loaded = nt.load_model(path).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items()), "weights differ"
    return {}


@case("refused:FileRefused", "not a file name inside")
def weights_index_climbs_out_through_a_subfolder(folder):
    path, state = model_folder(folder)
    (path / "sub").mkdir()
    index = {"weight_map": {k: "sub/../../model/model.safetensors" for k in state}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    nt.load_model(path)


@case("refused:FileRefused", "pipe")
def weights_file_is_a_fifo(folder):
    path, _ = model_folder(folder)
    (path / "model.safetensors").unlink()
    fifo(path / "model.safetensors")
    nt.load_model(path)


def _with_weight(folder: Path, key: str, change) -> Path:
    path, state = model_folder(folder)
    state[key] = change(state[key])
    save_file(state, str(path / "model.safetensors"))
    return path


def _nan(t):
    t = t.clone()
    t.view(-1)[3] = math.nan
    return t


def _inf(t):
    t = t.clone()
    t.view(-1)[0] = math.inf
    return t


@case("refused:ValueError", "model.layers.1.mlp.up_proj.weight", "model.safetensors", "NaN")
def weights_hold_nan(folder):
    nt.load_model(_with_weight(folder, "model.layers.1.mlp.up_proj.weight", _nan))


@case("refused:ValueError", "model.norm.weight", "infinite")
def weights_hold_inf(folder):
    nt.load_model(_with_weight(folder, "model.norm.weight", _inf))


@case("accepted")
def weights_nan_allowed_for_debugging(folder):
    path = _with_weight(folder, "model.norm.weight", _nan)
    os.environ["NBTUNE_ALLOW_NONFINITE"] = "1"
    model = nt.load_model(path)
    assert torch.isnan(model.model.norm.weight).sum() == 1, "the NaN was not loaded as it is"
    return {}


@case("refused:ValueError", "model.norm.weight", "integers")
def weights_are_integers(folder):
    nt.load_model(_with_weight(folder, "model.norm.weight", lambda t: t.to(torch.int32)))


@case("refused:ValueError", "model.safetensors", "damaged")
def weights_truncated(folder):
    path, _ = model_folder(folder)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    nt.load_model(path)


@case("refused:ValueError", "model.safetensors", "damaged")
def weights_header_claims_huge_size(folder):
    path, _ = model_folder(folder)
    data = bytearray((path / "model.safetensors").read_bytes())
    data[:8] = struct.pack("<Q", 1 << 40)
    (path / "model.safetensors").write_bytes(bytes(data))
    nt.load_model(path)


@case("refused:FileNotFoundError", "pickle")
def weights_only_a_pickle(folder):
    path, _ = model_folder(folder)
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(payload_pickle(path / MARKER))
    nt.load_model(path)


# ---- GGUF ---------------------------------------------------------------------------

def _gguf(folder: Path, blob: bytes) -> Path:
    path = folder / "model.gguf"
    path.write_bytes(blob)
    return path


@case("refused:GGUFError", "model.gguf", "not a GGUF")
def gguf_not_gguf(folder):
    nt.load_model(_gguf(folder, b"hello, this is text" * 4))


@case("refused:GGUFError", "model.gguf", "array", "declares")
def gguf_array_longer_than_the_file(folder):
    k = b"tokenizer.ggml.tokens"
    entry = struct.pack("<Q", len(k)) + k + struct.pack("<IIQ", 9, 8, 1 << 60)
    nt.load_model(_gguf(folder, gguf_bytes([entry], [])))


@case("refused:GGUFError", "model.gguf", "string")
def gguf_string_longer_than_the_file(folder):
    k = b"general.name"
    entry = struct.pack("<Q", len(k)) + k + struct.pack("<IQ", 8, 1 << 62) + b"x" * 64
    nt.load_model(_gguf(folder, gguf_bytes([entry], [])))


@case("refused:GGUFError", "model.gguf", "declares")
def gguf_absurd_tensor_count(folder):
    nt.load_model(_gguf(folder, gguf_bytes([], [], counts=(1 << 50, 0))))


@case("refused:GGUFError", "model.gguf", "outside the file")
def gguf_tensor_outside_the_file(folder):
    entries = [kv_string("general.architecture", "llama")]
    tensors = [("token_embd.weight", [8, 4], 0, 1 << 20)]
    nt.load_model(_gguf(folder, gguf_bytes(entries, tensors, b"\0" * 128)))


@case("refused:GGUFError", "model.gguf", "overlap")
def gguf_tensors_overlap(folder):
    entries = [kv_string("general.architecture", "llama")]
    tensors = [("a.weight", [8, 4], 0, 0), ("b.weight", [8, 4], 0, 64)]
    nt.load_model(_gguf(folder, gguf_bytes(entries, tensors, b"\0" * 256)))


@case("refused:GGUFError", "model.gguf", "unaligned")
def gguf_tensor_misaligned(folder):
    entries = [kv_string("general.architecture", "llama")]
    tensors = [("a.weight", [8, 4], 0, 4)]
    nt.load_model(_gguf(folder, gguf_bytes(entries, tensors, b"\0" * 256)))


@case("refused:GGUFError", "model.gguf", "integers")
def gguf_integer_tensor(folder):
    entries = [kv_string("general.architecture", "llama")]
    tensors = [("token_embd.weight", [8, 4], 26, 0)]  # I32
    nt.load_model(_gguf(folder, gguf_bytes(entries, tensors, b"\0" * 256)))


@case("refused:GGUFError", "model.gguf", "dimensions")
def gguf_tensor_with_nine_dimensions(folder):
    tensors = [("a.weight", [1] * 9, 0, 0)]
    nt.load_model(_gguf(folder, gguf_bytes([], tensors, b"\0" * 64)))


@case("refused:GGUFError", "model.gguf", "alignment")
def gguf_alignment_not_a_power_of_two(folder):
    nt.load_model(_gguf(folder, gguf_bytes([kv_u32("general.alignment", 24)], [])))


@case("refused:ConfigError", "model.gguf", "num_hidden_layers", "limit")
def gguf_absurd_layer_count(folder):
    entries = [kv_string("general.architecture", "llama"), kv_u32("llama.block_count", 10**9),
               kv_u32("llama.embedding_length", 32), kv_u32("llama.feed_forward_length", 64),
               kv_u32("llama.attention.head_count", 4), kv_u32("llama.vocab_size", 64)]
    nt.load_model(_gguf(folder, gguf_bytes(entries, [])))


@case("refused:ConfigError", "model.gguf", "num_attention_heads")
def gguf_phi3_without_heads(folder):
    """(Its head width divides by the head count: a zero there raised ZeroDivisionError.)"""
    entries = [kv_string("general.architecture", "phi3"), kv_u32("phi3.block_count", 2),
               kv_u32("phi3.embedding_length", 32), kv_u32("phi3.feed_forward_length", 64),
               kv_u32("phi3.attention.head_count", 0), kv_u32("phi3.rope.dimension_count", 8),
               kv_u32("phi3.vocab_size", 64)]
    nt.load_model(_gguf(folder, gguf_bytes(entries, [])))


@case("refused:GGUFError", "model.gguf", "rope_factors_long", "at most")
def gguf_phi3_rope_factors_of_a_million(folder):
    """Read into a list of Python floats: bounded before (1M of them would be 32 MB)."""
    entries = [kv_string("general.architecture", "phi3"), kv_u32("phi3.block_count", 2),
               kv_u32("phi3.embedding_length", 32), kv_u32("phi3.feed_forward_length", 64),
               kv_u32("phi3.attention.head_count", 4), kv_u32("phi3.vocab_size", 64)]
    tensors = [("rope_factors_long.weight", [1 << 20], 0, 0), ("rope_factors_short.weight", [4], 0, 4 << 20)]
    nt.load_model(_gguf(folder, gguf_bytes(entries, tensors, b"\0" * ((4 << 20) + 32))))


@case("refused:ConfigError", "model.gguf", "num_experts", "limit")
def gguf_qwen3moe_with_a_billion_experts(folder):
    entries = [kv_string("general.architecture", "qwen3moe"), kv_u32("qwen3moe.block_count", 2),
               kv_u32("qwen3moe.embedding_length", 32), kv_u32("qwen3moe.feed_forward_length", 64),
               kv_u32("qwen3moe.attention.head_count", 4), kv_u32("qwen3moe.vocab_size", 64),
               kv_u32("qwen3moe.expert_count", 10**9), kv_u32("qwen3moe.expert_used_count", 2),
               kv_u32("qwen3moe.expert_feed_forward_length", 16)]
    nt.load_model(_gguf(folder, gguf_bytes(entries, [])))


@case("refused:GGUFError", "model.gguf", "pipe")
def gguf_is_a_fifo(folder):
    nt.load_model(fifo(folder / "model.gguf"))


def _tiny_gguf(folder: Path) -> Path:
    """A valid f32 GGUF of a tiny model, written by nbtune."""
    from nbtune.models.gguf import write_gguf
    from nbtune.models.hf import dense_weights
    from nbtune.models.tiny import byte_tokenizer

    tok = byte_tokenizer()
    config = ModelConfig.from_hf({**CONFIG, "vocab_size": tok.backend.get_vocab_size()})
    torch.manual_seed(0)
    model = CausalLM(config)
    model.reset_parameters()
    write_gguf(folder / "model.gguf", dense_weights(model), config, tok, "f32")
    return folder / "model.gguf"


@case("refused:GGUFError", "model.gguf")
def gguf_truncated(folder):
    path = _tiny_gguf(folder)
    data = path.read_bytes()
    nt.load_model(_gguf(folder, data[: len(data) * 2 // 3]))


@case("refused:GGUFError", "output_norm.weight", "NaN")
def gguf_nan_weight(folder):
    from nbtune.models.gguf import GGUFFile

    path = _tiny_gguf(folder)
    norm = next(t for t in GGUFFile(path).tensors if t.name == "output_norm.weight")
    data = bytearray(path.read_bytes())
    struct.pack_into("<f", data, norm.data_offset, math.nan)
    nt.load_model(_gguf(folder, bytes(data)))


def _gguf_tokenizer_meta(folder: Path, tokens, merges) -> Path:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(folder / "model.gguf"), "llama")
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.merges", merges)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return folder / "model.gguf"


@case("refused:GGUFError", "model.gguf", "tokenizer metadata is damaged")
def gguf_tokens_are_numbers(folder):
    from nbtune.models.gguf import gguf_tokenizer

    gguf_tokenizer(_gguf_tokenizer_meta(folder, [1, 2, 3], ["a b"]))


@case("refused:GGUFError", "model.gguf", "tokenizer metadata is damaged")
def gguf_merges_without_a_space(folder):
    from nbtune.models.gguf import gguf_tokenizer

    gguf_tokenizer(_gguf_tokenizer_meta(folder, ["a", "b", "ab"], ["ab"]))


@case("refused:GGUFError", "model.gguf", "'llama.context_length' holds str '4096'", "must be a number")
def gguf_number_field_holding_a_string(folder):
    entries = [kv_string("general.architecture", "llama"), kv_string("llama.context_length", "4096")]
    nt.load_model(_gguf(folder, gguf_bytes(entries, [])))


@case("refused:GGUFError", "model.gguf", "'llama.context_length' holds str", "must be a number")
def gguf_tokenizer_context_length_holding_a_string(folder):
    from gguf import GGUFWriter

    from nbtune.models.gguf import gguf_tokenizer

    writer = GGUFWriter(str(folder / "model.gguf"), "llama")
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "ab"])
    writer.add_array("tokenizer.ggml.merges", ["a b"])
    writer.add_string("llama.context_length", "long")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    gguf_tokenizer(folder / "model.gguf")


# ---- data files ------------------------------------------------------------------------

def _session_data(path) -> None:
    from nbtune.data import load_examples

    load_examples(path)


@case("refused:DataError", "/dev/zero", "device")
def data_dev_zero(folder):
    _session_data("/dev/zero")


@case("refused:DataError", "rows.jsonl", "pipe")
def data_is_a_fifo(folder):
    _session_data(fifo(folder / "rows.jsonl"))


@case("refused:DataError", "rows.jsonl", "line 2", "limit")
def data_one_huge_line(folder):
    path = folder / "rows.jsonl"
    with open(path, "w") as f:
        f.write('{"instruction": "a", "output": "b"}\n{"instruction": "')
        for _ in range(24):
            f.write("x" * (1 << 20))
        f.write('", "output": "b"}\n')
    _session_data(path)


@case("refused:DataError", "rows.jsonl", "line 1", "surrogate")
def data_lone_surrogate(folder):
    path = folder / "rows.jsonl"
    path.write_text('{"instruction": "hi \\ud800 there", "output": "b"}\n')
    _session_data(path)


@case("accepted")
def data_line_separator_inside_a_string(folder):
    from nbtune.data import load_examples

    path = folder / "rows.jsonl"
    path.write_text(json.dumps({"instruction": "a\u2028b", "output": "c\u2029d"},
                               ensure_ascii=False) + "\n", encoding="utf-8")
    examples = load_examples(path)
    assert len(examples) == 1 and examples[0].messages[-1][1] == "c\u2029d", "row changed"
    return {"rows": 1}


@case("refused:DataError", "rows.jsonl", "line 1", "nested")
def data_deeply_nested_row(folder):
    path = folder / "rows.jsonl"
    path.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    _session_data(path)


@case("refused:DataError", "rows.jsonl", "UTF-8")
def data_not_utf8(folder):
    path = folder / "rows.jsonl"
    path.write_bytes(b'{"instruction": "caf\xe9", "output": "b"}\n')
    _session_data(path)


@case("refused:DataError", "rows.pkl", "pickle")
def data_pickle_is_never_unpickled(folder):
    path = folder / "rows.pkl"
    path.write_bytes(payload_pickle(folder / MARKER))
    _session_data(path)


@case("accepted")
def data_long_row_is_cut_before_tokenizing(folder):
    """A 12 MB answer (under the line limit) at seq_len 64: the tokenizer is given a cut text,
    not 12 MB, and the sample equals the one made from the answer's first 20,000 characters."""
    from nbtune.data import Example, tokenize
    from nbtune.models.tiny import byte_tokenizer

    tok = byte_tokenizer()
    encoded = []
    whole = tok.encode_with_offsets
    tok.encode_with_offsets = lambda text: encoded.append(len(text)) or whole(text)
    text = "word " * (12 << 18)
    long = tokenize(Example((("user", "q"), ("assistant", text)), instruction=("q", "")), tok, 64)
    short = tokenize(Example((("user", "q"), ("assistant", text[:20_000])), instruction=("q", "")),
                     tok, 64)
    assert encoded[0] < 100_000, f"the tokenizer was given {encoded[0]:,} characters"
    assert torch.equal(long.input_ids, short.input_ids) and torch.equal(long.labels, short.labels)
    assert len(long.input_ids) == 64, f"{len(long.input_ids)} tokens, not seq_len"
    return {"encoded": encoded[0]}


@case("accepted")
def data_json_list_on_one_long_line(folder):
    """A .json list written on one line (json.dump, pandas) longer than the JSONL row limit
    is read: the limit is per JSONL line, not per .json file."""
    from nbtune.data import load_examples

    rows = [{"instruction": f"q{i}", "output": "a" * 4096} for i in range(5000)]
    path = folder / "rows.json"
    path.write_text(json.dumps(rows))
    assert path.stat().st_size > 16 << 20
    examples = load_examples(path)
    assert len(examples) == 5000 and examples[-1].messages[-1][1] == "a" * 4096
    return {"rows": 5000}


# ---- run files -------------------------------------------------------------------------

def _run_file(folder: Path, text: str) -> Path:
    path = folder / "run.yaml"
    path.write_text(text)
    return path


@case("refused:RunFileError", "run.yaml", "aliases")
def runfile_alias_bomb(folder):
    from nbtune import runfile

    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        lines.append(f"{chr(97 + i)}: &{chr(97 + i)} [{', '.join(['*' + chr(96 + i)] * 9)}]")
    runfile.load(_run_file(folder, "\n".join(lines) + "\ndemo: tiny\n"))


@case("refused:RunFileError", "run.yaml")
def runfile_python_tag_is_not_run(folder):
    from nbtune import runfile

    marker = folder / MARKER
    runfile.load(_run_file(folder, f'demo: !!python/object/apply:os.system ["touch {marker}"]\n'))


@case("refused:RunFileError", "run.yaml", "UTF-8")
def runfile_not_utf8(folder):
    from nbtune import runfile

    path = folder / "run.yaml"
    path.write_bytes(b"demo: t\xffiny\n")
    runfile.load(path)


@case("refused:RunFileError", "run.yaml", "pipe")
def runfile_is_a_fifo(folder):
    from nbtune import runfile

    runfile.load(fifo(folder / "run.yaml"))


@case("refused:RunFileError", "run.yaml", "limit")
def runfile_huge(folder):
    from nbtune import runfile

    runfile.load(_run_file(folder, "demo: tiny\n" + "# pad\n" * (1 << 19)))


def _train_cli(run_file: Path, *args) -> tuple[int, str]:
    import contextlib
    import io

    import nbtune.cli.main as cli

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(["train", str(run_file), "--no-progress", *map(str, args)])
    return code, err.getvalue()


def _cli_refusal(code: int, shown: str) -> None:
    """A CLI refusal: exit 2, one message, no traceback (raised for run() to report)."""
    assert code == 2 and "Traceback" not in shown, f"exit {code}: {shown}"
    raise ValueError(shown)


@case("refused:ValueError", "holds the run file", "run.yaml")
def runfile_out_is_its_own_folder(folder):
    path = _run_file(folder, "demo: tiny\nrun: {steps: 1, out: .}\n")
    before = path.read_bytes()
    code, shown = _train_cli(path)
    assert path.read_bytes() == before, "the run file was written over"
    _cli_refusal(code, shown)


@case("refused:ValueError", "is a file")
def runfile_out_is_a_file(folder):
    (folder / "out").write_text("mine")
    code, shown = _train_cli(_run_file(folder, "demo: tiny\nrun: {steps: 1}\n"), "--out", folder / "out")
    assert (folder / "out").read_text() == "mine"
    _cli_refusal(code, shown)


@case("refused:ValueError", "did not write")
def runfile_out_holds_other_files(folder):
    (folder / "out").mkdir()
    (folder / "out" / "summary.json").write_text("mine")
    code, shown = _train_cli(_run_file(folder, "demo: tiny\nrun: {steps: 1}\n"), "--out", folder / "out")
    assert (folder / "out" / "summary.json").read_text() == "mine"
    _cli_refusal(code, shown)


@case("refused:ValueError", "did not write")
def runfile_out_holds_a_foreign_metrics_file(folder):
    """A metrics.jsonl alone does not make a folder nbtune's (only its marker, run.yaml or a
    checkpoint does): resuming into it is refused and the file kept."""
    (folder / "out").mkdir()
    (folder / "out" / "metrics.jsonl").write_text('{"step": 1}\n')
    code, shown = _train_cli(_run_file(folder, "demo: tiny\nrun: {steps: 1}\n"), "--out",
                             folder / "out", "--resume")
    assert (folder / "out" / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert sorted(p.name for p in (folder / "out").iterdir()) == ["metrics.jsonl"]
    _cli_refusal(code, shown)


@case("accepted")
def runfile_out_folders_nbtune_made_are_reused(folder):
    """An output folder is reused when nbtune made it: resuming from its own run.yaml copy, a
    folder of an earlier version (run.yaml and a checkpoint, no marker), one holding only
    dotfiles (.ipynb_checkpoints)."""
    import nbtune.cli.train as train_cli
    from nbtune import runfile

    out = folder / "out"
    out.mkdir()
    (out / "run.yaml").write_text(runfile.HEADER + " nbtune train THIS_FILE\ndemo: tiny\n")
    train_cli.check_out(out, out / "run.yaml")
    older = folder / "older"
    (older / "checkpoints" / "step-00000002").mkdir(parents=True)
    (older / "checkpoints" / "step-00000002" / "trainer_state.json").write_text("{}")
    (older / "notes.txt").write_text("x")
    train_cli.check_out(older, folder / "run.yaml")
    (folder / "dots" / ".ipynb_checkpoints").mkdir(parents=True)
    train_cli.check_out(folder / "dots", folder / "run.yaml")
    return {}


@case("refused:ValueError", "config.json", "num_hidden_layers")
def cli_bad_model_config_exits_2(folder):
    from nbtune.models.tiny import byte_tokenizer

    path = with_config(folder, num_hidden_layers=10**9)
    byte_tokenizer().save(path)
    rows = folder / "rows.jsonl"
    rows.write_text('{"instruction": "a", "output": "b"}\n')
    run = _run_file(folder, f"model: {path}\ndata: {{train: {rows}}}\nrun: {{steps: 1}}\n")
    _cli_refusal(*_train_cli(run, "--out", folder / "o"))


@case("refused:ValueError", "WORLD_SIZE", "torchrun")
def cli_bad_world_size_exits_2(folder):
    os.environ["WORLD_SIZE"] = "two"
    _cli_refusal(*_train_cli(_run_file(folder, "demo: tiny\nrun: {steps: 1}\n"), "--out", folder / "o"))


@case("refused:ValueError", "RANK", "torchrun")
def cli_world_without_rank_exits_2(folder):
    os.environ["WORLD_SIZE"] = "2"
    os.environ.pop("RANK", None)
    _cli_refusal(*_train_cli(_run_file(folder, "demo: tiny\nrun: {steps: 1}\n"), "--out", folder / "o"))


@case("refused:ValueError", "File name too long", "Check the path")
def cli_out_name_too_long_exits_2(folder):
    run = _run_file(folder, "demo: tiny\nrun: {steps: 1}\n")
    _cli_refusal(*_train_cli(run, "--out", folder / ("o" * 300)))


# ---- save_config and checkpoints -----------------------------------------------------------

def _demo_session():
    return nt.Session.demo("tiny", device="cpu")


@case("refused:FileExistsError", "link")
def save_config_through_a_link(folder):
    target = folder / "precious.txt"
    target.write_text("mine")
    (folder / "run.yaml").symlink_to(target)
    try:
        _demo_session().save_config(folder / "run.yaml", steps=1)
    finally:
        assert target.read_text() == "mine", "written through the link"


@case("refused:FileExistsError", "not a run file nbtune wrote")
def save_config_over_a_file_it_did_not_write(folder):
    (folder / "run.yaml").write_text("my notes\n")
    try:
        _demo_session().save_config(folder / "run.yaml", steps=1)
    finally:
        assert (folder / "run.yaml").read_text() == "my notes\n"


@case("accepted")
def save_config_over_its_own_file(folder):
    session = _demo_session()
    session.save_config(folder / "run.yaml", steps=1)
    session.save_config(folder / "run.yaml", steps=2)
    assert "steps: 2" in (folder / "run.yaml").read_text()
    return {}


@case("refused:CheckpointRefused", "trainer_state.json", "not valid JSON")
def checkpoint_state_not_json(folder):
    session = _demo_session()
    session.save_checkpoint(folder / "ck")
    (folder / "ck" / "trainer_state.json").write_text("{")
    session.load_checkpoint(folder / "ck")


@case("refused:CheckpointRefused", "outside")
def checkpoint_names_a_file_outside(folder):
    session = _demo_session()
    session.save_checkpoint(folder / "ck")
    state = json.loads((folder / "ck" / "trainer_state.json").read_text())
    state["files"]["weights"] = ["../../etc/passwd"]
    (folder / "ck" / "trainer_state.json").write_text(json.dumps(state))
    session.load_checkpoint(folder / "ck")


@case("refused:CheckpointRefused", "trainer_state.json", "pipe")
def checkpoint_state_is_a_fifo(folder):
    session = _demo_session()
    session.save_checkpoint(folder / "ck")
    (folder / "ck" / "trainer_state.json").unlink()
    fifo(folder / "ck" / "trainer_state.json")
    session.load_checkpoint(folder / "ck")


# ---- settings given as dicts ----------------------------------------------------------------

@case("accepted")
def estimate_takes_a_dict_like_session(folder):
    path = with_config(folder)
    given = nt.estimate(path, {"batch_size": 2, "seq_len": 64})
    want = nt.estimate(path, nt.Techniques(batch_size=2, seq_len=64))
    assert given.as_dict() == want.as_dict(), "a dict estimated differently"
    return {}


@case("accepted")
def techniques_dict_applies_on_top_of_the_session(folder):
    session = _demo_session()
    before = session.techniques
    session.techniques = {"lr": 1e-4}
    assert session.techniques == before.replace(lr=1e-4), session.techniques.changed(before)
    return {}
