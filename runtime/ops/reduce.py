"""The data-parallel op: ``allreduce`` of a pack's gradients over the ranks (inserted by the compress pass),
registered in the op table (runtime/ops/) with all it needs.
"""
from __future__ import annotations

import torch

from harmony.base.tiers import Tier
from harmony.runtime.comm.collectives import allreduce as reduce_all
from harmony.runtime.comm.communicator import comm_groups, communicator, existing, scope
from harmony.runtime.comm.compression import DEFAULT_MIN_SIZE, NO_COMPRESSION
from harmony.runtime.comm.jobwide import STEP_KEY, Words, ghost
from harmony.runtime.ops import Predicted, allreduce, register
from harmony.runtime.plan import NOMINAL_NETWORK_BANDWIDTH, NOMINAL_NETWORK_LATENCY
from harmony.runtime.tiers.memory import CountAllocations


def _allreduce_execute(rt, pack, kind="none", *, world=1, where=Tier.DEVICE, sync=False, min_size=DEFAULT_MIN_SIZE,
                       warmup=0, weight=None, **spec):
    """Average the pack's gradients over ranks.

    ``where="host"``: the gradients were released to the host; average the host copies on the host
    thread, ahead of the host step queued behind it (its future joins the step's drain).
    Otherwise the gradients are on the device: average them on the host thread, counted on the
    device meter, and return a future a ``wait`` joins (``sync``: join it here). The ondemand
    runtime reduces on the main thread, where it moves state as ops touch it. ``weight``: this rank's
    share of the global batch (ranks of a balanced plan train on different numbers of samples).
    """
    from concurrent.futures import Future

    comm = communicator(rt, allreduce, kind, world, min_size, warmup, spec, weight)
    if rt.on_demand is not None:
        with rt.counting():
            comm.reduce(rt, pack)
        fut = Future()
        fut.set_result(None)
    elif where == Tier.HOST:
        def job():
            try:
                comm.reduce(rt, pack)
            except BaseException:       # the host step behind it must not apply un-averaged gradients
                for n in rt.plan.packs[pack].owned:
                    rt.state.tensors[n].grad = None
                raise
        rt.state.pending[("allreduce", pack)] = rt.state.host_pool.submit(job)
        return None
    else:
        def job():
            with CountAllocations(rt.meter):
                comm.reduce(rt, pack)
        fut = rt.state.host_pool.submit(job)
        if sync:
            fut.result()
    fut.harmony_jobs = ()            # what ``TieredState.wait`` expects of a copy's future
    return fut


def comm_buffer_bytes(grad_bytes: int, kind: str, world: int, bits: int = 4, error_feedback: bool = False) -> int:
    """Device bytes an all-reduce of ``grad_bytes`` of fp32 gradients allocates at its peak.

    The fused fp32 buffer (1x); fp16/bf16 add the half copy and the fp32 result (2.5x in all);
    quantized adds the quantizer's temporaries, the packed chunks sent and received, and the
    decoded chunk, per rank's share of the buffer: 1.3x + (2.3 + 0.15 bits) / world, fitted to
    measurements on 2 and 3 ranks at 1 to 8 bits (2.0x to 3.0x) with 3% to spare. Error feedback
    adds a residual buffer (1x). An fp32 buffer over several ranks carries the ranks' words on the step at its end
    (``words_pad``, and the words themselves before they are copied in: runtime/comm/collectives.py).
    """
    if kind == "none":
        from harmony.runtime.comm.collectives import words_pad
        words = 4 * (words_pad(world) + world) if world > 1 else 0
        return int(grad_bytes * (1.0 + (1.0 if error_feedback else 0.0))) + words
    elif kind in ("fp16", "bf16"):
        factor = 2.5
    else:
        factor = 1.3 + (2.3 + 0.15 * bits) / max(world, 1)
    return int(grad_bytes * (factor + (1.0 if error_feedback else 0.0)))


def _allreduce_effect(m, pack, kind="none", *, world=1, where=Tier.DEVICE, sync=False, bits=4, error_feedback=False,
                      **kw):
    if where == Tier.HOST:          # the host copies: nothing on the device
        return None, 0
    grads = sum(m.sizes.get(("grads", n), 0) for n in m.plan.packs[pack].owned)
    held = comm_buffer_bytes(grads, kind, world, bits, error_feedback)
    if sync:
        return None, held
    return Predicted(held), 0       # in flight until the ``wait`` that joins it


def _allreduce_cost(plan, hw, pack, kind="none", *, world=1, bits=4, **kw):
    """Ring all-reduce bytes (fp32, half) or scatter-reduce + all-gather of packed levels, at network speed.

    The pack's parameter bytes stand for its owned gradients (equal unless a weight is shared).
    """
    size = plan.packs[pack].param_bytes
    per_byte = {"none": 1.0, "fp16": 0.5, "bf16": 0.5}.get(kind, bits / 32 + 2 * 4 / 512 / 4)
    sent = 2 * (world - 1) / max(world, 1) * size * per_byte
    bandwidth = getattr(hw, "network_bandwidth", NOMINAL_NETWORK_BANDWIDTH)
    return "network", sent / bandwidth + 2 * (world - 1) * getattr(hw, "network_latency", NOMINAL_NETWORK_LATENCY)


@ghost(allreduce)
def _allreduce_ghost(rt, node) -> None:
    """In a replay: one meet per communication group, as ``Communicator.reduce`` meets."""
    comm = existing(rt)
    groups = comm.owned.get(node.args[0]) if comm is not None else None
    status = rt.status
    key, group = scope(rt)
    for names in groups if groups is not None else comm_groups(rt, node.args[0]):
        if group is not None or not rides(comm, node):
            status.meet(key, group, "the all-reduce of the gradients")
        elif not status.skip(STEP_KEY):     # the words ride on the all-reduce: zeros sent in its place
            words = Words(status, STEP_KEY, None)
            reduce_all([torch.zeros(rt.state.tensors[n].shape) for n in names], NO_COMPRESSION, words=words)
            words.settle(raises=False)


def rides(comm, node) -> bool:
    """``Communicator.rides``, from the op's keywords where the runtime has made no communicator yet."""
    if comm is not None:
        return comm.rides()
    return (node.kwargs.get("world") or 1) >= 2 and not node.kwargs.get("warmup") \
        and node.args[1:2] in ((), ("none",)) and node.kwargs.get("kind", "none") == "none"


register(allreduce, _allreduce_execute, _allreduce_effect, _allreduce_cost, "copy",
         needs=lambda kw: () if kw.get("where") == Tier.HOST else ("grads",), colour="#fc9272", reduces=True)
