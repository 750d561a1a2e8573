"""The disk tier as the runtime uses it: the optimizer state of the packs the offload pass placed on disk.

``DiskTier`` keeps each disk-placed pack's optimizer state in a file of a ``DiskStore`` (runtime/tiers/disk.py) between
steps and in an aligned host buffer during one: the next pack's file is read ahead while this one steps, and a
stepped pack's buffer is written back in the background. ``step_stats`` and ``take`` are shared with the tier of
packs wholly on disk (runtime/tiers/params_disk.py).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_all

import torch

from harmony.base.errors import OffloadError
from harmony.base.tiers import Tier
from harmony.runtime.tiers.disk import DiskStore, step_order


def _large(v) -> bool:
    """State that goes to disk: tensors with elements per parameter (not 0-d counters such as Adam's step)."""
    return isinstance(v, torch.Tensor) and v.dim() > 0


def step_stats(tier, **extra) -> dict:
    """A disk tier's traffic since the last call (a step), for ``sm.stats`` and the report.

    Bytes are counted when issued: a read started at the end of a step for the next one
    belongs to this step's plan; ``*_done`` and ``*_seconds`` are the I/O that finished, for
    GB/s. ``extra``: more of the tier's counters, as {stat name: attribute name}.
    """
    counters = dict(wait_seconds="wait_seconds", on_demand="on_demand", **{a: a for a in extra.values()})
    now = dict(tier.store.stats(), **{k: getattr(tier, a) for k, a in counters.items()})
    last, tier._last = tier._last, now
    d = {k: now[k] - last.get(k, 0) for k in ("read_bytes", "read_seconds", "write_bytes", "write_seconds",
                                               "read_issued", "write_issued", "buffer_fresh_bytes", *counters)}
    tier.store.buffers.reset_peak()       # the next step's peak starts from what is alive now
    return dict(disk_read_bytes=d["read_issued"], disk_write_bytes=d["write_issued"],
                disk_read_done=d["read_bytes"], disk_read_seconds=d["read_seconds"],
                disk_write_done=d["write_bytes"], disk_write_seconds=d["write_seconds"],
                disk_wait_seconds=d["wait_seconds"], disk_reads_not_ahead=d["on_demand"],
                disk_buffer_peak_bytes=now["buffer_peak"], disk_buffer_fresh_bytes=d["buffer_fresh_bytes"],
                disk_io=tier.store.why, offload_dir=str(tier.store.path),
                **{k: d[a] for k, a in extra.items()})


def take(tier, key) -> list[torch.Tensor]:
    """A file's buffer for a step: kept in memory after a failed write, else its read ahead (started now if not)."""
    with tier._lock:
        kept = tier._kept.pop(key, None)
    if kept is not None:
        return kept
    if key not in tier._reads:
        tier.on_demand += 1
        tier.prefetch(key)
    fut, views = tier._reads.pop(key)
    t0 = time.perf_counter()
    try:
        fut.result()
    finally:
        tier.wait_seconds += time.perf_counter() - t0
    return views


class DiskTier:
    """The optimizer state of disk-placed packs: on disk between steps, in an aligned host buffer during one."""

    def __init__(self, store: DiskStore, packs: dict[int, list[str]], tensors: dict, optimizers: dict,
                 order: list[int]):
        self.store = store
        self.names = {p: list(ns) for p, ns in packs.items()}     # pack -> params whose state is on disk
        self.pack_of = {n: p for p, ns in self.names.items() for n in ns}
        self.tensors, self.optimizers = tensors, optimizers
        self.order = [p for p in dict.fromkeys(order)]
        self.layouts: dict[int, list[tuple[str, str, tuple, torch.dtype]]] = {}   # what each file holds
        self._reads: dict[int, tuple[Future, list[torch.Tensor]]] = {}
        self._live: dict[int, list[torch.Tensor]] = {}       # installed in the optimizer during a step
        self._kept: dict[int, list[torch.Tensor]] = {}       # a write failed: the state stays in memory
        self._writing: list[tuple[int, Future]] = []
        self._inflight: dict[int, list[torch.Tensor]] = {}   # buffers being written (kept if the write fails)
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()
        disk_order = [p for p in self.order if p in self.names]
        # the last disk pack of a step reads ahead the first one of the next step, across the forward pass
        self._wrap = (disk_order[-1], disk_order[0]) if len(disk_order) > 1 else None
        self.wait_seconds = 0.0                              # the host thread blocked on reads
        self.on_demand = 0                                   # reads not started ahead of their step
        self._last = dict(store.stats(), wait_seconds=0.0, on_demand=0)

    @classmethod
    def create(cls, plan, graph, tensors: dict, optimizers: dict, offload_dir=None, **io) -> "DiskTier | None":
        """The tier of the packs whose optimizer state ``plan.residency`` places on disk, or None if there are none."""
        packs = {s.index: [n for n in s.stepped if n in optimizers] for s in plan.packs
                 if plan.at(s.index).optim_on == Tier.DISK
                 and plan.at(s.index).master_on != Tier.DISK    # packs wholly on disk have their own
                 and plan.at(s.index).shares is None}          # partitioned: runtime/partitioned/disk.py
        if not packs:
            return None
        return cls(DiskStore(offload_dir, **io), packs, tensors, optimizers, step_order(graph))

    def holds(self, pack: int) -> bool:
        return pack in self.names

    # -- the host step -------------------------------------------------------------------------
    def begin(self, pack: int) -> None:
        """Start reading the next disk pack's state; put this pack's into its optimizer (waiting if needed)."""
        nxt = self._next(pack)
        if pack in self.names or nxt is not None:
            self._settle_writes()    # the previous pack's buffer goes before the next one's comes
        if nxt is not None:
            self.prefetch(nxt)
        if pack not in self.names:
            return
        views = self._take(pack)
        if views is not None:
            self._install(pack, views)

    def end(self, pack: int) -> None:
        """After the step: write the pack's state back, leave placeholders, let the buffer go once written."""
        if pack not in self.names:
            return
        entries = self._entries(pack)
        lay = [(n, k, tuple(v.shape), v.dtype) for n, k, v in entries]
        live = self._live.pop(pack, None)
        if live is not None and len(live) == len(entries) and all(a is e[2] for a, e in zip(live, entries)):
            views = live
        else:      # the first step (the optimizer made its state) or the optimizer replaced a tensor
            views = self.store.empty([(s, d) for _, _, s, d in lay])
            for dst, (_, _, src) in zip(views, entries):
                dst.copy_(src)
        self.layouts[pack] = lay
        self._placeholders(pack)
        if not lay:
            self.store.remove(pack)
            return
        self._settle_writes()
        with self._lock:
            self._inflight[pack] = views
        fut = self.store.write(pack, views)
        del views
        self._writing.append((pack, fut))
        if self._wrap is not None and pack == self._wrap[0]:
            self.prefetch(self._wrap[1])

    def _entries(self, pack: int) -> list[tuple[str, str, torch.Tensor]]:
        """(name, key, tensor) of what the pack's file holds: ``_head`` and its parameters' large optimizer state."""
        return self._head(pack) + [(n, k, v) for n in self.names[pack]
                                   for k, v in self.optimizers[n].state.get(self.tensors[n], {}).items() if _large(v)]

    def _head(self, pack: int) -> list[tuple[str, str, torch.Tensor]]:
        """Entries ahead of the optimizer state in a file (a partitioned pack's chunks: runtime/partitioned/disk.py)."""
        return []

    def abort(self, pack: int) -> None:
        """The step failed: leave placeholders; the file keeps the state from before the step."""
        views = self._live.pop(pack, None)
        if views is not None and pack in self.layouts:
            self._placeholders(pack)

    def prefetch(self, pack: int) -> None:
        if pack in self._reads or pack in self._kept or pack not in self.layouts or not self.layouts[pack]:
            return
        views = self.store.empty([(s, d) for _, _, s, d in self.layouts[pack]])
        self._reads[pack] = (self.store.read(pack, into=views), views)

    def _next(self, pack: int) -> int | None:
        if pack not in self.order:
            return None
        for p in self.order[self.order.index(pack) + 1:]:
            if p in self.names:
                return p
        return None

    def _take(self, pack: int) -> list[torch.Tensor] | None:
        if pack not in self._kept and not self.layouts.get(pack):
            return None          # never stepped: the optimizer makes its state
        return take(self, pack)

    def _install(self, pack: int, views: list[torch.Tensor]) -> None:
        for (n, k, _, _), v in zip(self.layouts[pack], views):
            self.optimizers[n].state.setdefault(self.tensors[n], {})[k] = v
        self._live[pack] = views

    def _placeholders(self, pack: int) -> None:
        for n, k, shape, dtype in self.layouts.get(pack, ()):
            self.optimizers[n].state[self.tensors[n]][k] = torch.empty(shape, dtype=dtype, device="meta")

    def _settle_writes(self) -> None:
        """Let earlier writes finish and free their buffers, or keep them if a write failed (``flush`` raises)."""
        writing, self._writing = self._writing, []
        for pack, fut in writing:
            wait_all([fut])
            e = fut.exception()
            with self._lock:
                views = self._inflight.pop(pack, None)
                if e is None:
                    continue
                self._kept[pack] = views
            if isinstance(e, OffloadError):
                e.add_note(f"the optimizer state of pack {pack} is kept in host memory and no partial file is "
                           f"left in {self.store.path}; after making room, resume from your last checkpoint "
                           f"(harmony.load) or save one now (harmony.save)")
            self._errors.append(e)

    def flush(self) -> None:
        """Wait for the writes of this step; raise the first that failed (the end of a training step)."""
        self._settle_writes()
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    # -- checkpoints: one pack at a time --------------------------------------------------------
    def state_of(self, names) -> dict[str, dict]:
        """Real optimizer state of ``names`` that live on disk: {name: {key: tensor}}, read pack by pack."""
        out: dict[str, dict] = {}
        for pack in dict.fromkeys(self.pack_of[n] for n in names if n in self.pack_of):
            with self._lock:
                views = self._kept.get(pack)
            lay = self.layouts.get(pack, [])
            if views is None and lay:
                views = self.store.empty([(s, d) for _, _, s, d in lay])
                self.store.read(pack, into=views).result()
            big = {(n, k): v for (n, k, _, _), v in zip(lay, views or [])}
            for n in self.names[pack]:
                if n not in names:
                    continue
                state = self.optimizers[n].state.get(self.tensors[n], {})
                if state:
                    out[n] = {k: big.get((n, k), v) for k, v in state.items()}
        return out

    def set_state(self, pack: int, states: dict) -> None:
        """Replace pack ``pack``'s optimizer state with ``states`` {name: {key: value}} (names missing: none)."""
        self.flush()
        old = self._reads.pop(pack, None)
        if old is not None:
            wait_all([old[0]])
        with self._lock:
            self._kept.pop(pack, None)
        self._live.pop(pack, None)
        head = self._head(pack)
        lay, values = [(n, k, tuple(v.shape), v.dtype) for n, k, v in head], [v for _, _, v in head]
        for n in self.names[pack]:
            p, s = self.tensors[n], states.get(n) or {}
            new = {}
            for k, v in s.items():
                if _large(v):
                    lay.append((n, k, tuple(v.shape), v.dtype))
                    values.append(v)
                else:
                    new[k] = v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
            if s:
                self.optimizers[n].state[p] = new
            else:
                self.optimizers[n].state.pop(p, None)
        self.layouts[pack] = lay
        self._placeholders(pack)
        if lay:
            views = self.store.empty([(s, d) for _, _, s, d in lay])
            with torch.no_grad():
                for dst, src in zip(views, values):
                    dst.copy_(src)
            self.store.write(pack, views).result()
        else:
            self.store.remove(pack)

    # -- reports and lifetime ------------------------------------------------------------------
    def step_stats(self) -> dict:
        return step_stats(self)

    def close(self) -> None:
        try:
            wait_all([f for _, f in self._writing])
        finally:
            self._writing = []
            self.store.close()
