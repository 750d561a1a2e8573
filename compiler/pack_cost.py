"""What a pack allocates when the runtime runs it: its forward, its backward, with and without recompute.

``measure_pack`` runs a pack's graph module exactly as the runtime's ``forward`` and
``backward`` ops do, on the fake tensors of the cost model's run (``fake.FakeRun``), and
counts the bytes each phase newly allocates (``runtime.memory.MemoryMeter``): what the
partition checks a candidate pack against the budget with, and ``verify`` predicts with.
Packs of the same layers at other depths take the figures of one measured before
(``signature.pack_signature``).
"""
from __future__ import annotations

import torch
import torch.fx
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    unset_fake_temporarily,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.nn.utils.stateless import _reparametrize_module

from harmony.compiler import measured
from harmony.compiler.cost import Writes, tensors_of
from harmony.compiler.fake import FakeRun
from harmony.compiler.signature import pack_signature
from harmony.runtime.pack_inputs import enter
from harmony.runtime.precision import device_dtype
from harmony.runtime.tiers.memory import CountAllocations, MemoryMeter


def _fake_state_of(module, run):
    out = {}
    state = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    for name, t in state:
        if id(t) in run.state:   # constants the tracer lifted stay real (the fake mode accepts them)
            out[name] = run.state[id(t)]
    return out


def measure_pack(module: torch.fx.GraphModule, inputs: list, grad_inputs: list[bool], run: FakeRun,
                 loss_output: bool, keep: bool = False, reuse: bool = True) -> dict:
    """Bytes a pack allocates at its peak, run exactly as the runtime runs it, on fake tensors.

    Every figure counts the bytes newly allocated during the op, results included:
    fwd_peak (no grad), out_bytes and held_in_bytes (the inputs a kept forward holds); for a pack that keeps its
    forward's graph for its backward (the last, ``loss_output``, always; any other with ``keep``) fwd_keep_peak,
    saved_bytes and the backward's bwd_peak; for the others, which recompute, bwd_recompute_peak (recompute and
    backward, beside the copies of the running statistics it restores). Each when the parameters have no gradient
    yet and, suffixed ``_accum``, when they have one to accumulate into.

    ``reuse``: a pack like one measured before, in this compile or an earlier one of the process
    (``pack_signature``, ``compiler/measured.py``), takes its figures; False measures it afresh.
    """
    key = pack_signature(module, inputs, grad_inputs, run, loss_output, keep) if reuse else None
    if key is not None and key in measured.PACKS:
        return measured.PACKS[key]
    out = _measure_pack(module, inputs, grad_inputs, run, loss_output, keep)
    if key is not None:
        measured.PACKS[key] = out
    return dict(out)


def _measure_pack(module, inputs, grad_inputs, run, loss_output, keep) -> dict:
    try:
        with run.mode, _reparametrize_module(module, _fake_state_of(module, run), tie_weights=True):
            return _profile_pack(module, inputs, grad_inputs, loss_output, keep)
    except (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode):
        # a leaf module that branches on data: measure the pack once on real zeros
        with unset_fake_temporarily():
            zeros = [torch.zeros(tuple(x.shape), dtype=x.dtype) if isinstance(x, torch.Tensor) else x
                     for x in inputs]
            cast = {n: t.detach().to(device_dtype(t, run.dtype)).requires_grad_(t.requires_grad)   # as on the device
                    for n, t in list(module.named_parameters()) + list(module.named_buffers())
                    if device_dtype(t, run.dtype) != t.dtype}
            with _reparametrize_module(module, cast, tie_weights=True):
                out = _profile_pack(module, zeros, grad_inputs, loss_output, keep)
        for p in module.parameters():
            p.grad = None
        return out


def _profile_pack(module, inputs, grad_inputs, loss_output, keep=False) -> dict:
    """The measurements of ``measure_pack``, on whatever tensors (fake or real) it is given."""
    out = {}

    def entered():     # the pack's inputs as the runtime's forward and backward make them, afresh each time
        return [enter(x, g) for x, g in zip(inputs, grad_inputs)]

    def measured(fn):
        meter = MemoryMeter("pack")
        with CountAllocations(meter):
            result = fn()
        return result, meter

    with Writes() as writes:
        outs, meter = measured(lambda: _no_grad(module, entered()))
    written = [b for b in module.buffers() if id(b.untyped_storage()) in writes.written]
    out["fwd_peak"] = meter.peak
    out["held_in_bytes"] = _input_bytes(entered())
    out["out_bytes"] = sum(t.untyped_storage().nbytes() for t in tensors_of(outs))
    del outs
    for suffix in ("", "_accum"):       # the second round finds the gradients of the first
        leaves = entered()
        if loss_output or keep:         # the pack keeps its forward's graph for its backward
            outs, meter = measured(lambda: _with_grad(module, leaves))
            out["fwd_keep_peak" + suffix] = meter.peak
            out["saved_bytes" + suffix] = meter.live - out["out_bytes"]
            seeds = _seeds(outs, loss_output)
            _, meter = measured(lambda: _run_backward(*seeds))
            out["bwd_peak" + suffix] = meter.peak
            del outs, seeds
            out["bwd_recompute_peak" + suffix] = 0
        else:                           # every other pack recomputes its forward inside its backward
            _, meter = measured(lambda: _recompute_backward(module, leaves, loss_output, written))
            out["bwd_recompute_peak" + suffix] = meter.peak
            out["fwd_keep_peak" + suffix] = out["saved_bytes" + suffix] = out["bwd_peak" + suffix] = 0
    _clear_grads(module)
    return out


def _input_bytes(leaves) -> int:
    """Bytes of the pack's inputs a kept forward holds until its backward: its leaves (runtime/ops/compute.py), whose
    gradients the backward reads, hold every tensor input, of any dtype (a batch's token ids, an earlier pack's
    integer positions or masks), after the values that brought them die; a view of an input counts its whole
    storage."""
    storages = {x.untyped_storage()._cdata: x.untyped_storage().nbytes() for x in leaves
                if isinstance(x, torch.Tensor)}
    return sum(storages.values())


def _recompute_backward(module, leaves, loss_output, written):
    """A recompute and its backward as ``backward`` runs them: it copies the buffers the forward writes (running
    statistics) before recomputing, to restore them after the backward, so the copies live through both."""
    restore = [b.clone() for b in written]
    _run_backward(*_seeds(_with_grad(module, leaves), loss_output))
    return restore


def _no_grad(module, leaves):
    with torch.no_grad():
        return module(*leaves)


def _with_grad(module, leaves):
    with torch.enable_grad():
        return module(*leaves)


def _seeds(outs, loss_output):
    outs = [t for t in tensors_of(outs) if t.requires_grad]
    if loss_output:
        return [outs[0] / 2], [None]
    return outs, [torch.ones_like(t) for t in outs]


def _run_backward(tensors, grads):
    if tensors:
        torch.autograd.backward(tensors, grads)


def _clear_grads(module):
    for p in module.parameters():
        p.grad = None
