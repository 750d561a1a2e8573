"""``shard_state="full"`` with the disk tiers: each rank keeps its share of a pack in a file on its own disk.

This is ZeRO-Infinity's bandwidth-centric partitioning: every rank reads and writes only its chunks of each pack
(runtime/partitioned/), so N ranks read a layer from N disks at once and no rank's disk holds more than its
share. The offload pass places a partitioned pack's state on disk when ``host_memory_budget`` cannot hold this
rank's share of it (``Residency.optim_on == Tier.DISK``: the optimizer state of the rank's pieces), or its weights'
share too (``master_on == Tier.DISK``: the pieces' fp32 weights, as this rank's chunk of each of the pack's
segments, ahead of the state in the same file).

``ShareTier`` is a ``DiskTier`` (runtime/tiers/optim_disk.py) whose files hold, in this order, the pack's chunks
(when its weights are on disk) and its pieces' optimizer state, so a pack's host step is the disk tier's: ``begin``
installs the file read ahead (the chunks into ``Shares``, whose pieces' parameters become views of them, and the
state into the pack's optimizer), the optimizer steps the pieces, ``end`` writes the file back and leaves
placeholders. A ``gather`` of such a pack reads the chunks, a prefix of the file, on the copy thread and all-gathers
them (``Shares.load``), after the write of the last step (``DiskStore`` orders a file's reads after its write). Per
step a rank therefore reads its chunks once per gather and its whole file once, and writes its file once: each 1/N
of the replicated run's files. A gather that takes the copy a carried pack's last step refilled
(runtime/partitioned/carry.py) reads nothing; where it is the last before the step (``state_only``), every read
ahead of the step's file reads the optimizer state alone, and ``_take`` fills the chunks in from that copy.

Between steps a weights-on-disk pack's pieces hold placeholders and ``Shares.chunks`` has no entry for it;
checkpoints read and write the chunks through ``weights_of`` and ``set_state``, one pack at a time.
"""
from __future__ import annotations

from concurrent.futures import Future
from concurrent.futures import wait as wait_all

import torch

from harmony.base.tiers import Tier
from harmony.runtime.ops import ops_of
from harmony.runtime.tiers.disk import ALIGN, DiskStore, layout, step_order, views_of
from harmony.runtime.tiers.optim_disk import DiskTier

CHUNK = "chunk"      # the key of a chunk's entry in a file's layout (optimizer state keys are the optimizer's)


def _chunk_name(pack: int, segment: int) -> str:
    return f"{CHUNK}:{pack}:{segment}"


def state_only(graph) -> set[int]:
    """Packs whose last gather before their step takes the copy the last step carried and reads the optimizer state
    alone (``gather(..., carried=True, reads="state")``, passes/shard.py): every read ahead of their step's file
    leaves the chunks out."""
    last, out = {}, set()
    for n, op in ops_of(graph.nodes):
        if op.fetches and op.partitioned and n.args[1:2] == ("params",):     # a gather
            last[n.args[0]] = n
        elif op.steps and n.args[0] in last:
            if last.pop(n.args[0]).kwargs.get("reads") == "state":
                out.add(n.args[0])
    return out


class ShareTier(DiskTier):
    """This rank's share of the partitioned packs placed on disk: a file per pack, see the module docstring."""

    def __init__(self, store: DiskStore, packs: dict[int, list[str]], tensors: dict, optimizers: dict,
                 order: list[int], shares, weights: set[int]):
        super().__init__(store, packs, tensors, optimizers, order)
        self.shares, self.weights = shares, set(weights)
        self.piece_pack = {}                 # piece name -> its pack, for the packs whose chunks are on disk
        for p in self.weights:
            self.piece_pack.update(dict.fromkeys(self.names[p], p))
        shares.tier = self
        self._graph, self._gathers, self._expect = None, {}, {}    # gathers since each pack's step (read_chunks)
        self._fill: dict[int, tuple] = {}    # pack -> (buffer, offset): a read ahead without its chunks (_take)
        self.state_only: set[int] = set()    # packs whose step reads its optimizer state alone (``state_only``)
        for p in sorted(self.weights):       # the chunks go to their files now: the host keeps none of them
            entries = self._head(p)
            self.layouts[p] = [(n, k, tuple(v.shape), v.dtype) for n, k, v in entries]
            self.store.write(p, [v for _, _, v in entries]).result()
            shares.evict(p)

    @classmethod
    def create(cls, plan, graph, tensors: dict, optimizers: dict, shares, offload_dir=None, **io) -> "ShareTier | None":
        """The tier of the partitioned packs whose state ``plan.residency`` places on disk, or None if none is."""
        packs, opts, weights = {}, {}, set()
        for p, record in plan.residency.items():
            if record.shares is None or record.optim_on != Tier.DISK:
                continue
            names = [piece.name for piece in record.shares.pieces]
            opt = next((optimizers[n] for n in plan.packs[p].stepped if n in optimizers), None)
            if opt is None or not names:
                continue
            packs[p] = names
            opts.update(dict.fromkeys(names, opt))
            if record.master_on == Tier.DISK:
                weights.add(p)
        if not packs:
            return None
        tier = cls(DiskStore(offload_dir, **io), packs, tensors, opts, step_order(graph), shares, weights)
        tier.state_only = state_only(graph) & weights
        return tier

    # -- the file's entries: the chunks first, then the pieces' optimizer state ----------------------
    def _head(self, pack: int) -> list[tuple[str, str, torch.Tensor]]:
        if pack not in self.weights:
            return []
        return [(_chunk_name(pack, s), CHUNK, c) for s, c in enumerate(self.shares.loaded(pack))]

    def _install(self, pack: int, views: list[torch.Tensor]) -> None:
        for (n, k, _, _), v in zip(self.layouts[pack], views):
            if k == CHUNK:
                self.shares.install(pack, int(n.rsplit(":", 1)[1]), v)
            else:
                self.optimizers[n].state.setdefault(self.tensors[n], {})[k] = v
        self._live[pack] = views

    def _placeholders(self, pack: int) -> None:
        for n, k, shape, dtype in self.layouts.get(pack, ()):
            if k != CHUNK:
                self.optimizers[n].state[self.tensors[n]][k] = torch.empty(shape, dtype=dtype, device="meta")
        if pack in self.weights:
            self.shares.evict(pack)

    def _last_gather(self, graph, pack: int) -> bool:
        """Whether this gather of ``pack`` is the last before its step in ``graph`` (counted since that step)."""
        with self._lock:
            if graph is not self._graph:      # another schedule (an evaluation, another batch shape): count anew
                nodes = list(ops_of(graph.nodes))
                steps = {n.args[0]: i for i, (n, op) in enumerate(nodes) if op.steps}
                self._graph, self._gathers = graph, {}
                self._expect = {p: sum(op.fetches and op.partitioned and n.args[0] == p for n, op in nodes[:i])
                                for p, i in steps.items()}
            count = self._gathers[pack] = self._gathers.get(pack, 0) + 1
            return count == self._expect.get(pack)

    def prefetch(self, pack: int) -> None:
        if pack in self.state_only:     # the step takes the chunks from the carried copy: its state alone
            self._prefetch_state(pack)
            return
        with self._lock:       # the copy thread's gathers start the steps' reads too
            super().prefetch(pack)

    def end(self, pack: int) -> None:
        with self._lock:
            self._gathers.pop(pack, None)
        super().end(pack)

    def _chunk_count(self, pack: int) -> int:
        return sum(k == CHUNK for _, k, _, _ in self.layouts.get(pack, ()))

    # -- the gathers' reads ----------------------------------------------------------------------------
    def count_gather(self, pack: int, graph) -> None:
        """A gather of ``pack`` that took its carried copies (runtime/partitioned/carry.py) reads no chunks, but
        counts as a gather: where it is the last before the step, the step's read of the file starts here (of the
        optimizer state alone for a ``state_only`` pack, whose step takes the chunks from the carried copy)."""
        with self._lock:
            kept = self._kept.get(pack)
        if kept is None and graph is not None and self._last_gather(graph, pack):
            self.prefetch(pack)

    def _prefetch_state(self, pack: int) -> None:
        """The step's read ahead of the file's optimizer state, into the buffer of the whole file, from the 4 KiB
        page holding its first byte; the chunks ahead of it are filled in from the carried copy (``_take``)."""
        with self._lock:
            if pack in self._reads or pack in self._kept or not self.layouts.get(pack):
                return
            specs = [(s, d) for _, _, s, d in self.layouts[pack]]
            offsets, total = layout(specs)
            k = self._chunk_count(pack)
            at = (offsets[k] if k < len(specs) else total) // ALIGN * ALIGN
            buf = self.store.buffers.take(total)
            views = views_of(buf, specs, offsets)
            if at < total:
                fut = self.store.read_at(pack, buf[at:], at)
            else:
                fut = Future()
                fut.set_result(None)
            self._reads[pack] = (fut, views)
            self._fill[pack] = (buf, at)

    def _take(self, pack: int) -> list[torch.Tensor] | None:
        views = super()._take(pack)
        fill = self._fill.pop(pack, None)
        if views is not None and fill is not None:
            self._fill_chunks(pack, views[: self._chunk_count(pack)], *fill)
        return views

    def _fill_chunks(self, pack: int, chunks: list[torch.Tensor], buf: torch.Tensor, at: int) -> None:
        """This rank's chunks, from the device copy the pack's step will refill (bitwise the file's: the copy was
        all-gathered from these chunks); read from the file where a copy is missing."""
        carry = self.shares.carry
        copies = carry.stepping.get(pack, {}) if carry is not None else {}
        shares = self.shares.plan.at(pack).shares
        if any(n not in copies or copies[n].dtype != c.dtype for seg, c in zip(shares.segments, chunks)
               for n in seg.names):
            if at:
                self.store.read_at(pack, buf[:at], 0).result()
            return
        r = shares.rank
        with torch.no_grad():
            for seg, c in zip(shares.segments, chunks):
                b0, b1 = seg.bounds[r], seg.bounds[r + 1]
                c.zero_()
                for n, off, k in seg.items():
                    lo, hi = max(off, b0), min(off + k, b1)
                    if lo < hi:
                        c[lo - b0: hi - b0].copy_(copies[n].reshape(-1)[lo - off: hi - off])

    def read_chunks(self, pack: int, graph=None) -> list[torch.Tensor]:
        """This rank's chunks of ``pack``, read from the front of its file (or its buffer, if its write failed).

        The last gather of the pack before its step in ``graph`` (the schedule running) reads the whole file
        instead, as the step's read ahead: the step takes the weights with their state, and the pack's chunks are
        read once per gather, not once more for the step."""
        with self._lock:
            kept = self._kept.get(pack)
        k = self._chunk_count(pack)
        if kept is not None:
            return list(kept[:k])
        if graph is not None and self._last_gather(graph, pack):
            self.prefetch(pack)
            fut, views = self._reads[pack]
            fut.result()
            fill = self._fill.pop(pack, None)
            if fill is not None and fill[1]:   # a read of the state alone, no carried copy taken: the chunks too
                self.store.read_at(pack, fill[0][: fill[1]], 0).result()
            return list(views[:k])
        specs = [(s, d) for _, _, s, d in self.layouts[pack][:k]]
        offsets, end = layout(specs)          # the chunks' entries, to the 4 KiB page after them
        buf = self.store.buffers.take(end)
        self.store.read_at(pack, buf, 0).result()
        return views_of(buf, specs, offsets)

    # -- checkpoints -------------------------------------------------------------------------------------
    def holds_weight(self, name: str) -> bool:
        return name in self.piece_pack

    def weights_of(self, names) -> dict[str, torch.Tensor]:
        """The fp32 weights of the pieces among ``names`` whose chunks are on disk, read a pack at a time."""
        out = {}
        for pack in dict.fromkeys(self.piece_pack[n] for n in names if n in self.piece_pack):
            views = self.shares.pieces_of(pack, self.shares.load(pack))
            out.update({n: v for n, v in views.items() if n in names})
        return out

    def set_state(self, pack: int, states: dict, weights: dict | None = None) -> None:
        """Replace pack ``pack``'s optimizer state with ``states`` and, where its chunks are on disk, the
        weights of its pieces in ``weights`` {piece name: tensor} (the others keep theirs)."""
        if pack not in self.weights:
            return super().set_state(pack, states)
        self.flush()
        old = self._reads.pop(pack, None)
        self._fill.pop(pack, None)
        if old is not None:
            wait_all([old[0]])
        chunks = [c.clone() for c in self.read_chunks(pack)]
        with self._lock:
            self._kept.pop(pack, None)
        self._live.pop(pack, None)
        views = self.shares.pieces_of(pack, chunks)
        with torch.no_grad():
            for n, v in (weights or {}).items():
                views[n].copy_(v.reshape(views[n].shape))
        for s, c in enumerate(chunks):
            self.shares.install(pack, s, c)
        super().set_state(pack, states)      # writes the chunks (``_head``) and the state, and evicts the chunks
