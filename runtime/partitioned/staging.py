"""Host buffers a ``shard_state="full"`` gather receives the ranks' chunks into before its copy to the device.

A gather of a segment into device copies (``Shares.gather_into``) all-gathers the chunks into one flat host buffer
(gloo's collectives run on host tensors), then copies each weight's part of it to the device; a weight the device
holds in the compute dtype (mixed precision) is cast on the host first, into a buffer of that dtype. The buffers
are allocated once and reused: each grows to the largest segment it is asked for (in the first step's gathers), so
later steps allocate nothing, and a buffer is written again only after the device copies that read it last are done
(the event recorded behind them on the stream they were queued on, waited for by the thread that takes it next: the
copy thread or the host thread, never the one issuing ops).

On a GPU the buffers are pinned, so those copies run asynchronously on the copy stream (a copy from pageable memory
holds the thread that issues it until it is made). On the CPU device the same code runs with no event: the copies
are made when issued, and a buffer is free as soon as it is handed back.
"""
from __future__ import annotations

import contextlib
import threading

import torch


class _Buffer:
    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.tensor: torch.Tensor | None = None
        self.event = None       # a CUDA event behind the last copies that read it (None: nothing in flight)


class Staging:
    """A pool of host buffers reused across gathers for copies to ``device`` (see the module's docstring): pinned
    where it is a GPU."""

    def __init__(self, device=None):
        self.device = torch.device("cpu" if device is None else device)
        self.pin = self.device.type == "cuda"
        self._free: list[_Buffer] = []
        self._lock = threading.Lock()
        self.allocations = 0     # buffers made or grown: none once every size has been asked for

    @contextlib.contextmanager
    def hold(self, numel: int, dtype: torch.dtype = torch.float32):
        """A flat host tensor of ``numel`` elements of ``dtype`` for the ``with`` block. Copies to the device that read
        it are queued in the block on the current stream; the buffer is not handed out again before they are done."""
        buf = self._take(numel, dtype)
        try:
            yield buf.tensor[:numel]
        finally:
            buf.event = torch.cuda.current_stream(self.device).record_event() if self.pin else None
            with self._lock:
                self._free.append(buf)

    def _take(self, numel: int, dtype: torch.dtype) -> _Buffer:
        with self._lock:
            mine = [b for b in self._free if b.dtype == dtype]
            # the smallest that holds it (a small request leaves the large buffers to the large), else the largest,
            # grown: the pool keeps as many buffers as were ever held at once, each as large as it was asked
            fits = [b for b in mine if b.tensor.numel() >= numel]
            buf = (min(fits, key=lambda b: b.tensor.numel()) if fits
                   else max(mine, key=lambda b: b.tensor.numel(), default=None))
            if buf is not None:
                self._free.remove(buf)
        if buf is None:
            buf = _Buffer(dtype)
        if buf.event is not None:        # the device copies that read it last
            buf.event.synchronize()
            buf.event = None
        if buf.tensor is None or buf.tensor.numel() < numel:
            buf.tensor = None            # (the old one first: its memory may serve the new one)
            buf.tensor = torch.empty(numel, dtype=dtype, pin_memory=self.pin)
            self.allocations += 1
        return buf

    def held_bytes(self) -> int:
        """Host bytes of the buffers not in use now."""
        with self._lock:
            return sum(b.tensor.numel() * b.tensor.element_size() for b in self._free if b.tensor is not None)


def to_device(dests: dict, seg, flat: torch.Tensor, staging: Staging) -> None:
    """Each weight of segment ``seg`` that ``dests`` names (name -> flat view of its copy) from ``flat``, the gathered
    segment on the host: cast on the host where the copy is of another dtype (in a buffer of ``staging``), then
    copied without blocking (queued on the current stream where the copy is on a GPU: the copy thread's copy stream).
    A copy freed before its copy is made is not reused until then (``record_stream``)."""
    casts = {d.dtype for d in dests.values()} - {flat.dtype}
    with contextlib.ExitStack() as stack:
        into = {dt: stack.enter_context(staging.hold(seg.size, dt)) for dt in sorted(casts, key=str)}
        for n, off, k in seg.items():
            d = dests.get(n)
            if d is None:
                continue
            src = flat[off: off + k]
            if d.dtype != src.dtype:      # the cast a copy_ across dtypes makes, on this thread (not the issuing one)
                src = into[d.dtype][off: off + k].copy_(src)
            d.copy_(src, non_blocking=True)
            if d.is_cuda:
                d.record_stream(torch.cuda.current_stream(d.device))
