"""Exact accounting of the bytes that live on a device.

``MemoryMeter`` counts every storage that is allocated while it is active (each
op output whose storage is new) plus the tensors the runtime registers
explicitly (copies made by ``swap_in``). A storage is counted once, however many
views share it, and uncounted the moment it is freed (a weak reference's callback on
the storage object, which PyTorch keeps alive exactly as long as the storage).
It works on real and on fake tensors, so the cost model and the runtime measure
memory with the same code.
"""
from __future__ import annotations

import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harmony.base.errors import DeviceOutOfMemory

UNDER_PREDICTED = ("The plan under-predicted this device's memory and the safety net (runtime/safety.py) found "
                   "nothing more it could move off the device; compile with a smaller memory_budget or a larger "
                   "plan_margin to leave headroom, and report the model so the cost model can be fixed.")


def settle_limit(meter) -> int | None:
    """Live bytes past which a meter's ``settle`` lets copies in flight land first: its budget, or the plan's
    predicted peak (``settle_above``) where that is lower; None if it has neither."""
    limits = [b for b in (meter.budget, meter.settle_above) if b is not None]
    return min(limits) if limits else None


def _storages(x, out: list) -> list:
    """Append the storages of the tensors in an op's arguments or results to ``out``: aten ops take and return
    tensors, lists or tuples of them and scalars. Walking these two levels instead of a pytree flatten, and
    looking at the inputs only for uncounted outputs, is what keeps the meter cheap: it runs around every op of
    every step (Hardware.profile's ``kernel_latency`` measures what it costs per op)."""
    if isinstance(x, torch.Tensor):
        out.append(x.untyped_storage())
    elif isinstance(x, (list, tuple)):
        for y in x:
            if isinstance(y, torch.Tensor):
                out.append(y.untyped_storage())
            elif isinstance(y, (list, tuple)):
                _storages(y, out)
    return out


class MemoryMeter:
    """Live and peak bytes of one (logical) device, with an optional enforced budget."""

    def __init__(self, name: str = "device", budget: int | None = None):
        self.name = name
        self.budget = budget
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}    # the weak reference to each counted storage, whose death uncounts it
        # reentrant: a storage that dies while the lock is held (the cyclic GC may run at any allocation inside it,
        # freeing a failed step's frames) uncounts itself through ``_release`` on the same thread
        self._lock = threading.RLock()
        self.on_pressure = None  # callable(bytes_needed) -> bytes_freed, for on-demand eviction
        self.settle = None       # callable(limit): lets go of device tensors only copies in flight still hold,
                                 # oldest first, until the live bytes are within ``limit`` or none are left
        self.settle_above = None  # live bytes above which ``settle`` runs first (the plan's predicted peak)
        self.caches: list = []   # free memory kept for reuse in the same memory (iobuffers.Buffers.share_room): trimmed
                                 # so that it and the live bytes stay within the budget

    def _release(self, key: int) -> None:
        """Uncount a storage: it died (its weak reference's callback) or lives on elsewhere (``forget``, whose
        dropped reference never calls back)."""
        with self._lock:
            self.live -= self._sizes.pop(key, 0)
            self._refs.pop(key, None)

    def track(self, tensor_or_storage, enforce: bool = True) -> None:
        """Count a storage as living on this device until it is freed."""
        s = tensor_or_storage
        if isinstance(s, torch.Tensor):
            s = s.untyped_storage()
        n = s.nbytes()
        key = id(s)
        if n == 0 or key in self._sizes:
            return
        with self._lock:
            self._sizes[key] = n
            self.live += n
            above = settle_limit(self)
            over = self.budget is not None and self.live > self.budget
            if self.settle is None or above is None or self.live <= above:
                above = None
                if not (over and enforce and self.on_pressure is not None):
                    self.peak = max(self.peak, self.live)
        # (a weak reference's callback rather than weakref.finalize, which costs several times more, on every op)
        self._refs[key] = weakref.ref(s, lambda _, key=key: self._release(key))
        if above is not None:     # copies in flight hold device memory the plan had freed: they land first
            self.settle(above)
            with self._lock:
                over = self.budget is not None and self.live > self.budget
                if not (over and enforce and self.on_pressure is not None):
                    self.peak = max(self.peak, self.live)
        if over and enforce:
            self._over_budget(n)
        if self.caches and self.budget is not None:
            excess = self.live + sum(c.free_bytes for c in self.caches) - self.budget
            for c in self.caches:
                if excess > 0:
                    before = c.free_bytes
                    c.trim(excess)
                    excess -= before - c.free_bytes

    def _over_budget(self, n: int) -> None:
        """Over the budget: ``on_pressure`` (the safety net, runtime/safety.py, or the ondemand policy's eviction)
        makes room first; the peak counts the live bytes once it has, as a device that made room before the
        allocation would hold them. Still over: ``DeviceOutOfMemory``."""
        if self.on_pressure is not None:
            self.on_pressure(self.live - self.budget)
            with self._lock:
                self.peak = max(self.peak, self.live)
        if self.live > self.budget:
            raise DeviceOutOfMemory(
                f"{self.name}: {self.live / 2**20:.1f} MiB live after allocating {n / 2**20:.2f} MiB, "
                f"over its budget of {self.budget / 2**20:.1f} MiB. {UNDER_PREDICTED}")

    def forget(self, tensor: torch.Tensor) -> None:
        """Stop counting ``tensor``'s storage on this device: it lives on as host memory (on the CPU device,
        a copy the disk tier stepped in place and is writing to its file)."""
        self._release(id(tensor.untyped_storage()))

    def holds(self, tensor: torch.Tensor) -> bool:
        return id(tensor.untyped_storage()) in self._sizes

    def holds_storage(self, storage) -> bool:
        return id(storage) in self._sizes

    def reset_peak(self) -> None:
        self.peak = self.live


class AllocatorMeter:
    """A CUDA device's bytes as torch's caching allocator counts them (``accounting="allocator"``): what
    ``MemoryMeter`` keeps, without looking at each op.

    ``CountAllocations`` runs Python around every tensor op; a GPU's host issuing small ops runs ahead of the card only
    if each costs it little. Here ``live`` is the bytes allocated on the device less those allocated when the
    runtime started (the user's tensors, the CUDA libraries' workspaces that compile measured), ``peak`` the
    allocator's peak less the same, and a tensor is on the device if it is on this CUDA device. ``observe`` after
    each op raises if the op took the device over the budget, which the ops' meter would have caught at the
    allocation. ``stats``: (allocated, max allocated, reset peak) functions, the allocator's by default.
    """

    def __init__(self, name: str, budget: int | None, device: torch.device, stats=None):
        self.name, self.budget, self.device = name, budget, torch.device(device)
        self._allocated, self._max_allocated, self._reset = stats or (
            lambda: torch.cuda.memory_allocated(self.device), lambda: torch.cuda.max_memory_allocated(self.device),
            lambda: torch.cuda.reset_peak_memory_stats(self.device))
        self.base = self._allocated()
        self._reset()       # a peak from before the runtime (another model, the compile's probes) is not its
        self.on_pressure = self.settle = self.settle_above = None    # (as MemoryMeter's)
        self.caches: list = []

    @property
    def live(self) -> int:
        return max(0, self._allocated() - self.base)

    @property
    def peak(self) -> int:
        return max(0, self._max_allocated() - self.base)

    @peak.setter
    def peak(self, value: int) -> None:
        """Ignored: the executor sets the peak to the live bytes around each op to take the op's own, which would
        mean resetting the allocator's, which the report and the user read over the whole step. Each op's event
        has the step's peak so far."""

    def track(self, tensor_or_storage, enforce: bool = True) -> None:
        """The allocator has counted it; past the plan's peak, copies in flight land first (``MemoryMeter.track``)."""
        above = settle_limit(self)
        if self.settle is not None and above is not None and self.live > above:
            self.settle(above)
        if enforce:
            self.observe()

    def observe(self) -> None:
        """Raise if the device went over the budget since the peak was last reset."""
        if self.budget is not None and self.peak > self.budget:
            raise DeviceOutOfMemory(
                f"{self.name}: the allocator's peak, {self.peak / 2**20:.1f} MiB above what was allocated when the "
                f"runtime started, is over the budget of {self.budget / 2**20:.1f} MiB. {UNDER_PREDICTED}")

    def forget(self, tensor: torch.Tensor) -> None:
        pass

    def holds(self, tensor: torch.Tensor) -> bool:
        return self._here(tensor.device)

    def holds_storage(self, storage) -> bool:
        return self._here(storage.device)

    def _here(self, device: torch.device) -> bool:
        return device.type == self.device.type and self.device.index in (None, device.index)

    def reset_peak(self) -> None:
        self._reset()


class CountAllocations(TorchDispatchMode):
    """Counts every new storage an op creates on ``meter`` (inputs' storages and views are not new).

    An ``observer`` sees each op before it runs and the bytes it allocated after: the
    on-demand mode fetches what an op touches and makes room for what it will allocate.
    """

    def __init__(self, meter: MemoryMeter, observer=None):
        super().__init__()
        self.meter = meter
        self.observer = observer   # .before_op(func, args, kwargs) and .after_op(new_bytes)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing is compiled inside this mode: without this, every op pays for torch's dynamo-disabling
        # wrapper around __torch_dispatch__.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.observer is not None:
            self.observer.before_op(func, args, kwargs)
        out = func(*args, **kwargs)
        new = 0
        held = self.meter.holds_storage
        fresh = [s for s in _storages(out, []) if not held(s)]
        if fresh:           # not counted yet: new, unless it is an input's (a view of a host tensor, out=)
            inputs = {id(s) for s in _storages((args, tuple(kwargs.values())), [])}
            for s in fresh:
                if id(s) not in inputs and not held(s):
                    new += s.nbytes()
                    self.meter.track(s)
        if self.observer is not None:
            self.observer.after_op(new)
        return out
