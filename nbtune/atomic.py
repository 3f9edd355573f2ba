"""Atomic folder saves: the target holds the whole old content or the whole new one, never less.

``write_atomically(folder, write)`` runs ``write(tmp)`` on a fresh temporary folder next to
``folder`` (same parent, so same filesystem), fsyncs it, and then puts it in place:

* On Linux, with a filesystem that supports ``renameat2(..., RENAME_EXCHANGE)`` (ext4, xfs,
  btrfs, f2fs, tmpfs, overlayfs on recent kernels), an existing folder and the new one are
  swapped in ONE system call, so at every instant ``folder`` is complete, even if the
  process is killed or the machine loses power. The old content, now at the temporary
  path, is then deleted.
* Elsewhere (other systems, NFS/CIFS/FUSE mounts, glibc < 2.28) it falls back to two
  renames: ``folder`` -> ``.<name>.nbtune-old-<pid>-<random>``, then the new folder ->
  ``folder``. A process killed between the two leaves ``folder`` missing for a moment; the
  next save to it (or :func:`recover`) renames the old content back first.

Temporary folders are named ``.<name>.nbtune-tmp-<pid>-<random>`` (hidden, in the target's
parent). One left by a killed save is removed by the next save to the same target, once its
writer's process is gone (``os.kill(pid, 0)``) and nobody holds its lock (``flock``, which
also covers writers in another PID namespace sharing the folder).

What is refused, before anything is written: a target that exists and is not a folder (a
file, a symbolic link), and an existing folder that does not look like a previous save (see
:func:`looks_like_a_save`), since replacing it would delete what it holds.

Standard library only, so a bare process can import this file alone (the kill tests do).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import re
import secrets
import shutil
import stat
import sys
from pathlib import Path
from typing import Callable

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

__all__ = ["write_atomically", "write_file_atomically", "looks_like_a_save", "recover",
           "remove_stale_temporaries", "SaveFailed"]

RENAME_EXCHANGE = 2  # <linux/fs.h>
TMP_TAG, OLD_TAG = "nbtune-tmp", "nbtune-old"

# A folder holding one of these was written by a save (ours, transformers', peft's, HF Trainer's)...
SAVE_MARKERS = frozenset({"config.json", "adapter_config.json", "trainer_state.json"})
MARKER_SUFFIXES = (".safetensors",)
# ...and replacing it is allowed only if every entry is a file such folders hold.
SAVE_SUFFIXES = (".json", ".safetensors", ".jinja", ".model", ".bin", ".pt", ".pth", ".gguf",
                 ".tiktoken", ".msgpack", ".h5")
SAVE_NAMES = frozenset({"merges.txt", "vocab.txt", "README.md", ".gitattributes", ".DS_Store"})

_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, getattr(errno, "ENOTSUP", -1),
                getattr(errno, "EOPNOTSUPP", -1)}


# ---- the one-syscall swap -----------------------------------------------------------------

def _load_renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28, musl >= 1.2.5
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_renameat2 = _load_renameat2()


class ExchangeUnsupported(OSError):
    """This system or filesystem cannot swap two paths in one call."""


def _exchange(dir_fd: int, a: str, b: str) -> None:
    """Swap the entries ``a`` and ``b`` of the folder ``dir_fd`` in one system call."""
    if _renameat2 is None:
        raise ExchangeUnsupported(errno.ENOSYS, "renameat2 is not available")
    if _renameat2(dir_fd, os.fsencode(a), dir_fd, os.fsencode(b), RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        if code in _UNSUPPORTED:
            raise ExchangeUnsupported(code, f"RENAME_EXCHANGE: {os.strerror(code)}")
        raise OSError(code, os.strerror(code), b)


def _rename(dir_fd: int | None, parent: Path, src: str, dst: str) -> None:
    """Rename the entry ``src`` of ``parent`` (open as ``dir_fd`` if not None) to ``dst``."""
    if dir_fd is None:
        os.rename(parent / src, parent / dst)
    else:
        os.rename(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


# ---- names, liveness, locks ---------------------------------------------------------------

def _stem(name: str) -> str:
    """``name`` as it appears in temporary names: shortened (with a hash) if it is long."""
    if len(os.fsencode(name)) <= 150:
        return name
    return name[:100] + "~" + hashlib.sha1(os.fsencode(name)).hexdigest()[:12]


def _temp_name(name: str, tag: str) -> str:
    return f".{_stem(name)}.{tag}-{os.getpid()}-{secrets.token_hex(4)}"


def _temp_pattern(name: str) -> re.Pattern:
    return re.compile(rf"\.{re.escape(_stem(name))}\.({TMP_TAG}|{OLD_TAG})-([0-9]+)-[0-9a-f]+\Z")


_IN_PROGRESS: set[str] = set()  # temporary names this process is writing or swapping now


def _in_use(pid: int, entry: str) -> bool:
    """Whether the temporary ``entry`` made by process ``pid`` may still be in use (unsure: yes)."""
    if pid == os.getpid():
        return entry in _IN_PROGRESS
    if pid <= 0 or os.name != "posix":
        return True  # os.kill on Windows would terminate the process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: someone else's live process
        return True
    return True


def _open_dir(path, dir_fd: int | None = None) -> int | None:
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        return os.open(path, flags, dir_fd=dir_fd)
    except (OSError, NotImplementedError):
        return None


def _lock(fd: int | None) -> bool:
    """Lock an open folder (False if another holds it; True also when locks do not work here)."""
    if fd is None or fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return True  # no locks on this filesystem: the PID check alone decides
    return True


def _close(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)


def _remove(path: Path) -> None:
    """Delete a temporary folder (or stray link), ignoring what has already gone."""
    try:
        if path.is_symlink() or not path.is_dir():
            path.unlink(missing_ok=True)
        else:
            shutil.rmtree(path, ignore_errors=True)
    except OSError:
        pass


def _stale(parent: Path, name: str) -> list[tuple[str, Path]]:
    """(tag, path) of the temporaries for ``name`` in ``parent`` whose writer has gone."""
    pattern = _temp_pattern(name)
    found = []
    try:
        entries = os.listdir(parent)
    except OSError:
        return found
    for entry in entries:
        match = pattern.match(entry)
        if match is None or _in_use(int(match.group(2)), entry):
            continue
        path = parent / entry
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                continue  # we only ever make folders: not ours
        except OSError:
            continue
        found.append((match.group(1), path))
    return found


def recover(folder: str | os.PathLike) -> bool:
    """Put back ``folder`` if a save killed between its two fallback renames left it missing.

    Returns True if something was restored. Never needed after a one-call swap (Linux).
    """
    folder = Path(os.path.abspath(folder))
    if os.path.lexists(folder):
        return False
    olds = [path for tag, path in _stale(folder.parent, folder.name) if tag == OLD_TAG]
    def changed(path: Path) -> float:
        try:
            return path.lstat().st_ctime
        except OSError:
            return 0.0

    for path in sorted(olds, key=changed, reverse=True):  # the latest, should there be several
        try:
            os.rename(path, folder)
            return True
        except OSError:
            continue
    return False


def remove_stale_temporaries(folder: str | os.PathLike) -> list[Path]:
    """Delete what killed saves to ``folder`` left next to it; returns the paths removed.

    Only hidden folders named as this module names them for this very target, whose writer
    process has exited and whose lock is free, are touched.
    """
    folder = Path(os.path.abspath(folder))
    recover(folder)  # an old folder is content to restore, not garbage
    removed = []
    for _tag, path in _stale(folder.parent, folder.name):
        fd = _open_dir(path)
        try:
            if fd is not None and not _lock(fd):
                continue  # a live writer (perhaps in another PID namespace) holds it
            _remove(path)
            removed.append(path)
        finally:
            _close(fd)
    return removed


# ---- what may be replaced -------------------------------------------------------------------

def looks_like_a_save(folder: str | os.PathLike) -> tuple[bool, list[str]]:
    """(whether replacing the existing folder is safe, the entries that make it unsafe).

    An empty folder may be replaced, and so may a previous save: one holding config.json,
    adapter_config.json, trainer_state.json or a *.safetensors file and nothing but the
    plain files model folders hold (*.json, *.safetensors, tokenizer files, pickled weights,
    README.md). Anything else (a subfolder, a notebook, a script, notes) means the folder is
    someone's work, and replacing it would delete that.
    """
    entries = sorted(os.listdir(folder))
    if not entries:
        return True, []
    foreign = []
    for entry in entries:
        try:
            mode = os.lstat(os.path.join(folder, entry)).st_mode
        except FileNotFoundError:
            continue
        plain = stat.S_ISREG(mode) or stat.S_ISLNK(mode)
        if not plain or not (entry in SAVE_NAMES or entry.endswith(SAVE_SUFFIXES)):
            foreign.append(entry + ("/" if stat.S_ISDIR(mode) else ""))
    marked = any(e in SAVE_MARKERS or e.endswith(MARKER_SUFFIXES) for e in entries)
    if not marked and not foreign:
        foreign = entries  # only JSON and the like, but nothing a save always writes
    return not foreign, foreign


def _check_target(folder: Path) -> bool:
    """Raise if ``folder`` must not be replaced; True if it exists (a folder we may replace)."""
    try:
        mode = os.lstat(folder).st_mode
    except FileNotFoundError:
        return False
    except NotADirectoryError:
        raise ValueError(f"Cannot save to {folder}: a part of that path is a file, not a "
                         "folder. Choose a folder path.") from None
    if stat.S_ISLNK(mode):
        raise ValueError(f"Cannot save to {folder}: it is a symbolic link (to "
                         f"{os.readlink(folder)}), which saving would replace by a folder. "
                         "Choose a folder path (the link's target itself, or a new name); "
                         "the link was left as it is.")
    if not stat.S_ISDIR(mode):
        raise ValueError(f"Cannot save to {folder}: it is a file, not a folder, and a save "
                         "writes a folder of files. Choose a folder path (a new name such "
                         f"as {folder.with_suffix('')}-model); the file was left as it is.")
    safe, foreign = looks_like_a_save(folder)
    if not safe:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ValueError(f"Cannot save to {folder}: it is a folder that holds other things "
                         f"({shown}), not a previous save, and saving would delete them. "
                         "Choose a new folder path (or an empty folder); nothing was changed.")
    return True


# ---- durability -----------------------------------------------------------------------------

def _fsync_fd(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.EBADF, errno.EROFS):  # cannot sync this kind
            raise


def _fsync_tree(root: Path) -> None:
    """Flush every file and folder under ``root`` to disk: no half-written folder after a crash."""
    if not hasattr(os, "fwalk"):  # Windows: files only
        for dirpath, _, filenames in os.walk(root):
            for name in filenames:
                with open(os.path.join(dirpath, name), "rb+") as f:
                    os.fsync(f.fileno())
        return
    for _, _, filenames, dir_fd in os.fwalk(root):
        for name in filenames:
            try:
                fd = os.open(name, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0), dir_fd=dir_fd)
            except OSError:
                continue  # a symbolic link: nothing of ours to flush
            try:
                _fsync_fd(fd)
            finally:
                os.close(fd)
        _fsync_fd(dir_fd)


# ---- the save -------------------------------------------------------------------------------

class _Folder:
    """Entries of one folder, renamed relative to an open descriptor of it where possible."""

    def __init__(self, path: Path):
        self.path, self.fd = path, _open_dir(path)

    def rename(self, src: str, dst: str) -> None:
        _rename(self.fd, self.path, src, dst)

    def exchange(self, a: str, b: str) -> None:
        if self.fd is None:
            raise ExchangeUnsupported(errno.ENOSYS, "the folder cannot be opened")
        _exchange(self.fd, a, b)

    def sync(self) -> None:
        if self.fd is not None:
            _fsync_fd(self.fd)

    def close(self) -> None:
        _close(self.fd)
        self.fd = None


def _swap_by_renames(parent: _Folder, tmp: str, target: str) -> str:
    """Fallback: target -> old name, tmp -> target. Returns the old name (to delete)."""
    old = _temp_name(target, OLD_TAG)
    _IN_PROGRESS.add(old)  # not for another thread's recover() to put back meanwhile
    try:
        parent.rename(target, old)
        parent.rename(tmp, target)
    except BaseException:
        try:
            parent.rename(old, target)  # put the old content back (if it moved)
        except OSError:
            pass  # the next save (or recover) restores it
        _IN_PROGRESS.discard(old)
        raise
    return old


def _put_in_place(parent: _Folder, tmp: str, target: str, exists: bool) -> str | None:
    """Move the folder ``tmp`` to ``target``; returns the name now holding the old content."""
    for _ in range(8):  # another process may create or remove the target meanwhile
        if not exists:
            try:
                parent.rename(tmp, target)  # replaces nothing (or an empty folder)
                return None
            except OSError as err:
                if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
            exists = True
            continue
        try:
            parent.exchange(tmp, target)  # the one call that keeps the target whole
            return tmp
        except ExchangeUnsupported:
            pass
        except FileNotFoundError:
            exists = False
            continue
        try:
            return _swap_by_renames(parent, tmp, target)
        except FileNotFoundError:
            exists = False
    raise OSError(errno.EAGAIN, "the folder kept changing while it was being saved", target)


def _usual_modes(root: Path) -> None:
    """Give every file written the mode a plain ``open`` gives (0644 under the usual umask):
    safetensors writes its files 0600, so an adapter came out unreadable to the group while the
    JSON beside it was not. The mode is read off a probe file, not by setting the umask
    (process-wide, and a background save runs beside other threads)."""
    probe = root / ".nbtune-mode-probe"
    probe.touch()
    mode = stat.S_IMODE(probe.stat().st_mode)
    probe.unlink()
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink() and stat.S_IMODE(path.stat().st_mode) != mode:
            path.chmod(mode)


class SaveFailed(OSError):
    """The file system refused a save: one sentence naming the path and the fix (``str``
    is that sentence alone; ``errno`` and ``filename`` are the file system's)."""

    def __str__(self) -> str:
        return self.strerror


# What the file system said, and what to do about it: a notebook shows one sentence, not
# "[Errno 30] Read-only file system: '.../.out.nbtune-tmp-...'".
_FIXES = {
    errno.EACCES: "there is no permission to write in {parent}: choose a folder you can write to",
    errno.EPERM: "there is no permission to write in {parent}: choose a folder you can write to",
    errno.EROFS: "the file system holding {parent} is read-only: choose a folder on a writable disk",
    errno.ENAMETOOLONG: ("the name is longer than the file system there allows (at most {most} "
                         "bytes a name): choose a shorter name"),
    errno.ENOSPC: "the disk holding {parent} is full: free space there or choose another disk",
    errno.EDQUOT: "the disk quota for {parent} is used up: free space there or choose another disk",
    errno.EFBIG: ("a file is larger than the file system holding {parent} (or this process's "
                  "file size limit) allows (FAT32: 4 GiB): choose a folder on another disk"),
}


@contextlib.contextmanager
def _said_plainly(target: Path):
    """Turn the file system's refusal of a save into ``SaveFailed``: the path and the fix."""
    try:
        yield
    except SaveFailed:
        raise
    except OSError as err:
        _refuse_plainly(target, err)
        raise
    except Exception as err:  # safetensors' own error, carrying the OS error as text
        found = _SAFETENSORS_OS_ERROR.search(str(err)) if type(err).__name__ == "SafetensorError" else None
        if found is None:
            raise
        code = int(found[1] or found[3])
        _refuse_plainly(target, OSError(code, os.strerror(code), found[2]))
        raise


# safetensors says "Error while serializing: I/O error: No space left on device (os error 28)
# at path "/x/.tmpAbc"" (0.8) or "...IoError(Os { code: 28, kind: StorageFull, ..." (older)
_SAFETENSORS_OS_ERROR = re.compile(r'\(os error (\d+)\)(?: at path "(.*)")?|Os \{ code: (\d+)')


def _refuse_plainly(target: Path, err: OSError) -> None:
    """Raise ``SaveFailed`` for ``err`` where it is a known refusal of the save's own paths."""
    fix = _FIXES.get(err.errno)
    where = Path(os.path.abspath(err.filename)) if isinstance(err.filename, str) else None
    # the save's own paths (the target, its temporary, the folders above), not a file
    # it reads beside them (a model folder next to the output)
    near = where is None or where == target or where == target.parent \
        or where in target.parent.parents or TMP_TAG in where.name \
        or any(TMP_TAG in part.name for part in where.parents)
    if fix is None or not near:
        return
    try:
        most = os.pathconf(target.parent if target.parent.exists() else "/", "PC_NAME_MAX")
    except (OSError, ValueError):
        most = 255
    raise SaveFailed(err.errno, f"Cannot save to {target}: "
                     f"{fix.format(parent=target.parent, most=most)}.", str(target)) from None


def write_atomically(folder: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Run ``write(tmp_dir)``, then put tmp_dir in place of ``folder`` in one step.

    ``folder`` holds its complete old content or the complete new one at every instant
    (one ``renameat2`` exchange on Linux; see the module's notes for other systems). If
    ``write`` raises, nothing changes and the temporary folder is removed. A ``folder``
    that is a file, a link or a folder of other things is refused before anything is written.
    """
    given = Path(folder)
    target = Path(os.path.abspath(given))
    if not target.name:
        raise ValueError(f"Cannot save to {given}: choose a folder path, not the filesystem root.")
    with _said_plainly(target):
        return _write_atomically(given, target, write)


def _write_atomically(given: Path, target: Path, write: Callable[[Path], object]) -> Path:
    _check_target(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(target)
    tmp_name = _temp_name(target.name, TMP_TAG)
    tmp = target.parent / tmp_name
    _IN_PROGRESS.add(tmp_name)
    parent = _Folder(target.parent)  # renames relative to this very folder
    lock = None
    old_name = None
    try:
        os.mkdir(tmp)  # the usual permissions (mkdtemp's are 0700)
        lock = _open_dir(tmp)
        _lock(lock)
        write(tmp)
        _usual_modes(tmp)
        _fsync_tree(tmp)
        exists = _check_target(target)  # again: the folder may have changed while writing
        try:
            old_name = _put_in_place(parent, tmp_name, target.name, exists)
        except OSError as err:
            if err.errno in (errno.EBUSY, errno.EXDEV):
                raise OSError(err.errno, f"Cannot replace {target} ({err.strerror}): it is "
                              "probably a mount point. Save into a new folder inside it.") from err
            raise
        parent.sync()  # the rename itself reaches the disk
    except BaseException:
        if old_name is None:
            _remove(tmp)  # still the new, unused folder
        raise
    finally:
        _close(lock)
        if old_name is not None:  # the old content, swapped out
            _remove(target.parent / old_name)
            _IN_PROGRESS.discard(old_name)
        parent.close()
        _IN_PROGRESS.discard(tmp_name)
    return given


def write_file_atomically(path: str | os.PathLike, content: str | bytes,
                          may_replace: Callable[[Path], bool] | None = None) -> Path:
    """Write one file so that ``path`` holds the whole old or the whole new content.

    The bytes go to a fresh temporary file beside it (created exclusively, never through a
    link), are synced, and are renamed over ``path``; the rename replaces a link itself
    rather than writing where it points. An existing ``path`` is replaced only if
    ``may_replace(path)`` says it is ours to replace (default: never for a link or a folder).
    """
    path = Path(path)
    if os.path.lexists(path):
        if path.is_symlink() or not path.is_file():
            raise FileExistsError(f"{path} exists and is {'a link' if path.is_symlink() else 'not a file'}: "
                                  "nbtune does not write through it. Choose another path.")
        if may_replace is not None and not may_replace(path):
            raise FileExistsError(f"{path} exists and was not written by nbtune: it is left as "
                                  "it is. Choose another path, or move the file away first.")
    data = content.encode("utf-8") if isinstance(content, str) else content
    mode = stat.S_IMODE(os.stat(path).st_mode) if os.path.lexists(path) else 0o666  # as before
    tmp = path.with_name(_temp_name(path.name, TMP_TAG))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    parent = _open_dir(path.parent)
    with contextlib.suppress(OSError):  # the rename itself reaches the disk
        if parent is not None:
            os.fsync(parent)
    _close(parent)
    return path
