"""The layout of ``shard_state="full"``: how each pack's parameters are cut into chunks over the ranks (plain data,
in the plan's ``Residency.shares``); runtime/partitioned/ has the live chunks and the ops that move them."""
from __future__ import annotations

from dataclasses import dataclass, field

from harmony.runtime.comm.collectives import DEFAULT_FUSION_BYTES, fuse, ring_bytes
from harmony.runtime.comm.compression import NO_COMPRESSION, wire_bytes

PREFIX = "share:"      # the names of a rank's chunk pieces (optimizer state and checkpoints are keyed by them)


# -- the layout: plain data, in the plan -----------------------------------------------------------
@dataclass
class Segment:
    """One fused buffer of a pack's parameters, cut into ``world`` chunks: rank r's is ``bounds[r]:bounds[r + 1]``.

    ``offsets``: where each parameter starts in the buffer (packed, or on bucket boundaries in a quantized one);
    ``codec``: the quantized buffer's ``CompressionSpec`` fields (None: fp32); ``call``: which of the pack's
    all-reduce groups it belongs to (one ``collectives`` call each); ``sent``: the bytes this rank sends to
    reduce-scatter it; ``codec_chunks``: a quantized buffer's chunks are the codec's own (equal shares), so its
    reduce-scatter is the codec's; uneven ones are cut from the whole quantized all-reduce; ``pairwise``: two
    ranks reduce-scatter this fp32 buffer by swapping chunks (runtime/partitioned/), sending the other rank its
    chunk alone."""

    names: list[str]
    numels: list[int]
    bounds: list[int]
    offsets: list[int] = field(default_factory=list)
    codec: dict | None = None
    call: int = 0
    sent: int = 0
    codec_chunks: bool = False
    pairwise: bool = False

    @property
    def total(self) -> int:
        return sum(self.numels)

    @property
    def size(self) -> int:
        """Elements of the buffer, padding included."""
        return self.bounds[-1]

    def items(self):
        """(name, offset, numel) of each parameter in the buffer."""
        yield from zip(self.names, self.offsets, self.numels)

    def overlaps(self, rank: int):
        """(name, offset, a, b) of each parameter that rank ``rank``'s chunk holds a piece of: elements ``a:b`` of
        the buffer (``a - offset : b - offset`` of the parameter), in the buffer's order."""
        lo, hi = self.bounds[rank], self.bounds[rank + 1]
        for n, off, k in self.items():
            a, b = max(lo, off), min(hi, off + k)
            if a < b:
                yield n, off, a, b

    def share(self, rank: int) -> int:
        """Elements of rank ``rank``'s chunk."""
        return self.bounds[rank + 1] - self.bounds[rank]


@dataclass
class Piece:
    """One parameter's part of a rank's chunk: one tensor its optimizer steps."""

    name: str
    segment: int
    start: int          # in the segment's elements
    end: int
    group: int


@dataclass
class PackShares:
    """How one pack's parameters are partitioned over ``world`` ranks, and this rank's pieces.

    ``allreduce``: the gradients are averaged by the replicated run's own all-reduce (its ``Communicator``: fp16 or
    bf16 compression, adaptive bits), each rank then keeping its chunks; the segments are cut as fp32 buffers, since
    the codec's buffers change when adaptive bits are chosen, and the chunks must not.

    ``padded``: the replicated run's words on a step ride at the end of the first buffer of each all-reduce call
    (no compression: runtime/comm/communicator.py ``Communicator.rides``), so this run's all-reduces of those buffers
    are padded alike (gloo's ring cuts a buffer by its length: over three ranks or more another length sums an
    element in another order). Not under compression, even where a pack's buffers are all fp32 (small tensors):
    the replicated run's words meet apart there, and its buffers go unpadded."""

    world: int
    rank: int
    segments: list[Segment]
    pieces: list[Piece] = field(default_factory=list)
    allreduce: bool = False
    padded: bool = False

    def names(self) -> list[str]:
        return [n for s in self.segments for n in s.names]

    def elements(self, rank: int | None = None) -> int:
        """Elements rank ``rank`` (this one by default) owns; all of them with ``rank=-1``."""
        if rank == -1:
            return sum(s.total for s in self.segments)
        return sum(s.share(self.rank if rank is None else rank) for s in self.segments)


def layout(groups: list[list[tuple[str, int]]], world: int, rank: int, group_of: dict[str, int],
           fusion_bytes: int = DEFAULT_FUSION_BYTES, specs: dict | None = None,
           fractions: list[float] | None = None, pairwise: bool = True) -> PackShares:
    """The segments of a pack whose all-reduce groups are ``groups`` ([(name, numel)] each), fused as
    ``collectives.allreduce`` fuses them (``specs``: each name's ``CompressionSpec`` as ``spec_for`` settles it;
    fp32 without), and this rank's pieces (with their param groups, ``group_of``).

    ``fractions``: each rank's share of every buffer (a balanced plan's state shares, summing to 1); None or equal
    ones: equal chunks. An fp32 buffer is cut there, each boundary on a multiple of ``ALIGN`` elements from the
    start of the parameter it cuts: torch's fused CPU optimizers (and other vectorised kernels) round a tensor's last
    ``numel % lanes`` elements apart from the rest, so a piece must start where the parameter's vector lanes start
    for its update to be the whole parameter's, bit for bit (cut at 13 elements, fused AdamW differed in 1784 of
    200k elements after 3 steps; at multiples of 64, 8 or 1000, in none). A quantized buffer's parameters start on
    bucket boundaries; with equal shares rank r owns the codec's chunk r, whose sum it reduces and quantizes in the
    all-reduce too, so the partition's chunk is bitwise the replicated run's. Uneven shares cut it as an fp32
    buffer is cut, and each rank takes its chunk from the whole quantized all-reduce (both halves: the replicated
    run's bytes and sums).

    ``pairwise`` (unless the rank needs whole gradients, as clipping does): on two ranks the fp32 buffers of an
    all-reduce group without quantized ones are reduce-scattered by a swap of chunks, half the ring all-reduce's
    bytes; a sum of two is the same either way round, so bitwise the all-reduce's.
    """
    segments = []
    for call, group in enumerate(groups):
        sizes = [_Numel(k) for _, k in group]
        codec = [(specs or {}).get(n, NO_COMPRESSION) for n, _ in group]
        for spec, idx in fuse(sizes, codec, fusion_bytes):
            names, numels = [group[i][0] for i in idx], [group[i][1] for i in idx]
            seg = (_quantized(names, numels, world, spec, fractions) if spec.kind == "quantized" else
                   _segment(names, numels, world, fractions))
            seg.call = call
            segments.append(seg)
        if pairwise and world == 2 and not any(s.codec for s in segments if s.call == call):
            for seg in (s for s in segments if s.call == call):
                seg.pairwise, seg.sent = True, 4 * seg.share(1 - rank)
    shares = PackShares(world, rank, segments)
    for s, seg in enumerate(segments):
        for n, off, a, b in seg.overlaps(rank):
            shares.pieces.append(Piece(f"{PREFIX}{n}[{a - off}:{b - off}]", s, a, b, group_of[n]))
    return shares


class _Numel:
    """A stand-in with a tensor's ``numel`` for ``collectives.fuse``."""

    def __init__(self, n: int):
        self.n = n

    def numel(self) -> int:
        return self.n


ALIGN = 64


def uneven(fractions: list[float] | None) -> bool:
    """Whether ``fractions`` asks for anything but equal shares."""
    return fractions is not None and max(fractions) - min(fractions) > 1e-9


def _cut(seg: Segment, size: int, world: int, fractions: list[float] | None) -> list[int]:
    """Boundaries of ``world`` chunks of ``size`` elements (equal, or at the cumulative ``fractions``), each moved
    back to a multiple of ``ALIGN`` from the start of the parameter it cuts."""
    step, acc, bounds = -(-size // world), 0.0, [0]
    for r in range(1, world):
        if uneven(fractions):
            acc += fractions[r - 1]
            b = min(size, round(acc * size))
        else:
            b = min(size, r * step)
        for _, off, k in seg.items():
            if off <= b < off + k:
                b = off + (b - off) // ALIGN * ALIGN
                break
        bounds.append(max(b, bounds[-1]))
    return bounds + [size]


def _segment(names: list[str], numels: list[int], world: int, fractions: list[float] | None = None) -> Segment:
    """Chunks in the shares (equal by default) of the packed buffer, each boundary moved back to a multiple of
    ``ALIGN`` from the start of the parameter it cuts."""
    seg = Segment(names, numels, [], [sum(numels[:i]) for i in range(len(numels))])
    seg.bounds = _cut(seg, seg.total, world, fractions)
    seg.sent = ring_bytes(4 * seg.total, world)       # gloo's all-reduce of the buffer (the module's note)
    return seg


def _quantized(names: list[str], numels: list[int], world: int, spec, fractions: list[float] | None = None) -> Segment:
    """The codec's buffer (``collectives._Job.launch``): each parameter from a bucket boundary, ``world`` chunks
    of whole buckets, what the reduce-scatter sends every other rank quantized; uneven ``fractions``: chunks cut
    as an fp32 buffer's, taken from the whole all-reduce (twice those bytes)."""
    align, offsets, off = spec.bucket_size, [], 0
    for k in numels:
        offsets.append(off)
        off += -(-k // align) * align
    chunk = -(-off // (world * align)) * align if off >= world * align else -(-off // world)
    codec = dict(kind=spec.kind, bits=spec.bits, bucket_size=spec.bucket_size, rounding=spec.rounding,
                 error_feedback=spec.error_feedback, meta=spec.meta)
    sent = (world - 1) * wire_bytes(chunk, spec.bits, spec.bucket_size, spec.meta_dtype)
    seg = Segment(names, numels, [r * chunk for r in range(world + 1)], offsets, codec, sent=sent, codec_chunks=True)
    if uneven(fractions):
        seg.bounds, seg.sent, seg.codec_chunks = _cut(seg, off, world, fractions), 2 * sent, False
    return seg
