"""The files of a checkpoint directory: written under a temporary name and swapped in by rename, found again after a
crash.

``harmony.driver.checkpoint.io`` decides what a checkpoint holds; this module only makes a directory of
files appear atomically and reads it back with its checksums:

* ``paths(ckpt)`` gives ``ckpt``, ``ckpt.old`` and ``ckpt.tmp-<pid>``; a save writes every file
  into the temporary directory (``write_file`` / ``write_bytes``: created exclusively, fsynced,
  hashed as written), fsyncs it, then ``commit`` renames ``ckpt`` to ``ckpt.old``, the new one to
  ``ckpt``, and removes ``ckpt.old``, fsyncing the parent after each rename.
* a process killed between the two renames leaves only ``ckpt.old``: ``find`` loads from it and
  ``recover`` (called by the next save) puts it back; ``remove_stale_temps`` drops the temporary
  directories of saves whose process died.
* ``check_replaceable`` refuses to replace a path that is a file or a directory that is not a
  checkpoint; ``explain_save`` turns an OSError into what went wrong, where and what to do.
* ``verify`` checks a file against the manifest's size and sha256 before ``read_file`` loads it
  with ``torch.load(weights_only=True)``: plain tensors and containers, never arbitrary objects.

A directory is a checkpoint when it holds ``manifest.json`` (written last).
"""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
from pathlib import Path

import torch

from harmony.base.errors import CheckpointError
from harmony.base.process import pid_alive
from harmony.base.units import fmt_bytes

MANIFEST = "manifest.json"


def paths(path) -> tuple[Path, Path, Path]:
    """The checkpoint directory, its ``.old`` and this process's temporary one. A path that is a symbolic link is
    resolved once, here: the link's target is replaced atomically and the link still points at it (renaming the
    link itself would leave a link where a directory is expected)."""
    target = Path(os.path.realpath(os.fspath(path)))
    return (target, target.with_name(target.name + ".old"),
            target.with_name(f"{target.name}.tmp-{os.getpid()}"))


def is_checkpoint(d: Path) -> bool:
    return (d / MANIFEST).is_file()


def recover(target: Path, old: Path) -> None:
    """A save killed between its two renames left only ``<dir>.old``: put it back first."""
    if not target.exists() and is_checkpoint(old):
        os.rename(old, target)
        fsync_dir(target.parent)


def check_replaceable(target: Path) -> bool:
    """True if a previous checkpoint is there; refuse to replace anything that is not one."""
    if not target.exists():
        return False
    if not target.is_dir():
        raise CheckpointError(f"cannot save a checkpoint to {target}: it is a file, not a directory; "
                              f"choose another path")
    if is_checkpoint(target):
        return True
    if any(target.iterdir()):
        raise CheckpointError(f"cannot save a checkpoint to {target}: the directory holds files and no "
                              f"{MANIFEST}, so it is not a Harmony checkpoint and would be replaced; "
                              f"choose another path or empty it")
    return False


def remove_stale_temps(target: Path) -> None:
    """Temp directories of saves whose process died (SIGKILL leaves them; nothing else does)."""
    for d in target.parent.glob(f"{target.name}.tmp-*"):
        pid = d.name.rsplit("-", 1)[-1]
        if pid.isdigit() and (int(pid) == os.getpid() or not pid_alive(int(pid))):
            shutil.rmtree(d, ignore_errors=True)


def commit(tmp: Path, target: Path, old: Path) -> None:
    if target.exists():
        if old.exists():
            shutil.rmtree(old)
        os.rename(target, old)
        fsync_dir(target.parent)
        try:
            os.rename(tmp, target)
        except OSError:
            os.rename(old, target)
            raise
        fsync_dir(target.parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, target)
        fsync_dir(target.parent)


class HashingWriter:
    """A file that hashes what it is given, so a checkpoint is read back by nobody to get its sha256."""

    def __init__(self, f):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0
        self.error: OSError | None = None

    def write(self, b) -> int:
        self.sha.update(b)
        self.size += len(b)
        try:
            return self.f.write(b)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def _create(path: Path):
    """A new file only its owner reads (training state is private, as the offload files are), never through a link."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb")


def write_file(path: Path, obj) -> tuple[int, str]:
    """``torch.save`` to a new file, fsynced; returns (bytes, sha256)."""
    with _create(path) as f:
        w = HashingWriter(f)
        try:
            torch.save(obj, w)
        except Exception:
            if w.error is not None:   # torch's zip writer turns a failed write (ENOSPC) into a RuntimeError
                raise w.error from None
            raise
        f.flush()
        os.fsync(f.fileno())
    return w.size, w.sha.hexdigest()


def write_bytes(path: Path, data: bytes) -> None:
    with _create(path) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def explain_save(e: OSError, target: Path, need: int, previous: bool) -> str:
    where = e.filename or target.parent
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        todo = (f"the file system holding {target.parent} is full: free at least {fmt_bytes(need)} there (the new "
                f"checkpoint is complete before the old one is removed, so both need room) or save elsewhere")
    elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        todo = "that location is not writable: save to a directory you can write to, or fix its permissions"
    elif e.errno in (errno.ENOTDIR, errno.EEXIST):
        todo = "a part of that path is a file, not a directory: choose another path"
    elif e.errno == errno.ENOENT:
        todo = ("it cannot be created there (a part of the path is missing, or the file system, like /proc, "
                "takes no new files): save to a writable directory")
    else:
        todo = "check the path and the file system"
    kept = (f"The previous checkpoint at {target} is intact" if previous
            else f"Nothing was at {target} before and nothing was written there")
    return (f"could not save the checkpoint to {target}: {e.strerror or e} ({where}); {todo}. "
            f"{kept}, and no temporary files were left behind.")


def find(target: Path, old: Path) -> tuple[Path, bool]:
    if is_checkpoint(target):
        return target, False
    if not target.exists() and is_checkpoint(old):
        return old, True
    temps = sorted(p.name for p in target.parent.glob(f"{target.name}.tmp-*")) if target.parent.is_dir() else []
    if target.exists():
        why = f"{target} has no {MANIFEST}, so it is not a complete Harmony checkpoint"
    else:
        why = f"there is no checkpoint at {target} (nor {old.name})"
    if temps:
        why += f"; {', '.join(temps)} beside it are saves that never completed"
    raise CheckpointError(f"cannot load: {why}. Pass the directory harmony.save wrote.")


def verify(src: Path, f: dict) -> None:
    path = src / f["name"]
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            sha.update(chunk)
            size += len(chunk)
    if size != f["bytes"] or sha.hexdigest() != f["sha256"]:
        raise CheckpointError(f"{path} is damaged: {size} bytes with sha256 {sha.hexdigest()[:12]}..., the "
                              f"manifest says {f['bytes']} bytes with {f['sha256'][:12]}...; nothing was changed. "
                              f"Load an older checkpoint.")


def read_file(path: Path, mmap: bool = False) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except OSError:
        raise
    except Exception as e:   # weights_only refuses anything but tensors and plain containers
        raise CheckpointError(f"{path} cannot be loaded as plain tensors ({type(e).__name__}: {e}); "
                              f"Harmony never unpickles arbitrary objects. The model may be partly loaded: "
                              f"load another checkpoint before training.") from e
