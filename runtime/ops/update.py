"""The optimizer ``step`` op: on the device (mixed precision's fp32 masters brought in one at a time), streamed, on
the host copies, or group by group from disk; registered in the op table (runtime/ops/) with all it needs.
"""
from __future__ import annotations

import time

import torch

from harmony.base.tiers import Tier
from harmony.base.units import nbytes
from harmony.runtime.comm.jobwide import STEP_KEY
from harmony.runtime.ops import register, step
from harmony.runtime.ops.compute import kernels_cost, ondemand_seconds, pack_compute_cost
from harmony.runtime.ops.move import step_disk_io
from harmony.runtime.partitioned import scope, share_params
from harmony.runtime.placeholders import point
from harmony.runtime.plan import step_traffic
from harmony.runtime.precision import master_grads


def _step_execute(rt, pack, stream=False, where=Tier.DEVICE, overlap=False):
    """The optimizer update of the parameters whose gradients this pack completed.

    ``where="disk"``: the pack's weights and optimizer state are in files; its gradients
    leave the device a group at a time as the groups step on the host (runtime/tiers/params_disk.py).
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
    if where == Tier.DISK:
        return _step_disk(rt, pack, spec, overlap)
    if where == Tier.HOST:
        return _step_host(rt, pack, spec)
    if rt.compute_dtype is not None:    # (compile refuses fp16 and clipping with device steps)
        return _step_mixed(rt, spec)
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


def _step_mixed(rt, spec) -> None:
    """bf16 on the device: each parameter's fp32 master comes in with its optimizer state (unless that stays
    resident), steps there against its gradient made fp32, refreshes the device copy in place (cast as ``swap_in``
    casts it) and goes back to the host. The next parameter's master and state come in on the copy engine while
    this one steps, so the device holds one parameter's fp32 state and the next one's inputs at a time."""
    st = rt.state
    names = [n for n in spec.stepped if st.grad(n) is not None]
    coming = _bring(st, names[0]) if names else None
    for i, n in enumerate(names):
        master, jobs = coming
        for job in jobs:
            st.wait(job)
        coming = _bring(st, names[i + 1]) if i + 1 < len(names) else None
        t, grad, host = st.tensors[n], st.grad(n), st.master[n]
        copy = t.data
        with rt.counting():
            g32 = grad.to(host.dtype)
        t.grad = None
        point(t, master)     # the Parameter the optimizer holds steps as its fp32 master
        t.grad = g32
        try:
            with rt.counting():
                _step_one(st.optimizers[n], t)
                copy.copy_(master)
            st.send(master, host)     # lands while the next parameter steps; the next fetch waits for it
        finally:
            t.grad = None
            point(t, copy)
        del master, g32
        st.release("optim", [n])


def _bring(st, name: str):
    """Start bringing parameter ``name``'s fp32 master and optimizer state to the device: (the master's device
    tensor, the copies to wait for)."""
    master, fut = st.fetch_master(name)
    return master, [st.fetch("optim", [name]), fut]


def _step_disk(rt, pack, spec, overlap) -> None:
    """Weights and state in files: step group by group (runtime/tiers/params_disk.py), inline or on the host thread."""
    pd = rt.state.params_disk
    if not overlap:
        rt.state.land()      # the gradients it reads that left the device ahead of their weights (parked)
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
    disk = getattr(rt.state, "disk", None)   # optimizer state of disk-placed packs (runtime/tiers/disk.py)
    shares = getattr(rt.state, "shares", None)
    carry = shares.carry if shares is not None and pack in shares.carry_packs else None
    key, group = scope(rt) if carry is not None else (STEP_KEY, None)    # the refill's ranks (a grid's replicas)

    status = rt.status

    def update(skip=False):
        if status is not None and status.aborted_on(STEP_KEY):   # a rank's step failed: every rank skips it alike
            rt.transaction.unstep(pack)
            if carry is not None:       # (its refill's meet, made by every rank: runtime/partitioned/meet.py)
                status.meet(key, group, "the refill of carried weights")
            return
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
                if status is None or status.meet(key, group, "the refill of carried weights"):
                    carry.refill(rt.state.shares, pack, group)
                else:
                    carry.stepping.pop(pack, None)
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
    ops = kernels_cost(spec, "step") / max(1, len(spec.stepped)) * len(parts)
    return _share_traffic(spec, sum(parts.values())) / hw.memory_bandwidth + pack_compute_cost(hw, 0, ops)


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


def _step_effect(m, pack, stream=False, where=Tier.DEVICE, overlap=False):
    spec = m.plan.packs[pack]
    if where in (Tier.HOST, Tier.DISK):   # gradients left with the pack's release (a disk step takes them now)
        on_device = _device_parts(m.plan, spec) if where == Tier.HOST else []
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
    mixed = m.plan.precision != "fp32"      # fp32 masters come in one at a time, and go back with the state
    if not mixed:
        m.dirty.update(spec.stepped)
    if stream or mixed:   # what is not held on the device comes in and goes back out
        moved = sum(m.sizes.get(("optim", n), 0) for n in spec.stepped if not m.resident("optim", n))
        moved += mixed_master_bytes(m.plan, spec)
        m.moved["h2d"] += moved
        m.moved["d2h"] += moved
        return None, spec.stream_step_peak
    return None, spec.step_extra


def mixed_master_bytes(plan, spec) -> int:
    """The fp32 masters a mixed-precision device step brings in and sends back (none in fp32: the weights are
    stepped where they are)."""
    return spec.stepped_master_bytes if plan.precision != "fp32" else 0


def _step_cost(plan, hw, pack, stream=False, where=Tier.DEVICE, overlap=False):
    """An optimizer step is memory-bound: its traffic at memory bandwidth, plus a fixed cost per tensor op.

    Traffic: ``plan.step_traffic``, 4 x (2 P + O) bytes. A streamed step also copies each parameter's optimizer state in
    and back out, one parameter at a time, the copies in on the compute stream's critical path; under mixed precision
    its fp32 master too (M bytes), stepped in place of the device copy, with the casts of its gradient to fp32 and of
    the master back into the copy (1.5 M bytes of traffic each); there the next parameter's copies in run beside this
    one's step. The copies out land on the other copy engine while the next parameters come in and step
    (``TieredState.send``), except where copies block the compute (``sync_copies``: the CPU device).
    """
    spec = plan.packs[pack]
    master = mixed_master_bytes(plan, spec)
    traffic = step_traffic(master or spec.param_bytes, spec.optim_bytes) + 3 * master
    if where in (Tier.HOST, Tier.DISK):   # the host's own memory, outside the runtime's accounting: plain dispatch
        master = spec.master_bytes or spec.param_bytes      # fp32 masters, less those stepped on the device first
        host = master - sum(device_part_bytes(plan, spec).values()) if where == Tier.HOST else master
        traffic = _share_traffic(spec, host)
        return "host", traffic / getattr(hw, "host_memory_bandwidth", hw.memory_bandwidth)
    ops = kernels_cost(spec, "step")
    seconds = traffic / hw.memory_bandwidth + pack_compute_cost(hw, 0, ops, ondemand_seconds(plan, hw, ops))
    copies = (streamed_optim_bytes(plan, pack) if stream else 0) + master
    ins, out = copies / hw.h2d_bandwidth, copies / hw.d2h_bandwidth
    if getattr(hw, "sync_copies", False):
        return "compute", (max(seconds, ins) if master else seconds + ins) + out
    return "compute", max(seconds, ins, out) if master else max(seconds + ins, out)


def streamed_optim_bytes(plan, pack: int) -> int:
    """A streamed step's optimizer state that comes in and goes out: the pack's, less what stays resident."""
    spec = plan.packs[pack]
    kept = plan.at(pack).optim_kept
    return spec.optim_bytes - sum(kept.get(n, 0) for n in spec.stepped)


def _step_needs(kwargs) -> tuple:
    if kwargs.get("where", Tier.DEVICE) in (Tier.HOST, Tier.DISK):
        return ()                      # the host copies are stepped
    if kwargs.get("stream"):
        return ("params", "grads")     # it brings the optimizer state in itself, a parameter at a time
    return ("params", "grads", "optim")


def _step_label(args, kwargs) -> str:
    where = kwargs.get("where", Tier.DEVICE)
    return (f"pack {args[0]}" + (f" · {where}" if where != Tier.DEVICE else "")
            + (" · overlapped" if kwargs.get("overlap") else "")) if args else ""


register(step, _step_execute, _step_effect, _step_cost, "compute", needs=_step_needs, disk_io=step_disk_io,
         disk_read_ahead=True, colour="#a1d99b", label=_step_label, steps=True)
