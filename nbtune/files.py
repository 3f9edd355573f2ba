"""The trust boundary: every file nbtune did not write itself is read through here.

Model folders, GGUF files, tokenizer configs, chat templates, datasets, run files and
checkpoints come from the Hub or from strangers. Before anything parses them this layer
bounds them: regular files only (a FIFO or ``/dev/zero`` would hang or never end), a size
known before reading, JSON of bounded size and depth, paths that stay inside the folder
they came with, and plausible model dimensions. Every limit lives in ``LIMITS`` with the
reason for it; exceeding one is a ``FileRefused`` naming the file, the limit and the fix.

Standard library only: the loaders import this, never the other way round.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

MiB, GiB = 1 << 20, 1 << 30

# name: (limit, why). Sizes in bytes. Generous for real checkpoints (the largest real value
# seen is in the reason), small enough that a crafted file is refused in well under a second.
LIMITS: dict[str, tuple[int, str]] = {
    "config_bytes": (4 * MiB, "config.json, generation_config.json: real ones are a few KiB"),
    "json_bytes": (256 * MiB, "tokenizer.json: Gemma's 256k vocabulary is ~35 MiB"),
    "json_depth": (200, "real config and tokenizer JSON nests < 10 deep; Python's parser recurses"),
    "index_bytes": (64 * MiB, "model.safetensors.index.json: a 405B index is ~100 KiB"),
    "state_bytes": (1 * GiB, "trainer_state.json: the step history of a very long run"),
    "template_bytes": (1 * MiB, "chat templates: the longest real ones are ~20 KiB"),
    "run_file_bytes": (1 * MiB, "a run file is a page of YAML"),
    "run_file_nodes": (10_000, "YAML nodes in a run file: aliases can multiply a tiny file"),
    "data_bytes": (8 * GiB, "a dataset file is read whole into memory; split a larger one"),
    "row_bytes": (16 * MiB, "one JSONL row: far above any seq_len; the tokenizer encodes it whole"),
    "gguf_bytes": (1 << 40, "a GGUF file: a 405B model in f16 is ~800 GiB"),
    "weights_bytes": (1 << 40, "one safetensors file: shards are ~5 GiB, a whole 405B ~800 GiB"),
    "gguf_array_items": (1 << 24, "a GGUF metadata array: a 256k vocabulary has 2.6e5 tokens"),
    "gguf_string_bytes": (16 * MiB, "one GGUF metadata string: a chat template is ~20 KiB"),
    # model dimensions (config.json or GGUF metadata)
    "vocab_size": (1 << 21, "the largest real vocabularies are ~256k tokens"),
    "hidden_size": (1 << 16, "Llama 3.1 405B: 16384"),
    "intermediate_size": (1 << 19, "Llama 3.1 405B: 53248"),
    "num_hidden_layers": (1024, "Llama 3.1 405B: 126"),
    "num_attention_heads": (1024, "Llama 3.1 405B: 128"),
    "num_key_value_heads": (1024, "at most the attention heads"),
    "head_dim": (1024, "real models use 64-256"),
    "num_experts": (1024, "DeepSeek-V3 and Qwen3-MoE: 256 and 128"),
    "max_position_embeddings": (1 << 24, "1M-token context models: 1048576"),
    # chat templates (nbtune/template/): code from the Hub, run in jinja's sandbox, which
    # bounds what a template may reach but not how long it runs or how much it builds
    "template_compile_ms": (2_000, "CPU time to parse a template and generate its code: "
                            "SmolLM2's takes ~7 ms, a 64 KiB one ~0.7 s on a slow CPU"),
    "template_code_bytes": (1 * MiB, "the Python a template compiles to, before compile() (one "
                            "call no check can interrupt): a 64 KiB template gives ~200 KiB"),
    "template_render_ms": (1_000, "CPU time of one render, plus 1 ms per message: real templates "
                           "take 10-60 microseconds per message"),
    "template_output": (4 * MiB, "characters a render may build in one value or write in all, or "
                        "4x the conversation's size if more: real templates add a few KiB"),
    "template_memory": (512 * MiB, "memory one render may add to the process, or 16 bytes per "
                        "character of template_output if more: real renders add a few MiB"),
    "template_steps": (1_000_000, "loop iterations, calls, filters and operators counted in one "
                       "render, plus 1,000 per message: real templates take 1-5 per message"),
    "template_depth": (100, "nested macro calls and recursive loops: real templates nest < 10 "
                       "(a recursive macro follows a JSON schema's depth)"),
    "template_int": (1 << 20, "an integer given to a call or filter, or a format width (a "
                     "width, count or indent): real ones are < 10,000"),
    "template_int_bits": (4096, "the bits of an integer * or ** may build (1,234 digits): real "
                          "templates count messages"),
}


def shown(value) -> str:
    """A value read from a file, for an error message: its type and its text, cut short (a
    crafted one may be long)."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"

def limit(name: str) -> int:
    return LIMITS[name][0]


class FileRefused(ValueError):
    """A file nbtune will not read, naming the file, what is wrong and what to do."""


def _size(size: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"


def regular_file(path, what: str, limit_name: str | None) -> int:
    """The size of ``path`` if it is a regular file (links followed) within its limit (None: a
    file read as a stream, whatever its size)."""
    path = Path(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such {what}.") from None
    except OSError as err:
        raise FileRefused(f"{path}: cannot read this {what} ({err.strerror}).") from None
    if not stat.S_ISREG(info.st_mode):
        kind = ("a folder" if stat.S_ISDIR(info.st_mode) else "a pipe" if stat.S_ISFIFO(info.st_mode)
                else "a device" if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode)
                else "a socket" if stat.S_ISSOCK(info.st_mode) else "not a regular file")
        raise FileRefused(f"{path} is {kind}, not a {what} file: nbtune reads regular files "
                          "only. Give the path of the file itself.")
    cap, why = LIMITS[limit_name] if limit_name is not None else (float("inf"), "")
    if info.st_size > cap:
        raise FileRefused(f"{path} is {_size(info.st_size)}, more than nbtune reads as a {what} "
                          f"file (limit {_size(cap)}: {why}).")
    return info.st_size


def read_bytes(path, what: str, limit_name: str) -> bytes:
    """A regular file's bytes, refused before reading if it exceeds its limit."""
    size = regular_file(path, what, limit_name)
    with open(path, "rb") as f:
        data = f.read(size + 1)
    if len(data) > size:  # it grew while being read
        raise FileRefused(f"{path} changed while it was read; try again once it is complete.")
    return data


def read_text(path, what: str, limit_name: str) -> str:
    data = read_bytes(path, what, limit_name)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise FileRefused(f"{path} is not UTF-8 text (byte {err.start}: {err.reason}). Save the "
                          f"{what} as UTF-8.") from None


def parse_json(text: str, source, what: str, fix: str = ""):
    """JSON text with nbtune's error for damaged or absurdly nested input; ``fix`` says what to
    do (default: get the file again)."""
    fix = fix or f"download or write the {what} again"
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise FileRefused(f"{source} is not valid JSON (line {err.lineno}, column {err.colno}: "
                          f"{err.msg}). Fix it or {fix}.") from None
    except RecursionError:
        raise FileRefused(f"{source} nests deeper than any {what} does (limit "
                          f"{limit('json_depth')}). It is damaged or crafted.") from None


def read_json(path, what: str, limit_name: str = "config_bytes", kind: type | None = dict,
              fix: str = ""):
    """A bounded JSON file; ``kind``: the type its top level must have."""
    value = parse_json(read_text(path, what, limit_name), path, what, fix)
    if kind is not None and not isinstance(value, kind):
        raise FileRefused(f"{path} holds a JSON {type(value).__name__}, but a {what} is a JSON "
                          f"{'object' if kind is dict else kind.__name__}. It is damaged.")
    return value


def root_of(folder) -> Path:
    """Where links in ``folder`` may point: the folder itself, or inside a Hugging Face cache
    snapshot (``models--org--name/snapshots/<rev>/...``, whose files link to ``../../blobs``)
    the repository's cache folder."""
    folder = Path(folder).resolve()
    for parent in folder.parents:
        if parent.name == "snapshots" and parent.parent.name.startswith("models--"):
            return parent.parent
    return folder


def inside(folder, name, what: str, links: bool = False) -> Path:
    """``folder / name``, refused if the name leads outside ``folder`` (``..``, an absolute
    path: a crafted index could otherwise point anywhere) or, unless ``links``, if a link it
    follows does. ``links=True`` is for weights, which download tools link into their cache
    (``snapshot_download(local_dir=...)``) and which must parse as safetensors anyway; text
    that could leak into a prompt (a chat template) must really lie inside."""
    folder = Path(folder)
    if not isinstance(name, str) or not name or os.path.isabs(name) or "\x00" in name \
            or ".." in Path(name).parts:
        raise FileRefused(f"{folder}: the {what} {name!r} is not a file name inside the folder. "
                          "The folder is damaged or crafted.")
    path = folder / name
    if links:
        return path
    root = root_of(folder)
    resolved = path.resolve()
    if resolved != root and root not in resolved.parents:
        raise FileRefused(f"{path}: the {what} leads outside {folder} (to {resolved}). nbtune "
                          "reads only files inside the model folder; copy the file in.")
    return path
