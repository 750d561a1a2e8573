"""How ``shard_state="full"``'s collectives take part in the job-wide step (runtime/comm/jobwide.py).

What a gather exchanges is the same on every rank whatever this rank holds (runtime/partitioned/
``exchange_parts``), so a rank whose step failed replays its remaining gathers whole (its chunks sent, the peers'
received into scratch): a peer waiting in one is served, goes on, and learns of the failure at the next
reduce-scatter, before the update behind it. A gather carries no word of its own (its own message to every peer
cost the step several per cent). A reduce-scatter's words ride on its first swap of chunks (two ranks, fp32
buffers: ``rides``), or beside its all-reduces (three ranks or more), else it meets on the default group first; a
rank that failed replays its swaps or all-reduces on zeros."""
from __future__ import annotations

import inspect

import torch

from harmony.base.tiers import Tier
from harmony.runtime.comm.jobwide import STEP_KEY, Words, ghost
from harmony.runtime.partitioned.carry import CARRY
from harmony.runtime.partitioned.shares import grid_of, own_groups

GATHERS = "gathers"       # the key of the gathers' words (their own group, the copy thread's)
__all__ = ["GATHERS", "Words", "apart", "grid_of", "own_groups", "pads", "rides", "scope", "swapped"]


@ghost("gather")
def _gather_ghost(rt, node) -> None:
    """In a replay: the agreement on carried copies (none here, or what this rank said before it failed), then the
    gather's exchanges whole, into scratch, carrying this rank's word."""
    from harmony.runtime.ops import moving_names
    from harmony.runtime.partitioned import exchange_parts, gather, gathered, homes
    args = inspect.signature(gather).bind(*node.args, **node.kwargs).arguments
    pack, held = args["pack"], args.get("held", ())
    st, plan, status = rt.state, rt.plan, rt.status
    names = moving_names(plan.packs[pack], "params", held)
    carry = st.shares.carry
    if args.get("carried") and carry is not None:
        took = status.took.get(status.replayed[CARRY]) if status.skip(CARRY) else carry.agree(False, status)
        if took:
            own = set(plan.at(pack).shares.names())
            names = [n for n in names if n not in own]
    home = homes(plan)
    wanted = {n: torch.empty(st.tensors[n].shape, dtype=st.compute_dtype or st.tensors[n].dtype, device=st.device)
              for n in names if n in home}
    if not wanted or status.skip(GATHERS):
        return
    status.done[GATHERS] += 1
    exchange_parts(rt, pack, gathered(plan, pack, held, home), wanted)


@ghost("step")
def _step_ghost(rt, node) -> None:
    """In a replay: the meet before a carried pack's refill."""
    if refills(rt, node.args[0], node.kwargs.get("where")):
        rt.status.meet(*scope(rt), "the refill of carried weights")


def refills(rt, pack: int, where) -> bool:
    """Whether ``pack``'s host step refills carried copies (a collective of the default group)."""
    shares = getattr(rt.state, "shares", None)
    return (shares is not None and shares.carry is not None and pack in shares.carry_packs
            and where == Tier.HOST and rt.status is not None)


def rides(shares, comm, plan=None) -> bool:
    """Whether a reduce-scatter's words ride on its collectives (fp32 buffers, no codec): on its first swap of chunks
    (``swapped``: two ranks), else in the pad of its first all-reduce (``pads``), else beside its all-reduces
    (``apart``: ``Words.launch``); else it meets first, as a grid's reduce-scatters do (over the replica group: as
    its replicated all-reduces meet). The same on every rank (the plan's)."""
    return (comm is None and bool(shares.segments) and all(seg.codec is None for seg in shares.segments)
            and grid_of(plan) is None)


def scope(rt) -> tuple:
    """(meet key, process group) of the host thread's collectives of the partitioned state (the reduce-scatters, a
    carried pack's refill): the default group's; in a grid this rank's replica group's (as its all-reduces')."""
    from harmony.runtime.comm.communicator import scope as comm_scope
    return comm_scope(rt)


def pads(shares, s: int) -> bool:
    """Whether segment ``s``'s all-reduce is padded: the first buffer of its all-reduce call, where the replicated
    run's words ride at the end of it (runtime/comm/collectives.py ``allreduce``; ``PackShares.padded``: not under
    compression), which a riding reduce-scatter pads alike."""
    first = next(i for i, seg in enumerate(shares.segments) if seg.call == shares.segments[s].call)
    return shares.padded and first == s


def swapped(shares) -> bool:
    """Whether every segment of a riding reduce-scatter swaps chunks (two ranks), so the words go in its first swap."""
    return all(seg.pairwise for seg in shares.segments)


def apart(shares) -> bool:
    """Whether a riding reduce-scatter's words go beside its collectives (their own all-reduce, ``Words.launch``):
    where it swaps no chunks (``swapped``) and its first buffer has no pad to carry them (``pads``: under
    compression, a pack whose buffers are all fp32)."""
    return not swapped(shares) and not pads(shares, 0)


@ghost("reduce_scatter")
def _reduce_scatter_ghost(rt, node) -> None:
    """In a replay: the reduce-scatter's meet, or its swaps of chunks or all-reduces (zeros sent) with this rank's
    word, where the step's own carry it."""
    from harmony.runtime.partitioned import reduce_scatter
    from harmony.runtime.partitioned.reduce import all_reduce_chunk, swap_chunks
    args = inspect.signature(reduce_scatter).bind(*node.args, **node.kwargs).arguments
    shares, status = rt.plan.at(args["pack"]).shares, rt.status
    if not rides(shares, args.get("comm"), rt.plan):
        status.meet(*scope(rt), "a reduce-scatter of gradients")
        return
    if status.skip(STEP_KEY):
        return
    words = Words(status, STEP_KEY, None)
    beside = apart(shares)
    if beside:
        words.launch(shares.world, shares.rank, status.timeout)
    for s, seg in enumerate(shares.segments):
        if seg.pairwise:
            swap_chunks(torch.zeros(seg.size), seg, shares.rank, None if beside else words)
        else:
            all_reduce_chunk(torch.zeros(seg.size), seg, shares.rank, shares.world, None, {},
                             padded=pads(shares, s), words=None if beside else words)
    if beside:
        words.join(status.timeout)
    words.settle(raises=False)
