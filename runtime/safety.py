"""The runtime's safety net: a plan that under-predicts an op's memory does not end the step.

The cost model measures each pack on fake tensors and the verifier replays the schedule, but an op can still
allocate more than predicted (a kernel's workspace, an allocation the measurement did not see). Without a net the
meter raises ``DeviceOutOfMemory`` at the allocation that crosses the budget. With it (``Runtime.safety``, the
meter's ``on_pressure``) the crossing is a *plan miss*:

1. copies out in flight land first (the device tensors they still hold go);
2. then what the plan can fetch again leaves the device, the value used farthest ahead first: weights whose
   current value the host master holds (clean, not on disk, not partitioned: dropping them moves nothing), and
   values the executor holds for a later op (a microbatch's inputs, a pack's outputs or input gradients, a kept
   forward's saved tensors), copied to the host;
3. each comes back, exactly (the same bytes), just before the next op that reads it; at the end of the step (and
   after a rollback) every weight the plan holds on the device is back, so the next step starts as planned.

Only when nothing more can go and the device is still over does the meter raise ``DeviceOutOfMemory`` as before.
Each miss is counted (``sm.stats["plan_misses"]``, the op, the bytes over and released) and the next compile of the
same model learns it (driver/misses.py). Numerics do not change: nothing is recomputed, only moved and brought back.

What it does not cover: the ``ondemand`` policy (its own eviction is its net), ``accounting="allocator"`` (the
allocator's counters are read after an op, too late to make room), weights on disk or partitioned
(``shard_state="full"``: the device copy is the only current one within a step), gradients and optimizer state
(moved only by the plan), a kept forward's inputs and outputs (its graph holds them), and allocations made on a
thread other than the one running the schedule.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
import torch.fx

from harmony.base.units import nbytes
from harmony.runtime.ops import Acts, op_of
from harmony.runtime.placeholders import is_placeholder


@dataclass
class Miss:
    """One op at which the device went over its budget."""

    op: str              # the schedule node's name
    over: int            # bytes over the budget at the allocation that crossed it (the largest, if it crossed again)
    released: int = 0    # bytes the net let go to bring it back within the budget
    times: int = 1       # allocations in the op that crossed it
    reached: int = 0     # the most bytes live at a crossing, before the net made room


@dataclass
class _Away:
    """An executor value whose device tensors went to the host: the value, and per storage its host copy and the
    places its tensors were (``acts.values`` keys), with their views' geometry."""

    acts: Acts
    storages: list       # [(host uint8 tensor, [(key, dtype, size, stride, offset)])]


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
        if not self.weights and not any(isinstance(self.env.get(x), _Away) for x in node.all_input_nodes):
            if not op_of(node).runs_backward:
                return
        for name in [n for n in _weights_read(self.plan, node) if n in self.weights]:
            self._bring_weight(name)
        for x in node.all_input_nodes:
            value = self.env.get(x)
            if isinstance(value, _Away):
                self.env[x] = self._bring_value(value)
        saved = node.kwargs.get("saved")
        if isinstance(saved, torch.fx.Node) and isinstance(self.env.get(saved), Acts):
            self._bring_graph(self.env[saved])

    def end(self, restore: bool = True) -> None:
        """The graph is done (or failed): let go of its values; ``restore``: every weight the plan still holds
        comes back to the device now (a failed step's rollback calls ``restore`` once it has released its holds)."""
        self.env, self.node = None, None
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
        """(index of the next op that reads it, a function that lets it go) for everything the net may release."""
        now = self.order.get(self.node, -1)
        reads = set(self.node.all_input_nodes) if self.node is not None else set()
        busy = set(_weights_read(self.plan, self.node)) if self.node is not None else set()
        out = []
        for name in self._releasable_weights(busy):
            later = [i for i in self.readers.get(name, ()) if i > now]
            out.append((later[0] if later else len(self.order), lambda n=name: self._drop_weight(n)))
        graphs = {id(self.env[x].graph) for x in reads if isinstance(self.env.get(x), Acts)
                  and self.env[x].graph is not None}
        for node, value in list(self.env.items()):
            if node in reads or node is self.node or not isinstance(value, Acts) or value.arriving is not None:
                continue
            later = [self.order[u] for u in node.users if self.order.get(u, -1) > now]
            nxt = min(later, default=len(self.order))
            if value.graph is not None:
                if value.graph and id(value.graph) not in graphs:
                    graphs.add(id(value.graph))
                    out.append((nxt, lambda v=value: self._drop_graph(v)))
            elif value.leaves is None and value.on_device:
                out.append((nxt, lambda n=node, v=value: self._drop_value(n, v)))
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

    def _drop_value(self, node: torch.fx.Node, acts: Acts) -> None:
        """A plain value's device tensors to the host, storage by storage; ``env`` holds an ``_Away`` instead."""
        meter = self.rt.meter
        by_storage: dict[int, list] = {}
        for key, t in acts.values.items():
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and meter.holds(t):
                by_storage.setdefault(id(t.untyped_storage()), []).append(key)
        away = []
        for keys in by_storage.values():
            t = acts.values[keys[0]]
            host = self.rt.state.to_host(_whole(t))
            views = [(k, acts.values[k].dtype, acts.values[k].size(), acts.values[k].stride(),
                      acts.values[k].storage_offset()) for k in keys]
            ref = weakref.ref(t.untyped_storage())
            del t
            for k in keys:
                acts.values[k] = None
            storage = ref()
            if storage is not None:      # another value holds it too: it stays
                for k, *geometry in views:
                    acts.values[k] = _view(storage, *geometry)
                continue
            away.append((host, views))
        if away:
            self.env[node] = _Away(acts, away)

    def _bring_value(self, away: _Away) -> Acts:
        for host, views in away.storages:
            whole = self._bring(host)
            for k, *geometry in views:
                away.acts.values[k] = _view(whole.untyped_storage(), *geometry)
        return away.acts

    def _drop_graph(self, acts: Acts) -> None:
        """A kept forward's saved tensors to the host, as a ``stash`` sends them (``Saved.host`` and its view), so
        that an ``unstash`` of the plan or the net before the backward brings them back alike."""
        meter = self.rt.meter
        stay = {id(t.untyped_storage()) for t in (*acts.leaves.values(), *acts.outs.values())
                if isinstance(t, torch.Tensor)}
        by_storage: dict[int, list] = {}
        for held in acts.graph:
            t = held.t
            if t is None or t.layout != torch.strided or not meter.holds(t) or id(t.untyped_storage()) in stay:
                continue
            by_storage.setdefault(id(t.untyped_storage()), []).append(held)
        del t
        for holders in by_storage.values():
            first = holders[0].t
            host = self.rt.state.to_host(_whole(first))
            ref = weakref.ref(first.untyped_storage())
            del first
            for held in holders:
                t = held.t
                held.host, held.view, held.t = host, (t.dtype, t.size(), t.stride(), t.storage_offset()), None
            del t
            storage = ref()
            if storage is not None:      # held elsewhere: it stays
                for held in holders:
                    held.t, held.host, held.view = _view(storage, *held.view), None, None

    def _bring_graph(self, acts: Acts) -> None:
        """A backward's saved graph: what the net (or a stash whose unstash the net pre-empts) sent out, back."""
        if not acts.graph:
            return
        wholes: dict[int, torch.Tensor] = {}
        for held in acts.graph:
            if held.host is not None and held.t is None:
                key = id(held.host)
                if key not in wholes:
                    wholes[key] = self._bring(held.host)
                held.t, held.host, held.view = _view(wholes[key].untyped_storage(), *held.view), None, None

    def _bring(self, host: torch.Tensor) -> torch.Tensor:
        (whole,), fut = self.rt.state.bring([host])
        self.rt.state.wait(fut)
        return whole


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
