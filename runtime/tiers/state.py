"""Where training state lives: the device tier (accounted, budgeted) and the host tier.

Every parameter, buffer, gradient and optimizer-state tensor has one home tier at
a time; the tensor objects the user and the optimizer hold never change, only
what they point to (``param.data``, ``param.grad``, ``optimizer.state[p][k]``),
as ZeRO-Offload does. Moving a tensor between tiers is a real copy, counted in
``moved`` and, on the device side, in the ``MemoryMeter``.
"""
from __future__ import annotations

import threading
import time
from collections import Counter, deque
from concurrent.futures import Future

import torch

from harmony.base.process import Pool, run_when_idle, started_pool
from harmony.base.units import nbytes
from harmony.runtime.placeholders import is_placeholder, point
from harmony.runtime.precision import GradBuffer, master_grads
from harmony.runtime.tiers.link import EmulatedLink
from harmony.runtime.tiers.memory import MemoryMeter


class CopyEngine:
    """Asynchronous copies: a worker thread on the CPU, a side stream where CUDA exists; copies out of device memory
    (``send``) on a stream of their own, the other copy engine's direction.

    ``late_out`` (a debugging aid, for tests): seconds by which every copy out lands late on the CPU device, where
    they are otherwise made at once. A reader that does not wait for one (``TieredState.landed``) reads NaN or the
    old value, and a test that compares with eager catches it, as a use before the copy lands would on a GPU.
    ``late_in``: the same for copies in (``submit``), whose device tensors ``TieredState.bring`` hands out poisoned
    until they land: a reader that does not join them (``ops.arrived``) reads NaN.
    ``link`` (an ``EmulatedLink``, runtime/tiers/link.py; the CPU device only): every copy is paced to a slower
    link's rate, and copies out run on a thread of their own as a GPU's other copy engine runs them.
    """

    late_out: float | None = None
    late_in: float | None = None

    def __init__(self, device: torch.device, link: EmulatedLink | None = None):
        self.device = device
        self.link = link if device.type != "cuda" else None
        self.pool = started_pool(1, "harmony-copy")    # at this thread's priority, not the idle host thread's
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.out_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.late = None if device.type == "cuda" else self.late_out
        self.late_back = None if device.type == "cuda" else self.late_in
        self.out_pool = started_pool(1, "harmony-copy-out") if self.late is not None or self.link else None

    def submit(self, fn) -> Future:
        if self.stream is None:   # (an emulated link's pace is the job's own: TieredState._copy_in)
            return self.pool.submit(fn) if self.late_back is None else self.pool.submit(_late, self.late_back, fn)
        # The copy writes into blocks the caching allocator handed out on the compute stream, which may have
        # held tensors that kernels queued there still read: the copy starts only after them.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            fn()
        fut: Future = Future()
        event = torch.cuda.Event()
        event.record(self.stream)
        fut.set_result(event)
        return fut

    def submit_host(self, fn) -> Future:
        """Run ``fn`` on the copy thread, its copies to the device on the copy stream: host work first (a gather's
        collective on host tensors, runtime/partitioned/), then copies it queues on the stream current there. Where
        CUDA exists the issuing thread goes on at once (``submit`` there queues the copies inline, which would hold
        it for the host work), and the future's result is the event recorded behind ``fn``'s copies, which ``join``
        makes the compute stream wait for (not a device-wide sync); on the CPU device it is ``submit``: the thread
        runs ``fn`` and the future's result is its own."""
        if self.stream is None:
            return self.submit(fn)
        # the copies write into blocks the caching allocator handed out on the compute stream (as ``submit``'s): they
        # start after the kernels queued there so far, which is now, on the issuing thread
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

        def job():
            with torch.cuda.stream(self.stream):
                fn()
                return self.stream.record_event()
        return self.pool.submit(job)

    def join(self, fut: Future) -> None:
        res = fut.result()
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_event(res)

    def send(self, fn, nbytes: int = 0):
        """Run ``fn``, copies out of device memory (``nbytes`` of them), after the compute issued so far (it wrote
        what they read): on the out stream, returning the event that marks them done; at once on the CPU device
        (None), or on a thread under ``late_out`` or an emulated link (a future)."""
        if self.out_stream is not None:
            self.out_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.out_stream):
                fn()
            event = torch.cuda.Event()
            event.record(self.out_stream)
            return event
        if self.link is not None:
            job = fn if self.late is None else (lambda: _late(self.late, fn))
            return self.out_pool.submit(self.link.run, "d2h", nbytes, job)
        if self.out_pool is not None:
            return self.out_pool.submit(_late, self.late, fn)
        fn()
        return None

    def close(self):
        self.pool.shutdown(wait=True)
        if self.out_pool is not None:
            self.out_pool.shutdown(wait=True)


def _poison(t: torch.Tensor) -> None:
    """A late copy's destination until it lands (``late_out``, ``late_in``: debugging): a reader that does not wait
    for the copy reads NaN (or -1), which a comparison with eager catches."""
    t.fill_(float("nan") if t.is_floating_point() else -1)


def _late(seconds: float, fn) -> None:
    threading.Event().wait(seconds)     # (not time.sleep: tests count the emulated device's sleeps)
    fn()


def _done(handle) -> bool:
    return handle.query() if isinstance(handle, torch.cuda.Event) else handle.done()


def _block(handle) -> None:
    """Wait here, on this thread, until the copies out behind ``handle`` have landed."""
    if isinstance(handle, torch.cuda.Event):
        handle.synchronize()
    else:
        handle.result()


class HostPool(Pool):
    """The host thread: each job first waits for the copies out issued before it was submitted (``landing()``: the
    last one; copies out land in order), since it reads what they write (gradients, optimizer state)."""

    def __init__(self, landing, **kwargs):
        super().__init__(**kwargs)
        self.landing = landing

    def submit(self, fn, /, *args, **kwargs):
        handle = self.landing()
        return super().submit(_after, handle, fn, *args, **kwargs) if handle is not None else \
            super().submit(fn, *args, **kwargs)


def _after(handle, fn, *args, **kwargs):
    _block(handle)
    return fn(*args, **kwargs)


class TieredState:
    """Parameters, buffers, grads and optimizer state of one device and its host, with refcounted residency.

    The host keeps the master copy of every parameter and buffer that is not resident;
    the device copy is a cache, written back only when the optimizer changed it.
    Gradients and optimizer state are moved, not cached.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], optimizers: dict[str, torch.optim.Optimizer],
                 meter: MemoryMeter, device: torch.device, idle_host: bool = True, link: EmulatedLink | None = None):
        self.tensors = tensors            # name -> the user's Parameter / buffer object (never replaced)
        self.optimizers = optimizers      # param name -> the optimizer that steps it
        self.meter = meter
        self.device = device
        self.copier = CopyEngine(device, link)
        self.link = self.copier.link      # an emulated host link's pace (runtime/tiers/link.py), or None
        self.refs: Counter = Counter()    # (kind, name) -> holds on the device copy
        if device.type == "cuda":        # host copies in pinned memory, once: copies from them run async on the
            for t in tensors.values():   # copy stream (a pageable copy blocks the thread that issues it); not a
                if t.device.type == "cpu" and not t.is_pinned() and not is_placeholder(t):   # placeholder's NaN
                    t.data = t.data.pin_memory()
        self.master = {name: t.data for name, t in tensors.items()}  # host copies of params and buffers
        self.dirty: set[str] = set()      # params changed on the device since they came in
        self.parked: dict[str, torch.Tensor] = {}   # param -> its gradient, on another device than its weights
        self.moved = Counter()            # "h2d" / "d2h" -> bytes since the counter was cleared
        self.host_step_seconds = 0.0      # the host thread's time in optimizer updates since the executor cleared it
        self.pin = device.type == "cuda"
        # On the CPU device the host thread shares the cores with the device's compute: its torch ops (the
        # optimizer steps that overlap the next pack's backward) run on one intra-op thread. A second
        # OpenMP team as wide as the machine stalls both teams at their barriers (benchmarks/offload.py's
        # steps were slower with it, and the cores less busy).
        # With ``idle_host`` it also runs at idle priority there (harmony.base.process.run_when_idle): on a core the
        # team and the disk threads leave. (Not where it runs all-reduces: other ranks wait for those.)
        one = device.type == "cpu" and torch.get_num_threads() > 1
        self.host_idle = None             # whether the host thread runs at idle priority (once it has started)
        self.host_pool = HostPool(lambda: self.last_out, max_workers=1, thread_name_prefix="harmony-host",
                                  initializer=self._host_setup if device.type == "cpu" else None,
                                  initargs=(one, idle_host) if device.type == "cpu" else ())
        # Copies out of device memory in flight (``send``), in the order issued: (handle, host storage, host
        # tensor, device tensor). The device tensor stays referenced, so counted on the meter and not reused, until
        # its copy lands; ``landing`` has the last handle of each host storage, for readers of that storage.
        self.outgoing: deque = deque()
        self.landing: dict[int, object] = {}
        self.last_out = None
        self.inflight = 0                 # bytes of the device tensors ``outgoing`` holds
        self._out_lock = threading.Lock()
        meter.settle = self._make_room
        self.pending: dict[str, Future] = {}  # param name -> optimizer step running on the host
        self.disk = None                  # runtime.disk.DiskTier: optimizer state of the disk-placed packs
        self.params_disk = None           # runtime.diskparams.DiskParams: packs wholly on disk (weights too)
        self.compute_dtype = None         # mixed precision: dtype of device copies of float params and buffers
        self.grad_buffer = GradBuffer()   # mixed precision: the host's fp32 gradients of the pack stepping now
        self.shares = None                # runtime.partitioned.Shares: this rank's chunks (shard_state="full")

    def _host_setup(self, one_thread: bool, idle: bool) -> None:
        if one_thread:
            torch.set_num_threads(1)
        self.host_idle = run_when_idle() if idle else False

    def settle(self, names) -> None:
        """Wait for host optimizer steps still updating these parameters."""
        for name in names:
            fut = self.pending.pop(name, None)
            if fut is not None:
                try:
                    fut.result()
                except BaseException:   # report a failed step once, not again for each of its parameters
                    for n in [n for n, f in self.pending.items() if f is fut]:
                        del self.pending[n]
                    raise

    def drain(self) -> None:
        """Wait for every host optimizer step and its disk writes, and every copy out (the end of an iteration)."""
        self.settle(list(self.pending))
        self.land()
        if self.disk is not None:
            self.disk.flush()
        if self.params_disk is not None:
            self.params_disk.flush()

    # torch keeps a parameter's gradient on the parameter's device: on a GPU, a gradient that left the device while
    # its weights are still there (or came back before them) waits here until the two meet again.
    def grad(self, name: str) -> torch.Tensor | None:
        """The gradient of parameter ``name`` wherever it is."""
        parked = self.parked.get(name)
        return parked if parked is not None else self.tensors[name].grad

    def set_grad(self, name: str, g: torch.Tensor | None) -> None:
        t = self.tensors[name]
        self.parked.pop(name, None)
        if g is not None and (g.device != t.device or g.dtype != t.dtype):   # (mixed precision: a compute-dtype
            self.parked[name] = g                                            # gradient beside an fp32 master)
            g = None
        t.grad = g

    def unpark(self, names, convert: bool = True) -> list:
        """Give these host parameters their parked gradients, in the parameter's dtype (fp32 masters: the step).
        ``convert=False``: mixed precision's compute-dtype gradients are returned as (parameter, gradient) pairs
        for ``precision.master_grads`` instead (which converts them into the host thread's buffer)."""
        cast = []
        for name in names:
            g = self.parked.pop(name, None)
            if g is not None:
                t = self.tensors[name]
                if g.dtype == t.dtype:
                    t.grad = g
                else:
                    cast.append((t, g))
        if convert:
            master_grads(cast)
            return []
        return cast

    def set_data(self, name: str, data: torch.Tensor) -> None:
        """Point parameter or buffer ``name`` at ``data``, its gradient following where it can."""
        t = self.tensors[name]
        if (data.device == t.device and data.dtype == t.dtype) or not isinstance(t, torch.nn.Parameter):
            point(t, data)
            return
        g = self.grad(name)
        t.grad = None
        point(t, data)
        self.set_grad(name, g)

    def _on_device(self, t: torch.Tensor) -> bool:
        return self.meter.holds(t)

    def to_host(self, src: torch.Tensor, count: bool = True) -> torch.Tensor:
        """A host copy of a device tensor, made now, counted as bytes moved device-to-host (``count``: the caller
        counts them on the main thread, for a copy made on another)."""
        dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=self.pin)
        started = time.perf_counter()
        dst.copy_(src)
        if self.link is not None:
            self.link.pace("d2h", nbytes(src), started)
        if count:
            self.moved["d2h"] += nbytes(src)
        return dst

    def send(self, src: torch.Tensor, dst: torch.Tensor | None = None) -> torch.Tensor:
        """Copy device tensor ``src`` to the host (into ``dst``, or a new pinned tensor) without waiting for it: a
        reader of the host copy waits for it with ``landed`` (the host thread's jobs and ``drain`` do). ``src`` is
        held until the copy lands, on the meter too. Counted as bytes moved device-to-host."""
        if dst is None:    # its strides too: a value's readers run the kernels they would on the original
            dst = torch.empty_like(src, device="cpu", pin_memory=self.pin)
            if self.copier.late is not None:
                _poison(dst)
        self.moved["d2h"] += nbytes(src)
        handle = self.copier.send(lambda: dst.copy_(src, non_blocking=self.pin), nbytes(src))
        if handle is not None:
            key = id(dst.untyped_storage())
            self._reap()
            with self._out_lock:
                self.outgoing.append((handle, key, dst, src))
                self.landing[key] = self.last_out = handle
                self.inflight += nbytes(src)
        return dst

    def landed(self, t: torch.Tensor, device: bool = False) -> None:
        """Wait until host tensor ``t``'s copy from the device (``send``), if one is in flight, has landed:
        here, or (``device``: a copy to the device reads it next) on the device's current stream."""
        handle = self.landing.get(id(t.untyped_storage())) if self.landing else None
        if handle is None:
            return
        if device and isinstance(handle, torch.cuda.Event):
            torch.cuda.current_stream(self.device).wait_event(handle)
        else:
            _block(handle)

    def land(self) -> None:
        """Wait for every copy out in flight and let go of the device tensors they read."""
        last = self.last_out
        if last is not None:
            _block(last)       # copies out land in order: every one before it has landed too
            self._reap()

    def _make_room(self, limit: int) -> None:
        """The meter's ``settle`` (any thread allocating device memory may call it): the oldest copies out land
        until the device tensors let go of bring the live bytes within ``limit``."""
        while self.meter.live > limit and self._land_oldest():
            pass

    def land_beyond(self, slack: int) -> None:
        """The oldest copies out land until those in flight hold at most ``slack`` bytes of device memory (the
        ``AllocatorMeter``'s runtime, before each op: the room the budget leaves above the plan's peak)."""
        self._reap()
        while self.inflight > slack and self._land_oldest():
            pass

    def _land_oldest(self) -> bool:
        try:
            oldest = self.outgoing[0][0]
        except IndexError:
            return False
        _block(oldest)
        self._reap()
        return True

    def _reap(self) -> None:
        """Let go of the device tensors whose copies out have landed (in order: they land in order)."""
        done = []
        with self._out_lock:
            while self.outgoing and _done(self.outgoing[0][0]):
                entry = self.outgoing.popleft()
                if self.landing.get(entry[1]) is entry[0]:
                    del self.landing[entry[1]]
                self.inflight -= nbytes(entry[3])
                done.append(entry)
            if not self.outgoing:
                self.last_out = None
        del done               # (outside the lock: freeing them calls the meter, which may call ``land``)

    def _slots(self, kind: str, name: str):
        """(read, write) pairs for the tensors of one kind of one parameter."""
        t = self.tensors[name]
        if kind == "params":
            return [(lambda t=t: t.data, lambda d, n=name: self.set_data(n, d))]
        if kind == "grads":
            return [(lambda n=name: self.grad(n), lambda d, n=name: self.set_grad(n, d))]
        state = self.optimizers[name].state.get(t, {}) if name in self.optimizers else {}
        return [((lambda s=state, k=k: s[k]), (lambda d, s=state, k=k: s.__setitem__(k, d)))
                for k, v in state.items() if isinstance(v, torch.Tensor)]

    def fetch(self, kind: str, names: list[str]) -> Future | None:
        """Start bringing ``names`` onto the device: device memory is reserved now, the copy runs async."""
        jobs, reads, from_disk = [], [], []
        if kind == "params":
            self.settle(names)
        for name in names:
            self.refs[(kind, name)] += 1
            if self.refs[(kind, name)] > 1:
                continue
            if kind == "params" and self.params_disk is not None and self.params_disk.holds(name):
                from_disk.append(name)
                continue
            for read, write in self._slots(kind, name):
                src = read()
                if src is None or self._on_device(src):
                    continue
                # mixed precision: a parameter's device copy is cast to the compute dtype, its master stays fp32
                cast = self.compute_dtype if kind == "params" and src.is_floating_point() else None
                dst = torch.empty_like(src, device=self.device, dtype=cast)
                self.meter.track(dst)
                self.moved["h2d"] += nbytes(dst)
                jobs.append((write, dst, src))
        if from_disk:        # weights of packs wholly on disk: read from their files (into device memory on the CPU)
            reads, placed = self.params_disk.read_params(from_disk)
            for name, dst, src in placed:
                jobs.append((lambda d, n=name: self.set_data(n, d), dst, src))
                self.moved["h2d"] += nbytes(dst)
        return self._copy_in(jobs, reads) if jobs else None

    def fetch_master(self, name: str) -> tuple[torch.Tensor, Future]:
        """Start bringing parameter ``name``'s fp32 master to the device as it is (a mixed-precision device step
        steps it there): its device tensor, and the future ``wait`` joins."""
        (dst,), fut = self.bring([self.master[name]])
        return dst, fut

    def bring(self, hosts: list[torch.Tensor]) -> tuple[list[torch.Tensor], Future]:
        """Start copying host tensors to the device on the copy engine: their device tensors, reserved on the meter
        now, and the future ``wait`` joins before anything reads them."""
        jobs = []
        for host in hosts:
            dst = torch.empty_like(host, device=self.device)
            if self.copier.late_back is not None:
                _poison(dst)
            self.meter.track(dst)
            self.moved["h2d"] += nbytes(dst)
            jobs.append((lambda d: None, dst, host))
        return [dst for _, dst, _ in jobs], self._copy_in(jobs)

    def _copy_in(self, jobs: list, reads=()) -> Future:
        """Run ``jobs`` ((write, device tensor, host tensor)) on the copy engine once ``reads`` are done; ``wait``
        hands each device tensor to its ``write``."""
        def copy():
            for r in reads:
                r.result()
            for _, dst, src in jobs:     # a host copy still coming back from the device (``send``): after it
                if dst is not src:
                    self.landed(src, device=True)
            started = time.perf_counter()
            for _, dst, src in jobs:
                if dst is not src:
                    dst.copy_(src, non_blocking=self.pin)
                    if dst.is_cuda:   # freed before its ``wait`` (a failed step), it is not reused while the copy runs
                        dst.record_stream(torch.cuda.current_stream(dst.device))
            if self.link is not None:
                self.link.pace("h2d", sum(nbytes(dst) for _, dst, src in jobs if dst is not src), started)
        fut = self.copier.submit(copy)
        fut.harmony_jobs = jobs
        return fut

    def wait(self, fut: Future | None) -> None:
        if fut is None:
            return
        self.copier.join(fut)
        for write, dst, _ in fut.harmony_jobs:
            write(dst)
        fut.harmony_jobs = ()

    def release(self, kind: str, names: list[str], keep=()) -> None:
        """Drop one hold; the last one sends changed state to the host and frees the device copy.

        ``keep``: names whose device copy stays where it is (gradients a disk step takes from the device).
        """
        for name in names:
            self.refs[(kind, name)] -= 1
            if self.refs[(kind, name)] > 0 or name in keep:
                continue
            if kind == "params":
                t = self.tensors[name]
                if self._on_device(t.data):
                    if name in self.dirty:
                        self.send(t.data, self.master[name])
                    self.set_data(name, self.master[name])
                self.dirty.discard(name)
                continue
            for read, write in self._slots(kind, name):
                v = read()
                if v is not None and self._on_device(v):
                    write(self.send(v))

    def close(self):
        try:
            self.drain()
        finally:
            self.copier.close()
            self.host_pool.shutdown(wait=True)
            if self.disk is not None:
                self.disk.close()
            if self.params_disk is not None:
                self.params_disk.close()
