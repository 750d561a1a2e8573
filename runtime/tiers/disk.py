"""The disk tier: optimizer state of the packs the offload pass placed on disk, a file per pack.

``DiskStore`` is the I/O: a private directory (mode 0700) that is removed when the store
is closed, garbage collected, or the process exits (``weakref.finalize``, which runs at
exit through ``atexit``; also when the exit is an uncaught exception), and a thread pool
of two workers moving whole packs between aligned host buffers (``runtime/tiers/iobuffers.py``, reused
across steps) and files (a read's further ranges on helper threads)::

    with DiskStore("/nvme/scratch") as store:
        m, v = store.empty([((1024, 1024), torch.float32)] * 2)    # 4 KiB-aligned views of one buffer
        store.write(3, [m, v]).result()                           # pack 3's file
        store.read(3, into=[m, v]).result()

The tensors of a pack sit in its file one after the other (at 64-byte boundaries), the
file padded to 4 KiB, in the same layout ``empty`` gives the buffer, so a pack is one
4 KiB-aligned contiguous range in memory and on disk, moved in 16 MiB ``pwrite``/``preadv``
calls: a write one call at a time, over the file's blocks in place (never truncated: on ext4
allocating blocks anew made writes 3-5x slower), a read in up to four ranges at once
(``HARMONY_READ_DEPTH``; reads are faster with more in flight, writes were not). Where the file system takes
``O_DIRECT`` (probed once per store: open, write and read back one aligned block) the I/O
bypasses the page cache; elsewhere it is buffered,
and each file's pages are dropped after it is written (``fdatasync`` +
``POSIX_FADV_DONTNEED``) or read, so the page cache neither hides the disk nor grows.
``HARMONY_DIRECT_IO=0`` forces buffered I/O.

``DiskTier`` (runtime/tiers/optim_disk.py) is what the runtime uses: the optimizer state of disk-placed packs lives in
their files between steps. A host step of such a pack (``ops.step(where="host")``, on the
host thread) calls ``begin(pack)``, which starts reading the state of the next
disk-placed pack in step order (the schedule's order of ``step`` ops: under the harmony
policy the packs step last to first) and puts this pack's state, read ahead by the step
before, into its optimizer; then the optimizer steps; then ``end(pack)`` writes the state
back and leaves placeholders. The last disk pack of a step starts reading the first one
of the next step, so that read overlaps the next forward pass. Between steps
``optimizer.state[param]`` holds the real scalar entries (Adam's ``step``) and, for every
other tensor, a ``meta`` tensor of the same shape and dtype: no memory, and any use of it
outside a step fails loudly (``optimizer.state_dict()`` shows them too: use
``sm.training_state_dict()`` or ``harmony.save``, which read the files). At most two packs' state
is in host memory at once: a step first waits for the write of the pack stepped before it
(which had this pack's backward to finish), then starts reading the next pack's, so one
pack's buffer is stepping while one is read or written; the offload pass reserves that
much of ``host_memory_budget``. ``harmony.driver.checkpoint.io`` reads and writes a pack's state
through ``state_of`` and ``set_state``, one pack at a time.

A write that fails (a full disk, a path that became unwritable) raises ``OffloadError``
at the end of the training step, removes the partial file, and keeps that pack's state
in host memory, so nothing is lost and nothing partial is left on disk.
"""
from __future__ import annotations

import errno
import os
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from pathlib import Path

import torch

from harmony.base.env import env_default
from harmony.base.errors import OffloadError
from harmony.base.process import started_pool
from harmony.base.units import fmt_bytes
from harmony.runtime.ops import ops_of
from harmony.runtime.tiers.dirs import make_private_dir, remove_dir, remove_stale
from harmony.runtime.tiers.iobuffers import ALIGN, Buffers, align_up

SLOT = 64                      # tensors of a pack start at multiples of this within its range
CHUNK = 16 << 20               # bytes per pwrite/preadv call
PREFIX = "harmony-offload-"
O_DIRECT = getattr(os, "O_DIRECT", 0)

# the system calls, by name so tests can inject failures (ENOSPC) exactly at the write
_pwrite = os.pwrite
_preadv = os.preadv
_open = os.open


def layout(specs) -> tuple[list[int], int]:
    """Offsets of tensors of ``specs`` [(shape, dtype)] packed at 64-byte boundaries, and the total padded to 4 KiB."""
    offsets, at = [], 0
    for shape, dtype in specs:
        offsets.append(at)
        at += align_up(_numel(shape) * _itemsize(dtype), SLOT)
    return offsets, align_up(at)


def _cleanup(path: str, lock: int, pool: ThreadPoolExecutor, spans: ThreadPoolExecutor, buffers: "Buffers") -> None:
    pool.shutdown(wait=True, cancel_futures=True)
    spans.shutdown(wait=True)
    remove_dir(path, lock)
    buffers.clear()


def _spans(start: int, total: int, depth: int) -> list[tuple[int, int]]:
    """[start, total) cut into at most ``depth`` ranges of whole CHUNKs (the last takes the rest)."""
    chunks = -(-(total - start) // CHUNK)
    n = max(1, min(depth, chunks))
    per = -(-chunks // n) * CHUNK
    return [(lo, min(lo + per, total)) for lo in range(start, total, per)]


class DiskStore:
    """Files of pack state in a private directory, written and read by two worker threads.

    ``dir``: where to make the private directory (``offload_dir``; default the system's
    temp directory). ``direct``: None probes the file system for ``O_DIRECT``, False
    forces buffered I/O (so does ``HARMONY_DIRECT_IO=0``), True requires direct I/O.
    ``read_depth``: concurrent ``preadv`` calls per file read (a shared or cloud disk serves reads faster with
    more in flight; writes gained nothing, so they stay at one); ``keep_free``: ``Buffers``' ``keep``. Each
    is ``DiskConfig``'s field of that name; None takes the field's default (its environment variable's).
    """

    def __init__(self, dir=None, *, direct: bool | None = None, workers: int = 2, read_depth: int | None = None,
                 keep_free: int | None = None):
        parent = Path(os.path.abspath(os.fspath(dir))) if dir is not None else Path(tempfile.gettempdir())
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self.stale_removed = remove_stale(parent, PREFIX)     # runtime/tiers/dirs.py: provably dead only
            self.path, lock = make_private_dir(parent, PREFIX)
        except OSError as e:
            raise OffloadError(_explain(e, f"create the offload directory in {parent}", parent, 0)) from e
        # started here, at this thread's priority, not later by the idle-priority host thread
        self.pool = started_pool(workers, "harmony-disk")
        # the further ranges of reads under way (each worker reads the first range of its own)
        self.read_depth = env_default("read_depth") if read_depth is None else read_depth
        self._spans = started_pool(workers * max(1, self.read_depth - 1), "harmony-disk-read")
        keep = env_default("keep_free") if keep_free is None else keep_free
        self.buffers = Buffers(keep)              # the memory behind the aligned buffers, reused
        self._finalizer = weakref.finalize(self, _cleanup, str(self.path), lock, self.pool, self._spans, self.buffers)
        self._lock = threading.Lock()
        self._writes: dict[int, Future] = {}      # pack -> its write under way (a read of the pack waits for it)
        self.counters = dict(read_bytes=0, read_seconds=0.0, write_bytes=0, write_seconds=0.0, direct_ops=0,
                             read_issued=0, write_issued=0,
                             buffered_ops=0)
        if direct is None:
            direct = env_default("direct_io")
        if direct is False:
            self.direct, self.why = False, "buffered I/O forced (direct=False or HARMONY_DIRECT_IO=0)"
        else:
            try:
                self.direct, self.why = self._probe()
            except OSError as e:
                self.close()
                raise OffloadError(_explain(e, f"write a probe block to {self.path}", self.path, ALIGN)) from e
            if direct and not self.direct:
                self.close()
                raise OffloadError(f"direct I/O was required but {self.why}; pass another offload_dir, or "
                                   f"direct=None to fall back to buffered I/O")

    # -- setup ------------------------------------------------------------------------------
    def _probe(self) -> tuple[bool, str]:
        """(direct?, why): open, write and read back one aligned block with O_DIRECT."""
        if not O_DIRECT:
            return False, "this platform has no O_DIRECT: buffered I/O with fadvise"
        probe = self.path / ".probe"
        buf = self.buffers.take(ALIGN)
        buf.fill_(0x5A)
        try:
            try:
                fd = _open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | O_DIRECT, 0o600)
            except OSError as e:
                if e.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                    return False, f"the file system under {self.path.parent} refuses O_DIRECT ({e.strerror}): " \
                                  f"buffered I/O with fadvise"
                raise
            try:
                try:
                    _pwrite(fd, memoryview(buf.numpy()), 0)
                except OSError as e:
                    if e.errno == errno.EINVAL:
                        return False, f"O_DIRECT writes fail under {self.path.parent} ({e.strerror}): buffered I/O"
                    raise
            finally:
                os.close(fd)
            back = self.buffers.take(ALIGN)
            fd = _open(probe, os.O_RDONLY | os.O_NOFOLLOW | O_DIRECT)
            try:
                got = _preadv(fd, [memoryview(back.numpy())], 0)
            finally:
                os.close(fd)
            if got != ALIGN or not torch.equal(back, buf):
                return False, "O_DIRECT read back differently: buffered I/O with fadvise"
            return True, "direct I/O (O_DIRECT, 4 KiB-aligned buffers)"
        finally:
            try:
                probe.unlink()
            except OSError:
                pass

    # -- buffers ----------------------------------------------------------------------------
    def empty(self, specs) -> list[torch.Tensor]:
        """Tensors of ``specs`` [(shape, dtype)] as views of one 4 KiB-aligned buffer, in file layout.

        The buffer comes from ``buffers`` (``iobuffers.Buffers``) and goes back there when its last view is
        freed; until then its bytes count in ``buffers.in_use`` and its peak.
        """
        offsets, total = layout(specs)
        return views_of(self.buffers.take(total), specs, offsets)

    def file(self, pack: int) -> Path:
        return self.path / f"pack-{pack:03d}.bin"

    @staticmethod
    def file_range(tensors) -> tuple[torch.Tensor, int] | None:
        """The one aligned uint8 range holding ``tensors`` in file layout, if they are views made by ``empty``."""
        if not tensors:
            return None
        first = tensors[0]
        st = first.untyped_storage()
        start = first.data_ptr() - st.data_ptr()
        offsets, total = layout([(t.shape, t.dtype) for t in tensors])
        if first.device.type != "cpu" or first.data_ptr() % ALIGN or st.nbytes() < start + total:
            return None
        for t, o in zip(tensors, offsets):
            if (not t.is_contiguous() or t.untyped_storage().data_ptr() != st.data_ptr()
                    or t.data_ptr() != first.data_ptr() + o):
                return None
        return torch.empty(0, dtype=torch.uint8).set_(st, start, (total,)), total

    # -- I/O ------------------------------------------------------------------------------
    def write(self, pack: int, tensors) -> Future:
        """Write ``tensors`` (a list) as pack ``pack``'s file; the future resolves when it is on disk.

        Tensors from ``empty`` are written from where they are; others are first copied into an
        aligned buffer. The caller must not change them until the future resolves.
        """
        tensors = list(tensors)
        rng = self.file_range(tensors)
        if rng is None:
            staged = self.empty([(t.shape, t.dtype) for t in tensors])
            for dst, src in zip(staged, tensors):
                dst.copy_(src)
            rng = self.file_range(staged)
        buf, total = rng
        return self.write_parts(pack, [(buf, 0)], total)

    def write_parts(self, pack: int, parts, total: int) -> Future:
        """Write pack ``pack``'s file of ``total`` bytes from several buffers: ``parts`` [(uint8 buffer, file offset)].

        Each buffer is 4 KiB-aligned (``buffers.take``) and starts at a 4 KiB file offset; together
        they cover [0, total) once. The caller must not change them until the future resolves.
        """
        parts = [(b, at) for b, at in parts if b.numel()]
        with self._lock:
            self.counters["write_issued"] += total
        fut = self.pool.submit(self._write_job, pack, parts, total)   # the job drops the buffers when done
        with self._lock:
            self._writes[pack] = fut
        fut.add_done_callback(lambda f, pack=pack: self._forget(pack, f))
        return fut

    def _forget(self, pack: int, fut: Future) -> None:
        with self._lock:
            if self._writes.get(pack) is fut:
                del self._writes[pack]

    def read(self, pack: int, into) -> Future:
        """Read pack ``pack``'s file into ``into`` (same shapes and dtypes as written), after any write of it."""
        into = list(into)
        rng = self.file_range(into)
        staged = None
        if rng is None:
            staged = self.empty([(t.shape, t.dtype) for t in into])
            rng = self.file_range(staged)
        buf, total = rng
        with self._lock:
            self.counters["read_issued"] += total

        def job():
            self._read_job(pack, buf, total)
            if staged is not None:
                for dst, src in zip(into, staged):
                    dst.copy_(src)
        with self._lock:
            before = self._writes.get(pack)
        return self._after(before, job)

    def read_tail(self, pack: int, specs, skip: int) -> tuple[Future, list, tuple]:
        """Read the entries ``specs[skip:]`` of pack ``pack``'s file (laid out as ``specs``), not those before.

        They go into a buffer of their own that starts at the 4 KiB page holding the first of them
        (whose first bytes are the previous entry's last ones). Returns the read's future, a view per
        entry (None for the first ``skip``), and (that buffer or None if nothing follows, the file
        offset it starts at, the offset of entry ``skip``): what ``write_parts`` needs to write the
        file again from the skipped entries' own buffer and this one.
        """
        offsets, total = layout(specs)
        first = offsets[skip] if skip < len(specs) else total
        at = first // ALIGN * ALIGN
        if at == total:               # nothing after the skipped entries: nothing to read
            done: Future = Future()
            done.set_result(None)
            return done, [None] * len(specs), (None, at, first)
        buf = self.buffers.take(total - at)
        views = [None] * skip + views_of(buf, specs[skip:], offsets[skip:], base=at)
        return self.read_at(pack, buf, at), views, (buf, at, first)

    def read_at(self, pack: int, buf: torch.Tensor, offset: int) -> Future:
        """Read bytes [offset, offset + len(buf)) of pack ``pack``'s file into ``buf``, after any write of it.

        ``buf``: a 4 KiB-aligned uint8 buffer (``buffers.take``), ``offset`` a multiple of 4 KiB:
        the tail of a file (a group's optimizer state) without the bytes before it.
        """
        if offset % ALIGN or buf.data_ptr() % ALIGN:
            raise ValueError(f"read_at needs a 4 KiB-aligned offset and buffer (offset {offset})")
        with self._lock:
            self.counters["read_issued"] += buf.numel()
            before = self._writes.get(pack)
        return self._after(before, lambda: self._read_job(pack, buf, offset + buf.numel(), offset, base=offset))

    def _after(self, dep: Future | None, job) -> Future:
        """``job`` on the pool once ``dep`` is done (without occupying a worker while it waits)."""
        if dep is None or dep.done():
            return self.pool.submit(job)
        out: Future = Future()
        holder = [job]        # ``dep`` keeps its callbacks: let it drop the job (and its buffer) once submitted

        def go(_):
            try:
                inner = self.pool.submit(holder.pop())
            except RuntimeError as e:      # the pool was shut down
                out.set_exception(e)
                return
            inner.add_done_callback(lambda f: out.set_exception(f.exception()) if f.exception()
                                    else out.set_result(f.result()))
        dep.add_done_callback(go)
        return out

    def _write_job(self, pack: int, parts: list, total: int) -> None:
        path = self.file(pack)
        direct = self.direct
        views = [(memoryview(b.numpy()), at) for b, at in parts]
        parts.clear()                  # the job holds the buffers now: they go when it is done
        t0 = time.perf_counter()
        try:
            # overwrite in place, never O_TRUNC: on a disk mounted with discard (ext4, this project's) a
            # truncated file's blocks are freed, discarded and allocated again, several times slower than
            # writing into allocated blocks (compiler/machine.disk_bandwidth reports both)
            fd = _open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (O_DIRECT if direct else 0), 0o600)
            try:
                for mv, base in views:
                    end = min(base + len(mv), total)
                    at = base
                    while at < end:
                        n = _pwrite(fd, mv[at - base:min(at + CHUNK, end) - base], at)
                        if n <= 0:
                            raise OSError(errno.EIO, "short write", str(path))
                        at += n
                if os.fstat(fd).st_size > total:       # a shorter layout than before (weights without state)
                    os.ftruncate(fd, total)
                if not direct:
                    os.fdatasync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except OSError as e:
            try:
                path.unlink()
            except OSError:
                pass
            raise OffloadError(_explain(e, f"write the optimizer state of pack {pack} to {path}", path, total)) from e
        finally:
            for mv, _ in views:
                mv.release()
            views.clear()
        self._count("write", total, time.perf_counter() - t0, direct)

    def _read_job(self, pack: int, buf: torch.Tensor, total: int, start: int = 0, base: int = 0) -> None:
        """Read file bytes [start, total) into ``buf``, whose byte 0 is the file's byte ``base``."""
        if start >= total:
            return
        path = self.file(pack)
        direct = self.direct
        mv = memoryview(buf.numpy())
        t0 = time.perf_counter()
        try:
            fd = _open(path, os.O_RDONLY | os.O_NOFOLLOW | (O_DIRECT if direct else 0))
            try:
                first, *rest = _spans(start, total, self.read_depth)
                futs = [self._spans.submit(_read_span, fd, mv, lo, hi, path, base) for lo, hi in rest]
                try:
                    _read_span(fd, mv, *first, path, base)
                finally:
                    wait_all(futs)              # the fd and the buffer stay until every range is in
                for f in futs:
                    f.result()
                if not direct:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except OSError as e:
            raise OffloadError(_explain(e, f"read the optimizer state of pack {pack} from {path}", path, total)) from e
        self._count("read", total - start, time.perf_counter() - t0, direct)

    def _count(self, way: str, nbytes: int, seconds: float, direct: bool) -> None:
        with self._lock:
            self.counters[f"{way}_bytes"] += nbytes
            self.counters[f"{way}_seconds"] += seconds
            self.counters["direct_ops" if direct else "buffered_ops"] += 1

    def remove(self, pack: int) -> None:
        with self._lock:
            fut = self._writes.pop(pack, None)
        if fut is not None:
            wait_all([fut])
        try:
            self.file(pack).unlink()
        except FileNotFoundError:
            pass

    def flush(self) -> None:
        """Wait for every write (errors are the futures' to report)."""
        with self._lock:
            futs = list(self._writes.values())
        wait_all(futs)

    def stats(self) -> dict:
        """Cumulative bytes and seconds of reads and writes, and the achieved GB/s (10^9 bytes/s)."""
        with self._lock:
            c = dict(self.counters)
        c["read_GBps"] = c["read_bytes"] / c["read_seconds"] / 1e9 if c["read_seconds"] else 0.0
        c["write_GBps"] = c["write_bytes"] / c["write_seconds"] / 1e9 if c["write_seconds"] else 0.0
        c["direct"] = self.direct
        c["buffer_bytes"], c["buffer_peak"] = self.buffers.in_use, self.buffers.peak
        c["buffer_pool_bytes"], c["buffer_reuses"] = self.buffers.held, self.buffers.reuses
        c["buffer_fresh_bytes"] = self.buffers.fresh
        return c

    # -- lifetime ---------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Finish the I/O under way and remove the directory with everything in it."""
        self._finalizer()

    def __enter__(self) -> "DiskStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DiskStore({str(self.path)!r}, direct={self.direct})"


def views_of(buf: torch.Tensor, specs, offsets, base: int = 0) -> list[torch.Tensor]:
    """Tensors of ``specs`` [(shape, dtype)] at file ``offsets`` in ``buf``, whose byte 0 is the file's byte
    ``base``."""
    return [buf[o - base:o - base + _numel(shape) * _itemsize(dtype)].view(dtype).view(shape)
            for (shape, dtype), o in zip(specs, offsets)]


def _read_span(fd: int, mv: memoryview, lo: int, hi: int, path, base: int = 0) -> None:
    at = lo
    while at < hi:
        n = _preadv(fd, [mv[at - base:min(at + CHUNK, hi) - base]], at)
        if n <= 0:
            raise OSError(errno.EIO, f"the file ends at byte {at}, short of {hi}", str(path))
        at += n


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _explain(e: OSError, what: str, where, nbytes: int) -> str:
    """What failed, where, and what to do, for an OSError of the disk tier."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        todo = (f"the file system is full: free at least {fmt_bytes(nbytes)} there, pass offload_dir= naming a disk "
                f"with room, or raise host_memory_budget so fewer packs keep their optimizer state on disk")
    elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        todo = ("that location is not writable: pass offload_dir= naming a directory you can write to, "
                "or fix its permissions")
    elif e.errno in (errno.ENOTDIR, errno.EEXIST):
        todo = "a part of that path is a file, not a directory: pass another offload_dir="
    else:
        todo = "check the file system, or pass another offload_dir="
    loc = str(e.filename or where)
    return f"could not {what}: {e.strerror or e}{'' if loc in what else f' ({loc})'}; {todo}"


def step_order(graph) -> list[int]:
    """Packs in the order the schedule steps them (the ``step`` ops' order)."""
    return [n.args[0] for n, op in ops_of(graph.nodes) if op.steps]
