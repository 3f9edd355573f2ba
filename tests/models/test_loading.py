"""Loading: sharded checkpoints, Hub ids and data files from the cache (offline), lean casts."""

import shutil

import huggingface_hub
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import nbtune as nt
from nbtune.data import load_examples
from nbtune.hub import parse_datasets_url, resolve_data_file
from nbtune.models import demo_model_dir, hf
from nbtune.session import demo_data_file

from helpers import tiny_llama

COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty, private Hugging Face cache; the Hub itself is unreachable (HF_HUB_OFFLINE=1)."""
    assert huggingface_hub.constants.is_offline_mode()
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    # huggingface_hub reads HF_HUB_CACHE once, at import: point its constant at the tmp dir.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def cache_repo(cache, kind: str, repo_id: str, commit: str, files: dict, refs=("main",)):
    """Lay out one cached commit as huggingface_hub does: refs/<name> -> snapshots/<commit>/."""
    repo = cache / f"{kind}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, source in files.items():
        if isinstance(source, str):
            (snapshot / name).write_text(source)
        else:
            shutil.copy(source, snapshot / name)
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def test_sharded_checkpoint_loads_like_unsharded(tmp_path):
    ref = tiny_llama(tmp_path / "one", tie=False)
    tiny_llama(tmp_path / "many", tie=False, max_shard_size="40KB")
    shards = sorted(p.name for p in (tmp_path / "many").glob("*.safetensors"))
    assert len(shards) >= 3 and (tmp_path / "many" / "model.safetensors.index.json").exists()
    ids = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        one, many = nt.load_model(tmp_path / "one")(ids), nt.load_model(tmp_path / "many")(ids)
        expected = ref(ids).logits
    assert torch.equal(one, many)
    torch.testing.assert_close(many, expected, atol=1e-4, rtol=0)


def test_index_naming_an_absent_shard_is_named(tmp_path):
    tiny_llama(tmp_path, tie=False, max_shard_size="40KB")
    missing = sorted(tmp_path.glob("*.safetensors"))[-1]
    missing.unlink()
    with pytest.raises(FileNotFoundError, match=f"not there: {missing.name}"):
        nt.load_model(tmp_path)


def test_fp32_checkpoint_loads_as_bf16(tmp_path, monkeypatch):
    folder = demo_model_dir()
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    full = nt.load_model(folder)
    # A chunk smaller than any tensor (and not dividing it) runs the chunked cast's loop and tail.
    monkeypatch.setattr(hf, "CAST_CHUNK_BYTES", 1000)
    half = nt.load_model(folder, dtype="bf16")
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    for (name, a), (_, b) in zip(full.named_parameters(), half.named_parameters()):
        assert torch.equal(a.to(torch.bfloat16), b), name


def test_loaded_tensors_are_the_parameters_and_tied_head_is_shared(tmp_path):
    tiny_llama(tmp_path, tie=True)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["lm_head.weight"] = torch.zeros_like(state["model.embed_tokens.weight"])  # stored anyway
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = nt.load_model(tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"])
    params = {id(p) for p in model.parameters()}
    tensors = model.state_dict(keep_vars=True).values()
    assert all(id(t) in params for t in tensors)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == len(params)


def test_weights_are_not_backed_by_the_file(tmp_path):
    """An mmap-backed weight would change when the file changes under it (and count in RSS)."""
    shutil.copytree(demo_model_dir(), tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    model = nt.load_model(tmp_path / "m")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    size = len(weights.read_bytes())
    with open(weights, "r+b") as f:  # overwrite the data in place, keeping the header
        header = 8 + int.from_bytes(f.read(8), "little")
        f.seek(header)
        f.write(b"\0" * (size - header))
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_repo_id_resolves_from_the_cache_with_and_without_revision(hub_cache, tmp_path):
    demo = demo_model_dir()
    files = {f.name: f for f in demo.iterdir()}
    cache_repo(hub_cache, "model", "owner/tiny", COMMIT_A, files)
    changed = nt.load_model(demo)
    with torch.no_grad():
        changed.lm_head.weight.mul_(2)
    nt.save_model(changed, tmp_path / "v2")
    cache_repo(hub_cache, "model", "owner/tiny", COMMIT_B,
               {**files, "model.safetensors": tmp_path / "v2" / "model.safetensors"}, refs=("v2",))

    def head(**kw):
        return nt.load_model("owner/tiny", **kw).lm_head.weight

    reference = nt.load_model(demo).lm_head.weight
    assert torch.equal(head(), reference)
    assert torch.equal(head(revision=COMMIT_A), reference)
    assert torch.equal(head(revision=COMMIT_B), 2 * reference)
    assert torch.equal(head(revision="v2"), 2 * reference)


def test_uncached_repo_id_and_revision_say_so(hub_cache):
    cache_repo(hub_cache, "model", "owner/tiny", COMMIT_A, {"config.json": "{}"})
    with pytest.raises(FileNotFoundError, match="'owner/absent' is not in the local Hugging Face cache"):
        nt.load_model("owner/absent")
    with pytest.raises(FileNotFoundError, match="at revision 'v9' is not in the local .*HF_HUB_OFFLINE"):
        nt.load_model("owner/tiny", revision="v9")


def test_uncached_data_file_says_so(hub_cache):
    offline = "data file 'hf://datasets/owner/absent/train.jsonl' is not in the local Hugging Face cache"
    with pytest.raises(FileNotFoundError, match=offline):
        resolve_data_file("hf://datasets/owner/absent/train.jsonl")
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        nt.Session.from_pretrained(demo_model_dir(), data="hf://datasets/owner/absent/train.jsonl",
                                   device="cpu")


def test_session_reads_hub_data_from_the_cache(hub_cache, tmp_path):
    rows = demo_data_file("train").read_text().splitlines()
    cache_repo(hub_cache, "dataset", "owner/name", COMMIT_A, {"train.jsonl": "\n".join(rows[:8])})
    cache_repo(hub_cache, "dataset", "owner/name", COMMIT_B, {"train.jsonl": "\n".join(rows[8:12])},
               refs=("v1",))
    expected = load_examples(demo_data_file("train"))
    session = nt.Session.from_pretrained(demo_model_dir(), data="hf://datasets/owner/name/train.jsonl",
                                         techniques=nt.Techniques(batch_size=2, seq_len=128),
                                         device="cpu")
    assert session.train_examples == expected[:8]
    assert session.step().tokens > 0
    assert load_examples(resolve_data_file("hf://datasets/owner/name@v1/train.jsonl")) == expected[8:12]
    assert load_examples(resolve_data_file("hf://datasets/owner/name/train.jsonl",
                                           revision=COMMIT_B)) == expected[8:12]


def test_data_specs_parse_and_local_paths_stay_local(tmp_path):
    quoted = "hf://datasets/o/n@refs%2Fpr%2F1/dir/a.jsonl"
    assert parse_datasets_url(quoted) == ("o/n", "refs/pr/1", "dir/a.jsonl")
    assert parse_datasets_url("hf://datasets/o/n/a.json") == ("o/n", None, "a.json")
    assert resolve_data_file(str(tmp_path / "x.jsonl")) == tmp_path / "x.jsonl"
    with pytest.raises(ValueError, match="hf://datasets/owner/name/path"):
        resolve_data_file("hf://datasets/only-name/a.jsonl")
    with pytest.raises(ValueError, match="give one"):
        resolve_data_file("hf://datasets/o/n@v1/a.jsonl", revision="v2")


@pytest.mark.parametrize("repo_id", ["owner/na..me", "owner/name--x", "owner/name/extra", "-owner/name"])
def test_a_malformed_repo_id_gets_nbtunes_error_before_anything_is_fetched_or_written(
        repo_id, tmp_path, monkeypatch):
    """huggingface_hub's own rule decides; the message says what a repo id looks like."""
    import huggingface_hub

    import nbtune.hub
    from helpers import small_session

    monkeypatch.setattr(huggingface_hub, "HfApi", lambda **kwargs: pytest.fail("the Hub was reached"))
    said = "is not a valid .*A repo id is 'owner/name'"
    with pytest.raises(ValueError, match=said):
        nbtune.hub.push_to_hub(tmp_path, repo_id)  # (an empty folder: refused for the id first)
    session = small_session()
    monkeypatch.setattr(type(session), "save", lambda *a, **k: pytest.fail("saved first"))
    with pytest.raises(ValueError, match=said):
        session.push_to_hub(repo_id)
    if repo_id.count("/") == 1:
        with pytest.raises(ValueError, match=said):
            nbtune.hub.resolve_model_folder(repo_id)
        owner, name = repo_id.split("/")
        with pytest.raises(ValueError, match=said):
            nbtune.hub.parse_datasets_url(f"hf://datasets/{owner}/{name}/train.jsonl")
