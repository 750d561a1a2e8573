"""The op table: every schedule op as ``execute`` (real tensors), ``effect`` (predicted memory) and ``cost`` (seconds).

A schedule is a ``torch.fx.Graph`` whose ``call_function`` nodes target the stub
functions below, so ``print(graph.python_code("self").src)`` reads as the plan:

    p0 = swap_in(0, 'params');  wait(p0)
    b0 = load_batch(0, ('idx',))
    a0 = forward(0, 0, b0, keep=False)
    ...

Adding an op is one stub and one ``OPS`` entry.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


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

    def hold(self, kind, names, pack=None):
        for n in names:
            k = (kind, n)
            self.refs[k] = self.refs.get(k, 0) + 1
            if self.refs[k] == 1 and (kind != "grads" or n in self.grads_exist):
                self.live += self.sizes.get(k, 0)
                self.moved["h2d"] += self.sizes.get(k, 0)

    def drop(self, kind, names, write_back=False):
        for n in names:
            k = (kind, n)
            self.refs[k] -= 1
            if self.refs[k] == 0 and (kind != "grads" or n in self.grads_exist):
                self.live -= self.sizes.get(k, 0)
                if kind != "params" or write_back:
                    self.moved["d2h"] += self.sizes.get(k, 0)

    def resident(self, kind, name) -> bool:
        return self.refs.get((kind, name), 0) > 0


@dataclass
class OpDef:
    execute: Callable
    effect: Callable     # (model, *args, **kwargs) -> (Predicted | None, transient bytes above live)
    cost: Callable       # (plan, hw, *args, **kwargs) -> (stream name, seconds)
    kind: str            # "compute" | "copy" | "sync" for drawings and the simulator


# -- stubs: the names a schedule graph calls ----------------------------------------------------
def swap_in(pack: int, what: str): ...
def wait(handle): ...
def release(pack: int, what: str): ...
def load_batch(mb: int, names: tuple): ...
def forward(pack: int, mb: int, *inputs, keep: bool = False): ...
def backward(pack: int, mb: int, *inputs, saved=None, grads=()): ...
def stash(value): ...
def unstash(value): ...
def step(pack: int, stream: bool = False, where: str = "device"): ...


OPS: dict[str, OpDef] = {}


def register(stub, execute, effect, cost, kind):
    OPS[stub.__name__] = OpDef(execute, effect, cost, kind)


def op_of(node) -> OpDef:
    return OPS[node.target.__name__]


def state_names(spec, what: str) -> list[str]:
    """The state of one kind a pack needs: params (with buffers), grads, or optimizer state."""
    if what == "params":
        return spec.params + spec.buffers
    if what == "grads":
        return spec.params
    return spec.owned


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# -- swap_in / wait / release ------------------------------------------------------------------
def _swap_in_execute(rt, pack, what):
    return rt.state.fetch(what, state_names(rt.plan.packs[pack], what))


def _swap_in_effect(m, pack, what):
    m.hold(what, state_names(m.plan.packs[pack], what))
    return None, 0


def _swap_in_cost(plan, hw, pack, what):
    spec = plan.packs[pack]
    size = {"params": spec.param_bytes + spec.buffer_bytes, "grads": spec.param_bytes,
            "optim": spec.optim_bytes}[what]
    return "h2d", size / hw.h2d_bandwidth


def _wait_execute(rt, handle):
    rt.state.wait(handle)


def _release_execute(rt, pack, what):
    rt.state.release(what, state_names(rt.plan.packs[pack], what))


def _release_effect(m, pack, what):
    names = state_names(m.plan.packs[pack], what)
    m.drop(what, names, write_back=bool(m.dirty & set(names)))
    if what == "params":
        m.dirty -= {n for n in names if m.refs.get(("params", n), 0) == 0}
    return None, 0


def _release_cost(plan, hw, pack, what):
    spec = plan.packs[pack]
    # the whole write-back; the simulator scales it by what the effect moves (dirty params, existing grads)
    size = {"params": spec.param_bytes, "grads": spec.param_bytes, "optim": spec.optim_bytes}[what]
    return "d2h", size / hw.d2h_bandwidth


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
        dst = torch.empty(src.shape, dtype=src.dtype, device=rt.device)
        rt.meter.track(dst)
        dst.copy_(src)
        rt.state.moved["h2d"] += _nbytes(dst)
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
        rt.state.moved["h2d"] += _nbytes(dst)
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
    if spec.random:
        rt.rng[(pack, mb)] = torch.get_rng_state()
    with rt.counting():
        if keep:
            leaves = {n: _leaf(x, n not in rt.plan.input_names) for n, x in zip(spec.inputs, xs)}
            with torch.enable_grad():
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


def _leaf(x, grad: bool):
    if not isinstance(x, torch.Tensor):
        return x
    return x.detach().requires_grad_(grad and x.is_floating_point())


def _forward_effect(m, pack, mb, *inputs, keep=False):
    spec = m.plan.packs[pack]
    if keep:
        return Predicted(spec.out_bytes + spec.saved_bytes, kept=spec.saved_bytes), spec.fwd_keep_peak
    return Predicted(spec.out_bytes), spec.fwd_peak


def _pack_compute_cost(hw, flops: float, tensor_ops: float) -> float:
    """Seconds of compute on ``hw``: FLOPs at the rate a layer pack sustains, plus a fixed cost per tensor op.

    The rate is the peak times the device's ``efficiency`` (matmuls at a pack's shapes and the
    memory-bound ops around them); each tensor op (kernel) pays ``kernel_latency`` (launch,
    dispatch, the runtime's accounting), and the schedule op itself ``op_latency``.
    """
    rate = hw.flops * getattr(hw, "efficiency", 1.0)
    return flops / rate + tensor_ops * getattr(hw, "kernel_latency", 0.0) + hw.op_latency


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
    tensors = len(spec.owned) if phase == "step" else len(spec.params) + len(spec.buffers)
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
            rng = torch.get_rng_state() if spec.random else None
            if spec.random:
                torch.set_rng_state(rt.rng.pop((pack, mb)))
            with torch.enable_grad():
                outs = dict(zip(spec.outputs, spec.module(*leaves.values())))
            if rng is not None:
                torch.set_rng_state(rng)
        else:
            leaves, outs, restore = saved.leaves, saved.outs, []
        if "loss" in outs:
            tensors, seeds = [outs["loss"] / rt.plan.microbatches], [None]
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


def _step_execute(rt, pack, stream=False, where="device"):
    """The optimizer update of the parameters whose gradients this pack completed.

    ``where="host"``: the pack's gradients and weights are already on the host (its
    releases ran first); the optimizer steps the host copies on a host thread, overlapped
    with the next pack's backward, and the pack's next swap_in waits for it (ZeRO-Offload).
    ``stream``: the optimizer state lives on the host; bring each parameter's in, step it
    alone on the device, and send it back, so the device holds one parameter's state at a time.
    """
    spec = rt.plan.packs[pack]
    if where == "host":
        params = [rt.state.tensors[n] for n in spec.owned]
        opts = list(dict.fromkeys(rt.state.optimizers[n] for n in spec.owned))

        def update():
            for opt in opts:
                opt.step()
            for p in params:
                p.grad = None
        fut = rt.state.host_pool.submit(update)
        rt.state.pending.update((n, fut) for n in spec.owned)
        return
    if not stream:
        with rt.counting():
            for opt in dict.fromkeys(rt.state.optimizers[n] for n in spec.owned):
                opt.step()
    else:
        for n in spec.owned:      # moves happen outside the counting mode: host copies are not device bytes
            rt.state.wait(rt.state.fetch("optim", [n]))
            with rt.counting():
                _step_one(rt.state.optimizers[n], rt.state.tensors[n])
            rt.state.release("optim", [n])
    for n in spec.owned:
        rt.state.tensors[n].grad = None
    rt.state.dirty.update(spec.owned)


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


def _step_effect(m, pack, stream=False, where="device"):
    spec = m.plan.packs[pack]
    if where == "host":      # gradients left with the pack's release; nothing here touches the device
        m.grads_exist -= set(spec.owned)
        return None, 0
    for n in spec.owned:
        if n in m.grads_exist:
            m.grads_exist.discard(n)
            if m.resident("grads", n):
                m.live -= m.sizes[("grads", n)]
    m.dirty.update(spec.owned)
    if stream:
        moved = sum(m.sizes.get(("optim", n), 0) for n in spec.owned)
        m.moved["h2d"] += moved
        m.moved["d2h"] += moved
        return None, spec.stream_step_peak
    return None, spec.step_extra


def _step_cost(plan, hw, pack, stream=False, where="device"):
    """An optimizer step is memory-bound: its traffic at memory bandwidth, plus a fixed cost per tensor op.

    Traffic: Adam(W) reads parameter, gradient and state and writes parameter and state,
    and its for-loop form makes temporaries of the parameter's size on the way; counted as
    4 x (2 P + O) bytes. A streamed step also copies each parameter's optimizer state in
    and back out, one parameter at a time, on the compute stream's critical path.
    """
    spec = plan.packs[pack]
    traffic = 4 * (spec.param_bytes * 2 + spec.optim_bytes)
    if where == "host":      # the host's own memory, outside the runtime's accounting: plain dispatch
        return "host", traffic / getattr(hw, "host_memory_bandwidth", hw.memory_bandwidth)
    seconds = traffic / hw.memory_bandwidth + _pack_compute_cost(hw, 0, _kernels_cost(spec, "step"))
    if stream:
        seconds += spec.optim_bytes / hw.h2d_bandwidth + spec.optim_bytes / hw.d2h_bandwidth
    return "compute", seconds


register(swap_in, _swap_in_execute, _swap_in_effect, _swap_in_cost, "copy")
register(wait, _wait_execute, _no_effect, _free, "sync")
register(release, _release_execute, _release_effect, _release_cost, "copy")
register(load_batch, _load_batch_execute, _load_batch_effect, _load_batch_cost, "copy")
register(stash, _stash_execute, _stash_effect, _stash_cost, "copy")
register(unstash, _unstash_execute, _unstash_effect, _stash_cost, "copy")
register(forward, _forward_execute, _forward_effect, _forward_cost, "compute")
register(backward, _backward_execute, _backward_effect, _backward_cost, "compute")
register(step, _step_execute, _step_effect, _step_cost, "compute")
