"""Optimizer state sharded over data-parallel ranks (ZeRO stage 1), in shares that may be uneven (Cephalo).

Every rank holds every parameter and computes every gradient, all-reduced as usual; each
parameter is *owned* by one rank, which alone keeps its optimizer state and steps it
(``PackSpec.stepped``); the others drop its gradient after the all-reduce. At the end of
the iteration ``sync_state`` sends each rank's updated parameters to the others (one
broadcast per rank, fused), so every rank starts the next iteration with the same weights.
The same op broadcasts rank 0's buffers that forward mutates (BatchNorm's running
statistics, which each rank updates from its own samples), as DDP's ``broadcast_buffers``
does, whether or not optimizer state is sharded.
Because the all-reduce leaves the same gradient on every rank, the owner's update is the
one every rank would have made: a sharded run equals the replicated run bit for bit.

Ownership is contiguous in the model's parameter order, cut where each rank's byte share
ends (``owners``): the same on every rank whatever packs its budget gave it.
"""
from __future__ import annotations

import torch

from harmony.base.units import nbytes
from harmony.runtime.comm.collectives import guarded
from harmony.runtime.comm.communicator import scope
from harmony.runtime.comm.jobwide import ghost
from harmony.runtime.ops import register
from harmony.runtime.plan import NOMINAL_NETWORK_BANDWIDTH, NOMINAL_NETWORK_LATENCY


def owners(sizes: list[tuple[str, int]], shares: list[float]) -> dict[str, int]:
    """Each parameter's owning rank: contiguous runs in ``sizes`` order, rank r's run holding about
    ``shares[r]`` of the bytes (a parameter goes to the rank whose share holds its middle byte)."""
    total = sum(b for _, b in sizes) or 1
    norm = sum(shares)
    bounds, acc = [], 0.0
    for s in shares:
        acc += s / norm
        bounds.append(acc * total)
    out, done, r = {}, 0, 0
    for name, b in sizes:
        middle = done + b / 2
        while r < len(bounds) - 1 and middle > bounds[r]:
            r += 1
        out[name] = r
        done += b
    return out


def owners_among(sizes: list[tuple[str, int]], ranks: list[int]) -> dict[str, int]:
    """``owners`` in equal shares over ``ranks`` (job ranks): a grid's stage over its replica group
    (``parallel=("pipeline", "data")``), whose ranks hold the same packs."""
    return {n: ranks[r] for n, r in owners(sizes, [1.0] * len(ranks)).items()}


def by_owner(plan) -> list[list[str]]:
    """The parameter names each rank owns, in the model's order (``plan.state_owner`` keeps it)."""
    world = max(plan.state_owner.values(), default=-1) + 1
    out: list[list[str]] = [[] for _ in range(world)]
    for name, r in plan.state_owner.items():
        out[r].append(name)
    return out


# -- the op: every owner's updated parameters, and rank 0's buffers, to every rank -----------------
def sync_state(world: int): ...


def _sync_execute(rt, world):
    """After the host steps: each rank's parameters broadcast from it (sharded optimizer state), then
    rank 0's buffers that forward mutates (BatchNorm statistics, as DDP's ``broadcast_buffers``)."""
    st = rt.state
    st.settle(list(st.pending))          # host steps (and the host all-reduces ahead of them) are done
    rt.finish_updates()                  # and those waiting in the StepGate (clipping) have run
    # every rank's step got here (runtime/comm/jobwide.py): in a grid the ranks of this rank's replica group, which
    # hold the same packs and so all make this op (a stage with nothing to broadcast makes none: a meet of the whole
    # job here would wait for its ranks)
    if rt.status is not None:
        rt.status.go(*scope(rt), "the broadcast of the updated weights")
    mine, group, first = rt.plan.rank, _group(rt.plan), _first(rt.plan)
    for owner, names in enumerate(by_owner(rt.plan)):
        if names:
            _broadcast(st, names, owner, mine, group)
    buffers = sorted(rt.plan.sync_buffers)
    for dtype in dict.fromkeys(st.tensors[n].dtype for n in buffers):
        _broadcast(st, [n for n in buffers if st.tensors[n].dtype == dtype], first, mine, group)


def _grid(plan):
    return getattr(getattr(plan, "stage", None), "grid", None)


def _group(plan):
    """The process group of the broadcasts: the job's; in a grid this rank's replica group, the ranks holding the
    same packs (owners are job ranks, as ``broadcast`` takes its source on any group)."""
    if _grid(plan) is None:
        return None
    from harmony.runtime.comm.grid import replica_group
    return replica_group(_grid(plan))


def _first(plan) -> int:
    """Where the buffers forward mutates come from: rank 0; in a grid the first rank of this rank's replica group."""
    return 0 if _grid(plan) is None else _grid(plan).replica_ranks()[0]


def _broadcast(st, names: list[str], src: int, mine: int, group=None) -> None:
    """``names`` (one dtype) from rank ``src`` into every other rank's copies, wherever each copy is now."""
    import torch.distributed as dist

    ts = [st.tensors[n] for n in names]
    with torch.no_grad():
        if src == mine:
            flat = torch.cat([t.data.detach().reshape(-1).cpu() for t in ts])
            st.moved["d2h"] += sum(nbytes(t) for t in ts if st._on_device(t.data))
        else:
            flat = torch.empty(sum(t.numel() for t in ts), dtype=ts[0].dtype)
        guarded(f"the broadcast of rank {src}'s updated weights", dist.broadcast, flat, src=src, group=group, peer=src)
        if src == mine:
            return
        off = 0
        for n, t in zip(names, ts):      # the device copy if it is there, else the host master
            t.data.copy_(flat[off: off + t.numel()].view_as(t))
            off += t.numel()
            if st._on_device(t.data):
                st.moved["h2d"] += nbytes(t)
                st.dirty.add(n)          # the host master is stale until the device copy goes back


def _synced(plan):
    """(name, source rank, bytes) of everything ``sync_state`` broadcasts."""
    for name, r in plan.state_owner.items():
        yield name, r, plan.state_bytes.get(name, 0)
    first = _first(plan)
    for name, b in plan.sync_buffers.items():
        yield name, first, b


def _sync_effect(m, world):
    """What is held on the device at the end of the iteration crosses the host link: out on its source, in elsewhere."""
    mine = m.plan.rank
    for name, src, _ in _synced(m.plan):
        if m.resident("params", name):   # the rest went back to the host with their packs
            m.moved["d2h" if src == mine else "h2d"] += m.sizes.get(("params", name), 0)
            if src != mine:
                m.dirty.add(name)
    return None, 0


def _sync_cost(plan, hw, world):
    """Every rank receives what it is not the source of (a broadcast per source and dtype), at network speed."""
    received = sum(b for _, src, b in _synced(plan) if src != plan.rank)
    bandwidth = getattr(hw, "network_bandwidth", NOMINAL_NETWORK_BANDWIDTH)
    return "network", received / bandwidth + world * getattr(hw, "network_latency", NOMINAL_NETWORK_LATENCY)


@ghost(sync_state)
def _sync_ghost(rt, node) -> None:
    rt.status.meet(*scope(rt), "the broadcast of the updated weights")


register(sync_state, _sync_execute, _sync_effect, _sync_cost, "copy", colour="#fcbba1")
