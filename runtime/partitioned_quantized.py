"""``shard_state="full"``'s reduce-scatter of an all-reduce group whose buffers are quantized (runtime/partitioned.py
runs the fp32 ones itself): the replicated run's codec on the replicated run's buffers, so that each owner's chunk is
bitwise what the replicated run's all-reduce leaves there.
"""
from __future__ import annotations

import torch

from harmony.base.errors import HarmonyError


def reduce_scatter_quantized(st, shares, call: int, grads, keep, clipper=None, weight=None) -> list[int]:
    """One all-reduce group with quantized buffers: ``collectives.reduce_scatter`` of its gradients (the replicated
    run's buffers, codec and generator draws); each segment keeps this rank's chunk. Returns the segments done.

    Under ``clip_grad_norm`` the whole quantized all-reduce runs instead (its all-gather half too: the bytes the
    replicated run sends), so every rank holds each whole decoded gradient, bitwise the replicated run's, and takes
    its norm there as the fp32 path does; the chunks are then cut from those gradients. So it does where the shares
    are uneven (a balanced plan's): the chunks are not the codec's, and are cut from the whole result alike."""
    from harmony.runtime.collectives import allreduce, reduce_scatter
    from harmony.runtime.compression import NO_COMPRESSION, CompressionSpec
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
        stats = allreduce(tensors, specs, timeout=st.shares.timeout, generator=st.shares.generator,
                          error_feedback_state=ef, weight=weight)
        at = 0
        for s in mine:
            seg = shares.segments[s]
            got = tensors[at: at + len(seg.names)]
            at += len(seg.names)
            if clipper is not None:
                clipper.known.update(zip(seg.names, torch._foreach_norm(got, clipper.norm_type)))
            flat = torch.zeros(seg.size)       # the segment's layout (no piece covers its padding)
            for (_, off, k), g in zip(seg.items(), got):
                flat[off: off + k].copy_(g.reshape(-1))
            base = seg.bounds[shares.rank]
            keep(s, seg, flat[base: base + seg.share(shares.rank)].clone())
        st.shares.stats["reduce_scatter_wire_bytes"] += stats.wire_bytes
        return mine
    results, stats = reduce_scatter(tensors, specs, timeout=st.shares.timeout, generator=st.shares.generator,
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
