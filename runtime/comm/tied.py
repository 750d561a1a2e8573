"""A weight tied across pipeline ranks (an embedding shared with the output head): the process group of each set of
ranks that hold copies of it, and the communicator that sums the copies' gradients over it.

``torch.distributed.new_group`` must be called by every rank of the job for every group, in the same order, even
for groups it is not in: ``make_groups`` makes all of them at compile (the stage pass, on every rank, over the sets
of every pipeline in one sorted order), as runtime/comm/grid.py makes a grid's. The runtime only looks them up.
"""
from __future__ import annotations

import datetime
import weakref

from harmony.base.errors import ConfigError
from harmony.runtime.comm.communicator import Communicator

_GROUPS: dict = {}       # (the default group, job ranks) -> its process group, made once per process
_COMMS = weakref.WeakKeyDictionary()     # Runtime -> {job ranks: its Communicator}


def tied_key(ranks) -> str:
    """The meets' key of the all-reduce over ``ranks`` (runtime/comm/jobwide.py counts meets per key)."""
    return f"tied weights of ranks {','.join(map(str, ranks))}"


def make_groups(sets, timeout: float = 300.0) -> None:
    """The group of each set of job ranks in ``sets`` (every rank passes every pipeline's sets: a collective call)."""
    import torch.distributed as dist
    world = id(dist.group.WORLD)
    for ranks in sorted({tuple(r) for r in sets}):
        if (world, ranks) not in _GROUPS:
            _GROUPS[(world, ranks)] = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=timeout),
                                                     backend=dist.get_backend())


def group_of(ranks):
    """The group ``make_groups`` made for ``ranks``."""
    import torch.distributed as dist
    got = _GROUPS.get((id(dist.group.WORLD), tuple(ranks)))
    if got is None:
        raise ConfigError(f"no process group for the weights tied across ranks {list(ranks)}: the stage pass makes it "
                          f"at compile on every rank; compile every rank with the same model and parallel= setting")
    return got


def communicator(rt, ranks) -> Communicator:
    """The runtime's communicator over ``ranks``: fp32, uncompressed, the sum (a weight of 1 in the average)."""
    comms = _COMMS.setdefault(rt, {})
    ranks = tuple(ranks)
    if ranks not in comms:
        comms[ranks] = Communicator(None, "none", len(ranks), 0, 0, {}, weight=1.0, key=tied_key(ranks),
                                    group=group_of(ranks))
    return comms[ranks]


def tied_stats(rt) -> dict:
    """Bytes this rank sent and seconds taken summing tied gradients since the last call (empty: none)."""
    comms = _COMMS.get(rt)
    if not comms:
        return {}
    got = [c.pop() for c in comms.values()]
    return dict(tied_wire_bytes=sum(g["wire_bytes"] for g in got), tied_seconds=sum(g["seconds"] for g in got))
