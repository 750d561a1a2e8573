"""On-demand residency, the virtualized-memory baseline (CUDA unified memory, IBM LMS).

Nothing is planned: all state starts on the host; an op that touches a parameter,
buffer, gradient or optimizer-state tensor on the host fetches it first, and when
the device budget is hit the least recently used state not needed by the current op
goes back to the host (written back only if it changed). Before each op it also
makes room for the bytes that op allocated in the previous step (the largest seen so
far in the first step), as a virtual-memory system that knows the access pattern
would. Activations are not evictable here, so the schedule's packs still recompute
to bound them.

On a GPU the fetch has to happen above autograd: autograd records the device of every
tensor an op takes, and a weight fetched only inside the op (below autograd, where the
allocation counter runs) would be recorded on the host, so its gradient, computed on the
GPU, would be refused. ``calls()`` fetches what each torch call touches before autograd
sees it (and keeps it from eviction until the call returns); the per-op fetch below
autograd still serves the backward (autograd unpacks saved weights there) and the
optimizer.

Evicted gradients and optimizer state go to host buffers the policy keeps and reuses (pinned on CUDA),
as a virtual-memory system's backing store is allocated once: fresh pageable memory per eviction would
charge the baseline for page faults and staged copies that have nothing to do with its policy.
"""
from __future__ import annotations

import time
import weakref
from collections import OrderedDict

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten


class OnDemand:
    def __init__(self, rt):
        self.rt = rt
        # device-resident state, least recently used first; weak, so freed grads are not kept alive
        self.lru: OrderedDict[int, weakref.ref] = OrderedDict()
        self.version: dict[int, int] = {}
        self.master = {id(t): t.data for t in rt.state.tensors.values()}   # host copies of params, buffers
        self.persistent = {id(t) for t in rt.state.tensors.values()}
        self.on_host: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # evicted grads, state
        self.busy: set[int] = set()
        self.held: set[int] = set()       # the inputs of the torch call in flight (not evictable during it)
        self.allocs: list[int] = []       # bytes each op of the previous step allocated, in order
        self.current: list[int] = []
        self.largest = 0
        self.pin = torch.device(rt.device).type == "cuda"
        self.spare: dict[tuple, list[torch.Tensor]] = {}   # (shape, dtype) -> host buffers free for an eviction
        self.spare_bytes = 0
        self.backing: dict[int, weakref.finalize] = {}     # evicted tensor -> returns its buffer should it die there
        self.seconds = dict(fetch=0.0, evict=0.0)          # on the main thread, in the step so far
        self.new_host_bytes = 0                            # host buffers allocated for evictions in the step
        rt.meter.on_pressure = self.evict
        rt.state.fetch = self._no_fetch

    @staticmethod
    def _no_fetch(kind, names):
        raise AssertionError("the ondemand policy plans no swap_in")

    def _managed(self):
        """Parameters, buffers, grads and optimizer state, discovered afresh (grads come and go)."""
        st = self.rt.state
        out = list(st.tensors.values())
        out += [p.grad for p in st.tensors.values() if getattr(p, "grad", None) is not None]
        for opt in dict.fromkeys(st.optimizers.values()):
            out += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return out

    def start_step(self):
        if self.current:
            self.allocs = self.current
        self.current = []
        self.seconds = dict(fetch=0.0, evict=0.0)
        self.new_host_bytes = 0

    def stats(self) -> dict:
        """For ``sm.stats``: the step's time in fetches and evictions (both block the main thread), the host buffers
        it allocated for evictions, and those kept spare for the next."""
        return dict(ondemand_fetch_seconds=self.seconds["fetch"], ondemand_evict_seconds=self.seconds["evict"],
                    ondemand_new_host_bytes=self.new_host_bytes,
                    ondemand_spare_bytes=self.spare_bytes)

    def _is_managed_on_host(self, t) -> bool:
        key = id(t)
        return (key in self.persistent or self.on_host.get(key) is t) and not self.rt.meter.holds(t)

    def before_op(self, func, args, kwargs):
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        self.busy = {id(t) for t in tensors}
        for t in tensors:
            if id(t) in self.lru:
                self.lru.move_to_end(id(t))
            elif self._is_managed_on_host(t):
                self.fetch(t)
        i = len(self.current)
        room = self.allocs[i] if i < len(self.allocs) else self.largest
        meter = self.rt.meter
        if meter.budget is not None and meter.live + room > meter.budget:
            self.evict(meter.live + room - meter.budget)

    def calls(self) -> "FetchOnCall":
        """A mode that fetches each torch call's managed inputs before autograd records them."""
        return FetchOnCall(self)

    def hold(self, tensors) -> None:
        """Fetch what a torch call takes and keep it from eviction until ``unhold`` (calls do not nest: the
        mode is off inside its handler)."""
        for t in {id(t): t for t in tensors}.values():
            if id(t) in self.lru:
                self.lru.move_to_end(id(t))
            elif self._is_managed_on_host(t):
                self.fetch(t)
            else:
                continue
            self.held.add(id(t))

    def unhold(self) -> None:
        self.held = set()

    def after_op(self, new_bytes: int):
        self.current.append(new_bytes)
        self.largest = max(self.largest, new_bytes)

    def fetch(self, t: torch.Tensor):
        meter = self.rt.meter
        n = t.untyped_storage().nbytes()
        if meter.budget is not None and meter.live + n > meter.budget:
            self.evict(meter.live + n - meter.budget)
        start = time.perf_counter()
        dev = torch.empty_like(t.data, device=self.rt.device)
        meter.track(dev)
        dev.copy_(t.data)      # synchronous: its host buffer is free once this returns
        self.rt.state.moved["h2d"] += n
        t.data = dev
        self.on_host.pop(id(t), None)
        back = self.backing.pop(id(t), None)
        if back is not None:      # an evicted grad or state tensor: its host buffer is spare again
            _, _, args, _ = back.detach()
            self._spare(*args)
        self.seconds["fetch"] += time.perf_counter() - start
        self.lru[id(t)] = weakref.ref(t)
        self.version[id(t)] = t._version

    def close(self) -> None:
        """Let go of the spare host buffers (pinned on CUDA) and of the evicted tensors' claims on theirs."""
        for back in self.backing.values():
            back.detach()
        self.backing.clear()
        self.spare.clear()
        self.spare_bytes = 0

    def _spare(self, key: int, host: torch.Tensor) -> None:
        self.backing.pop(key, None)
        self.spare.setdefault((tuple(host.shape), host.dtype), []).append(host)
        self.spare_bytes += host.untyped_storage().nbytes()

    def evict(self, needed: int):
        """Send least recently used state to the host until ``needed`` bytes are really free.

        A tensor whose storage something else still holds (a view saved for backward)
        frees nothing when evicted, so progress is measured on the meter, not assumed.
        """
        meter = self.rt.meter
        target = meter.live - needed
        start = time.perf_counter()
        self._evict(target)
        self.seconds["evict"] += time.perf_counter() - start

    def _evict(self, target: int) -> None:
        meter = self.rt.meter
        self._evict_lru(target)
        if meter.live > target:   # new grads and optimizer state become evictable
            for t in self._managed():
                if id(t) not in self.lru and meter.holds(t):
                    self.lru[id(t)] = weakref.ref(t)
                    self.lru.move_to_end(id(t), last=False)
                    self.version[id(t)] = -1
            self._evict_lru(target)

    def _evict_lru(self, target: int) -> None:
        meter = self.rt.meter
        for key in list(self.lru):
            if meter.live <= target:
                return
            if key in self.busy or key in self.held:
                continue
            t = self.lru.pop(key)()
            if t is None or not meter.holds(t):
                continue
            n = t.untyped_storage().nbytes()
            if key in self.persistent:
                host = self.master[key]
                # buffers are always written back: batch norm updates running stats without a version bump
                if self.version.get(key) != t._version or not isinstance(t, torch.nn.Parameter):
                    host.copy_(t.data)
                    self.rt.state.moved["d2h"] += n
            else:
                free = self.spare.get((tuple(t.shape), t.dtype))
                if free:
                    host = free.pop()
                    self.spare_bytes -= host.untyped_storage().nbytes()
                else:
                    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin)
                    self.new_host_bytes += n
                host.copy_(t.data)
                self.rt.state.moved["d2h"] += n
                self.on_host[key] = t
                # a gradient dropped while on the host (set to None) gives its buffer back
                self.backing[key] = back = weakref.finalize(t, self._spare, key, host)
                back.atexit = False
            t.data = host


class FetchOnCall(TorchFunctionMode):
    """Fetches the managed tensors a torch call takes before the call (and autograd) sees them.

    Inside the handler the mode is off, so the call's own inner calls and ops run below it;
    the per-op fetch of ``CountAllocations`` still sees them.
    """

    def __init__(self, on_demand: OnDemand):
        super().__init__()
        self.on_demand = on_demand

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        od = self.on_demand
        if getattr(func, "__name__", None) in ("__get__", "__set__"):   # reading t.grad or t.data moves nothing
            return func(*args, **kwargs)
        with _disable_current_modes():   # the copies are the fetch's own, tracked by it, not an op's allocations
            od.hold(a for a in tree_flatten((args, kwargs))[0]
                    if isinstance(a, torch.Tensor) and id(a) in od.persistent)
        try:
            return func(*args, **kwargs)
        finally:
            od.unhold()
