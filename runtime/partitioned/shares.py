"""This rank's chunks of the partitioned packs (``Shares``: host tensors, the only copy of its share of the weights)
and the gathers that make a segment whole from every rank's chunk; the package's docstring has the design."""
from __future__ import annotations

import torch

from harmony.base.units import nbytes
from harmony.runtime.comm.collectives import exchange
from harmony.runtime.partitioned.carry import Carry
from harmony.runtime.partitioned.layout import PackShares
from harmony.runtime.partitioned.staging import Staging, to_device
from harmony.runtime.placeholders import withhold

DIRECT_BYTES = 256 << 10      # a segment whose parameters average this much is gathered into its copies directly


# -- the live chunks -----------------------------------------------------------------------------
class Shares:
    """This rank's chunks (host fp32 tensors, the only copy of its share of the weights) and their pieces.

    For a GPU (``device``) the chunks are cut into pinned memory, once: the optimizer steps them in place and the
    gathers send them from there every step (their pieces, views of them, are what the runtime's tiers see, already
    pinned). A gather into device copies receives the segment into a pinned staging buffer, allocated once and
    reused (``staging``, runtime/partitioned/staging.py), from which the copies to the device run on the copy
    stream; the same code runs on the CPU device with nothing pinned and no event."""

    def __init__(self, plan, tensors: dict, timeout: float | None = None, fill=None, device=None):
        """``fill(params)``: makes the parameters of a model built without its weights (driver/materialize.py),
        called with each pack's right before its chunks are cut, so the host holds one pack's whole weights at a
        time beside this rank's chunks. ``device``: where the runtime computes (None: the CPU)."""
        import datetime

        import torch.distributed as dist
        self.plan = plan
        self.staging = Staging(device)
        self.chunks: dict[tuple[int, int], torch.Tensor] = {}
        self.pieces: dict[int, list[torch.nn.Parameter]] = {}
        self.stats = {"gather_wire_bytes": 0, "reduce_scatter_wire_bytes": 0, "carried_gathers": 0}
        kw = {"timeout": datetime.timedelta(seconds=timeout)} if timeout else {}
        grid = grid_of(plan)
        # the copy thread's all-gathers: a group of their own (a grid's: of this rank's replica group's ranks)
        self.group = dist.new_group(backend="gloo", **kw) if grid is None else own_groups(grid, "gather")
        self.timeout = timeout
        self.tier = None            # runtime/partitioned_disk.ShareTier, where some packs' chunks live on disk
        self.error_feedback: dict = {}   # a quantized reduce-scatter's residuals (runtime/partitioned/reduce.py)
        # stochastic rounding draws as the replicated run's Communicator draws (runtime/comm/communicator.py)
        self.generator = torch.Generator().manual_seed(0x5EED + dist.get_rank())
        with torch.no_grad():
            for p, record in sorted(plan.residency.items()):
                if record.shares is not None:
                    if fill is not None:
                        fill([tensors[n] for n in record.shares.names()])
                    self._carve(p, record.shares, tensors)
        # weights carried on the device across their pack's step (runtime/partitioned/carry.py)
        self.carry_packs = {p for p, r in plan.residency.items() if r.shares is not None and r.carried}
        self.carry = Carry(None if grid is None else own_groups(grid, "carry")) if self.carry_packs else None

    def _carve(self, pack: int, shares: PackShares, tensors: dict) -> None:
        """Keep this rank's chunk of each segment, hand its pieces to ``tensors``, and drop the rest."""
        r = shares.rank
        for s, seg in enumerate(shares.segments):
            flat = torch.zeros(seg.size, dtype=tensors[seg.names[0]].dtype)
            for n, off, k in seg.items():
                flat[off: off + k] = tensors[n].data.reshape(-1)
            # its own size: this rank's host holds its share (a gather sends it at that length)
            mine = flat[seg.bounds[r]: seg.bounds[r + 1]]
            self.chunks[(pack, s)] = torch.empty(mine.shape, dtype=mine.dtype, pin_memory=self.staging.pin).copy_(mine)
        mine = self.pieces[pack] = []
        for piece in shares.pieces:
            base = shares.segments[piece.segment].bounds[r]
            t = torch.nn.Parameter(self.chunks[(pack, piece.segment)][piece.start - base: piece.end - base])
            tensors[piece.name] = t
            mine.append(t)
        for n in shares.names():
            withhold(tensors[n])

    # the chunks of a pack: in host memory, or between steps in this rank's file of it (runtime/partitioned/disk.py)
    def in_memory(self, pack: int) -> bool:
        return (pack, 0) in self.chunks

    def loaded(self, pack: int) -> list[torch.Tensor]:
        return [self.chunks[(pack, s)] for s in range(len(self.plan.at(pack).shares.segments))]

    def load(self, pack: int, graph=None) -> list[torch.Tensor]:
        """The pack's chunks, read from its file if they are not in memory (for a gather of ``graph``)."""
        return self.loaded(pack) if self.in_memory(pack) else self.tier.read_chunks(pack, graph)

    def install(self, pack: int, segment: int, chunk: torch.Tensor) -> None:
        """``chunk`` becomes the segment's chunk, and the pieces in it views of it."""
        self.chunks[(pack, segment)] = chunk
        for piece, t in self.pieces_of(pack, {segment: chunk}, params=True).items():
            piece.data = t

    def evict(self, pack: int) -> None:
        """Drop the pack's chunks from host memory (their file holds them); its pieces hold placeholders."""
        for s in range(len(self.plan.at(pack).shares.segments)):
            self.chunks.pop((pack, s), None)
        for t in self.pieces[pack]:
            withhold(t)

    def pieces_of(self, pack: int, chunks, params: bool = False) -> dict:
        """{piece name (or, with ``params``, its parameter): its view of ``chunks``} ({segment: chunk} or a list)."""
        shares = self.plan.at(pack).shares
        chunks = dict(enumerate(chunks)) if isinstance(chunks, list) else chunks
        out = {}
        for piece, t in zip(shares.pieces, self.pieces[pack]):
            if piece.segment in chunks:
                base = shares.segments[piece.segment].bounds[shares.rank]
                out[t if params else piece.name] = chunks[piece.segment][piece.start - base: piece.end - base] \
                    .view(t.shape)
        return out

    def gather(self, pack: int, segment: int, mine: torch.Tensor, group=None, words=None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """One segment whole, from every rank's chunk (``mine``: this rank's, from ``load``; a collective of
        ``group``, by default ``self.group``, the copy thread's), into ``out`` (a new tensor by default).

        Each rank sends its chunk to every other and receives theirs straight into their places in the buffer
        (gloo's point-to-point sends, all posted at once): the same bytes as gloo's ``all_gather_into_tensor``, which
        took more than twice as long on loopback here, and chunks of uneven shares travel at their own lengths, with
        no padding and no copy to drop it."""
        import torch.distributed as dist
        shares = self.plan.at(pack).shares
        seg, me, group = shares.segments[segment], shares.rank, self.group if group is None else group
        out = torch.empty(seg.size, dtype=mine.dtype) if out is None else out
        out[seg.bounds[me]: seg.bounds[me + 1]].copy_(mine)
        ops = words.ops(shares.world, me) if words is not None else []    # (``Words``: first, once)
        for r in range(shares.world):
            peer = dist.get_global_rank(group, r)
            if r != me and seg.share(r):
                ops.append(dist.P2POp(dist.irecv, out[seg.bounds[r]: seg.bounds[r + 1]], peer, group))
            if r != me and seg.share(me):
                ops.append(dist.P2POp(dist.isend, mine, peer, group))
        exchange(f"the gather of pack {pack}'s weights (segment {segment})", ops, self.timeout, group)
        self.stats["gather_wire_bytes"] += mine.element_size() * (seg.size - seg.share(me))   # received
        return out

    def gather_into(self, pack: int, segment: int, mine: torch.Tensor, dests: dict, group=None, words=None) -> None:
        """One segment's weights into ``dests`` ({name: flat tensor of the whole parameter}; the segment's other
        weights are not kept), from every rank's chunk, as ``gather`` brings them.

        Where the copies are of the chunks' dtype and the parameters are large, each peer's chunk is received piece by
        piece straight into the copies (one message per parameter it holds, every rank cutting its chunk alike), so
        no staging buffer is allocated and nothing is copied twice; otherwise (a copy in the compute dtype or in
        memory gloo cannot receive into, or a buffer of many small tensors, where a message each would cost more than
        the copy) through ``gather``, into a staging buffer (``staging``), from which each copy is made: on a GPU
        without blocking, queued on the current stream (the copy stream, on the copy thread, or the host thread's
        for a carried pack's refill), the buffer reused only once those copies are done."""
        shares = self.plan.at(pack).shares
        seg, me = shares.segments[segment], shares.rank
        if (any(d.dtype != mine.dtype or d.device.type != "cpu" for d in dests.values())
                or seg.total < DIRECT_BYTES // 4 * len(seg.names)):
            with self.staging.hold(seg.size, mine.dtype) as flat:
                self.gather(pack, segment, mine, group, words, out=flat)
                to_device(dests, seg, flat, self.staging)
            return
        import torch.distributed as dist
        group = self.group if group is None else group
        ops = words.ops(shares.world, me) if words is not None else []
        for r in range(shares.world):
            lo = seg.bounds[r]
            for n, off, a, b in seg.overlaps(r):
                if r == me:            # this rank's piece, and what it sends every peer
                    piece = mine[a - lo: b - lo]
                    if n in dests:
                        dests[n][a - off: b - off].copy_(piece)
                    ops += [dist.P2POp(dist.isend, piece, dist.get_global_rank(group, q), group)
                            for q in range(shares.world) if q != me]
                else:
                    into = dests[n][a - off: b - off] if n in dests else mine.new_empty(b - a)
                    ops.append(dist.P2POp(dist.irecv, into, dist.get_global_rank(group, r), group))
        exchange(f"the gather of pack {pack}'s weights (segment {segment})", ops, self.timeout, group)
        self.stats["gather_wire_bytes"] += mine.element_size() * received(shares, segment)

    def substitute(self, tensors: dict) -> None:
        """In a name -> tensor table of the training state: this rank's pieces in place of the partitioned weights."""
        for p, record in self.plan.residency.items():
            if record.shares is not None:
                for n in record.shares.names():
                    tensors.pop(n, None)
                tensors.update({piece.name: t for piece, t in zip(record.shares.pieces, self.pieces[p])})

    def gather_all(self, tensors: dict) -> list[str]:
        """Every partitioned weight, whole, into its parameter (every rank must call it); returns their names."""
        done = []
        with torch.no_grad():
            for p, record in sorted(self.plan.residency.items()):
                chunks = self.load(p) if record.shares is not None else []
                for s, seg in enumerate(record.shares.segments if record.shares is not None else ()):
                    flat = self.gather(p, s, chunks[s])
                    for n, off, k in seg.items():
                        tensors[n].data = flat[off: off + k].clone().view(tensors[n].shape)
                        done.append(n)
        return done

    def held_bytes(self) -> int:
        """Host bytes of this rank's chunks."""
        return sum(nbytes(c) for c in self.chunks.values())


def share_params(rt, pack: int) -> list:
    """The pieces a partitioned pack's step updates (empty for another pack)."""
    shares = getattr(rt.state, "shares", None)
    return list(shares.pieces.get(pack, ())) if shares is not None else []


def received(shares: PackShares, segment: int) -> int:
    """Elements this rank receives in a gather of one segment: the other ranks' chunks."""
    seg = shares.segments[segment]
    return seg.size - seg.share(shares.rank)


def grid_of(plan):
    """A grid's ``runtime.comm.grid.Grid`` (``parallel=("pipeline", "data")``: the chunks are cut over this rank's
    replica group), else None."""
    return getattr(getattr(plan, "stage", None), "grid", None)


def own_groups(grid, purpose: str):
    """This rank's replica group in the set made for ``purpose`` (runtime/comm/grid.py ``replica_groups_for``)."""
    from harmony.runtime.comm.grid import replica_groups_for
    return replica_groups_for(grid, purpose)[grid.stage]
