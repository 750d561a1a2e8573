"""The meets of ``shard_state="full"``'s collectives (runtime/comm/jobwide.py): a gather meets on the gathers' group
(the copy thread's) whatever it moves, a reduce-scatter on the default group (the host thread's), so that a rank
whose step failed can tell the others at whichever they wait in."""
from __future__ import annotations

from harmony.base.tiers import Tier
from harmony.runtime.comm.jobwide import STEP_KEY, ghost
from harmony.runtime.partitioned.carry import CARRY

GATHERS = "gathers"       # the key of the gathers' meets (their own group, the copy thread's)


def gather_meet(rt, pack: int):
    """What a gather of ``pack`` in a step of several ranks runs first on the copy thread: the ranks' word on the
    step, on the gathers' group (``fn(raises)``); None outside a step or in one process."""
    status = rt.status
    if status is None or not status.active:
        return None
    what = f"the gather of pack {pack}'s weights"
    group = rt.state.shares.group
    return lambda raises: status.go(GATHERS, group, what) if raises else status.meet(GATHERS, group, what)


def meet_alone(st, meet) -> None:
    """A gather that moves nothing still meets (every rank's gathers meet alike); a failure it finds stops the step
    at the executor's next op."""
    if meet is not None:
        st.copier.submit(lambda: meet(False))


@ghost("gather")
def _gather_ghost(rt, node) -> None:
    """In a replay: the agreement on carried copies (none here), then the gather's meet."""
    carry = rt.state.shares.carry
    if node.kwargs.get("carried") and carry is not None and not rt.status.skip(CARRY):
        carry.agree(False, rt.status)
    rt.status.meet(GATHERS, rt.state.shares.group, "a gather of weights")


@ghost("step")
def _step_ghost(rt, node) -> None:
    """In a replay: the meet before a carried pack's refill (``refill_meet``)."""
    if refills(rt, node.args[0], node.kwargs.get("where")):
        rt.status.meet(STEP_KEY, None, "the refill of carried weights")


def refills(rt, pack: int, where) -> bool:
    """Whether ``pack``'s host step refills carried copies (a collective of the default group)."""
    shares = getattr(rt.state, "shares", None)
    return (shares is not None and shares.carry is not None and pack in shares.carry_packs
            and where == Tier.HOST and rt.status is not None)


@ghost("reduce_scatter")
def _reduce_scatter_ghost(rt, node) -> None:
    rt.status.meet(STEP_KEY, None, "a reduce-scatter of gradients")
