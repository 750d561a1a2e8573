"""Optimizer state sharded over data-parallel ranks (ZeRO stage 1), in shares that may be uneven (Cephalo).

Every rank holds every parameter and computes every gradient, all-reduced as usual; each
parameter is *owned* by one rank, which alone keeps its optimizer state and steps it
(``PackSpec.stepped``); the others drop its gradient after the all-reduce. At the end of
the iteration ``sync_params`` sends each rank's updated parameters to the others (one
broadcast per rank, fused), so every rank starts the next iteration with the same weights.
Because the all-reduce leaves the same gradient on every rank, the owner's update is the
one every rank would have made: a sharded run equals the replicated run bit for bit.

Ownership is contiguous in the model's parameter order, cut where each rank's byte share
ends (``owners``): the same on every rank whatever packs its budget gave it.
"""
from __future__ import annotations

import torch

from harmony.runtime.ops import register


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


def by_owner(plan) -> list[list[str]]:
    """The parameter names each rank owns, in the model's order (``plan.state_owner`` keeps it)."""
    world = max(plan.state_owner.values(), default=-1) + 1
    out: list[list[str]] = [[] for _ in range(world)]
    for name, r in plan.state_owner.items():
        out[r].append(name)
    return out


# -- the op: every owner's updated parameters to every rank, after the last step -------------------
def sync_params(world: int): ...


def _sync_execute(rt, world):
    """Wait for the host steps, then broadcast each rank's parameters from it (fp32, fused per rank)."""
    import torch.distributed as dist

    st = rt.state
    st.settle(list(st.pending))          # host steps (and the host all-reduces ahead of them) are done
    mine = rt.plan.rank
    with torch.no_grad():
        for owner, names in enumerate(by_owner(rt.plan)):
            ts = [st.tensors[n] for n in names]
            if not ts:
                continue
            if owner == mine:
                flat = torch.cat([t.data.detach().reshape(-1).cpu() for t in ts])
                st.moved["d2h"] += sum(_nbytes(t) for t in ts if st._on_device(t.data))
            else:
                flat = torch.empty(sum(t.numel() for t in ts), dtype=ts[0].dtype)
            dist.broadcast(flat, src=owner)
            if owner == mine:
                continue
            off = 0
            for n, t in zip(names, ts):      # into wherever the parameter is now: device copy or host master
                t.data.copy_(flat[off: off + t.numel()].view_as(t))
                off += t.numel()
                if st._on_device(t.data):
                    st.moved["h2d"] += _nbytes(t)
                    st.dirty.add(n)          # the host master is stale until the device copy goes back


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _sync_effect(m, world):
    """Parameters held on the device at the end of an iteration cross the host link: out on their owner, in elsewhere."""
    mine = m.plan.rank
    for name, r in m.plan.state_owner.items():
        if m.resident("params", name):   # the rest went back to the host with their packs
            m.moved["d2h" if r == mine else "h2d"] += m.sizes.get(("params", name), 0)
            if r != mine:
                m.dirty.add(name)
    return None, 0


def _sync_cost(plan, hw, world):
    """Every rank receives the parameters it does not own (a broadcast per owner), at network speed."""
    received = sum(plan.state_bytes.get(n, 0) for n, r in plan.state_owner.items() if r != plan.rank)
    bandwidth = getattr(hw, "network_bandwidth", 1.25e9)
    return "network", received / bandwidth + world * getattr(hw, "network_latency", 50e-6)


register(sync_params, _sync_execute, _sync_effect, _sync_cost, "copy")
