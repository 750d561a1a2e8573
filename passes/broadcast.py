"""One rank's weights and buffers to the others: how data-parallel replicas (and a grid's replica groups) start from
the same state."""
from __future__ import annotations

import torch

from harmony.base.units import nbytes
from harmony.compiler.ir import Program
from harmony.runtime.comm.failures import guarded


def broadcast_state(program: Program, names=None, src: int = 0, group=None) -> int:
    """Rank ``src``'s parameters and buffers (those in ``names``; None: all) to every rank of ``group`` (fused per
    dtype); returns the bytes broadcast."""
    import torch.distributed as dist

    tensors = [t for n, t in [*program.gm.named_parameters(), *program.gm.named_buffers()]
               if names is None or n in names]
    by_dtype: dict = {}
    for t in dict((id(t), t) for t in tensors).values():
        by_dtype.setdefault(t.dtype, []).append(t)
    total = 0
    with torch.no_grad():
        for ts in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in ts])
            guarded(f"the broadcast of rank {src}'s weights and buffers", dist.broadcast, flat, src=src,
                    group=group, peer=src)
            off = 0
            for t in ts:
                t.copy_(flat[off: off + t.numel()].view_as(t))
                off += t.numel()
            total += nbytes(flat)
    return total
