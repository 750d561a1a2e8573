"""The ops that compute: a pack's ``forward`` and ``backward`` on one microbatch, and the optimizer ``step`` (on the
device, streamed, on the host copies or group by group from disk); each registered in the op table
(runtime/ops.py) with all it needs.
"""
from __future__ import annotations

import contextlib
import time

import torch

from harmony.base.units import nbytes
from harmony.runtime.ops import Acts, Predicted, backward, forward, label_args, register, step
from harmony.runtime.ops_move import disk_io
from harmony.runtime.partitioned import share_params
from harmony.runtime.plan import step_traffic
from harmony.runtime.precision import master_grads


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
        return x.detach()   # not x: a node saving its own output would hold itself (a cycle gc cannot see)

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
        # The batch tensors a pack reads count too: ``in_bytes`` has the other packs' outputs only, and a first op
        # that saves its input (a convolution's weight gradient needs it, an embedding its indices) keeps the
        # microbatch ``load_batch`` brought after that value dies.
        last = "loss" in spec.outputs
        batch = sum(m.plan.batch_bytes.get(n, 0) for n in spec.inputs if n in m.plan.input_names)
        retained = 0 if last or any(isinstance(v, Predicted) and v.kept for v in inputs) else spec.in_bytes + batch
        held = spec.saved_bytes + retained
        return Predicted(spec.out_bytes + held, kept=held), spec.fwd_keep_peak
    return Predicted(spec.out_bytes), spec.fwd_peak


def _pack_compute_cost(hw, flops: float, tensor_ops: float, extra: float = 0.0) -> float:
    """Seconds of compute on ``hw``: FLOPs at the rate a layer pack sustains, plus a fixed cost per tensor op.

    The rate is the peak times the device's ``efficiency`` (matmuls at a pack's shapes and the
    memory-bound ops around them); each tensor op (kernel) pays ``kernel_latency`` (launch,
    dispatch, the runtime's accounting), and the schedule op itself ``op_latency``; ``extra``: seconds the host
    spends besides, issuing them (``ondemand_latency``). On a device whose
    ops are ``queued`` (a GPU) the launches overlap the kernels: the longer of the two counts.
    """
    rate = hw.flops * getattr(hw, "efficiency", 1.0)
    launches = tensor_ops * getattr(hw, "kernel_latency", 0.0) + extra
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


def ondemand_latency(plan, hw, python_ops: float, autograd_ops: float = 0.0) -> float:
    """Seconds the ``ondemand`` runtime's fetch checks add to these tensor ops (runtime/ondemand.py): ops called
    from Python (a forward, a recompute, a for-loop optimizer step) pass its function-level and dispatch-level
    modes, those autograd's backward runs the dispatch level only; 0 under the other policies."""
    if plan.policy != "ondemand":
        return 0.0
    return python_ops * getattr(hw, "ondemand_call_latency", 0.0) + \
        autograd_ops * getattr(hw, "ondemand_op_latency", 0.0)


def _forward_cost(plan, hw, pack, mb, *inputs, keep=False):
    spec = plan.packs[pack]
    ops = _kernels_cost(spec, "forward")
    return "compute", _pack_compute_cost(hw, spec.fwd_flops, ops, ondemand_latency(plan, hw, ops))


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
            weight = rt.plan.loss_weight(mb)     # uneven microbatches: by rows, so the seeds sum to the batch mean
            seed = outs["loss"].float() / rt.plan.microbatches if weight is None else outs["loss"].float() * weight
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
    forward = _kernels_cost(spec, "forward") if recompute else 0
    ops = _kernels_cost(spec, "backward") + forward
    return "compute", _pack_compute_cost(hw, flops, ops, ondemand_latency(plan, hw, forward, ops - forward))


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
    Its parameters in ``Residency.device_parts`` (all their state resident) step first, here, on
    the device, one at a time; the host step leaves them (their gradients are gone by then).
    With mixed precision the host gradients arrive in the compute dtype and become fp32 first;
    under fp16 loss scaling they are unscaled and checked here, and under fp16 or clipping the update
    waits for ``StepGate.finish`` (runtime/precision.py), which clips it by the global norm first.
    ``stream``: the optimizer state lives on the host; bring each parameter's in, step it
    alone on the device, and send it back, so the device holds one parameter's state at a time.
    """
    spec = rt.plan.packs[pack]
    if where == "disk":
        return _step_disk(rt, pack, spec, overlap)
    if where == "host":
        return _step_host(rt, pack, spec)
    if rt.gate is not None:     # clipping: every step follows the last backward; the norm is known now
        rt.gate.clip([rt.state.tensors[n] for n in spec.stepped])
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


def _step_disk(rt, pack, spec, overlap) -> None:
    """Weights and state in files: step group by group (runtime/diskparams.py), inline or on the host thread."""
    pd = rt.state.params_disk
    if not overlap:
        pd.step(pack, rt.state.to_host)
        return
    pd.join()            # the previous overlapped step (the memory plan frees its gradients here)
    handed = [rt.state.tensors[n].grad for n in spec.owned]
    rt.state.moved["d2h"] += sum(nbytes(g) for g in handed if g is not None and rt.meter.holds(g))
    fut = pd.step_in_background(rt.state.host_pool, pack, lambda g: rt.state.to_host(g, count=False))
    rt.state.pending.update((n, fut) for n in spec.owned)


def _step_host(rt, pack, spec) -> None:
    """Step the host copies on the host thread (its ``Residency.device_parts`` first, here, on the device)."""
    on_device = _device_parts(rt.plan, spec)
    if on_device:
        if rt.gate is not None:
            rt.gate.clip([rt.state.tensors[n] for n in on_device])
        with rt.counting():
            for n in on_device:
                _step_one(rt.state.optimizers[n], rt.state.tensors[n])
        for n in on_device:
            rt.state.tensors[n].grad = None
        rt.state.dirty.update(on_device)
        if len(on_device) == len(spec.stepped):    # nothing left for the host to step
            return
    # (partitioned: the optimizer steps this rank's pieces of the pack's parameters, whose gradients go with them)
    params = [rt.state.tensors[n] for n in spec.owned] + share_params(rt, pack)
    # (a rank whose chunks of a partitioned pack are empty has no optimizer for it)
    opts = list(dict.fromkeys(rt.state.optimizers[n] for n in spec.stepped if n in rt.state.optimizers))
    disk = getattr(rt.state, "disk", None)   # optimizer state of disk-placed packs (runtime/disk.py)
    shares = getattr(rt.state, "shares", None)
    carry = shares.carry if shares is not None and pack in shares.carry_packs else None

    def update(skip=False):
        start = time.perf_counter()
        rt.state.unpark(spec.owned)   # gradients that reached the host before their weights (TieredState.parked)
        if disk is not None:   # read ahead the next disk pack's state; bring in this one's if on disk
            disk.begin(pack)
        try:
            if rt.gate is not None and not skip:     # clipping: by the global norm, known once every update waits
                rt.gate.clip(params)
            for opt in opts:
                if not skip:
                    opt.step()
            if carry is not None:    # partitioned: the updated chunks into the device copy carried to the forward
                carry.refill(rt.state.shares, pack)
        except BaseException:
            if disk is not None:
                disk.abort(pack)
            raise
        if disk is not None:   # write it back; placeholders stay in the optimizer until the next step
            disk.end(pack)
        for p in params:
            p.grad = None
        rt.state.host_step_seconds += time.perf_counter() - start

    def check_then_update():   # mixed precision: fp32 gradients; fp16: unscaled, checked; fp16, clipping: deferred
        start = time.perf_counter()
        # an update run now drops its gradients before the next pack's are made: they can share one buffer
        buffer = rt.state.grad_buffer if rt.gate is None else None
        cast = rt.state.unpark(spec.owned, convert=False)
        master_grads(cast + [(p, p.grad) for p in params if p.grad is not None and p.grad.dtype != p.dtype], buffer)
        rt.state.host_step_seconds += time.perf_counter() - start
        if rt.gate is None:
            return update()
        if rt.scaler is not None:
            rt.scaler.unscale([p.grad for p in params if p.grad is not None])
        rt.gate.defer(pack, update)
    fut = rt.state.host_pool.submit(update if rt.compute_dtype is None and rt.gate is None else check_then_update)
    rt.state.pending.update((n, fut) for n in spec.stepped if n not in on_device)


def device_part_bytes(plan, spec) -> dict[str, int]:
    """The fp32 bytes of each of the pack's parameters that step on the device though the pack steps on the host."""
    sizes = plan.at(spec.index).device_part_bytes
    return {n: sizes.get(n, 0) for n in _device_parts(plan, spec)}


def _share_traffic(spec, master: float) -> float:
    """``step_traffic`` of ``master`` fp32 bytes of the pack's parameters, with their share of its optimizer state."""
    whole = spec.master_bytes or spec.param_bytes
    return step_traffic(master, spec.optim_bytes * master / whole if whole else 0)


def device_part_cost(plan, hw, pack: int) -> float:
    """Seconds a host-stepped pack's ``step`` spends on the compute stream first, stepping its
    ``Residency.device_parts`` on the device one at a time: their traffic at the device's memory bandwidth and
    their tensor ops."""
    spec = plan.packs[pack]
    parts = device_part_bytes(plan, spec)
    if not parts:
        return 0.0
    ops = _kernels_cost(spec, "step") / max(1, len(spec.stepped)) * len(parts)
    return _share_traffic(spec, sum(parts.values())) / hw.memory_bandwidth + _pack_compute_cost(hw, 0, ops)


def _device_parts(plan, spec) -> list[str]:
    """The pack's parameters that step on the device though the pack steps on the host."""
    parts = plan.at(spec.index).device_parts
    return [n for n in spec.stepped if n in parts] if parts else []


def _step_one(opt: torch.optim.Optimizer, param: torch.Tensor) -> None:
    """Step one parameter with its optimizer: its group sees only it for the call, and the other groups nothing."""
    kept = [group["params"] for group in opt.param_groups]
    for group in opt.param_groups:
        group["params"] = [p for p in group["params"] if p is param]
    try:
        opt.step()
    finally:
        for group, params in zip(opt.param_groups, kept):
            group["params"] = params


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
        return None, max((m.plan.at(pack).device_parts[n] for n in on_device), default=0)
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
    ops = _kernels_cost(spec, "step")
    seconds = traffic / hw.memory_bandwidth + _pack_compute_cost(hw, 0, ops, ondemand_latency(plan, hw, ops))
    if stream:
        optim = streamed_optim_bytes(plan, pack)
        seconds += optim / hw.h2d_bandwidth + optim / hw.d2h_bandwidth
    return "compute", seconds


def streamed_optim_bytes(plan, pack: int) -> int:
    """A streamed step's optimizer state that comes in and goes out: the pack's, less what stays resident."""
    spec = plan.packs[pack]
    kept = plan.at(pack).optim_kept
    return spec.optim_bytes - sum(kept.get(n, 0) for n in spec.stepped)


def _step_needs(kwargs) -> tuple:
    if kwargs.get("where", "device") in ("host", "disk"):
        return ()                      # the host copies are stepped
    if kwargs.get("stream"):
        return ("params", "grads")     # it brings the optimizer state in itself, a parameter at a time
    return ("params", "grads", "optim")


def _pack_mb(args, kwargs) -> str:
    if len(args) < 2:
        return label_args(args, kwargs)
    keep = " · keep" if kwargs.get("keep") else ""
    recompute = " · recompute" if "saved" in kwargs and kwargs["saved"] is None else ""
    return f"pack {args[0]} · mb {args[1]}{keep}{recompute}"


def _step_label(args, kwargs) -> str:
    where = kwargs.get("where", "device")
    return (f"pack {args[0]}" + (f" · {where}" if where != "device" else "")
            + (" · overlapped" if kwargs.get("overlap") else "")) if args else ""


register(forward, _forward_execute, _forward_effect, _forward_cost, "compute", needs=lambda kw: ("params",),
         colour="#9ecae1", label=_pack_mb)
register(backward, _backward_execute, _backward_effect, _backward_cost, "compute",
         needs=lambda kw: ("params", "grads"), colour="#6baed6", label=_pack_mb)
register(step, _step_execute, _step_effect, _step_cost, "compute", needs=_step_needs, disk_io=disk_io,
         colour="#a1d99b", label=_step_label)
