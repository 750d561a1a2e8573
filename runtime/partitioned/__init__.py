"""Parameters, gradients and optimizer state partitioned over data-parallel ranks (ZeRO stage 3, ZeRO-Infinity).

``shard_state="full"``: each pack's parameters, in the order and fused buffers its replicated all-reduce
uses (``Plan.comm_groups``, cut at ``DEFAULT_FUSION_BYTES`` as ``collectives.allreduce`` cuts them), form
``Segment``s; each segment is cut into ``world`` contiguous chunks of about ``n / world`` elements (or, under
``balance``, of the plan's state shares) and rank ``r`` owns chunk ``r`` of every
segment (``PackShares``, plain data in ``Residency.shares``). A rank's host
holds only its chunks (fp32) and their optimizer state; the model's parameters of such a pack hold
placeholders between uses (runtime/placeholders.py). The layout is plain data (runtime/partitioned/layout.py); where
the offload pass puts a pack's share on disk, its chunks live in a file between uses (runtime/partitioned/disk.py).

* ``gather(pack, 'params', held=...)`` takes the place of the pack's ``swap_in`` of its weights: an all-gather
  of every rank's chunk (point-to-point sends to every peer: ``Shares.gather``) into a host staging buffer on the
  copy thread (runtime/partitioned/staging.py: allocated once, reused), then into fresh device copies
  (``wait`` joins it, as a swap_in's). It runs on its own process group (``Shares.group``): the copy
  thread's collectives never interleave with the host thread's. On a GPU the chunks and the staging buffers are
  pinned, the collective runs on the copy thread all the same (``CopyEngine.submit_host``: the thread issuing ops
  goes on), its copies to the device are queued on the copy stream behind an event, and the ``wait`` makes the
  compute stream wait for that event.
* ``reduce_scatter(pack, world=...)`` takes the place of the pack's host all-reduce: on the host thread, behind the
  release of the pack's gradients to the host (on a GPU: their copies out on the copy-out stream, whose event the
  host thread waits for before its collective, runtime/tiers/state.py ``HostPool``), each segment's gradients are
  summed over the ranks and this rank keeps its chunk, divided by ``world`` as the all-reduce divides; the pack's
  ``step`` (queued behind it on the same thread) steps the chunk; the whole gradients are dropped. Under
  ``clip_grad_norm`` it also takes each parameter's gradient norm from the whole averaged buffer it holds for that
  moment (``GradClip.known``): the per-tensor norms of every parameter, computed by the kernel ``get_total_norm``
  uses on values bitwise the replicated run's, so the global norm (the norm of those, in ``model.parameters()``
  order) and the clipped chunks are the replicated clipped run's bit for bit, for every norm type, on every rank,
  with no extra collective: the cost is one pass over each buffer (the division of all of it, not only the chunk,
  and the norms), what the replicated run spends too.

With ``compression`` (the quantized codec) a pack's buffers are fused and cut as ``collectives.allreduce`` fuses
and cuts them (``layout``: the small and 1-d tensors in an fp32 buffer, the others in quantized buffers whose
chunks are the codec's), and the reduce-scatter of an all-reduce group with a quantized buffer is
``collectives.reduce_scatter``: the all-reduce's scatter-reduce (each owner sums its chunk from every peer's
quantized copy and quantizes the sum once, drawing from a generator seeded as the replicated run's
``Communicator``'s) without the all-gather; the owner decodes its own chunk from those bytes, which is what the
replicated run decodes there, bit for bit.

Numerics: the chunk's optimizer steps flat pieces of the chunk (one per run of parameters of one param group);
an element-wise optimizer (AdamW, Adam, SGD: ``harmony.runtime.optim.elementwise``) computes bitwise what it computes on
the whole parameters. The sums: gloo adds a ring's partial sums in an order that depends on where an element
sits in the buffer and on the buffer's length, so with 3 ranks or more only the replicated run's own collective
on its own buffer gives its sums bit for bit (``reduce_scatter_tensor`` of the buffer padded to a multiple of the
world differed in 2 of 16768 elements after two steps). And gloo's ``reduce_scatter_tensor`` took 2.2x its
``all_reduce`` of the same 64 MiB on 2 ranks here (0.178 s vs 0.081 s). So the reduce-scatter runs as gloo's
``all_reduce`` of the replicated run's fused buffer, this rank keeping its chunk: bitwise, faster on gloo, and
counted as the ring all-reduce it is (twice a ring reduce-scatter's bytes; NCCL's reduce-scatter would halve it).
"""
from __future__ import annotations

import torch

from harmony.base.errors import HarmonyError
from harmony.base.units import nbytes
from harmony.runtime.comm.jobwide import STEP_KEY
from harmony.runtime.ops import moving_names, register
from harmony.runtime.ops.move import gather_disk_io, pack_what, swap_in_effect
from harmony.runtime.partitioned.layout import ALIGN, PREFIX, PackShares, Piece, Segment, layout  # noqa: F401
from harmony.runtime.partitioned.meet import GATHERS, Words, apart, pads, rides, scope
from harmony.runtime.partitioned.reduce import (
    all_reduce_chunk,
    reduce_scatter_quantized,
    replicated_communicator,
    swap_chunks,
    through_allreduce,
)
from harmony.runtime.partitioned.shares import DIRECT_BYTES, Shares, received, share_params  # noqa: F401
from harmony.runtime.placeholders import is_placeholder
from harmony.runtime.plan import NOMINAL_NETWORK_BANDWIDTH, NOMINAL_NETWORK_LATENCY


# -- the ops ---------------------------------------------------------------------------------------
def gather(pack: int, what: str = "params", held: tuple = (), carried: bool = False, reads: str | None = None): ...
def reduce_scatter(pack: int, *, world: int = 1, weight: float | None = None, comm: dict | None = None): ...


def _gather_execute(rt, pack, what="params", held=(), carried=False, reads=None):
    """Fresh device copies of the pack's moving weights, filled from the all-gather of every rank's chunks on the
    copy thread (its buffers come in as a swap_in's do); returns the future a ``wait`` joins. A weight another pack
    partitions (a tied embedding read by the head's pack) is gathered from that pack's chunks.

    ``carried``: the copies the pack's last step refilled are taken instead, where every rank has them
    (runtime/partitioned/carry.py). ``reads``: such a gather is the last before the pack's step, whose read of
    its file starts here ("state": its optimizer state alone, the chunks coming from the copy; "file": all of it)."""
    st, plan = rt.state, rt.plan
    status = rt.status if rt.status is not None and rt.status.active else None
    names = moving_names(plan.packs[pack], "params", held)
    carry = st.shares.carry
    if carried and carry is not None:
        own = set(plan.at(pack).shares.names())
        if carry.take(st, pack, [n for n in names if n in own], status):
            st.shares.stats["carried_gathers"] += 1
            if st.shares.tier is not None and not st.shares.in_memory(pack):
                st.shares.tier.count_gather(pack, rt.graph)
            names = [n for n in names if n not in own]
            if not names:
                return None
    home = homes(plan)
    parts = gathered(plan, pack, held, home)
    first = st.fetch("params", [n for n in names if n not in home])   # buffers: copied from the host
    st.settle([n for n in names if n in home])       # this rank's host steps have updated the chunks
    targets, wanted, jobs = {}, {}, []
    for n in names:
        if n not in home:
            continue
        st.refs[("params", n)] += 1
        t = st.tensors[n]   # (mixed precision: the device copy in the compute dtype, as a swap_in casts it)
        dst = wanted[n] = torch.empty(t.shape, dtype=st.compute_dtype or t.dtype, device=st.device)
        if st.refs[("params", n)] > 1:    # held already: received all the same (every rank's gathers alike)
            continue
        st.meter.track(dst)
        st.moved["h2d"] += nbytes(dst)
        targets[n] = dst
        jobs.append((lambda d, n=n: st.set_data(n, d), dst, None))
    if not wanted:
        return first
    if status is not None:     # counted: a rank whose step fails replays the gathers it has not made (meet.py)
        status.done[GATHERS] += 1

    def copy():     # on the copy thread: gloo on host tensors, then (a GPU) the copies on the copy stream
        exchange_parts(rt, pack, parts, wanted)
    fut = st.copier.submit_host(copy)
    fut.harmony_jobs = list(first.harmony_jobs if first is not None else ()) + jobs
    return fut


def exchange_parts(rt, pack: int, parts, wanted: dict, words=None) -> None:
    """The segments of ``parts`` that hold a weight of ``wanted`` (name -> its whole copy), gathered into it, the
    first exchange carrying ``words``: what a gather sends and receives, the same on every rank."""
    st, plan = rt.state, rt.plan
    for q in dict.fromkeys(q for q, _ in parts):
        segments = plan.at(q).shares.segments
        if not any(n in wanted for seg in segments for n in seg.names):
            continue
        # the pack's own chunks count toward its step's read ahead (runtime/partitioned/disk.py); another's not
        chunks = st.shares.load(q, rt.graph if q == pack else None)
        for s, seg in enumerate(segments):
            if any(n in wanted for n in seg.names):
                st.shares.gather_into(q, s, chunks[s], {n: wanted[n].view(-1) for n in seg.names if n in wanted},
                                      words=words)


def homes(plan) -> dict[str, int]:
    """Each partitioned weight's pack: the one whose chunks hold it."""
    return {n: p for p, r in plan.residency.items() if r.shares is not None for n in r.shares.names()}


def _network(hw):
    return (getattr(hw, "network_bandwidth", NOMINAL_NETWORK_BANDWIDTH),
            getattr(hw, "network_latency", NOMINAL_NETWORK_LATENCY))


def gathered(plan, pack: int, held=(), home: dict | None = None) -> list[tuple[int, int]]:
    """(pack, segment) of the segments a ``gather`` of the pack brings: those with a weight it moves, its own first,
    then other packs' holding weights it reads (whole segments: a held weight in one comes too; a segment of held
    weights only, the small tensors' fp32 buffer beside quantized ones, not). ``home``: ``homes(plan)``."""
    moving = set(moving_names(plan.packs[pack], "params", held))
    home = homes(plan) if home is None else home
    owners = [pack] if plan.at(pack).shares is not None else []
    owners += sorted({home[n] for n in moving if n in home} - {pack})
    return [(q, s) for q in owners for s, seg in enumerate(plan.at(q).shares.segments)
            if moving.intersection(seg.names)]


def gather_bytes(plan, pack: int, held=()) -> int:
    """Bytes a rank receives in one ``gather``: every other rank's chunks of those segments."""
    return _received(plan, gathered(plan, pack, held))[0]


def _received(plan, parts) -> tuple[int, int]:
    """(bytes received, world) of a gather of ``parts``."""
    world = plan.at(parts[0][0]).shares.world if parts else 1
    return 4 * sum(received(plan.at(q).shares, s) for q, s in parts), world


def _gather_effect(m, pack, what="params", held=(), carried=False, reads=None):
    return swap_in_effect(m, pack, what, held, carried)


def _gather_cost(plan, hw, pack, what="params", held=(), carried=False, reads=None):
    """Every other rank's chunks of the pack's weights arrive over the network (``carried``: at the end of the
    pack's last step, on the host thread; counted here, where they would have come)."""
    parts = gathered(plan, pack, held)
    received, world = _received(plan, parts)
    bandwidth, latency = _network(hw)
    return "network", received / bandwidth + (world - 1) * latency * len(parts)


def _reduce_scatter_execute(rt, pack, *, world=1, weight=None, comm=None):
    """On the host thread, behind the release of the pack's gradients: this rank's chunk of their average (a
    balanced rank's gradients weighted by ``weight`` first, as the replicated all-reduce weighs them), as the
    gradients of its pieces; the whole gradients are dropped. ``comm``: the replicated run's all-reduce (its codec
    keywords) averages them, and the chunks are cut from its result (``PackShares.allreduce``)."""
    st, shares = rt.state, rt.plan.at(pack).shares
    pieces = st.shares.pieces[pack]
    clipper = rt.gate.clipper if rt.gate is not None else None
    scale = 1.0 if weight is None else float(weight) * world

    def grads(seg):
        out = []
        for n in seg.names:
            g = st.grad(n)
            if g is None:
                raise HarmonyError(f"parameter {n} got no gradient in this step; shard_state='full' steps flat "
                                   f"chunks of every parameter of its pack: use shard_state=True for a model with "
                                   f"parameters that some steps leave unused")
            out.append(g)
        return out

    def keep(s, seg, out):
        base = seg.bounds[shares.rank]
        for piece, t in zip(shares.pieces, pieces):
            if piece.segment == s:
                t.grad = out[piece.start - base: piece.end - base]

    communicator = replicated_communicator(rt, reduce_scatter, world, weight, comm) if comm is not None else None
    status, (key, group) = rt.status, scope(rt)      # a grid's: over this rank's replica group

    def job():
        words = beside = None
        try:
            if status is not None and rides(shares, comm, rt.plan):   # the words ride a swap or a pad, or beside
                words = Words(status, STEP_KEY, None)
                beside = apart(shares)
                if beside:
                    words.launch(world, shares.rank, status.timeout)
            elif status is not None:    # every rank's step got here (runtime/comm/jobwide.py)
                status.go(key, group, f"the reduce-scatter of pack {pack}'s gradients")
            if communicator is not None:
                through_allreduce(rt, pack, communicator, grads, keep, clipper)
                return
            done = set()
            for s, seg in enumerate(shares.segments):
                if s in done:
                    continue
                if any(g.codec is not None for g in shares.segments if g.call == seg.call):
                    done.update(reduce_scatter_quantized(st, shares, seg.call, grads, keep, clipper, weight, group))
                    continue
                flat = torch.empty(seg.size)
                shapes = {}
                for (n, off, k), g in zip(seg.items(), grads(seg)):
                    flat[off: off + k].copy_(g.reshape(-1))
                    shapes[n] = g.shape
                if scale != 1.0:             # collectives.allreduce's weighting, on the same values
                    flat.mul_(scale)
                if seg.pairwise:             # two ranks: each sends the other its chunk, x + y is y + x bitwise
                    out = swap_chunks(flat, seg, shares.rank, None if beside else words, group).div_(world)
                else:      # the first buffer of a call: padded where the replicated run's words ride on it
                    pad, ride = words is not None and pads(shares, s), None if beside else words
                    out = all_reduce_chunk(flat, seg, shares.rank, world, clipper, shapes, group, pad, ride)
                st.shares.stats["reduce_scatter_wire_bytes"] += seg.sent
                keep(s, seg, out)
            if words is not None:
                if beside:
                    words.join(status.timeout)
                words.settle(raises=True)
        finally:
            for n in shares.names():
                st.set_grad(n, None)
    st.pending[("allreduce", pack)] = st.host_pool.submit(job)


def _reduce_scatter_effect(m, pack, *, world=1, weight=None, comm=None):
    return None, 0          # the host copies of the gradients: nothing on the device


def _reduce_scatter_cost(plan, hw, pack, *, world=1, weight=None, comm=None):
    """A ring all-reduce of the pack's gradients (what gloo's reduce-scatter costs too: see the module's note); a
    two-rank swap of chunks, or the codec's scatter-reduce, as ``Segment.sent`` counts them."""
    shares = plan.at(pack).shares
    bandwidth, latency = _network(hw)
    sent = sum(s.sent for s in shares.segments)
    return "network", sent / bandwidth + 2 * (world - 1) * latency * len(shares.segments)


register(gather, _gather_execute, _gather_effect, _gather_cost, "copy", colour="#fb6a4a", label=pack_what,
         disk_io=gather_disk_io, disk_read_ahead=True, fetches=True, copy_thread=True, partitioned=True)
register(reduce_scatter, _reduce_scatter_execute, _reduce_scatter_effect, _reduce_scatter_cost, "copy",
         colour="#ef3b2c", reduces=True, partitioned=True)


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
