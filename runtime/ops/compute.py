"""The ops that compute: a pack's ``forward`` and ``backward`` on one microbatch, each registered in the op table
(runtime/ops/) with all it needs, and the compute costs the optimizer ``step`` (runtime/ops/update.py) shares.
"""
from __future__ import annotations

import contextlib

import torch

from harmony.runtime.ops import Acts, Predicted, Saved, arrived, backward, forward, label_args, register
from harmony.runtime.pack_inputs import enter, grad_of
from harmony.runtime.plan import loss_seed
from harmony.runtime.rng import rng_state, set_rng_state


# -- forward / backward -----------------------------------------------------------------------
def _gather(rt, spec, handles):
    found = {}
    for h in handles:
        found.update(arrived(rt, h).values)
    return [found[n] for n in spec.inputs]


def _forward_execute(rt, pack, mb, *inputs, keep=False):
    spec = rt.plan.packs[pack]
    xs = _gather(rt, spec, inputs)
    streams = rt.streams if spec.random else None     # None: between steps (an evaluation draws as it finds)
    if streams is not None:      # microbatch mb's own stream, whatever ran before (runtime/rng.py)
        streams.enter(mb)
    if spec.random and not keep:     # a recompute replays the forward's random numbers
        rt.rng[(pack, mb)] = rng_state(rt.device)
    with rt.counting():
        if keep:
            leaves = {n: enter(x, n not in rt.plan.input_names) for n, x in zip(spec.inputs, xs)}
            graph: list = []
            with torch.enable_grad(), _state_by_name(rt, spec, graph):
                outs = spec.module(*leaves.values())
            outs = dict(zip(spec.outputs, outs))
            values = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in outs.items()}
            result = Acts(values, leaves=leaves, outs=outs, graph=graph)
        else:
            with torch.no_grad():
                outs = spec.module(*xs)
            result = Acts(dict(zip(spec.outputs, outs)))
    if streams is not None:
        streams.leave(mb)
    rt.state.dirty.update(spec.mutated)
    if "loss" in result.values:
        rt.losses.append(result.values["loss"].detach().clone())
    return result


def _state_by_name(rt, spec, graph: list):
    """Saved-tensor hooks under which a kept graph holds a parameter's name, not its device copy, and every other
    tensor it saves in a ``Saved`` holder, listed in ``graph`` (a ``stash`` may send them to the host).

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
        held = Saved(x.detach())   # not x: a node saving its own output would hold itself (a cycle gc cannot see)
        graph.append(held)
        return held

    def unpack(h):
        if isinstance(h, Saved):
            return h.t
        n, size, stride, offset = h
        data = rt.state.tensors[n].data
        return data.as_strided(size, stride, data.storage_offset() + offset)
    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _forward_effect(m, pack, mb, *inputs, keep=False):
    spec = m.plan.packs[pack]
    m.dirty.update(spec.mutated)      # running statistics changed: written back with the pack's release
    if keep:
        # the kept forward's leaves hold every input until the backward, after the values that brought them die
        # (``held_in_bytes``: the batch tensors ``load_batch`` brought and other packs' outputs of any dtype; a
        # token-id input is not in ``in_bytes``, which counts the gradients coming back); not when a value is a
        # kept forward's own, which lives until its (later) backward. The last pack's backward follows at once,
        # but not before its inputs' values die, and its measured peak does not count them.
        last = "loss" in spec.outputs
        retained = 0 if any(isinstance(v, Predicted) and v.kept for v in inputs) else spec.held_in_bytes
        held = spec.saved_bytes + retained
        # a stash can send the graph's own tensors to the host; the last pack's and ondemand's keep no holders
        graph = 0 if last or m.plan.policy == "ondemand" else spec.saved_bytes
        return Predicted(spec.out_bytes + held, kept=held, graph=graph), spec.fwd_keep_peak
    return Predicted(spec.out_bytes), spec.fwd_peak


def pack_compute_cost(hw, flops: float, tensor_ops: float, extra: float = 0.0) -> float:
    """Seconds of compute on ``hw``: FLOPs at the rate a layer pack sustains, plus a fixed cost per tensor op.

    The rate is the peak times the device's ``efficiency`` (matmuls at a pack's shapes and the
    memory-bound ops around them); each tensor op (kernel) pays ``kernel_latency`` (launch,
    dispatch, the runtime's accounting), and the schedule op itself ``op_latency``; ``extra``: seconds the host
    spends besides, issuing them (``ondemand_seconds``). On a device whose
    ops are ``queued`` (a GPU) the launches overlap the kernels: the longer of the two counts.
    """
    rate = hw.flops * getattr(hw, "efficiency", 1.0)
    launches = tensor_ops * getattr(hw, "kernel_latency", 0.0) + extra
    if getattr(hw, "queued", False):      # a GPU runs queued kernels while the host issues the next ones
        return max(flops / rate, launches) + hw.op_latency
    return flops / rate + launches + hw.op_latency


def kernels_cost(spec, phase: str) -> float:
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


def ondemand_seconds(plan, hw, python_ops: float, autograd_ops: float = 0.0) -> float:
    """Seconds the ``ondemand`` runtime's fetch checks add to these tensor ops (runtime/ondemand.py): ops called
    from Python (a forward, a recompute, a for-loop optimizer step) pass its function-level and dispatch-level
    modes, those autograd's backward runs the dispatch level only; 0 under the other policies."""
    if plan.policy != "ondemand":
        return 0.0
    return python_ops * getattr(hw, "ondemand_call_latency", 0.0) + \
        autograd_ops * getattr(hw, "ondemand_op_latency", 0.0)


def _forward_cost(plan, hw, pack, mb, *inputs, keep=False):
    spec = plan.packs[pack]
    ops = kernels_cost(spec, "forward")
    return "compute", pack_compute_cost(hw, spec.fwd_flops, ops, ondemand_seconds(plan, hw, ops))


def _backward_execute(rt, pack, mb, *inputs, saved=None, grads=(), chain=(), totals=()):
    spec = rt.plan.packs[pack]
    with rt.counting():
        if saved is None:  # recompute the pack's forward from its stashed inputs
            leaves = {n: enter(x, n not in rt.plan.input_names)
                      for n, x in zip(spec.inputs, _gather(rt, spec, inputs))}
            restore = [(t, t.clone()) for t in (rt.state.tensors[n] for n in spec.mutated)]
            rng = rng_state(rt.device) if spec.random else None
            if spec.random:
                set_rng_state(rt.device, rt.rng.pop((pack, mb)))
            with torch.enable_grad():
                outs = dict(zip(spec.outputs, spec.module(*leaves.values())))
            if rng is not None:
                set_rng_state(rt.device, rng)
        else:
            leaves, outs, restore = arrived(rt, saved).leaves, saved.outs, []   # (a stashed graph: its copies)
        if "loss" in outs:   # the seed is fp32 (a no-op in fp32); fp16 scales it (GradScaler.scale)
            seed = loss_seed(outs["loss"], rt.rows, mb, rt.token_scale)   # the seeds sum to the batch's mean
            tensors, seeds = [seed if rt.scaler is None else rt.scaler.scale_loss(seed)], [None]
        else:
            upstream: dict[str, torch.Tensor] = {}
            for g in grads:
                for k, v in arrived(rt, g).values.items():
                    if k in totals and k in upstream:     # the first reader's sum already holds this one's
                        continue
                    upstream[k] = upstream[k] + v if k in upstream else v
            pairs = [(outs[k], upstream[k]) for k in spec.outputs
                     if k in upstream and isinstance(outs[k], torch.Tensor) and outs[k].requires_grad]
            tensors, seeds = [p[0] for p in pairs], [p[1] for p in pairs]
        for n, h in chain:    # a value several packs read: its gradient goes on from the later readers' sum
            x, before = leaves.get(n), arrived(rt, h).values.get(n) if h is not None else None
            if before is not None and isinstance(x, torch.Tensor) and x.requires_grad:
                # made after the pack's ops, this view's backward runs before theirs (autograd runs the
                # latest-made node first): the sum so far is the first term of the leaf's, as in eager's fold
                tensors, seeds = [*tensors, x.view_as(x)], [*seeds, before]
        if tensors:
            torch.autograd.backward(tensors, seeds)
        for t, old in restore:  # running statistics advance once per microbatch, not again on recompute
            t.copy_(old)        # (after backward: batch norm saves them for it)
        found = {n: grad_of(x) for n, x in leaves.items() if n not in rt.plan.input_names}
        result = Acts({n: g for n, g in found.items() if g is not None})
    if saved is not None:
        saved.leaves = saved.outs = saved.graph = None
    return result


def _backward_effect(m, pack, mb, *inputs, saved=None, grads=(), chain=(), totals=()):
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


def _backward_cost(plan, hw, pack, mb, *inputs, saved=None, grads=(), chain=(), totals=()):
    spec = plan.packs[pack]
    recompute = saved is None
    flops = spec.bwd_flops + (spec.fwd_flops if recompute else 0)
    forward = kernels_cost(spec, "forward") if recompute else 0
    ops = kernels_cost(spec, "backward") + forward
    return "compute", pack_compute_cost(hw, flops, ops, ondemand_seconds(plan, hw, forward, ops - forward))



def _pack_mb(args, kwargs) -> str:
    if len(args) < 2:
        return label_args(args, kwargs)
    keep = " · keep" if kwargs.get("keep") else ""
    recompute = " · recompute" if "saved" in kwargs and kwargs["saved"] is None else ""
    return f"pack {args[0]} · mb {args[1]}{keep}{recompute}"


register(forward, _forward_execute, _forward_effect, _forward_cost, "compute", needs=lambda kw: ("params",),
         colour="#9ecae1", label=_pack_mb, runs_forward=True)
register(backward, _backward_execute, _backward_effect, _backward_cost, "compute",
         needs=lambda kw: ("params", "grads"), colour="#6baed6", label=_pack_mb, runs_backward=True)
