"""Parameters, gradients and optimizer state partitioned over data-parallel ranks (ZeRO stage 3, ZeRO-Infinity).

``shard_state="full"``: each pack's parameters, in the order and fused buffers its replicated all-reduce
uses (``Plan.comm_groups``, cut at ``DEFAULT_FUSION_BYTES`` as ``collectives.allreduce`` cuts them), form
``Segment``s; each segment is cut into ``world`` contiguous chunks of about ``n / world`` elements and rank
``r`` owns chunk ``r`` of every segment (``PackShares``, plain data in ``Residency.shares``). A rank's host
holds only its chunks (fp32) and their optimizer state; the model's parameters of such a pack hold
placeholders between uses (runtime/placeholders.py).

* ``gather(pack, 'params', held=...)`` takes the place of the pack's ``swap_in`` of its weights: an all-gather
  of every rank's chunk into a host staging buffer on the copy thread, then into fresh device copies
  (``wait`` joins it, as a swap_in's). It runs on its own process group (``Shares.group``): the copy
  thread's collectives never interleave with the host thread's.
* ``reduce_scatter(pack, world=...)`` takes the place of the pack's host all-reduce: on the host thread,
  behind the release of the pack's gradients to the host, each segment's gradients are summed over the ranks
  and this rank keeps its chunk, divided by ``world`` as the all-reduce divides; the pack's ``step`` (queued
  behind it on the same thread) steps the chunk; the whole gradients are dropped.

Numerics: the chunk's optimizer steps flat pieces of the chunk (one per run of parameters of one param group);
an element-wise optimizer (AdamW, Adam, SGD: ``harmony.optim.elementwise``) computes bitwise what it computes on
the whole parameters. The sums: gloo adds a ring's partial sums in an order that depends on where an element
sits in the buffer and on the buffer's length, so with 3 ranks or more only the replicated run's own collective
on its own buffer gives its sums bit for bit (``reduce_scatter_tensor`` of the buffer padded to a multiple of the
world differed in 2 of 16768 elements after two steps). And gloo's ``reduce_scatter_tensor`` took 2.2x its
``all_reduce`` of the same 64 MiB on 2 ranks here (0.178 s vs 0.081 s). So the reduce-scatter runs as gloo's
``all_reduce`` of the replicated run's fused buffer, this rank keeping its chunk: bitwise, faster on gloo, and
counted as the ring all-reduce it is (twice a ring reduce-scatter's bytes; NCCL's reduce-scatter would halve it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harmony.base.errors import HarmonyError
from harmony.base.units import nbytes
from harmony.runtime.collectives import DEFAULT_FUSION_BYTES, ring_bytes
from harmony.runtime.ops import moving_names, register
from harmony.runtime.ops_move import pack_what, swap_in_effect
from harmony.runtime.placeholders import is_placeholder, placeholder
from harmony.runtime.plan import NOMINAL_NETWORK_BANDWIDTH, NOMINAL_NETWORK_LATENCY

PREFIX = "share:"      # the names of a rank's chunk pieces (optimizer state and checkpoints are keyed by them)


# -- the layout: plain data, in the plan -----------------------------------------------------------
@dataclass
class Segment:
    """One fused buffer of a pack's parameters, cut into ``world`` chunks: rank r's is ``bounds[r]:bounds[r + 1]``."""

    names: list[str]
    numels: list[int]
    bounds: list[int]

    @property
    def chunk(self) -> int:
        """Elements of the largest chunk: what each rank sends in an all-gather (the others padded to it)."""
        return max(b - a for a, b in zip(self.bounds, self.bounds[1:]))

    @property
    def total(self) -> int:
        return sum(self.numels)

    def items(self):
        """(name, offset, numel) of each parameter in the buffer."""
        off = 0
        for n, k in zip(self.names, self.numels):
            yield n, off, k
            off += k

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
    """How one pack's parameters are partitioned over ``world`` ranks, and this rank's pieces."""

    world: int
    rank: int
    segments: list[Segment]
    pieces: list[Piece] = field(default_factory=list)

    def names(self) -> list[str]:
        return [n for s in self.segments for n in s.names]

    def elements(self, rank: int | None = None) -> int:
        """Elements rank ``rank`` (this one by default) owns; all of them with ``rank=-1``."""
        if rank == -1:
            return sum(s.total for s in self.segments)
        return sum(s.share(self.rank if rank is None else rank) for s in self.segments)


def layout(groups: list[list[tuple[str, int]]], world: int, rank: int, group_of: dict[str, int],
           fusion_bytes: int = DEFAULT_FUSION_BYTES) -> PackShares:
    """The segments of a pack whose all-reduce groups are ``groups`` ([(name, numel)] each), fused as
    ``collectives.allreduce`` fuses fp32 tensors, and this rank's pieces (with their param groups, ``group_of``).

    A chunk boundary falls on a multiple of ``ALIGN`` elements from the start of the parameter it cuts: torch's
    fused CPU optimizers (and other vectorised kernels) round a tensor's last ``numel % lanes`` elements apart from
    the rest, so a piece must start where the parameter's vector lanes start for its update to be the whole
    parameter's, bit for bit (cut at 13 elements, fused AdamW differed in 1784 of 200k elements after 3 steps; at
    multiples of 64, 8 or 1000, in none).
    """
    segments = []
    for group in groups:
        cur: list[tuple[str, int]] = []
        for item in group + [None]:
            if item is not None and not (cur and 4 * (sum(c for _, c in cur) + item[1]) > fusion_bytes):
                cur.append(item)
                continue
            if cur:
                segments.append(_segment([a for a, _ in cur], [c for _, c in cur], world))
            cur = [item] if item is not None else []
    shares = PackShares(world, rank, segments)
    for s, seg in enumerate(segments):
        lo, hi = seg.bounds[rank], seg.bounds[rank + 1]
        for n, off, k in seg.items():
            a, b = max(lo, off), min(hi, off + k)
            if a < b:
                shares.pieces.append(Piece(f"{PREFIX}{n}[{a - off}:{b - off}]", s, a, b, group_of[n]))
    return shares


ALIGN = 64


def _segment(names: list[str], numels: list[int], world: int) -> Segment:
    """Equal chunks, each boundary moved back to a multiple of ``ALIGN`` from the start of the parameter it cuts."""
    seg = Segment(names, numels, [])
    total, step = seg.total, -(-seg.total // world)
    bounds = [0]
    for r in range(1, world):
        b = min(total, r * step)
        for _, off, k in seg.items():
            if off <= b < off + k:
                b = off + (b - off) // ALIGN * ALIGN
                break
        bounds.append(max(b, bounds[-1]))
    seg.bounds = bounds + [total]
    return seg


# -- the live chunks -----------------------------------------------------------------------------
class Shares:
    """This rank's chunks (host fp32 tensors, the only copy of its share of the weights) and their pieces."""

    def __init__(self, plan, tensors: dict, timeout: float | None = None):
        import datetime

        import torch.distributed as dist
        self.plan = plan
        self.chunks: dict[tuple[int, int], torch.Tensor] = {}
        self.pieces: dict[int, list[torch.nn.Parameter]] = {}
        self.stats = {"gather_wire_bytes": 0, "reduce_scatter_wire_bytes": 0}
        kw = {"timeout": datetime.timedelta(seconds=timeout)} if timeout else {}
        self.group = dist.new_group(backend="gloo", **kw)   # the copy thread's all-gathers: a group of their own
        with torch.no_grad():
            for p, record in sorted(plan.residency.items()):
                if record.shares is not None:
                    self._carve(p, record.shares, tensors)

    def _carve(self, pack: int, shares: PackShares, tensors: dict) -> None:
        """Keep this rank's chunk of each segment, hand its pieces to ``tensors``, and drop the rest."""
        r = shares.rank
        for s, seg in enumerate(shares.segments):
            flat = torch.cat([tensors[n].data.reshape(-1) for n in seg.names])
            chunk = torch.zeros(seg.chunk, dtype=flat.dtype)
            chunk[: seg.share(r)] = flat[seg.bounds[r]: seg.bounds[r + 1]]
            self.chunks[(pack, s)] = chunk
        mine = self.pieces[pack] = []
        for piece in shares.pieces:
            base = shares.segments[piece.segment].bounds[r]
            t = torch.nn.Parameter(self.chunks[(pack, piece.segment)][piece.start - base: piece.end - base])
            tensors[piece.name] = t
            mine.append(t)
        for n in shares.names():
            tensors[n].data = placeholder(tensors[n])

    def gather(self, pack: int, segment: int) -> torch.Tensor:
        """One segment whole, from every rank's chunk (a collective of ``self.group``)."""
        import torch.distributed as dist
        shares = self.plan.at(pack).shares
        seg, mine = shares.segments[segment], self.chunks[(pack, segment)]
        out = torch.empty(mine.numel() * shares.world, dtype=mine.dtype)
        dist.all_gather_into_tensor(out, mine, group=self.group)
        self.stats["gather_wire_bytes"] += nbytes(mine) * (shares.world - 1)
        c = mine.numel()
        return torch.cat([out[r * c: r * c + seg.share(r)] for r in range(shares.world)])

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
                for s, seg in enumerate(record.shares.segments if record.shares is not None else ()):
                    flat = self.gather(p, s)
                    for n, off, k in seg.items():
                        tensors[n].data = flat[off: off + k].clone().view_as(tensors[n])
                        done.append(n)
        return done

    def held_bytes(self) -> int:
        """Host bytes of this rank's chunks."""
        return sum(nbytes(c) for c in self.chunks.values())


def share_params(rt, pack: int) -> list:
    """The pieces a partitioned pack's step updates (empty for another pack)."""
    shares = getattr(rt.state, "shares", None)
    return list(shares.pieces.get(pack, ())) if shares is not None else []


# -- the ops ---------------------------------------------------------------------------------------
def gather(pack: int, what: str = "params", held: tuple = ()): ...
def reduce_scatter(pack: int, *, world: int = 1): ...


def _gather_execute(rt, pack, what="params", held=()):
    """Fresh device copies of the pack's moving weights, filled from the all-gather of every rank's chunks on the
    copy thread (its buffers come in as a swap_in's do); returns the future a ``wait`` joins."""
    st, shares = rt.state, rt.plan.at(pack).shares
    names = moving_names(rt.plan.packs[pack], "params", held)
    mine = set(shares.names())
    first = st.fetch("params", [n for n in names if n not in mine])   # buffers: copied from the host
    st.settle([n for n in names if n in mine])           # this rank's host step of the pack has updated its chunk
    targets, jobs = {}, []
    for n in names:
        if n not in mine:
            continue
        st.refs[("params", n)] += 1
        if st.refs[("params", n)] > 1:
            continue
        t = st.tensors[n]
        dst = torch.empty(t.shape, dtype=t.dtype, device=st.device)
        st.meter.track(dst)
        st.moved["h2d"] += nbytes(dst)
        targets[n] = dst
        jobs.append((lambda d, n=n: st.set_data(n, d), dst, None))
    if not jobs:
        return first

    def copy():
        for s, seg in enumerate(shares.segments):
            if any(n in targets for n in seg.names):
                flat = st.shares.gather(pack, s)
                for n, off, k in seg.items():
                    if n in targets:
                        targets[n].view(-1).copy_(flat[off: off + k])
    fut = st.copier.submit(copy)
    fut.harmony_jobs = list(first.harmony_jobs if first is not None else ()) + jobs
    return fut


def _network(hw):
    return (getattr(hw, "network_bandwidth", NOMINAL_NETWORK_BANDWIDTH),
            getattr(hw, "network_latency", NOMINAL_NETWORK_LATENCY))


def _gather_cost(plan, hw, pack, what="params", held=()):
    """Every other rank's chunks of the pack's weights arrive over the network (the held ones too: the gather is
    of whole segments)."""
    shares = plan.at(pack).shares
    bandwidth, latency = _network(hw)
    received = 4 * sum(s.chunk for s in shares.segments) * (shares.world - 1)
    return "network", received / bandwidth + (shares.world - 1) * latency * len(shares.segments)


def _reduce_scatter_execute(rt, pack, *, world=1):
    """On the host thread, behind the release of the pack's gradients: this rank's chunk of their average, as the
    gradients of its pieces; the whole gradients are dropped."""
    import torch.distributed as dist
    st, shares = rt.state, rt.plan.at(pack).shares
    pieces = st.shares.pieces[pack]

    def job():
        try:
            for s, seg in enumerate(shares.segments):
                flat = torch.empty(seg.total)
                for n, off, k in seg.items():
                    g = st.grad(n)
                    if g is None:
                        raise HarmonyError(f"parameter {n} got no gradient in this step; shard_state='full' steps "
                                           f"flat chunks of every parameter of its pack: use shard_state=True for "
                                           f"a model with parameters that some steps leave unused")
                    flat[off: off + k].copy_(g.reshape(-1))
                dist.all_reduce(flat)        # the replicated run's collective on its buffer: the same sums
                base = seg.bounds[shares.rank]
                out = flat[base: base + seg.share(shares.rank)].div_(world).clone()   # averaged as it averages
                st.shares.stats["reduce_scatter_wire_bytes"] += ring_bytes(nbytes(flat), world)
                for piece, t in zip(shares.pieces, pieces):
                    if piece.segment == s:
                        t.grad = out[piece.start - base: piece.end - base]
        finally:
            for n in shares.names():
                st.set_grad(n, None)
    st.pending[("allreduce", pack)] = st.host_pool.submit(job)


def _reduce_scatter_effect(m, pack, *, world=1):
    return None, 0          # the host copies of the gradients: nothing on the device


def _reduce_scatter_cost(plan, hw, pack, *, world=1):
    """A ring all-reduce of the pack's gradients (what gloo's reduce-scatter costs too: see the module's note)."""
    shares = plan.at(pack).shares
    bandwidth, latency = _network(hw)
    sent = sum(ring_bytes(4 * s.total, world) for s in shares.segments)
    return "network", sent / bandwidth + 2 * (world - 1) * latency * len(shares.segments)


register(gather, _gather_execute, swap_in_effect, _gather_cost, "copy", colour="#fb6a4a", label=pack_what)
register(reduce_scatter, _reduce_scatter_execute, _reduce_scatter_effect, _reduce_scatter_cost, "copy",
         colour="#ef3b2c")


# -- what a step measured ----------------------------------------------------------------------------
def step_stats(sm) -> dict:
    """The partitioned state's traffic in the last step, and the host bytes of this rank's training state."""
    shares = getattr(sm.runtime.state, "shares", None)
    if shares is None:
        return {}
    out = dict(shares.stats)
    shares.stats.update(dict.fromkeys(shares.stats, 0))
    out["host_state_bytes"] = host_state_bytes(sm.runtime.state)
    return out


def host_state_bytes(state) -> int:
    """Bytes of host memory the training state holds between steps: the weights' host copies (chunks, masters)
    and the optimizers' state, each storage counted once (placeholders and device copies hold none here)."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if not isinstance(t, torch.Tensor) or state.meter.holds(t) or is_placeholder(t):
            return
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    for t in state.master.values():
        add(t)
    for opt in dict.fromkeys(state.optimizers.values()):
        for values in opt.state.values():
            for v in values.values():
                add(v)
    return total
