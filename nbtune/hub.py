"""Hugging Face Hub I/O in one place: model folders and data files, from the cache when offline.

Everything that may touch the network goes through here, so offline behaviour (and the
error a user sees when something is not cached) is decided once.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote

MODEL_FILES = ["*.json", "*.safetensors", "tokenizer.model"]  # never pickle, never code
DATASETS_URL = "hf://datasets/"


def _offline_error(what: str, err: Exception) -> FileNotFoundError:
    return FileNotFoundError(
        f"{what} is not in the local Hugging Face cache and the Hub cannot be reached "
        "(offline, or HF_HUB_OFFLINE=1). Download it once with network access (or unset "
        f"HF_HUB_OFFLINE), or pass a local path instead. ({err.__class__.__name__})")


def check_repo_id(repo_id: str, what: str = "Hub repo id") -> str:
    """``repo_id`` if the Hub would accept it (huggingface_hub's own rule), else nbtune's error
    saying what a repo id looks like (before anything is fetched or created)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ValueError(f"{repo_id!r} is not a valid {what} ({err}). A repo id is 'owner/name': "
                         "letters, digits, '-', '_' and '.', no '--' or '..', not starting or "
                         "ending with '-' or '.', at most 96 characters.") from None
    return repo_id


def resolve_model_folder(path_or_id: str | os.PathLike, revision: str | None = None,
                         files: list[str] = MODEL_FILES) -> Path:
    """A local folder as is; otherwise a Hub repo id fetched (``files``: by default
    safetensors and json only).

    A folder wins over a repo id of the same spelling, so local work never needs the network.
    """
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    name = str(path_or_id)
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise FileNotFoundError(
            f"{name!r} is neither a model folder nor a Hub repo id ('owner/name'). "
            "Give a folder holding config.json and *.safetensors, or a repo id.")
    check_repo_id(name, "model folder or Hub repo id")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=files))
    except LocalEntryNotFoundError as err:
        at = f" at revision {revision!r}" if revision else ""
        raise _offline_error(f"{name!r}{at}", err) from err


def parse_datasets_url(spec: str) -> tuple[str, str | None, str]:
    """``hf://datasets/owner/name[@revision]/path/in/repo`` -> (repo id, revision, path).

    The ``@revision`` sits after the repo name and may be URL-quoted (``refs%2Fpr%2F1``),
    as in the URLs ``huggingface_hub.HfFileSystem`` accepts.
    """
    parts = spec[len(DATASETS_URL):].split("/", 2)
    if not spec.startswith(DATASETS_URL) or len(parts) < 3 or not all(parts):
        raise ValueError(f"{spec!r}: a Hub data file is written "
                         "'hf://datasets/owner/name/path/in/repo.jsonl' (optionally name@revision).")
    owner, name, filename = parts
    name, _, revision = name.partition("@")
    return check_repo_id(f"{owner}/{name}", "Hub dataset id"), unquote(revision) or None, filename


def resolve_data_file(spec: str | os.PathLike, revision: str | None = None) -> Path:
    """A local path as is; ``hf://datasets/...`` fetched through the Hub cache.

    ``revision`` applies when the URL names none; naming two different ones is an error.
    """
    if not (isinstance(spec, str) and spec.startswith("hf://")):
        return Path(spec).expanduser()
    repo_id, url_revision, filename = parse_datasets_url(spec)
    if url_revision and revision and url_revision != revision:
        raise ValueError(f"{spec!r} names revision {url_revision!r} but revision={revision!r} "
                         "was passed too: give one.")
    revision = url_revision or revision
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(repo_id, filename, repo_type="dataset", revision=revision))
    except LocalEntryNotFoundError as err:
        raise _offline_error(f"The data file {spec!r}", err) from err


def push_to_hub(folder: str | os.PathLike, repo_id: str, *, private: bool | None = None,
                token: str | None = None, revision: str | None = None,
                commit_message: str = "Upload from nbtune") -> str:
    """Publish a folder written by ``Session.save`` to a Hub model repo; returns the commit URL.

    The repo is created if needed. Only a saved model (config.json + *.safetensors), a PEFT
    adapter (adapter_config.json + adapter_model.safetensors) or a GGUF export (model.gguf +
    its Ollama Modelfile: those two files only) is accepted, so nothing else in a working
    folder is uploaded by mistake.
    """
    check_repo_id(repo_id)  # before the folder is read or the Hub reached
    folder = Path(folder)
    is_model = (folder / "config.json").exists() and any(folder.glob("*.safetensors"))
    is_adapter = (folder / "adapter_config.json").exists() and (folder / "adapter_model.safetensors").exists()
    is_gguf = (folder / "model.gguf").is_file() and (folder / "Modelfile").is_file()
    if not (is_model or is_adapter or is_gguf):
        raise FileNotFoundError(f"{folder} is not a saved model, adapter or GGUF export: write it "
                                "with session.save(folder) (format='gguf' for GGUF) first.")
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    only = {} if is_model or is_adapter else {"allow_patterns": ["model.gguf", "Modelfile"]}
    commit = api.upload_folder(folder_path=str(folder), repo_id=repo_id, revision=revision,
                               commit_message=commit_message, **only)
    return str(getattr(commit, "commit_url", commit))
