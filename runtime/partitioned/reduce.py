"""The ways of ``shard_state="full"``'s reduce-scatter (the op is in runtime/partitioned/), each giving every owner
its chunk bitwise as the replicated run's all-reduce leaves it there: two ranks swap the chunks of an fp32 buffer
(``swap_chunks``); more run gloo's all-reduce of it (``all_reduce_chunk``); an all-reduce group whose buffers are
quantized runs the replicated run's codec on the replicated run's buffers (``reduce_scatter_quantized``); fp16/bf16
and adaptive bits run the replicated run's own ``Communicator`` (``through_allreduce``).
"""
from __future__ import annotations

import torch

from harmony.base.errors import HarmonyError
from harmony.runtime.comm.collectives import allreduce, exchange, guarded, reduce_scatter, words_pad
from harmony.runtime.comm.communicator import communicator
from harmony.runtime.comm.compression import DEFAULT_MIN_SIZE, NO_COMPRESSION, CompressionSpec


def reduce_scatter_quantized(st, shares, call: int, grads, keep, clipper=None, weight=None,
                             group=None) -> list[int]:
    """One all-reduce group with quantized buffers: ``collectives.reduce_scatter`` of its gradients (the replicated
    run's buffers, codec and generator draws); each segment keeps this rank's chunk. Returns the segments done.

    Under ``clip_grad_norm`` the whole quantized all-reduce runs instead (its all-gather half too: the bytes the
    replicated run sends), so every rank holds each whole decoded gradient, bitwise the replicated run's, and takes
    its norm there as the fp32 path does; the chunks are then cut from those gradients. So it does where the shares
    are uneven (a balanced plan's): the chunks are not the codec's, and are cut from the whole result alike."""
    mine = [s for s, seg in enumerate(shares.segments) if seg.call == call]
    tensors, specs, where = [], [], []
    for s in mine:      # the group's tensors in its order; each with its buffer's codec
        seg = shares.segments[s]
        spec = CompressionSpec(**seg.codec) if seg.codec is not None else NO_COMPRESSION
        for i, g in enumerate(grads(seg)):
            where.append((s, i))
            tensors.append(g)
            specs.append(spec)
    # error feedback: the residuals of this group's collective, kept across steps as the replicated run keeps them
    key = tuple(n for s in mine for n in shares.segments[s].names)
    ef = st.shares.error_feedback.setdefault(key, {}) if any(sp.error_feedback for sp in specs) else None
    if clipper is not None or not all(shares.segments[s].codec_chunks for s in mine if shares.segments[s].codec):
        stats = allreduce(tensors, specs, group, timeout=st.shares.timeout, generator=st.shares.generator,
                          error_feedback_state=ef, weight=weight)
        at = 0
        for s in mine:
            seg = shares.segments[s]
            keep(s, seg, chunk_of_whole(seg, shares.rank, tensors[at: at + len(seg.names)], clipper))
            at += len(seg.names)
        st.shares.stats["reduce_scatter_wire_bytes"] += stats.wire_bytes
        return mine
    results, stats = reduce_scatter(tensors, specs, group, timeout=st.shares.timeout, generator=st.shares.generator,
                                    error_feedback_state=ef, weight=weight)
    if len(results) != len(mine):
        raise HarmonyError(f"the reduce-scatter fused {len(results)} buffers where the layout has {len(mine)}: "
                           f"the partition and the codec disagree (a bug)")
    for s, (idx, offsets, chunk, out) in zip(mine, results):
        seg = shares.segments[s]
        if [where[i] for i in idx] != [(s, i) for i in range(len(seg.names))] or offsets != seg.offsets:
            raise HarmonyError(f"the reduce-scatter's buffer {s} is not the layout's (a bug)")
        base = seg.bounds[shares.rank]
        keep(s, seg, out.clone() if chunk else out[base: base + seg.share(shares.rank)].clone())
    st.shares.stats["reduce_scatter_wire_bytes"] += stats.wire_bytes
    return mine


def replicated_communicator(rt, op, world: int, weight, comm: dict):
    """The runtime's ``Communicator`` as the replicated run's ``allreduce`` ops make it (``comm``: their codec
    keywords; its step begins at the schedule's first ``op``, the reduce-scatter)."""
    spec = dict(comm)
    kind, min_size, warmup = spec.pop("kind"), spec.pop("min_size", DEFAULT_MIN_SIZE), spec.pop("warmup", 0)
    return communicator(rt, op, kind, world, min_size, warmup, spec, weight)


def through_allreduce(rt, pack: int, communicator, grads, keep, clipper) -> None:
    """The pack's gradients averaged in place by the replicated run's all-reduce (fp16/bf16, or adaptive bits: the
    warm-up's fp32 sends, then the chosen bits), bitwise its result; this rank keeps its chunk of each segment, and
    under clipping each gradient's norm (``GradClip.known``)."""
    st, shares = rt.state, rt.plan.at(pack).shares
    before = communicator.totals.get("wire_bytes", 0)     # the host thread's: nothing else adds to it meanwhile
    communicator.reduce(rt, pack, meet=False)     # (the reduce-scatter met already)
    st.shares.stats["reduce_scatter_wire_bytes"] += communicator.totals.get("wire_bytes", 0) - before
    for s, seg in enumerate(shares.segments):
        keep(s, seg, chunk_of_whole(seg, shares.rank, grads(seg), clipper))


def chunk_of_whole(seg, rank: int, got: list[torch.Tensor], clipper=None) -> torch.Tensor:
    """Rank ``rank``'s chunk of segment ``seg`` cut from its whole averaged gradients ``got`` (the segment's
    parameters in order), piece by piece; under clipping each gradient's own norm, taken from the whole
    (``clipper.known``)."""
    if clipper is not None:
        clipper.known.update(zip(seg.names, torch._foreach_norm(got, clipper.norm_type)))
    lo = seg.bounds[rank]
    chunk = torch.zeros(seg.share(rank))      # a quantized buffer's chunk has gaps between its pieces: zeros
    whole = dict(zip(seg.names, got))
    for n, off, a, b in seg.overlaps(rank):
        chunk[a - lo: b - lo].copy_(whole[n].reshape(-1)[a - off: b - off])
    return chunk


def all_reduce_chunk(flat: torch.Tensor, seg, rank: int, world: int, clipper, shapes: dict,
                     group=None, padded: bool = False, words=None) -> torch.Tensor:
    """This rank's chunk of the average from gloo's all-reduce of the whole buffer: the replicated run's collective on
    its buffer, so the same sums. Under clipping every rank has the whole average here, and takes each gradient's
    own norm from it (``clipper.known``). ``group``: the ranks sharing the chunks (a grid's replica group).
    ``padded``: the buffer is one the replicated run's step words ride at the end of (collectives.py ``allreduce``'s
    ``words``): padded alike, so gloo's ring cuts it where that run's does; ``words``: the ranks' words on the step
    ride in that pad, as they do there (the first buffer that has one)."""
    import torch.distributed as dist
    n = flat.numel()
    carries = padded and words is not None and words.got is None
    if padded:
        flat = torch.cat([flat, torch.zeros(words_pad(world))])
    if carries:
        flat[n: n + world].copy_(words.vector(world, rank))
    guarded("the reduce-scatter of gradients (shard_state='full')", dist.all_reduce, flat, group=group)
    if carries:
        words.read(flat[n: n + world])
    base, end = seg.bounds[rank], seg.bounds[rank + 1]
    if clipper is None:
        return flat[base: end].div_(world).clone()       # averaged as the all-reduce averages
    flat.div_(world)
    views = [flat[off: off + k].view(shapes[n]) for n, off, k in seg.items()]
    clipper.known.update(zip(seg.names, torch._foreach_norm(views, clipper.norm_type)))
    return flat[base: end].clone()


def swap_chunks(flat: torch.Tensor, seg, rank: int, words=None, group=None) -> torch.Tensor:
    """Two ranks' reduce-scatter of an fp32 buffer: this rank's chunk of the sum, the peer's part sent to it and its
    part of this one received (``Segment.pairwise``); ``words``: the ranks' words on the step go with it
    (runtime/partitioned/meet.py). ``rank``: this rank's place in ``group`` (a grid's replica group; by default
    the job's)."""
    import torch.distributed as dist
    peer = 1 - rank if group is None else dist.get_global_rank(group, 1 - rank)
    mine = flat[seg.bounds[rank]: seg.bounds[rank + 1]].clone()
    got = torch.empty_like(mine)
    exchange("the reduce-scatter of gradients (shard_state='full')",
             (words.ops(2, rank) if words is not None else [])
             + [dist.P2POp(dist.isend, flat[seg.bounds[1 - rank]: seg.bounds[2 - rank]], peer, group),
                dist.P2POp(dist.irecv, got, peer, group)], group=group, peer=peer)
    return mine.add_(got)
