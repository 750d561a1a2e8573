"""The op table: every schedule op as ``execute`` (real tensors), ``effect`` (predicted memory) and ``cost`` (seconds).

A schedule is a ``torch.fx.Graph`` whose ``call_function`` nodes target the stub
functions below, so ``print(graph.python_code("self").src)`` reads as the plan:

    p0 = swap_in(0, 'params');  wait(p0)
    b0 = load_batch(0, ('idx',))
    a0 = forward(0, 0, b0, keep=False)
    ...

Adding an op is one stub and one ``register`` call: its ``OpDef`` holds everything the runtime, the
verifier (what it needs resident), the simulator (its stream, state copies, disk I/O), the passes and
the drawings (colour, label) use. ``harmony.runtime`` registers every op when it is imported.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from harmony.base.units import nbytes
from harmony.runtime.compression import DEFAULT_MIN_SIZE
from harmony.runtime.plan import NOMINAL_NETWORK_BANDWIDTH, NOMINAL_NETWORK_LATENCY, step_traffic
from harmony.runtime.precision import device_dtype, master_grads


# -- the values that flow between ops ------------------------------------------------------------
@dataclass
class Acts:
    """One microbatch's tensors at a pack boundary (outputs, or gradients of inputs)."""

    values: dict[str, torch.Tensor]
    leaves: dict[str, torch.Tensor] | None = None   # kept forward: detached inputs that collect grads
    outs: dict[str, torch.Tensor] | None = None     # kept forward: outputs still attached to the graph
    on_device: bool = True


@dataclass
class Predicted:
    """What ``effect`` knows of a value: its bytes and where they live."""

    bytes: int
    on_device: bool = True
    kept: int = 0          # activations held for backward (a kept forward)


@dataclass
class MemoryModel:
    """Predicted device bytes while a schedule runs; mirrors ``TieredState`` refcounts."""

    plan: object
    sizes: dict[tuple, int]                 # (kind, name) -> bytes
    refs: dict = field(default_factory=dict)
    live: int = 0
    grads_exist: set = field(default_factory=set)
    dirty: set = field(default_factory=set)
    moved: dict = field(default_factory=lambda: {"h2d": 0, "d2h": 0})
    handed: dict = field(default_factory=dict)   # pack -> gradient bytes its release left for a disk step
    overlapping: int = 0   # bytes an overlapped disk step holds on the device (gradients, handed weights) until the
                           # next

    def hold(self, kind, names, moves: bool = True):
        """Take a reference to each; the first brings its bytes onto the device (``moves``: copied in, else
        already there, as weights the last step left)."""
        for n in names:
            k = (kind, n)
            self.refs[k] = self.refs.get(k, 0) + 1
            if self.refs[k] == 1 and (kind != "grads" or n in self.grads_exist):
                self.live += self.sizes.get(k, 0)
                if moves:
                    self.moved["h2d"] += self.sizes.get(k, 0)

    def drop(self, kind, names, write_back=False, stays=False) -> int:
        """Drop a reference to each; the last takes its bytes off the device, unless ``stays``: released by
        the schedule but still on the device (handed to a disk step, carried to the next iteration).
        Returns those bytes."""
        freed = 0
        for n in names:
            k = (kind, n)
            self.refs[k] -= 1
            if self.refs[k] == 0 and (kind != "grads" or n in self.grads_exist):
                freed += self.sizes.get(k, 0)
                if kind != "params" or write_back:
                    self.moved["d2h"] += self.sizes.get(k, 0)
        if not stays:
            self.live -= freed
        return freed

    def resident(self, kind, name) -> bool:
        return self.refs.get((kind, name), 0) > 0

    def carry_in(self, graph) -> None:
        """The weights the last step left on the device for this one (``swap_in(..., carried=True)``): live from
        the start, held until the forward that takes them releases them; nothing moves."""
        for n in graph.nodes:
            if n.op == "call_function" and n.target is swap_in and n.kwargs.get("carried"):
                self.hold("params", carried_names(self.plan, n.args[0]), moves=False)


def _needs_nothing(kwargs) -> tuple:
    return ()


def _label_args(args, kwargs) -> str:
    return ", ".join(_short(a) for a in args)


def _short(a) -> str:
    if hasattr(a, "name") and not isinstance(a, str):   # a value another op made
        return a.name
    if isinstance(a, (tuple, list)):
        return ",".join(_short(x) for x in a) or "()"
    return str(a)


@dataclass(frozen=True)
class OpDef:
    """Everything the runtime, verifier, simulator, passes and drawings know about one schedule op."""

    stub: Callable       # the function a schedule graph calls (its name is the op's name)
    execute: Callable    # (runtime, *args, **kwargs) -> value: real tensors
    effect: Callable     # (model, *args, **kwargs) -> (Predicted | None, transient bytes above live)
    cost: Callable       # (plan, hw, *args, **kwargs) -> (stream name, seconds)
    kind: str            # "compute" | "copy" | "sync": the stream family it runs on
    needs: Callable = _needs_nothing   # (kwargs) -> state kinds of its pack (args[0]) resident on the device
    state_copy: bool = False           # moves its pack's state of one kind (args (pack, kind)) across the link:
                                       # the simulator times what the effect really moves
    disk_io: Callable | None = None    # (plan, node, hw) -> {"read": s, "write": s} of disk I/O around it
    colour: str = ""                   # fill in drawings ("": its kind's)
    label: Callable = _label_args      # (args, kwargs) -> the second line of its label in drawings

    @property
    def name(self) -> str:
        return self.stub.__name__


# -- stubs: the names a schedule graph calls ----------------------------------------------------
def swap_in(pack: int, what: str, held: tuple = (), carried: bool = False): ...
def wait(handle): ...
def release(pack: int, what: str, handoff: bool = False, held: tuple = (), carry: bool = False): ...
def load_batch(mb: int, names: tuple): ...
def forward(pack: int, mb: int, *inputs, keep: bool = False): ...
def backward(pack: int, mb: int, *inputs, saved=None, grads=()): ...
def stash(value): ...
def unstash(value): ...
def step(pack: int, stream: bool = False, where: str = "device", overlap: bool = False): ...


OPS: dict[Callable, OpDef] = {}   # stub -> its definition; filled as harmony.runtime is imported


def register(stub, execute, effect, cost, kind, **more) -> OpDef:
    """Add an op: ``stub`` is what schedule graphs call; ``more`` any other ``OpDef`` field."""
    OPS[stub] = op = OpDef(stub, execute, effect, cost, kind, **more)
    return op


def op_of(node) -> OpDef:
    return OPS[node.target]


def op_named(name: str) -> OpDef | None:
    return next((op for op in OPS.values() if op.name == name), None)


def state_names(spec, what: str) -> list[str]:
    """The state of one kind a pack needs: params (with buffers), grads, or optimizer state."""
    if what == "params":
        return spec.params + spec.buffers
    if what == "grads":
        return spec.params
    return spec.stepped


def moving_names(spec, what: str, held=()) -> list[str]:
    """The names a ``swap_in`` or ``release`` moves: the pack's state of that kind but those ``held`` on the device
    across it (weights of a host-stepped pack kept between two visits, parameter by parameter)."""
    names = state_names(spec, what)
    if not held:
        return names
    held = set(held)
    return [n for n in names if n not in held]


def carried_names(plan, pack: int) -> list[str]:
    """The weights of a wholly-disk pack that its step can leave on the device for the next iteration's forward
    (``plan.carried``, the graph's ``carry``/``carried``): those of its files on disk. A file kept in host
    memory (``plan.disk_in_memory``) is stepped there and copied in for each use, carried or not."""
    in_memory = set((getattr(plan, "disk_in_memory", None) or {}).get(pack, ()))
    return [n for i, names in enumerate(plan.disk_groups.get(pack, ())) if i not in in_memory for n in names]


def resident_state(plan):
    """(kind, names) held on the device for the whole run: whole packs' state, single parameters' optimizer state,
    and all the state of single parameters of host-stepped packs that step on the device."""
    for pack, what in sorted(plan.resident):
        yield what, state_names(plan.packs[pack], what)
    if getattr(plan, "optim_resident", None):
        yield "optim", sorted(plan.optim_resident)
    parts = sorted(getattr(plan, "device_parts", None) or ())
    if parts:            # single parameters of host-stepped packs that step on the device: all their state stays
        for what in ("params", "grads", "optim"):
            yield what, parts


# -- swap_in / wait / release ------------------------------------------------------------------
def _swap_in_execute(rt, pack, what, held=(), carried=False):
    # ``carried``: the disk tier hands over the weights its last step left on the device instead of reading them
    return rt.state.fetch(what, moving_names(rt.plan.packs[pack], what, held))


def _swap_in_effect(m, pack, what, held=(), carried=False):
    names = moving_names(m.plan.packs[pack], what, held)
    if carried:     # on the device since the last step: ``memory_curve`` holds them from the start of the step
        carry = set(carried_names(m.plan, pack))
        names = [n for n in names if n not in carry]
    m.hold(what, names)
    return None, 0


def _held_bytes(plan, held) -> int:
    return sum((getattr(plan, "params_held", None) or {}).get(n, 0) for n in held)


def _swap_in_cost(plan, hw, pack, what, held=(), carried=False):
    spec = plan.packs[pack]
    size = {"params": spec.param_bytes + spec.buffer_bytes, "grads": spec.param_bytes,
            "optim": spec.optim_bytes}[what]
    if carried:
        size *= (getattr(plan, "disk_in_memory_share", None) or {}).get(pack, 0.0)   # only the files in memory
    return "h2d", max(0, size - _held_bytes(plan, held)) / hw.h2d_bandwidth


def _wait_execute(rt, handle):
    rt.state.wait(handle)


def _release_execute(rt, pack, what, handoff=False, held=(), carry=False):
    keep = ()
    pd = rt.state.params_disk
    if handoff and pd is not None:   # the disk step after it takes this pack's own gradients from the device
        keep = {n for n in rt.plan.packs[pack].owned if pd.holds(n)}
    rt.state.release(what, moving_names(rt.plan.packs[pack], what, held), keep=keep)


def _release_effect(m, pack, what, handoff=False, held=(), carry=False):
    names = moving_names(m.plan.packs[pack], what, held)
    if carry and what == "params":   # stepped where they are and kept there for the next forward: live to the end
        kept = set(carried_names(m.plan, pack))
        m.drop(what, [n for n in names if n in kept], stays=True)
        names = [n for n in names if n not in kept]
    if handoff:    # the pack's own gradients stay on the device until the disk step after it takes them
        owned = [n for n in names if n in set(m.plan.packs[pack].owned)]
        names = [n for n in names if n not in set(owned)]
        m.handed[pack] = m.handed.get(pack, 0) + m.drop(what, owned, stays=True)
    changed = [n for n in names if n in m.dirty]     # only what changed goes back (a shard's params, say)
    m.drop(what, [n for n in names if n not in m.dirty])
    m.drop(what, changed, write_back=True)
    if what == "params":
        m.dirty -= {n for n in names if m.refs.get(("params", n), 0) == 0}
    return None, 0


def _release_cost(plan, hw, pack, what, handoff=False, held=(), carry=False):
    spec = plan.packs[pack]
    # the whole write-back; the simulator scales it by what the effect moves (dirty params, existing grads)
    size = {"params": spec.param_bytes, "grads": spec.param_bytes, "optim": spec.optim_bytes}[what]
    return "d2h", max(0, size - _held_bytes(plan, held)) / hw.d2h_bandwidth


def _no_effect(m, *args, **kwargs):
    return None, 0


def _free(plan, hw, *args, **kwargs):
    return "sync", 0.0


# -- load_batch / stash / unstash ------------------------------------------------------------
def _load_batch_execute(rt, mb, names):
    b = rt.plan.microbatch_size
    out = {}
    for n in names:
        src = rt.batch[n][mb * b:(mb + 1) * b]
        dst = torch.empty(src.shape, dtype=device_dtype(src, rt.compute_dtype), device=rt.device)
        rt.meter.track(dst)
        dst.copy_(src)
        rt.state.moved["h2d"] += nbytes(dst)
        out[n] = dst
    return Acts(out)


def _load_batch_effect(m, mb, names):
    size = sum(m.plan.batch_bytes[n] for n in names)
    m.moved["h2d"] += size
    return Predicted(size), 0


def _load_batch_cost(plan, hw, mb, names):
    return "h2d", sum(plan.batch_bytes[n] for n in names) / hw.h2d_bandwidth


def _stash_execute(rt, acts):
    return Acts({k: rt.state.to_host(v) if isinstance(v, torch.Tensor) else v for k, v in acts.values.items()},
                on_device=False)


def _stash_effect(m, value):
    m.moved["d2h"] += value.bytes
    return Predicted(value.bytes, on_device=False), 0


def _unstash_execute(rt, acts):
    out = {}
    for k, v in acts.values.items():
        if not isinstance(v, torch.Tensor):
            out[k] = v
            continue
        dst = torch.empty_like(v, device=rt.device)
        rt.meter.track(dst)
        dst.copy_(v)
        rt.state.moved["h2d"] += nbytes(dst)
        out[k] = dst
    return Acts(out)


def _unstash_effect(m, value):
    m.moved["h2d"] += value.bytes
    return Predicted(value.bytes), 0


def _stash_cost(plan, hw, value):
    # one cost for both directions: stash reads a value on the device, unstash one on the host
    if value.on_device:
        return "d2h", value.bytes / hw.d2h_bandwidth
    return "h2d", value.bytes / hw.h2d_bandwidth


# -- forward / backward / step -----------------------------------------------------------------
def _gather(spec, handles):
    found = {}
    for h in handles:
        found.update(h.values)
    return [found[n] for n in spec.inputs]


def _forward_execute(rt, pack, mb, *inputs, keep=False):
    spec = rt.plan.packs[pack]
    xs = _gather(spec, inputs)
    if spec.random and not keep:     # a recompute replays the forward's random numbers
        rt.rng[(pack, mb)] = _rng_state(rt.device)
    with rt.counting():
        if keep:
            leaves = {n: _leaf(x, n not in rt.plan.input_names) for n, x in zip(spec.inputs, xs)}
            with torch.enable_grad(), _state_by_name(rt, spec):
                outs = spec.module(*leaves.values())
            outs = dict(zip(spec.outputs, outs))
            values = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in outs.items()}
            result = Acts(values, leaves=leaves, outs=outs)
        else:
            with torch.no_grad():
                outs = spec.module(*xs)
            result = Acts(dict(zip(spec.outputs, outs)))
    rt.state.dirty.update(spec.mutated)
    if "loss" in result.values:
        rt.losses.append(result.values["loss"].detach().clone())
    return result


def _rng_state(device: torch.device):
    """The generator a pack's random ops draw from: the CPU's, and on a GPU the GPU's (dropout there uses it)."""
    return (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _set_rng_state(device: torch.device, state) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _state_by_name(rt, spec):
    """Saved-tensor hooks under which a kept graph holds a parameter's name, not its device copy.

    Autograd saves the weights a layer's backward needs (``addmm`` saves a view of the
    weight), which would keep the forward's device copy alive after the pack's release
    until its backward. Instead a saved tensor that views a parameter or buffer of the pack
    is stored as (name, size, stride, offset) and rebuilt from whatever copy is on the
    device when the backward unpacks it: the same values, since the step comes after the
    backward (as ZeRO-3's parameter offload does).
    """
    if "loss" in spec.outputs:       # the last pack's backward follows at once, its weights still on the device
        return contextlib.nullcontext()   # (and a Python hook per saved tensor costs ~10% of a small model's step)
    if rt.on_demand is not None:     # it fetches and evicts inside the forward: a freed weight's address can
        return contextlib.nullcontext()   # come back as an activation's, so it keeps the graph's tensors as they are
    names: dict[int, list] = {}       # storage -> its parameters (a disk group's share one buffer)
    for n in spec.params + spec.buffers:
        data = rt.state.tensors[n].data
        ptr = data.untyped_storage().data_ptr()
        if ptr:
            names.setdefault(ptr, []).append((n, data.storage_offset(), data.storage_offset() + data.numel()))

    def pack(x):
        for n, start, end in names.get(x.untyped_storage().data_ptr(), ()) if x.layout == torch.strided else ():
            if start <= x.storage_offset() < end:   # offset from the parameter's own start: its next copy may
                return n, x.size(), x.stride(), x.storage_offset() - start   # sit elsewhere in its buffer
        return x

    def unpack(h):
        if isinstance(h, torch.Tensor):
            return h
        n, size, stride, offset = h
        data = rt.state.tensors[n].data
        return data.as_strided(size, stride, data.storage_offset() + offset)
    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _leaf(x, grad: bool):
    if not isinstance(x, torch.Tensor):
        return x
    return x.detach().requires_grad_(grad and x.is_floating_point())


def _forward_effect(m, pack, mb, *inputs, keep=False):
    spec = m.plan.packs[pack]
    m.dirty.update(spec.mutated)      # running statistics changed: written back with the pack's release
    if keep:
        # the graph may hold the pack's inputs (a first op that saves its input) after the value that brought
        # them dies, until the backward; not when that value is a kept forward's own, which lives until its
        # (later) backward, nor for the last pack, whose backward follows at once (its measured backward peak,
        # which counts a seed the runtime does not allocate, covers that)
        last = "loss" in spec.outputs
        retained = 0 if last or any(isinstance(v, Predicted) and v.kept for v in inputs) else spec.in_bytes
        held = spec.saved_bytes + retained
        return Predicted(spec.out_bytes + held, kept=held), spec.fwd_keep_peak
    return Predicted(spec.out_bytes), spec.fwd_peak


def _pack_compute_cost(hw, flops: float, tensor_ops: float) -> float:
    """Seconds of compute on ``hw``: FLOPs at the rate a layer pack sustains, plus a fixed cost per tensor op.

    The rate is the peak times the device's ``efficiency`` (matmuls at a pack's shapes and the
    memory-bound ops around them); each tensor op (kernel) pays ``kernel_latency`` (launch,
    dispatch, the runtime's accounting), and the schedule op itself ``op_latency``. On a device whose
    ops are ``queued`` (a GPU) the launches overlap the kernels: the longer of the two counts.
    """
    rate = hw.flops * getattr(hw, "efficiency", 1.0)
    launches = tensor_ops * getattr(hw, "kernel_latency", 0.0)
    if getattr(hw, "queued", False):      # a GPU runs queued kernels while the host issues the next ones
        return max(flops / rate, launches) + hw.op_latency
    return flops / rate + launches + hw.op_latency


def _kernels_cost(spec, phase: str) -> float:
    """Tensor ops one ``phase`` ("forward", "backward", "step") of a pack dispatches, estimated.

    The plan does not keep the ops a pack dispatches, so they are estimated from the
    parameter tensors it reads, which they follow closely in layer stacks: a linear layer's
    weight and bias take a matmul, a view and an add forward and about twice that backward.
    Counted on the built-in GPT (fx front end, packs of one to three blocks): 2.6 to 2.8
    ops per parameter tensor forward, 5.6 to 5.9 backward (without the recompute), and
    21 per parameter for an Adam(W) step (its for-loop implementation, the CPU default).
    """
    per_tensor = {"forward": 2.7, "backward": 5.8, "step": 21.0}[phase]
    tensors = len(spec.stepped) if phase == "step" else len(spec.params) + len(spec.buffers)
    return per_tensor * max(tensors, 1)


def _forward_cost(plan, hw, pack, mb, *inputs, keep=False):
    spec = plan.packs[pack]
    return "compute", _pack_compute_cost(hw, spec.fwd_flops, _kernels_cost(spec, "forward"))


def _backward_execute(rt, pack, mb, *inputs, saved=None, grads=()):
    spec = rt.plan.packs[pack]
    with rt.counting():
        if saved is None:  # recompute the pack's forward from its stashed inputs
            leaves = {n: _leaf(x, n not in rt.plan.input_names)
                      for n, x in zip(spec.inputs, _gather(spec, inputs))}
            restore = [(t, t.clone()) for t in (rt.state.tensors[n] for n in spec.mutated)]
            rng = _rng_state(rt.device) if spec.random else None
            if spec.random:
                _set_rng_state(rt.device, rt.rng.pop((pack, mb)))
            with torch.enable_grad():
                outs = dict(zip(spec.outputs, spec.module(*leaves.values())))
            if rng is not None:
                _set_rng_state(rt.device, rng)
        else:
            leaves, outs, restore = saved.leaves, saved.outs, []
        if "loss" in outs:   # the seed is fp32 (a no-op in fp32); fp16 scales it (GradScaler.scale)
            seed = outs["loss"].float() / rt.plan.microbatches
            tensors, seeds = [seed if rt.scaler is None else rt.scaler.scale_loss(seed)], [None]
        else:
            upstream: dict[str, torch.Tensor] = {}
            for g in grads:
                for k, v in g.values.items():
                    upstream[k] = upstream[k] + v if k in upstream else v
            pairs = [(outs[k], upstream[k]) for k in spec.outputs
                     if k in upstream and isinstance(outs[k], torch.Tensor) and outs[k].requires_grad]
            tensors, seeds = [p[0] for p in pairs], [p[1] for p in pairs]
        if tensors:
            torch.autograd.backward(tensors, seeds)
        for t, old in restore:  # running statistics advance once per microbatch, not again on recompute
            t.copy_(old)        # (after backward: batch norm saves them for it)
        result = Acts({n: x.grad for n, x in leaves.items()
                       if isinstance(x, torch.Tensor) and x.grad is not None and n not in rt.plan.input_names})
    if saved is not None:
        saved.leaves = saved.outs = None
    return result


def _backward_effect(m, pack, mb, *inputs, saved=None, grads=()):
    spec = m.plan.packs[pack]
    accumulate = bool(spec.params) and all(n in m.grads_exist for n in spec.params)
    if saved is None:
        transient = spec.bwd_recompute_peak_accum if accumulate else spec.bwd_recompute_peak
    else:
        transient = spec.bwd_peak_accum if accumulate else spec.bwd_peak
    new = 0
    for n in spec.params:
        if n not in m.grads_exist:
            m.grads_exist.add(n)
            if m.resident("grads", n):
                new += m.sizes[("grads", n)]
    m.live += new
    return Predicted(spec.in_bytes), transient


def _backward_cost(plan, hw, pack, mb, *inputs, saved=None, grads=()):
    spec = plan.packs[pack]
    recompute = saved is None
    flops = spec.bwd_flops + (spec.fwd_flops if recompute else 0)
    ops = _kernels_cost(spec, "backward") + (_kernels_cost(spec, "forward") if recompute else 0)
    return "compute", _pack_compute_cost(hw, flops, ops)


def _step_execute(rt, pack, stream=False, where="device", overlap=False):
    """The optimizer update of the parameters whose gradients this pack completed.

    ``where="disk"``: the pack's weights and optimizer state are in files; its gradients
    leave the device a group at a time as the groups step on the host (runtime/diskparams.py).
    ``overlap``: that step runs on the host thread while the device runs the next pack's
    backward; the next such step first waits for it, so at most one is under way and the
    device holds its pack's gradients until it has taken them.
    ``where="host"``: the pack's gradients and weights are already on the host (its
    releases ran first); the optimizer steps the host copies on a host thread, overlapped
    with the next pack's backward, and the pack's next swap_in waits for it (ZeRO-Offload).
    Its parameters in ``plan.device_parts`` (all their state resident) step first, here, on
    the device, one at a time; the host step leaves them (their gradients are gone by then).
    With mixed precision the host gradients arrive in the compute dtype and become fp32 first;
    under fp16 loss scaling they are unscaled and checked here, and the update waits for
    ``LossScaler.finish`` (runtime/precision.py).
    ``stream``: the optimizer state lives on the host; bring each parameter's in, step it
    alone on the device, and send it back, so the device holds one parameter's state at a time.
    """
    spec = rt.plan.packs[pack]
    if where == "disk":      # weights and state in files: step group by group (runtime/diskparams.py)
        pd = rt.state.params_disk
        if not overlap:
            pd.step(pack, rt.state.to_host)
            return
        pd.join()            # the previous overlapped step (the memory plan frees its gradients here)
        handed = [rt.state.tensors[n].grad for n in spec.owned]
        rt.state.moved["d2h"] += sum(nbytes(g) for g in handed if g is not None and rt.meter.holds(g))
        fut = pd.step_in_background(rt.state.host_pool, pack, lambda g: rt.state.to_host(g, count=False))
        rt.state.pending.update((n, fut) for n in spec.owned)
        return
    if where == "host":
        on_device = _device_parts(rt.plan, spec)
        if on_device:
            with rt.counting():
                for n in on_device:
                    _step_one(rt.state.optimizers[n], rt.state.tensors[n])
            for n in on_device:
                rt.state.tensors[n].grad = None
            rt.state.dirty.update(on_device)
            if len(on_device) == len(spec.stepped):    # nothing left for the host to step
                return
        params = [rt.state.tensors[n] for n in spec.owned]
        opts = list(dict.fromkeys(rt.state.optimizers[n] for n in spec.stepped))
        disk = getattr(rt.state, "disk", None)   # optimizer state of disk-placed packs (runtime/disk.py)

        def update(skip=False):
            rt.state.unpark(spec.owned)   # gradients that reached the host before their weights (TieredState.parked)
            if disk is not None:   # read ahead the next disk pack's state; bring in this one's if on disk
                disk.begin(pack)
            try:
                for opt in opts:
                    if not skip:
                        opt.step()
            except BaseException:
                if disk is not None:
                    disk.abort(pack)
                raise
            if disk is not None:   # write it back; placeholders stay in the optimizer until the next step
                disk.end(pack)
            for p in params:
                p.grad = None

        def check_then_update():   # mixed precision: fp32 gradients; fp16: unscaled, checked, step deferred
            rt.state.unpark(spec.owned)
            master_grads(params)
            if rt.scaler is None:
                return update()
            rt.scaler.unscale([p.grad for p in params if p.grad is not None])
            rt.scaler.defer(update)
        fut = rt.state.host_pool.submit(update if rt.compute_dtype is None else check_then_update)
        rt.state.pending.update((n, fut) for n in spec.stepped if n not in on_device)
        return
    if not stream:
        with rt.counting():
            for opt in dict.fromkeys(rt.state.optimizers[n] for n in spec.stepped):
                opt.step()
    else:
        for n in spec.stepped:    # moves happen outside the counting mode: host copies are not device bytes
            rt.state.wait(rt.state.fetch("optim", [n]))
            with rt.counting():
                _step_one(rt.state.optimizers[n], rt.state.tensors[n])
            rt.state.release("optim", [n])
    for n in spec.owned:      # sharded: the gradients of params other ranks step are dropped too
        rt.state.tensors[n].grad = None
    rt.state.dirty.update(spec.stepped)


def device_part_bytes(plan, spec) -> dict[str, int]:
    """The fp32 bytes of each of the pack's parameters that step on the device though the pack steps on the host."""
    sizes = getattr(plan, "device_part_bytes", None) or {}
    return {n: sizes.get(n, 0) for n in _device_parts(plan, spec)}


def _share_traffic(spec, master: float) -> float:
    """``step_traffic`` of ``master`` fp32 bytes of the pack's parameters, with their share of its optimizer state."""
    whole = spec.master_bytes or spec.param_bytes
    return step_traffic(master, spec.optim_bytes * master / whole if whole else 0)


def device_part_cost(plan, hw, pack: int) -> float:
    """Seconds a host-stepped pack's ``step`` spends on the compute stream first, stepping its ``plan.device_parts``
    on the device one at a time: their traffic at the device's memory bandwidth and their tensor ops."""
    spec = plan.packs[pack]
    parts = device_part_bytes(plan, spec)
    if not parts:
        return 0.0
    ops = _kernels_cost(spec, "step") / max(1, len(spec.stepped)) * len(parts)
    return _share_traffic(spec, sum(parts.values())) / hw.memory_bandwidth + _pack_compute_cost(hw, 0, ops)


def _device_parts(plan, spec) -> list[str]:
    """The pack's parameters that step on the device though the pack steps on the host."""
    parts = getattr(plan, "device_parts", None) or {}
    return [n for n in spec.stepped if n in parts] if parts else []


def _step_one(opt: torch.optim.Optimizer, param: torch.Tensor) -> None:
    """Step one parameter with its optimizer: its group sees only it for the call."""
    for group in opt.param_groups:
        if any(p is param for p in group["params"]):
            kept, group["params"] = group["params"], [param]
            try:
                opt.step()
            finally:
                group["params"] = kept
            return


def _step_effect(m, pack, stream=False, where="device", overlap=False):
    spec = m.plan.packs[pack]
    if where in ("host", "disk"):   # gradients left with the pack's release (a disk step takes them now)
        on_device = _device_parts(m.plan, spec) if where == "host" else []
        for n in on_device:         # but those of parameters stepping on the device: they go with the step
            if n in m.grads_exist and m.resident("grads", n):
                m.live -= m.sizes[("grads", n)]
        m.dirty.update(on_device)
        m.grads_exist -= set(spec.owned)
        if overlap:                 # the previous overlapped step has taken its gradients; this one holds its own
            m.live -= m.overlapping
            m.overlapping = m.handed.pop(pack, 0)
        else:
            m.live -= m.handed.pop(pack, 0)
        return None, max((m.plan.device_parts[n] for n in on_device), default=0)
    for n in spec.owned:
        if n in m.grads_exist:
            m.grads_exist.discard(n)
            if m.resident("grads", n):
                m.live -= m.sizes[("grads", n)]
    m.dirty.update(spec.stepped)
    if stream:   # what is not held on the device comes in and goes back out
        moved = sum(m.sizes.get(("optim", n), 0) for n in spec.stepped if not m.resident("optim", n))
        m.moved["h2d"] += moved
        m.moved["d2h"] += moved
        return None, spec.stream_step_peak
    return None, spec.step_extra


def _step_cost(plan, hw, pack, stream=False, where="device", overlap=False):
    """An optimizer step is memory-bound: its traffic at memory bandwidth, plus a fixed cost per tensor op.

    Traffic: ``plan.step_traffic``, 4 x (2 P + O) bytes. A streamed step also copies each parameter's optimizer state in
    and back out, one parameter at a time, on the compute stream's critical path.
    """
    spec = plan.packs[pack]
    traffic = step_traffic(spec.param_bytes, spec.optim_bytes)
    if where in ("host", "disk"):   # the host's own memory, outside the runtime's accounting: plain dispatch
        master = spec.master_bytes or spec.param_bytes      # fp32 masters, less those stepped on the device first
        host = master - sum(device_part_bytes(plan, spec).values()) if where == "host" else master
        traffic = _share_traffic(spec, host)
        return "host", traffic / getattr(hw, "host_memory_bandwidth", hw.memory_bandwidth)
    seconds = traffic / hw.memory_bandwidth + _pack_compute_cost(hw, 0, _kernels_cost(spec, "step"))
    if stream:
        optim = streamed_optim_bytes(plan, pack)
        seconds += optim / hw.h2d_bandwidth + optim / hw.d2h_bandwidth
    return "compute", seconds


def streamed_optim_bytes(plan, pack: int) -> int:
    """A streamed step's optimizer state that comes in and goes out: the pack's, less what stays resident."""
    spec = plan.packs[pack]
    kept = getattr(plan, "optim_resident", None) or {}
    return spec.optim_bytes - sum(kept.get(n, 0) for n in spec.stepped)


# -- allreduce: data-parallel gradient averaging (inserted by the compress pass) ----------------------
def allreduce(pack: int, kind: str = "none", *, world: int = 1, where: str = "device", sync: bool = False,
              min_size: int = DEFAULT_MIN_SIZE, warmup: int = 0, weight: float | None = None, **spec): ...


def _allreduce_execute(rt, pack, kind="none", *, world=1, where="device", sync=False, min_size=DEFAULT_MIN_SIZE,
                       warmup=0, weight=None, **spec):
    """Average the pack's gradients over ranks.

    ``where="host"``: the gradients were released to the host; average the host copies on the host
    thread, ahead of the host step queued behind it (its future joins the step's drain).
    Otherwise the gradients are on the device: average them on the host thread, counted on the
    device meter, and return a future a ``wait`` joins (``sync``: join it here). The ondemand
    runtime reduces on the main thread, where it moves state as ops touch it. ``weight``: this rank's
    share of the global batch (ranks of a balanced plan train on different numbers of samples).
    """
    from concurrent.futures import Future

    from harmony.runtime.communicator import communicator
    from harmony.runtime.memory import CountAllocations
    first = next((n.args[0] for n in rt.graph.nodes if n.op == "call_function" and n.target is allreduce), None)
    comm = communicator(rt, first, kind, world, min_size, warmup, spec, weight)
    if rt.on_demand is not None:
        with rt.counting():
            comm.reduce(rt, pack)
        fut = Future()
        fut.set_result(None)
    elif where == "host":
        def job():
            try:
                comm.reduce(rt, pack)
            except BaseException:       # the host step behind it must not apply un-averaged gradients
                for n in rt.plan.packs[pack].owned:
                    rt.state.tensors[n].grad = None
                raise
        rt.state.pending[("allreduce", pack)] = rt.state.host_pool.submit(job)
        return None
    else:
        def job():
            with CountAllocations(rt.meter):
                comm.reduce(rt, pack)
        fut = rt.state.host_pool.submit(job)
        if sync:
            fut.result()
    fut.harmony_jobs = ()            # what ``TieredState.wait`` expects of a copy's future
    return fut


def _comm_buffer_bytes(grad_bytes: int, kind: str, world: int, bits: int = 4, error_feedback: bool = False) -> int:
    """Device bytes an all-reduce of ``grad_bytes`` of fp32 gradients allocates at its peak.

    The fused fp32 buffer (1x); fp16/bf16 add the half copy and the fp32 result (2.5x in all);
    quantized adds the quantizer's temporaries, the packed chunks sent and received, and the
    decoded chunk, per rank's share of the buffer: 1.3x + (2.3 + 0.15 bits) / world, fitted to
    measurements on 2 and 3 ranks at 1 to 8 bits (2.0x to 3.0x) with 3% to spare. Error feedback
    adds a residual buffer (1x).
    """
    if kind == "none":
        factor = 1.0
    elif kind in ("fp16", "bf16"):
        factor = 2.5
    else:
        factor = 1.3 + (2.3 + 0.15 * bits) / max(world, 1)
    return int(grad_bytes * (factor + (1.0 if error_feedback else 0.0)))


def _allreduce_effect(m, pack, kind="none", *, world=1, where="device", sync=False, bits=4, error_feedback=False,
                      **kw):
    if where == "host":             # the host copies: nothing on the device
        return None, 0
    grads = sum(m.sizes.get(("grads", n), 0) for n in m.plan.packs[pack].owned)
    held = _comm_buffer_bytes(grads, kind, world, bits, error_feedback)
    if sync:
        return None, held
    return Predicted(held), 0       # in flight until the ``wait`` that joins it


def _allreduce_cost(plan, hw, pack, kind="none", *, world=1, bits=4, **kw):
    """Ring all-reduce bytes (fp32, half) or scatter-reduce + all-gather of packed levels, at network speed.

    The pack's parameter bytes stand for its owned gradients (equal unless a weight is shared).
    """
    size = plan.packs[pack].param_bytes
    per_byte = {"none": 1.0, "fp16": 0.5, "bf16": 0.5}.get(kind, bits / 32 + 2 * 4 / 512 / 4)
    sent = 2 * (world - 1) / max(world, 1) * size * per_byte
    bandwidth = getattr(hw, "network_bandwidth", NOMINAL_NETWORK_BANDWIDTH)
    return "network", sent / bandwidth + 2 * (world - 1) * getattr(hw, "network_latency", NOMINAL_NETWORK_LATENCY)


# -- what the simulator and drawings need besides ------------------------------------------------
def _disk_io(plan, node, hw) -> dict:
    """Seconds a ``swap_in`` or ``step`` reads from and writes to disk (runtime/disk.py, runtime/diskparams.py).

    A ``swap_in`` of a wholly-disk pack's weights reads them (unless the last step left them on the device:
    ``carried``); the step of a wholly-disk pack reads and writes its files (weights and optimizer state), that
    of a pack with optimizer state alone on disk reads and writes that state. Files kept in host memory
    (``plan.disk_in_memory``) are neither read nor written.
    """
    pack = node.args[0]
    spec = plan.packs[pack]
    whole = (getattr(plan, "master_on", None) or {}).get(pack) == "disk"
    optim = (getattr(plan, "optim_on", None) or {}).get(pack) == "disk"
    read = written = 0
    on_disk = 1 - (getattr(plan, "disk_in_memory_share", None) or {}).get(pack, 0.0)
    if node.target is swap_in and node.args[1] == "params" and whole and not node.kwargs.get("carried"):
        read = spec.param_bytes * on_disk
    elif node.target is step and (whole or optim):
        written = (spec.optim_bytes + (spec.param_bytes if whole else 0)) * on_disk
        read = written
    rbw = getattr(hw, "disk_read_bandwidth", 0) or 1e30
    wbw = getattr(hw, "disk_write_bandwidth", 0) or 1e30
    return {"read": read / rbw, "write": written / wbw}


def _step_needs(kwargs) -> tuple:
    if kwargs.get("where", "device") in ("host", "disk"):
        return ()                      # the host copies are stepped
    if kwargs.get("stream"):
        return ("params", "grads")     # it brings the optimizer state in itself, a parameter at a time
    return ("params", "grads", "optim")


def _pack_mb(args, kwargs) -> str:
    if len(args) < 2:
        return _label_args(args, kwargs)
    keep = " · keep" if kwargs.get("keep") else ""
    recompute = " · recompute" if "saved" in kwargs and kwargs["saved"] is None else ""
    return f"pack {args[0]} · mb {args[1]}{keep}{recompute}"


def _pack_what(args, kwargs) -> str:
    return f"pack {args[0]} {args[1]}" if len(args) >= 2 else _label_args(args, kwargs)


def _step_label(args, kwargs) -> str:
    where = kwargs.get("where", "device")
    return (f"pack {args[0]}" + (f" · {where}" if where != "device" else "")
            + (" · overlapped" if kwargs.get("overlap") else "")) if args else ""


def _batch_label(args, kwargs) -> str:
    return f"mb {args[0]} {_short(args[1])}" if len(args) >= 2 else _label_args(args, kwargs)


# colours: compute blues, state copies orange, activation copies purple, sync grey, optimizer green, network reds
register(swap_in, _swap_in_execute, _swap_in_effect, _swap_in_cost, "copy", state_copy=True, disk_io=_disk_io,
         colour="#fdae6b", label=_pack_what)
register(wait, _wait_execute, _no_effect, _free, "sync", colour="#d9d9d9")
register(release, _release_execute, _release_effect, _release_cost, "copy", state_copy=True, colour="#fdd0a2",
         label=_pack_what)
register(load_batch, _load_batch_execute, _load_batch_effect, _load_batch_cost, "copy", colour="#fee6ce",
         label=_batch_label)
register(stash, _stash_execute, _stash_effect, _stash_cost, "copy", colour="#bcbddc")
register(unstash, _unstash_execute, _unstash_effect, _stash_cost, "copy", colour="#9e9ac8")
register(forward, _forward_execute, _forward_effect, _forward_cost, "compute", needs=lambda kw: ("params",),
         colour="#9ecae1", label=_pack_mb)
register(backward, _backward_execute, _backward_effect, _backward_cost, "compute",
         needs=lambda kw: ("params", "grads"), colour="#6baed6", label=_pack_mb)
register(step, _step_execute, _step_effect, _step_cost, "compute", needs=_step_needs, disk_io=_disk_io,
         colour="#a1d99b", label=_step_label)
register(allreduce, _allreduce_execute, _allreduce_effect, _allreduce_cost, "copy",
         needs=lambda kw: () if kw.get("where") == "host" else ("grads",), colour="#fc9272")
