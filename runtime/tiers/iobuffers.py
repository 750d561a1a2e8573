"""Aligned host buffers for the disk tier's I/O (``Buffers``), reused across steps.

Direct I/O needs buffers at 4 KiB-aligned addresses, and every training step reads and
writes the same files, so it asks for buffers of the same sizes again and again: the disk
tier (``runtime/tiers/disk.py``) takes them from one ``Buffers`` per store.
"""
from __future__ import annotations

import mmap
import threading
import weakref

import torch

ALIGN = 4096                   # file offsets, buffer addresses and lengths of direct I/O


def align_up(n: int, to: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return -(-n // to) * to


HUGE_FROM = 4 << 20            # buffers from this size are aligned and advised for (2 MiB) huge pages
HUGE = 2 << 20


class Buffers:
    """Aligned host buffers for the disk tier's I/O, reused across steps.

    Every step reads and writes the same files, so it asks for buffers of the same sizes
    again and again. A fresh buffer is fresh memory, which the kernel zeroes page by page
    on first touch -- inside the O_DIRECT read that fills it, or the copy into it: 11% of all
    CPU time in the offload benchmark's step (perf: ``clear_page_erms``), on cores the
    backward needs. So ``take`` hands out a view of an anonymous ``mmap`` (4 KiB-aligned;
    2 MiB-aligned and advised for huge pages from 4 MiB), and when the last tensor using it
    is gone the mapping goes back to a free list of its size, for the next ``take`` of that
    size.

    How much stays mapped: by default (``keep=None``) the buffers in use and free together
    never exceed the most bytes ever in use at once (``high``): a freed buffer is kept while
    that holds, and a ``take`` that must map anew first unmaps free buffers of other sizes
    until it holds. So the pool's memory is at most what the tier needed at its busiest
    moment -- a burst of many buffers alive at once (the setup writes one file at a time)
    is the only way to raise it. A buffer from 4 MiB holds whole 2 MiB pages and a take may get
    a free one up to an eighth larger, so near sizes share: on benchmarks/offload.py's model both
    cut the bytes mapped anew per step (``fresh`` in the disk tier's stats) and the peak RSS against exact
    sizes with a fixed number of free bytes kept. ``keep=N`` (``HARMONY_KEEP_FREE``) instead keeps at most N
    free bytes.
    ``held`` (``DiskStore.stats()['buffer_pool_bytes']``) is what is mapped, in use or free;
    ``clear`` unmaps the free ones (``DiskStore.close`` does).

    On the CPU device the buffers and the device's tensors share the same memory, and free
    buffers are counted by neither the device's ``MemoryMeter`` nor the host budget: ``share_room``
    keeps the free ones within the room the device's budget leaves (the meter trims them as its
    live bytes grow). Without it, weights carried across the step boundary raised the peak in use, and
    the buffers they freed during the forward stayed mapped beside the activations the forward made: the
    offload benchmark's peak RSS went over its budget + 1 GiB.
    """

    def __init__(self, keep: int | None = None):
        self.keep = keep                    # free bytes kept at most; None: within the peak in use (above)
        self.free_bytes = 0
        self._free: dict[int, list[tuple[mmap.mmap, int]]] = {}
        self._lock = threading.RLock()      # a finalizer may run in any thread, also one holding it
        self.held = 0                       # bytes mapped, in use or free
        self.in_use = self.peak = 0         # bytes of the buffers taken and alive now, and their peak
        self.high = 0                       # the most bytes ever in use at once (peak is reset per step)
        self.reuses = 0
        self.fresh = 0                      # bytes mapped anew (the kernel zeroes them at first touch)
        self.cleared = False
        self.room = None                    # callable: free bytes that may be kept now (``share_room``)

    def share_room(self, meter) -> None:
        """Keep free buffers only in the room ``meter``'s budget leaves (the CPU device: the same memory)."""
        if meter.budget is None:
            return
        self.room = lambda: max(0, meter.budget - meter.live)
        meter.caches.append(self)

    def trim(self, nbytes: int) -> None:
        """Unmap free buffers, the most free bytes of one size first, until ``nbytes`` are gone or none is left."""
        drop = []
        with self._lock:
            while nbytes > 0 and self._free:
                size = max(self._free, key=lambda k: len(self._free[k]) * k)
                mm, _ = self._free[size].pop()
                if not self._free[size]:
                    del self._free[size]
                self.free_bytes -= size
                self.held -= len(mm)
                nbytes -= size
                drop.append(mm)
        for mm in drop:
            _unmap(mm)

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` (rounded up to 4 KiB) at a 4 KiB-aligned address; contents undefined.
        Its storage is exactly those bytes (what a ``MemoryMeter`` counts), whatever buffer serves it.

        Its buffer holds whole 2 MiB pages from ``HUGE_FROM`` on (what huge pages take anyway), and may be
        a free one up to an eighth larger: a step's files differ a little in size.
        """
        length = align_up(max(nbytes, 1))
        want = align_up(length, HUGE) if length >= HUGE_FROM else length
        drop = 0
        with self._lock:
            fits = [k for k in self._free if want <= k <= want + want // 8]
            size = min(fits) if fits else want
            got = self._free[size].pop() if fits else None
            if got is not None:
                if not self._free[size]:
                    del self._free[size]
                self.reuses += 1
                self.free_bytes -= size
            self.in_use += size
            self.peak = max(self.peak, self.in_use)
            self.high = max(self.high, self.in_use)
            if got is None:
                self.fresh += size
                if self.keep is None:
                    drop = self.in_use + self.free_bytes - self.high
        if drop > 0:
            self.trim(drop)
        if got is None:
            got = self._map(size)
        mm, start = got
        # a storage of exactly ``length`` bytes, not the whole mapping: the device's ``MemoryMeter`` counts
        # storages, and a buffer's 2 MiB alignment pad or the extra of a larger free buffer reused is no
        # memory the tensor holds (counting them put the offload benchmark's device 37 MB over the plan)
        buf = torch.frombuffer(mm, dtype=torch.uint8, count=length, offset=start)
        weakref.finalize(buf.untyped_storage(), self._give_back, size, mm, start)
        return buf

    def _map(self, size: int) -> tuple[mmap.mmap, int]:
        huge = size >= HUGE_FROM
        pad = HUGE if huge else 0
        # private: a shared anonymous map is shmem, which takes no transparent huge pages
        mm = mmap.mmap(-1, size + pad, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        probe = torch.frombuffer(mm, dtype=torch.uint8)
        start = (-probe.data_ptr()) % HUGE if huge else 0
        del probe
        if huge and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                mm.madvise(mmap.MADV_HUGEPAGE, start, size)    # advice only: a refusal changes nothing
            except OSError:
                pass
        with self._lock:
            self.held += len(mm)
        return mm, start

    def reset_peak(self) -> None:
        """Start the peak again from what is in use now (the disk tiers do at each step)."""
        with self._lock:
            self.peak = self.in_use

    def _give_back(self, size: int, mm: mmap.mmap, start: int) -> None:
        with self._lock:
            self.in_use -= size
            room = self.keep if self.keep is not None else self.high - self.in_use
            if self.room is not None:
                room = min(room, self.room())
            if not self.cleared and self.free_bytes + size <= room:
                self._free.setdefault(size, []).append((mm, start))
                self.free_bytes += size
                return
            self.held -= len(mm)
        _unmap(mm)

    def clear(self) -> None:
        """Unmap the free buffers; those in use are unmapped when their last tensor is gone."""
        with self._lock:
            self.cleared = True
            free, self._free = self._free, {}
            self.held -= sum(len(mm) for lst in free.values() for mm, _ in lst)
            self.free_bytes = 0
        for lst in free.values():
            for mm, _ in lst:
                _unmap(mm)


def _unmap(mm: mmap.mmap) -> None:
    try:
        mm.close()          # the last tensor on it is gone: nothing should export it now
    except BufferError:     # something still does: the map goes when the last reference does
        pass
