"""Atomic saves: what is refused, what is replaced, faults in the swap, SIGKILL at random moments."""

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import nbtune.atomic as atomic
from nbtune.atomic import write_atomically
from nbtune.models.hf import write_atomically as reexported

from helpers import small_session

ATOMIC_FILE = Path(atomic.__file__)
LOAD_ALONE = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("atomic_alone", {str(ATOMIC_FILE)!r})
atomic = importlib.util.module_from_spec(spec)
spec.loader.exec_module(atomic)  # the module alone: no torch, so the process starts fast
"""


def writer(letter: str, n: int = 1000, fail_after_first: bool = False):
    """A save of two files that must agree: config.json and model.safetensors, ``n`` letters each."""
    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps({"letter": letter, "text": letter * n}))
        if fail_after_first:
            raise RuntimeError("disk full")
        (tmp / "model.safetensors").write_bytes(letter.encode() * n)
    return write


def content(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".nbtune-" in p.name)


def assert_complete(folder: Path, n: int) -> str:
    """``folder`` holds one whole save of ``writer``: both files, one letter, full length."""
    assert folder.is_dir(), f"{folder} is missing"
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((folder / "config.json").read_text())
    letter = config["letter"]
    assert config["text"] == letter * n
    assert (folder / "model.safetensors").read_bytes() == letter.encode() * n
    return letter


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_the_old_import_path_is_the_new_function():
    assert reexported is write_atomically


# ---- what is refused ------------------------------------------------------------------------

def test_saving_onto_a_file_is_refused_and_the_file_is_untouched(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"my notes\x00\xff")
    with pytest.raises(ValueError, match=r"notes\.txt: it is a file, not a folder.*Choose a folder path"):
        write_atomically(notes, writer("A"))
    assert notes.read_bytes() == b"my notes\x00\xff"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_saving_onto_a_link_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "folder").mkdir()
    write_atomically(tmp_path / "folder", writer("A"))
    for name in ("file", "folder", "nowhere"):
        link = tmp_path / f"link-to-{name}"
        link.symlink_to(tmp_path / name)
        with pytest.raises(ValueError, match="symbolic link.*Choose a folder path"):
            write_atomically(link, writer("B"))
        assert os.readlink(link) == str(tmp_path / name)
    assert (tmp_path / "file").read_text() == "x"
    assert assert_complete(tmp_path / "folder", 1000) == "A"
    assert leftovers(tmp_path) == []


def test_saving_under_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="part of that path is a file"):
        write_atomically(tmp_path / "file" / "out", writer("A"))
    assert (tmp_path / "file").read_text() == "x"


@pytest.mark.parametrize("entries", [
    {"analysis.ipynb": "{}", "data/train.jsonl": "{}"},  # a notebooks folder
    {"config.json": "{}", "train.py": "print()"},  # a project with a config.json
    {"config.json": "{}", "model.safetensors": "x", "checkpoint-500/model.safetensors": "x"},
    {"notes.txt": "hello"},
    {"settings.json": "{}"},  # JSON, but nothing a save always writes
])
def test_an_unrelated_folder_is_refused_and_unchanged(tmp_path, entries):
    folder = tmp_path / "work"
    for name, text in entries.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    before = content(folder)
    with pytest.raises(ValueError, match="holds other things.*not a previous save.*Choose a new folder"):
        write_atomically(folder, writer("A"))
    assert content(folder) == before
    assert leftovers(tmp_path) == []


def test_an_empty_folder_and_previous_saves_are_replaced(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert write_atomically(empty, writer("A")) == empty
    assert assert_complete(empty, 1000) == "A"
    write_atomically(empty, writer("B"))  # our previous save
    assert assert_complete(empty, 1000) == "B"
    hf = tmp_path / "hf"  # as transformers / peft / the HF Trainer write them
    hf.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "merges.txt", "README.md", "adapter_config.json", "optimizer.pt", "rng_state.pth",
                 "training_args.bin", "trainer_state.json", "chat_template.jinja"):
        (hf / name).write_text("x")
    write_atomically(hf, writer("A"))
    assert assert_complete(hf, 1000) == "A"
    assert leftovers(tmp_path) == []


def test_a_new_folder_gets_the_usual_permissions(tmp_path):
    umask = os.umask(0)
    os.umask(umask)
    write_atomically(tmp_path / "deep" / "er" / "out", writer("A"))
    assert (tmp_path / "deep" / "er" / "out").stat().st_mode & 0o777 == 0o777 & ~umask


def test_a_long_name_keeps_temporary_names_short(tmp_path):
    target = tmp_path / ("m" * 240)
    seen = []
    write_atomically(target, lambda tmp: (seen.append(tmp.name), writer("A")(tmp)))
    write_atomically(target, writer("B"))
    assert len(seen[0]) < 200 and assert_complete(target, 1000) == "B"
    assert leftovers(tmp_path) == []


# ---- through the session ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def session():
    return small_session()


def test_a_name_too_long_for_the_file_system_is_one_sentence_and_leaves_nothing(tmp_path, session):
    """The file system's ENAMETOOLONG, as a notebook shows it: the path and the fix."""
    target = tmp_path / ("m" * 300)
    with pytest.raises(atomic.SaveFailed, match=r"Cannot save to .*mmm: the name is longer than the "
                                                r"file system there allows \(at most 255 bytes a name\): "
                                                r"choose a shorter name\.$") as refused:
        session.save(target)
    assert "Errno" not in str(refused.value) and isinstance(refused.value, OSError)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("code,fix", [(errno.EROFS, "is read-only: choose a folder on a writable disk"),
                                      (errno.EACCES, "there is no permission to write in"),
                                      (errno.ENOSPC, "is full: free space there")])
def test_a_read_only_or_full_disk_is_one_sentence_and_leaves_nothing(tmp_path, session, monkeypatch,
                                                                     code, fix):
    """A read-only mount cannot be made here (root ignores modes): the file system's own
    error is raised where a save first writes, the temporary folder's creation."""
    real = os.mkdir

    def refuse(path, *args, **kwargs):
        if ".nbtune-tmp-" in str(path):
            raise OSError(code, os.strerror(code), str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", refuse)
    with pytest.raises(atomic.SaveFailed, match=rf"Cannot save to {tmp_path / 'out'}: .*{fix}") as refused:
        session.save(tmp_path / "out")
    assert "Errno" not in str(refused.value)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(os, "mkdir", real)
    session.save(tmp_path / "out")  # and once the disk takes it, the save is whole
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file() or (tmp_path / "out" / "config.json").is_file()


def test_safetensors_own_write_error_is_one_sentence_too(tmp_path, session):
    """safetensors reports the file system's refusal of its write as its own SafetensorError
    (text, not an OSError): a real one here, from a file size limit (RLIMIT_FSIZE: the write
    fails with EFBIG, as on a FAT32 stick past 4 GiB), becomes the same one sentence."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, limit[1]))
    try:
        with pytest.raises(atomic.SaveFailed, match=rf"Cannot save to {tmp_path / 'out'}: a file is "
                           "larger than the file system") as refused:
            session.save(tmp_path / "out", merge=True)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, previous)
    assert refused.value.errno == errno.EFBIG and "Errno" not in str(refused.value)
    assert list(tmp_path.iterdir()) == []


def test_session_save_refuses_a_file_and_a_foreign_folder(tmp_path, session):
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        session.save(notes)
    assert notes.read_text() == "keep me"
    (tmp_path / "project" / "src").mkdir(parents=True)
    (tmp_path / "project" / "run.ipynb").write_text("{}")
    before = content(tmp_path / "project")
    with pytest.raises(ValueError, match="holds other things"):
        session.save(tmp_path / "project")
    with pytest.raises(ValueError, match="holds other things"):
        session.save_checkpoint(tmp_path / "project")
    assert content(tmp_path / "project") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "project"]


def test_session_save_into_an_empty_folder_and_over_a_previous_save(tmp_path, session):
    out = tmp_path / "out"
    out.mkdir()
    session.save(out)
    first = content(out)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(first)
    session.step()
    session.save(out)  # over the previous save: replaced
    assert set(content(out)) == set(first)
    assert content(out)["model.safetensors"] != first["model.safetensors"]
    session.save_checkpoint(out)  # a checkpoint over a model save: also ours
    assert (out / "trainer_state.json").is_file() and not (out / "config.json").exists()
    session.load_checkpoint(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ---- failures and faults ----------------------------------------------------------------------

@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_failing_write_leaves_the_old_folder_and_no_temporary(tmp_path, error):
    target = tmp_path / "out"
    write_atomically(target, writer("A"))
    before = content(target)

    def write(tmp):
        writer("B")(tmp)
        raise error("interrupted mid-write")

    with pytest.raises(error):
        write_atomically(target, write)
    with pytest.raises(RuntimeError):
        write_atomically(target, writer("B", fail_after_first=True))
    assert content(target) == before
    assert leftovers(tmp_path) == []


def test_a_fault_in_the_exchange_leaves_the_old_content(tmp_path, monkeypatch):
    target = tmp_path / "out"
    write_atomically(target, writer("A"))
    before = content(target)

    def broken(dir_fd, a, b):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(atomic, "_exchange", broken)
    with pytest.raises(OSError, match="I/O error"):
        write_atomically(target, writer("B"))
    assert content(target) == before
    assert leftovers(tmp_path) == []


def force_fallback(monkeypatch):
    def unsupported(dir_fd, a, b):
        raise atomic.ExchangeUnsupported(errno.EINVAL, "no RENAME_EXCHANGE here")

    monkeypatch.setattr(atomic, "_exchange", unsupported)


def test_the_fallback_renames_swap_when_the_exchange_is_unsupported(tmp_path, monkeypatch):
    force_fallback(monkeypatch)
    target = tmp_path / "out"
    for letter in "ABA":
        write_atomically(target, writer(letter))
        assert assert_complete(target, 1000) == letter
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("fail_at", [1, 2])
def test_a_fault_between_the_fallback_renames_leaves_the_old_content(tmp_path, monkeypatch, fail_at):
    target = tmp_path / "out"
    write_atomically(target, writer("A"))
    before = content(target)
    force_fallback(monkeypatch)
    calls = []
    rename = atomic._rename

    def faulty(dir_fd, parent, src, dst):
        calls.append((src, dst))
        if len(calls) == fail_at:  # 1: target -> old; 2: tmp -> target
            raise OSError(errno.EIO, "I/O error")
        rename(dir_fd, parent, src, dst)

    monkeypatch.setattr(atomic, "_rename", faulty)
    with pytest.raises(OSError, match="I/O error"):
        write_atomically(target, writer("B"))
    assert content(target) == before
    assert leftovers(tmp_path) == []


def test_the_next_save_restores_a_folder_a_kill_between_the_fallback_renames_removed(tmp_path):
    target = tmp_path / "out"
    write_atomically(target, writer("A"))
    killed = subprocess.run([sys.executable, "-c", LOAD_ALONE + f"""
import errno, os, signal
def unsupported(*args):
    raise atomic.ExchangeUnsupported(errno.EINVAL, "no RENAME_EXCHANGE here")
atomic._exchange = unsupported
rename, calls = atomic._rename, []
def rename_then_die(*args):
    calls.append(args)
    if len(calls) == 2:  # after target -> old, before tmp -> target
        os.kill(os.getpid(), signal.SIGKILL)
    rename(*args)
atomic._rename = rename_then_die
atomic.write_atomically({str(target)!r}, lambda tmp: (tmp / "config.json").write_text("B"))
"""])
    assert killed.returncode == -signal.SIGKILL
    assert not target.exists()  # the window the fallback has and the exchange has not
    assert [name.split(".")[2].rsplit("-", 2)[0] for name in leftovers(tmp_path)] == ["nbtune-old", "nbtune-tmp"]
    with pytest.raises(RuntimeError):  # even a save that fails puts the old folder back first
        write_atomically(target, writer("B", fail_after_first=True))
    assert assert_complete(target, 1000) == "A"
    assert leftovers(tmp_path) == []
    assert atomic.recover(target) is False


def test_only_stale_temporaries_of_this_target_are_removed(tmp_path):
    target = tmp_path / "out"
    write_atomically(target, writer("A"))
    dead, live = dead_pid(), os.getppid()
    names = {
        "stale": f".out.nbtune-tmp-{dead}-0123abcd",
        "stale_swapped_out": f".out.nbtune-tmp-{dead}-4567cdef",
        "live_writer": f".out.nbtune-tmp-{live}-0123abcd",
        "other_target": f".outer.nbtune-tmp-{dead}-0123abcd",
        "user_folder": f".out.nbtune-tmp-{dead}-notours",
        "locked": f".out.nbtune-tmp-{dead}-89abcdef",  # e.g. a writer in another PID namespace
    }
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_text("partial")
    (tmp_path / f".out.nbtune-tmp-{dead}-feedbeef").write_text("a file: not ours")
    import fcntl

    fd = os.open(tmp_path / names["locked"], os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        write_atomically(target, writer("B"))
    finally:
        os.close(fd)
    kept = set(leftovers(tmp_path))
    assert names["stale"] not in kept and names["stale_swapped_out"] not in kept
    assert kept == {names["live_writer"], names["other_target"], names["user_folder"],
                    names["locked"], f".out.nbtune-tmp-{dead}-feedbeef"}
    assert assert_complete(target, 1000) == "B"


# ---- SIGKILL at random moments ------------------------------------------------------------------

SAVE_FOREVER = LOAD_ALONE + """
import json
target, n, i = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def write(letter):
    def inner(tmp):
        (tmp / "config.json").write_text(json.dumps({"letter": letter, "text": letter * n}))
        (tmp / "model.safetensors").write_bytes(letter.encode() * n)
    return inner
print("saving", flush=True)
while True:
    atomic.write_atomically(target, write("AB"[i % 2]))
    i += 1
"""


@pytest.mark.slow
def test_sigkill_at_random_moments_never_leaves_a_partial_folder(tmp_path):
    """Children save in a loop (two files, alternating letters) and die by SIGKILL at random
    moments: after every kill the target holds one whole save; the next save tidies up."""
    n = 256 << 10
    target = tmp_path / "out"
    write_atomically(target, writer("A", n))
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    kills, letters, with_leftovers, most_leftovers = 0, set(), 0, 0
    deadline = time.monotonic() + 12
    while kills < 40 and time.monotonic() < deadline:
        child = subprocess.Popen([sys.executable, "-c", SAVE_FOREVER, str(target), str(n), str(kills)],
                                 stdout=subprocess.PIPE)
        assert child.stdout.readline() == b"saving\n", f"the child failed (seed {seed})"
        time.sleep(rng.uniform(0, 0.06))
        child.send_signal(signal.SIGKILL)
        assert child.wait() == -signal.SIGKILL, f"the child stopped by itself (seed {seed})"
        child.stdout.close()
        kills += 1
        letters.add(assert_complete(target, n))
        left = leftovers(tmp_path)
        with_leftovers += bool(left)
        most_leftovers = max(most_leftovers, len(left))
    assert kills >= 30, f"only {kills} kills in time (seed {seed})"
    assert letters == {"A", "B"}, f"the saves never alternated (seed {seed})"
    assert with_leftovers > 0, f"no kill landed inside a save (seed {seed})"
    assert most_leftovers <= 2  # each child's first save removed what the previous one left
    write_atomically(target, writer("B", n))
    assert assert_complete(target, n) == "B"
    assert leftovers(tmp_path) == []


def test_every_saved_file_gets_the_mode_a_plain_file_gets(tmp_path):
    """safetensors wrote its files 0600 while the JSON beside them got 0644: an adapter the
    group could not read. Every file of a save now has the mode ``open`` gives here."""
    import stat

    import nbtune as nt

    plain = tmp_path / "plain"
    plain.touch()
    usual = stat.S_IMODE(plain.stat().st_mode)
    session = nt.Session.demo(techniques=dict(method="lora"))
    session.echo = False
    session.save(tmp_path / "adapter")
    session.save(tmp_path / "merged", merge=True)
    session.save_checkpoint(tmp_path / "checkpoint")
    files = [p for folder in ("adapter", "merged", "checkpoint") for p in (tmp_path / folder).iterdir()]
    assert any(p.suffix == ".safetensors" for p in files) and len(files) >= 8
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in files} == {p.name: usual for p in files}
