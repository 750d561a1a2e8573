"""A collective's failure as the user sees it: a ``CommunicationError`` naming the op, this rank, the peer it waited
for and what to do (a peer that died or stalled leaves the process group unusable)."""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from harmony.base.errors import CommunicationError


def wait_work(work, what: str, timeout: float | None, group=None, peer: int | None = None) -> None:
    """Join an async ``work`` within ``timeout`` seconds; a failure or a timeout is a ``CommunicationError``
    naming ``what``, this rank and ``peer`` (the rank it exchanges with, where there is one)."""
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timedelta(seconds=timeout))
    except (RuntimeError, dist.DistError) as e:
        raise comm_error(what, e, timeout, group, peer) from e


def comm_error(what: str, e: BaseException, timeout, group=None, peer: int | None = None) -> CommunicationError:
    """The ``CommunicationError`` a failed ``what`` raises: this rank, the peer (or every other rank), the limit,
    the backend's first line, and what to do."""
    try:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    except (RuntimeError, ValueError):        # the group is gone already
        rank, world = "?", "?"
    limit = f" within {timeout:g} s" if timeout is not None else ""
    detail = str(e).splitlines()[0] if str(e) else type(e).__name__
    who = f"peer rank {peer}" if peer is not None else "a peer rank (every rank of the group takes part)"
    return CommunicationError(
        f"{what} failed on rank {rank} of {world}{limit} ({detail}). The op waited for {who}, which probably "
        f"died or stalled; check its log. The process group is no longer usable: destroy it and restart "
        f"all ranks (torchrun --max-restarts does this), then harmony.load the last checkpoint.")


def exchange(what: str, ops: list, timeout: float | None = None, group=None, peer: int | None = None) -> None:
    """``dist.batch_isend_irecv(ops)`` joined; a failure (a peer that died, a timeout) is a ``CommunicationError``
    naming ``what``."""
    if not ops:
        return
    try:
        reqs = dist.batch_isend_irecv(ops)
    except (RuntimeError, dist.DistError) as e:
        raise comm_error(what, e, timeout, group, peer) from e
    for req in reqs:
        wait_work(req, what, timeout, group, peer)


def guarded(what: str, fn, *args, timeout: float | None = None, group=None, peer: int | None = None, **kwargs):
    """A blocking collective ``fn(*args, group=group, **kwargs)``; a failure is a ``CommunicationError`` naming
    ``what``."""
    try:
        return fn(*args, group=group, **kwargs)
    except (RuntimeError, dist.DistError) as e:
        raise comm_error(what, e, timeout, group, peer) from e


def launch(what: str, timeout, group, fn, *args, **kwargs):
    """Launch an async collective, turning launch-time failures into CommunicationError."""
    try:
        return fn(*args, group=group, async_op=True, **kwargs)
    except (RuntimeError, dist.DistError) as e:
        raise comm_error(what, e, timeout, group) from e
