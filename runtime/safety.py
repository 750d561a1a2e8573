"""The runtime's safety net: a plan that under-predicts an op's memory does not end the step.

The cost model measures each pack on fake tensors and the verifier replays the schedule, but an op can still
allocate more than predicted (a kernel's workspace, an allocation the measurement did not see). Without a net the
meter raises ``DeviceOutOfMemory`` at the allocation that crosses the budget. With it (``Runtime.safety``, the
meter's ``on_pressure``) the crossing is a *plan miss*:

1. copies out in flight land first (the device tensors they still hold go);
2. then what the plan can fetch again leaves the device, the value used farthest ahead first: weights whose
   current value the host master holds (clean, not on disk, not partitioned: dropping them moves nothing), and
   values the executor holds for a later op (a microbatch's inputs, a pack's outputs or input gradients, a kept
   forward's inputs, outputs and saved tensors), copied to the host storage by storage, each tensor object that
   views the storage pointed at the host copy (``.data``) so autograd's graph and the plan's stash see the same
   objects;
3. each comes back, exactly (the same bytes), just before the next op that reads it; at the end of the step (and
   after a rollback) every weight the plan holds on the device is back, so the next step starts as planned.

Only when nothing more can go and the device is still over does the meter raise ``DeviceOutOfMemory`` as before.
Each miss is counted (``sm.stats["plan_misses"]``, the op, the bytes over and released) and the next compile of the
same model learns it (driver/misses.py). Numerics do not change: nothing is recomputed, only moved and brought back.

What it does not cover: the ``ondemand`` policy (its own eviction is its net), ``accounting="allocator"`` (the
allocator's counters are read after an op, too late to make room), weights on disk or partitioned
(``shard_state="full"``: the device copy is the only current one within a step), gradients and optimizer state
(moved only by the plan), a storage something outside the executor's values also holds (the last pack's
graph, which saves its tensors without holders), the running op's own inputs and working set, and allocations made
on a thread other than the one running the schedule. CUDA has not been run yet: the moves are written for it (a
host copy made synchronously, the copy engine bringing it back) but untested there.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
import torch.fx

from harmony.base.units import nbytes
from harmony.runtime.ops import Acts, arrived, op_of
from harmony.runtime.pack_inputs import entered_base
from harmony.runtime.placeholders import is_placeholder


@dataclass
class Miss:
    """One op at which the device went over its budget."""

    op: str              # the schedule node's name
    over: int            # bytes over the budget at the allocation that crossed it (the largest, if it crossed again)
    released: int = 0    # bytes the net let go to bring it back within the budget
    times: int = 1       # allocations in the op that crossed it
    reached: int = 0     # the most bytes live at a crossing, before the net made room


class SafetyNet:
    """Makes room on ``rt``'s device when an allocation crosses the budget (see the module docstring)."""

    def __init__(self, rt):
        self.rt = rt
        self.env: dict | None = None        # the running graph's values (run_graph's)
        self.node: torch.fx.Node | None = None   # the op running now
        self.order: dict = {}                # node -> its index in the running graph
        self.readers: dict = {}              # weight name -> indices of the ops that read it, in order
        self._graph = self._plan = self.plan = None
        self.thread: int | None = None
        self.weights: set[str] = set()       # released weights the plan still holds (refs > 0)
        self.away: dict[int, tuple] = {}     # id of a value's tensor the net sent to the host -> its storage's
                                             # (host copy, [(tensor, view geometry)])
        self.misses: dict[str, Miss] = {}    # op name -> its miss, in order, in the running graph
        self.busy = False
        rt.meter.on_pressure = self.relieve

    # -- around the executor's loop ---------------------------------------------------------------
    def begin(self, runner, graph: torch.fx.Graph, env: dict) -> None:
        """``runner`` (the runtime, or an evaluation's run) starts running ``graph`` with values ``env``: its misses
        are counted afresh."""
        self.plan = runner.plan
        if graph is not self._graph or self.plan is not self._plan:
            self._plan = self.plan
            self._graph, self.order, self.readers = graph, {}, {}
            for i, node in enumerate(n for n in graph.nodes if n.op == "call_function"):
                self.order[node] = i
                for name in _weights_read(self.plan, node):
                    self.readers.setdefault(name, []).append(i)
        self.env, self.node, self.misses = env, None, {}
        self.thread = threading.get_ident()

    def before(self, node: torch.fx.Node) -> None:
        """``node`` runs next: what it reads that the net let go comes back first."""
        self.node = node
        if self.weights:
            for name in [n for n in _weights_read(self.plan, node) if n in self.weights]:
                self._bring_weight(name)
        if self.away:
            self._bring_values(self.env.get(x) for x in node.all_input_nodes)

    def end(self, restore: bool = True) -> None:
        """The graph is done (or failed): let go of its values; ``restore``: every weight the plan still holds
        comes back to the device now (a failed step's rollback calls ``restore`` once it has released its holds)."""
        self.env, self.node = None, None
        self.away.clear()     # the graph's values are gone with it
        if restore:
            self.restore()

    def restore(self) -> None:
        """Bring back every released weight the plan holds on the device; forget those it no longer holds."""
        while self.weights:
            self._bring_weight(min(self.weights))

    def stats(self) -> dict:
        """For ``sm.stats``: the running (or last) graph's misses."""
        misses = list(self.misses.values())
        return dict(plan_misses=sum(m.times for m in misses),
                    plan_miss_over_bytes=max((m.over for m in misses), default=0),
                    plan_miss_released_bytes=sum(m.released for m in misses),
                    plan_miss_ops=[(m.op, m.over) for m in misses])

    # -- making room ------------------------------------------------------------------------------
    def relieve(self, excess: int) -> None:
        """The meter's ``on_pressure``: the device is ``excess`` bytes over its budget. Copies in flight land, then
        what can be fetched again goes, farthest next use first, until the device is within the budget."""
        meter = self.rt.meter
        if self.busy or self.env is None or threading.get_ident() != self.thread:
            return          # (the meter raises DeviceOutOfMemory as before)
        self.busy = True
        try:
            name = self.node.name if self.node is not None else "(between ops)"
            miss = self.misses.get(name)
            if miss is None:
                miss = self.misses[name] = Miss(name, excess, times=0)
            miss.times += 1
            miss.over = max(miss.over, excess)
            before = meter.live
            miss.reached = max(miss.reached, before)
            self.rt.state.land()
            for _, release in sorted(self._candidates(), key=lambda c: -c[0]):
                if meter.live <= meter.budget:
                    break
                release()
            miss.released += max(0, before - meter.live)
        finally:
            self.busy = False

    def _candidates(self) -> list:
        """(index of the next op that reads it, a function that lets it go) for everything the net may release: the
        clean weights the running op does not read, and each device storage of the executor's values that no value
        the running op reads shares."""
        now = self.order.get(self.node, -1)
        reads = set(self.node.all_input_nodes) if self.node is not None else set()
        busy = set(_weights_read(self.plan, self.node)) if self.node is not None else set()
        out = []
        for name in self._releasable_weights(busy):
            later = [i for i in self.readers.get(name, ()) if i > now]
            out.append((later[0] if later else len(self.order), lambda n=name: self._drop_weight(n)))
        meter = self.rt.meter
        taken = {id(t.untyped_storage()) for t in _tensors(self.env.get(x) for x in reads)}
        groups: dict[int, list] = {}     # storage -> [next use, its tensors by id, the values still arriving]
        for node, value in list(self.env.items()):
            if node in reads or not isinstance(value, Acts):
                continue
            later = [self.order[u] for u in node.users if self.order.get(u, -1) > now]
            for t in _tensors([value]):
                key = id(t.untyped_storage())
                if key in taken or t.layout != torch.strided or not meter.holds(t):
                    continue
                group = groups.setdefault(key, [len(self.order), {}, []])
                group[0] = min([group[0], *later])
                group[1][id(t)] = t
                if value.arriving is not None:
                    group[2].append(value)
        for nxt, members, arriving in groups.values():
            out.append((nxt, lambda m=list(members.values()), a=arriving: self._drop_group(m, a)))
        return out

    def _releasable_weights(self, busy: set) -> list[str]:
        st = self.rt.state
        if st.shares is not None:
            return []
        pd = st.params_disk
        out = []
        for (kind, name), n in st.refs.items():
            if kind != "params" or n <= 0 or name in busy or name in self.weights or name in st.dirty:
                continue
            if name in st.pending or (pd is not None and pd.holds(name)) or is_placeholder(st.master[name]):
                continue
            if self.rt.meter.holds(st.tensors[name].data):
                out.append(name)
        return out

    def _drop_weight(self, name: str) -> None:
        """Point weight ``name`` at its host master (the same values) and let its device copy go, unless something
        else holds that copy (a kept graph of the last pack saves weights as they are): then it stays."""
        st = self.rt.state
        data = st.tensors[name].data
        geometry = (data.dtype, data.size(), data.stride(), data.storage_offset())
        ref = weakref.ref(data.untyped_storage())
        del data
        st.set_data(name, st.master[name])
        storage = ref()
        if storage is not None:     # held elsewhere: dropping it frees nothing, and it would come back twice
            st.set_data(name, _view(storage, *geometry))
            return
        self.weights.add(name)

    def _bring_weight(self, name: str) -> None:
        """Weight ``name``'s device copy again, made from its master as ``swap_in`` makes it; nothing if the plan
        no longer holds it on the device."""
        st = self.rt.state
        self.weights.discard(name)
        if st.refs.get(("params", name), 0) <= 0 or self.rt.meter.holds(st.tensors[name].data):
            return
        st.settle([name])
        src = st.master[name]
        st.landed(src)
        cast = st.compute_dtype if src.is_floating_point() else None
        dst = torch.empty_like(src, device=st.device, dtype=cast)
        self.rt.meter.track(dst)
        dst.copy_(src)
        st.moved["h2d"] += nbytes(dst)
        st.set_data(name, dst)

    def _drop_group(self, members: list, arriving: list) -> None:
        """One device storage's tensors (``members``: every executor value's tensor object on it) to the host: its
        bytes copied once, each tensor pointed (``.data``) at the same view of the host copy, so the values, kept
        graphs and autograd's leaves that hold those objects hold the host copy. Unless something else holds the
        storage still (dropping it frees nothing): then each points back at it. ``arriving``: values whose copies
        in (an ``unstash``) write it, joined first."""
        for value in arriving:
            arrived(self.rt, value)
        first = members[0]
        host = self.rt.state.to_host(_whole(first)).untyped_storage()
        ref = weakref.ref(first.untyped_storage())
        views = [(t, t.dtype, t.size(), t.stride(), t.storage_offset()) for t in members]
        del first, members
        for t, *geometry in views:
            t.data = _view(host, *geometry)
        del t
        storage = ref()
        if storage is not None:
            for t, *geometry in views:
                t.data = _view(storage, *geometry)
            return
        group = (host, views)
        for t, *_ in views:
            self.away[id(t)] = group

    def _bring_values(self, values) -> None:
        """The tensors of ``values`` (executor values an op reads) that the net sent to the host, back on the device,
        storage by storage, at the views they had."""
        for t in _tensors(values):
            group = self.away.pop(id(t), None)
            if group is None:
                continue
            host, views = group
            (whole,), fut = self.rt.state.bring([torch.empty(0, dtype=torch.uint8).set_(host)])
            self.rt.state.wait(fut)
            for u, *geometry in views:
                self.away.pop(id(u), None)
                u.data = _view(whole.untyped_storage(), *geometry)


def _tensors(values) -> list[torch.Tensor]:
    """The tensor objects executor values (``Acts``) hold: their values, a kept forward's leaves, outputs and saved
    tensors (``Saved.t``)."""
    out = []
    for value in values:
        if not isinstance(value, Acts):
            continue
        for d in (value.values, value.leaves, value.outs):
            out += [t for t in (d or {}).values() if isinstance(t, torch.Tensor)]
        out += [held.t for held in value.graph or () if held.t is not None]
    # a pack's input enters its graph as a view of a detached tensor (runtime/pack_inputs.py), which holds the
    # storage too: it goes with the view
    return out + [b for b in map(entered_base, out) if b is not None]


def _weights_read(plan, node) -> list[str]:
    """The weights ``node``'s op reads on the device: its pack's, for any op on a pack but those that move them."""
    op = op_of(node)
    if op is None or op.fetches or op.releases or not node.args or type(node.args[0]) is not int:
        return []
    packs = plan.packs
    if not 0 <= node.args[0] < len(packs):
        return []
    spec = packs[node.args[0]]
    return spec.params + spec.buffers


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s whole storage, as one uint8 tensor on its device."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _view(storage, dtype, size, stride, offset) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)
