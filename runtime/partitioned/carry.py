"""``shard_state="full"``: a pack's gathered weights carried on the device across its step to the next forward.

The swap pass carries a pack's weights across the step boundary where the device has room at the end of the
backward (``Residency.carried``; passes/swap/search.py ``carry_weights``). For a pack wholly on disk in a replicated
run the step updates the device copy where it is. A partitioned pack's step updates only this rank's chunks, so
here the step, on the host thread, all-gathers the updated chunks into the device copy the backward left
(``refill``), while the chunks are still in memory, before its file is written. The next forward's ``gather``
then takes that copy (``take``): it reads nothing from disk and sends nothing, where it would have read this
rank's chunks from its file and all-gathered them. The bytes on the network are the same, moved to the step.

Each rank decides alone whether it holds an up-to-date copy (a rolled-back step, a checkpoint loaded, the first
step hold none), and a gather is a collective every rank must join or skip alike, so ``take`` first agrees with
the other ranks (a one-element all-reduce of its own process group, on the thread that runs the schedule):
the copy is taken only where every rank has one; otherwise every rank drops its copy and gathers.
"""
from __future__ import annotations

import torch

CARRY = "carried weights"    # the key of ``take``'s agreements among a step's collectives (runtime/comm/jobwide.py)

class Carry:
    """The device copies of the carried packs' weights between a pack's backward and the next forward."""

    def __init__(self, group=None):
        """``group``: the ranks that share the packs' chunks (a grid's replica group, a set of its own); by default
        the job's, in a process group of its own."""
        import torch.distributed as dist
        # ``take``'s agreement: the schedule's thread only
        self.group = dist.new_group(backend="gloo") if group is None else group
        self.stepping: dict[int, dict[str, torch.Tensor]] = {}   # released by the backward, step not done yet
        self.ready: dict[int, dict[str, torch.Tensor]] = {}      # the stepped weights: the next gather takes them

    def hand_over(self, st, pack: int, names) -> None:
        """``release(pack, 'params', carry=True)``: the last hold of each of ``names`` keeps its device copy here
        for the step to refill, instead of freeing it (the meter goes on counting it)."""
        copies = self.stepping.setdefault(pack, {})
        for n in names:
            st.refs[("params", n)] -= 1
            if st.refs[("params", n)] > 0:
                continue
            t = st.tensors[n]
            if st.meter.holds(t.data):
                copies[n] = t.data
            st.set_data(n, st.master[n])
            st.dirty.discard(n)

    def refill(self, shares, pack: int, group=None) -> None:
        """On the host thread, once the pack's chunks are stepped: every rank's updated chunks into the copies
        (a collective of the group the host thread's reduce-scatters use, in schedule order: ``group``, by default
        the job's)."""
        copies = self.stepping.pop(pack, None)
        if copies is None:        # no release handed this pack over (on no rank: the schedule is every rank's)
            return
        import torch.distributed as dist
        chunks = shares.loaded(pack)
        for s, seg in enumerate(shares.plan.at(pack).shares.segments):
            # every segment, whatever this rank kept: a collective every rank joins alike ("take" then agrees)
            shares.gather_into(pack, s, chunks[s], {n: copies[n].view(-1) for n in seg.names if n in copies},
                               group=dist.group.WORLD if group is None else group)
        self.ready[pack] = copies

    def take(self, st, pack: int, names, status=None) -> bool:
        """``gather(pack, 'params', carried=True)``: hold the carried copies of ``names`` if every rank has its
        own (True); else drop this rank's and return False, for a gather. ``status``: the step's (several ranks,
        runtime/comm/jobwide.py), which counts this agreement among its collectives."""
        copies = self.ready.pop(pack, None)
        have = copies is not None and all(n in copies for n in names)
        if not self.agree(have, status):
            return False
        for n in names:
            st.refs[("params", n)] += 1
            st.set_data(n, copies[n])
        return True

    def agree(self, have: bool, status=None) -> bool:
        """Whether every rank has its copy (one all-reduce of ``self.group``)."""
        import torch.distributed as dist

        from harmony.runtime.comm.collectives import comm_error
        flag = torch.tensor([int(have)], dtype=torch.int32)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        except (RuntimeError, dist.DistError) as e:
            raise comm_error("the ranks' agreement on carried weights (shard_state='full')", e, None,
                             self.group) from e
        if status is not None and status.active:     # counted, with what it said (a replay's gathers follow it)
            status.done[CARRY] += 1
            status.took[status.done[CARRY]] = bool(flag.item())
        return bool(flag.item())

    def carry_on(self) -> None:
        """After an evaluation: the copies its gathers took and its releases handed over are still the stepped
        weights (no step came between), so the next forward takes them."""
        self.ready.update(self.stepping)
        self.stepping.clear()

    def drop(self) -> None:
        """Forget every copy (a step rolled back, weights loaded): the next gathers read and all-gather."""
        self.stepping.clear()
        self.ready.clear()
