"""The private offload directories: made with an owner record and a lock, removed however the process ends, and
swept only where they are provably dead.

* ``make_private_dir(parent)`` makes ``harmony-offload-<pid>-<machine>-XXXX`` (mode 0700), where ``<machine>`` is a
  hash of this host's name and boot, and holds an exclusive ``flock`` on the directory itself for as long as it
  lives. (The record is in the name and the lock on the directory, so that the directory holds the pack files
  only.)
* The directory goes with the store (``weakref.finalize``, which runs at a normal exit, after ``KeyboardInterrupt``
  too). SIGTERM and SIGHUP end a process without exit handlers, so ``guard_signals`` installs a handler for each
  that still has the default action: it removes every live directory, then lets the signal end the process as it
  would have (default action, same exit status). A handler the user installed is left alone: it decides whether
  the process ends, and if it exits normally the finalizers run.
* ``check_room(parent, nbytes)``, before any file is written: the disk under ``parent`` has room for the state the
  plan puts there (a write that fails later, on a disk something else filled, still names the file and what to do).
* ``remove_stale(parent)`` removes a directory only when it can prove its owner dead: its name records this host
  and this boot, that pid is gone, and its lock can be taken. Shared scratch (NFS, a volume several containers
  mount) may hold other machines' live state: their directories are never touched, nor any without a record (a
  file system that cannot lock a directory proves nothing either: its directories stay).
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import signal
import socket
import tempfile
import threading
from pathlib import Path

from harmony.base.errors import OffloadError
from harmony.base.process import pid_alive
from harmony.base.units import fmt_bytes

_live: set[str] = set()              # directories this process holds (for the signal handlers)
_guarded: dict[int, object] = {}     # signal -> the handler that was there before


def machine_tag() -> str:
    """This host and boot, short: a pid names a process only on the machine and boot that gave it out."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return hashlib.sha256(f"{socket.gethostname()}/{boot}".encode()).hexdigest()[:10]


def make_private_dir(parent: Path, prefix: str) -> tuple[Path, int | None]:
    """A new 0700 directory under ``parent`` named for its owner, and the fd of its lock (held; None if the file
    system cannot lock a directory)."""
    path = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-{machine_tag()}-", dir=parent))
    try:
        os.chmod(path, 0o700)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        fd = None
    _live.add(str(path))
    guard_signals()
    return path, fd


def room_needed(nbytes: int) -> int:
    """Free space ``nbytes`` of training state on disk need: with room for each file's alignment to the I/O block,
    the probe and the file system's own."""
    return int(nbytes * 1.02) + 64 * 2**20 if nbytes > 0 else 0


def check_room(parent, nbytes: int) -> None:
    """Raise ``OffloadError`` before anything is written if the disk under ``parent`` (None: the system's temp
    directory) has less free space than ``nbytes`` of training state need there."""
    if nbytes <= 0:
        return
    where = Path(os.path.abspath(os.fspath(parent))) if parent is not None else Path(tempfile.gettempdir())
    probe = where
    while not probe.exists() and probe != probe.parent:    # a directory still to be made: its disk is its parent's
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return      # the store's own setup reports an unusable path, with what to do
    need = room_needed(nbytes)
    if free < need:
        raise OffloadError(f"the plan puts {fmt_bytes(nbytes)} of training state on disk under {where}, whose file "
                           f"system has {fmt_bytes(free)} free (with headroom it needs {fmt_bytes(need)}): pass "
                           f"offload_dir= naming a disk with room, or raise host_memory_budget so that less of the "
                           f"state goes to disk")


def remove_dir(path: str, lock_fd: int | None) -> None:
    """Remove a directory this process made (its lock goes with it)."""
    _live.discard(path)
    shutil.rmtree(path, ignore_errors=True)
    if lock_fd is not None:
        try:
            os.close(lock_fd)
        except OSError:
            pass


def remove_stale(parent: Path, prefix: str) -> list[str]:
    """Offload directories under ``parent`` whose owner is provably dead (see the module docstring), removed."""
    removed = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    tag = machine_tag()
    for d in entries:
        parts = d.name[len(prefix):].split("-")
        if not d.name.startswith(prefix) or str(d) in _live or len(parts) < 3 or parts[1] != tag:
            continue                   # not ours to judge: another machine's or boot's, or no record
        if not parts[0].isdigit() or int(parts[0]) == os.getpid() or pid_alive(int(parts[0])):
            continue
        try:
            if not d.is_dir() or d.is_symlink() or d.stat().st_uid != os.getuid():
                continue
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)     # held by a live owner (or not lockable): proves nothing
        except OSError:
            continue
        finally:
            os.close(fd)
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d.name)
    return removed


def guard_signals() -> None:
    """Remove the live offload directories on SIGTERM and SIGHUP where the process would otherwise just die."""
    if threading.current_thread() is not threading.main_thread():
        return                         # handlers can be set from the main thread only; the finalizers still run
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if sig in _guarded or signal.getsignal(sig) is not signal.SIG_DFL:
            continue
        _guarded[sig] = signal.SIG_DFL
        signal.signal(sig, _on_signal)


def _on_signal(signum, frame) -> None:
    for path in list(_live):
        remove_dir(path, None)
    previous = _guarded.pop(signum, signal.SIG_DFL)
    signal.signal(signum, previous)
    os.kill(os.getpid(), signum)       # the default action now: the process ends as the signal says
