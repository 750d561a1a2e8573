"""The data-parallel op: ``allreduce`` of a pack's gradients over the ranks (inserted by the compress pass), and
``allreduce_tied``, the sum of a weight's gradient over the pipeline ranks that hold copies of it (inserted by the
tied pass), registered in the op table (runtime/ops/) with all they need.
"""
from __future__ import annotations

import torch

from harmony.base.tiers import Tier
from harmony.runtime.comm import tied
from harmony.runtime.comm.collectives import allreduce as reduce_all
from harmony.runtime.comm.communicator import comm_groups, communicator, existing, scope
from harmony.runtime.comm.compression import DEFAULT_MIN_SIZE, NO_COMPRESSION
from harmony.runtime.comm.jobwide import STEP_KEY, Words, ghost
from harmony.runtime.ops import Predicted, allreduce, register
from harmony.runtime.partitioned.layout import PREFIX
from harmony.runtime.plan import NOMINAL_NETWORK_BANDWIDTH, NOMINAL_NETWORK_LATENCY, codec_rate, socket_rate
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
    """Ring all-reduce bytes (fp32, half) or scatter-reduce + all-gather of packed levels, at network speed, and a
    ring's latency per collective: one per communication group of the pack (``Plan.comm_groups``: where ranks cut
    the model into other packs, a pack's all-reduce is several collectives, one per group every rank shares).

    The pack's parameter bytes stand for its owned gradients (equal unless a weight is shared).
    """
    sent = sent_bytes(plan.packs[pack].param_bytes, kind, world, bits)
    bandwidth = getattr(hw, "network_bandwidth", NOMINAL_NETWORK_BANDWIDTH)
    collectives = len(getattr(plan, "comm_groups", {}).get(pack) or ()) or 1
    return "network", sent / bandwidth + 2 * (world - 1) * getattr(hw, "network_latency",
                                                                   NOMINAL_NETWORK_LATENCY) * collectives


def sent_bytes(size: int, kind: str, world: int, bits: int = 4) -> float:
    """Bytes one rank sends in an all-reduce of ``size`` fp32 gradient bytes: a ring's ``2 (w - 1) / w`` of them,
    in half precision or as packed levels with a bucket's two fp32 per 512 values."""
    per_byte = {"none": 1.0, "fp16": 0.5, "bf16": 0.5}.get(kind, bits / 32 + 2 * 4 / 512 / 4)
    return 2 * (world - 1) / max(world, 1) * size * per_byte


def socket_seconds(plan, hw, pack, kind="none", *, world=1, bits=4, **kw) -> float:
    """Seconds of one core's work gloo spends on an all-reduce of the pack's gradients where the device is the CPU
    (``sync_copies``; on a GPU, NCCL's copies and sums run on the GPU): the bytes it sends and as many received, at
    ``socket_rate`` (the kernel's socket copies and gloo's sums), and the fused buffer's two copies (the gradients
    in, the average out) at the device's ``memory_bandwidth``. It runs on the host thread while the bytes travel:
    the transfer lasts at least this long, and takes a core of the host meanwhile. 0 on one rank."""
    if world < 2 or not getattr(hw, "sync_copies", False):
        return 0.0
    size = plan.packs[pack].param_bytes
    copies = 2 * size / hw.memory_bandwidth if getattr(hw, "memory_bandwidth", 0) else 0.0
    return 2 * sent_bytes(size, kind, world, bits) / socket_rate(hw) + copies


def codec_seconds(plan, hw, pack, kind="none", *, world=1, bits=4, **kw) -> float:
    """Seconds of one core's work a rank spends in the codec of a quantized all-reduce of the pack's gradients.

    Each rank quantizes every element once (the chunks it sends, then its reduced chunk) and dequantizes the
    w - 1 chunks it receives and then all w gathered ones: 1 quantize and (2w - 1) / w dequantizes per element,
    each taken as half of ``codec_rate``'s quantize + dequantize pair. It runs on the thread that runs the
    all-reduce (the host thread), before and between the transfers. Other kinds: 0 (not costed).
    """
    if kind != "quantized" or world < 2:
        return 0.0
    passes = (1 + (2 * world - 1) / world) / 2
    return plan.packs[pack].param_bytes * passes / codec_rate(hw, bits)


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


# -- a weight tied across pipeline ranks --------------------------------------------------------------
def allreduce_tied(pack: int, *, names: tuple, ranks: tuple, sync: bool = False, where: str = Tier.DEVICE): ...


def _tied_execute(rt, pack, *, names, ranks, sync=False, where=Tier.DEVICE):
    """Sum the gradients of the weights ``names``, tied across job ranks ``ranks``, over those ranks, in place, on the
    host thread; a ``wait`` joins it before the weights step (``sync``: here). The step's words ride on it (made here,
    on the thread issuing ops, so a replay knows it was made): a peer whose step failed says so before any copy
    steps, and the copies stay equal.

    ``where="host"``: the gradients were released to the host (the pack steps there); the host thread sums the host
    copies behind what it was given before (the pack's replica all-reduce, in a grid) and ahead of the host step
    queued next, whose drain joins it, as ``allreduce(where="host")`` does. No copy to or from the device touches
    them meanwhile: the sum follows the gradients to where they are instead of bringing them back."""
    comm = tied.communicator(rt, ranks)
    names = held(rt.plan, names)
    status = rt.status if rt.status is not None and rt.status.active else None
    words = Words(status, comm.key, comm.group) if status is not None else None
    host = where == Tier.HOST

    def job():
        try:
            if host and any(rt.state.grad(n) is None for n in names):
                # the replica all-reduce ahead of it failed (a peer's step did) and dropped them: the copies' ranks
                # still wait for this one, on zeros with this rank's word, as a replay sends it
                _zeros(rt, comm, names, words)
            else:
                with CountAllocations(rt.meter):
                    comm.reduce_names(rt, list(names), words)
            if words is not None:
                words.settle(raises=True)
        except BaseException:
            if host:        # the host step behind it must not apply a gradient the other copies did not
                for n in names:
                    rt.state.set_grad(n, None)
            raise
    fut = rt.state.host_pool.submit(job)      # (a pipeline refuses the ondemand policy)
    if host:
        rt.state.pending[("tied", pack)] = fut
    if sync:
        fut.result()
    else:       # a rollback's replay joins it (``replay_tied``); the step's ``wait`` (or drain) otherwise
        rt.__dict__["tied_inflight"] = [f for f in rt.__dict__.get("tied_inflight", []) if not f.done()] + [fut]
    fut.harmony_jobs = ()
    return None if host else fut


def held(plan, names) -> list[str]:
    """What this rank holds of the gradients of the tied weights ``names``: the weights', or where its packs'
    state is partitioned (``shard_state="full"``) the pieces of them in its chunks (``share:<name>[a:b]``, the same
    elements on every stage of its pipeline: passes/tied.py)."""
    out = []
    for n in names:
        shares = next((r.shares for r in plan.residency.values()
                       if r.shares is not None and n in r.shares.names()), None)
        out += [n] if shares is None else [q.name for q in shares.pieces if q.name.startswith(f"{PREFIX}{n}[")]
    return out


def _tied_bytes(m, names) -> int:
    return sum(m.sizes.get(("grads", n), 0) for n in names)


def _tied_effect(m, pack, *, names, ranks, sync=False, where=Tier.DEVICE):
    if where == Tier.HOST:          # the host copies: nothing on the device
        return None, 0
    held = comm_buffer_bytes(_tied_bytes(m, names), "none", len(ranks))
    return (None, held) if sync else (Predicted(held), 0)


def _tied_cost(plan, hw, pack, *, names, ranks, sync=False, where=Tier.DEVICE):
    """A ring all-reduce of the tied weights' fp32 gradients over their ranks, at network speed."""
    size = sum(plan.stage.tied_bytes.get(n, 0) for n in names)
    shares = plan.at(pack).shares
    if shares is not None:      # shard_state="full": this rank's chunk of them
        size //= shares.world
    world = len(ranks)
    bandwidth = getattr(hw, "network_bandwidth", NOMINAL_NETWORK_BANDWIDTH)
    return "network", 2 * (world - 1) / world * size / bandwidth + 2 * (world - 1) * getattr(
        hw, "network_latency", NOMINAL_NETWORK_LATENCY)


@ghost(allreduce_tied)
def _tied_ghost(rt, node) -> None:
    """In a replay: deferred to ``replay_tied``, as a peer may wait for this rank's sends that come after the
    all-reduce in the schedule (one launched from the last backward) before it makes its own."""
    rt.__dict__.setdefault("tied_replays", []).append(node)


def replay_tied(rt) -> None:
    """The replay's tied all-reduces this rank had not made, on zeros with its word (in schedule order, which is
    the sets' order on every rank), after every message's ghost and before the norms' and the loss's collectives;
    then any it had launched is joined, so nothing writes into the gradients the rollback drops."""
    for node in rt.__dict__.pop("tied_replays", []):
        comm = tied.communicator(rt, node.kwargs["ranks"])
        if not rt.status.skip(comm.key):
            words = Words(rt.status, comm.key, comm.group)
            _zeros(rt, comm, held(rt.plan, node.kwargs["names"]), words)
            words.settle(raises=False)
    for fut in rt.__dict__.pop("tied_inflight", []):
        try:
            fut.result()
        except BaseException:      # noqa: BLE001 (Aborted, where a peer's word said its step failed)
            pass


def _zeros(rt, comm, names, words) -> None:
    """The tied all-reduce on zeros in the gradients' place, carrying ``words``."""
    reduce_all([torch.zeros(rt.state.tensors[n].shape) for n in names], NO_COMPRESSION, group=comm.group, words=words)


register(allreduce_tied, _tied_execute, _tied_effect, _tied_cost, "copy",
         needs=lambda kw: () if kw.get("where") == Tier.HOST else ("grads",),
         colour="#fc9272", reduces=True, label=lambda args, kwargs: f"{','.join(kwargs['names'])} over ranks "
                                                                     f"{','.join(map(str, kwargs['ranks']))}")
