"""Ops whose outputs' shapes depend on values, given shapes bounded by their inputs' while the model is traced.

torch.export runs the model on fake tensors, which have shapes but no values. An op whose output's shape depends on
its inputs' values (``torch.Tag.dynamic_output_shape``) stops the trace (``DynamicOutputShapeException``) unless its
fake kernel can say the shape some other way. ``F.ctc_loss`` with tensor lengths (wav2vec2's and HuBERT's CTC head)
is one: ``aten._ctc_loss.Tensor`` returns the per-row losses, whose shape is the batch's, and ``log_alpha``, the
forward variables its backward reads, of shape ``(rows, frames, 2 * longest target + 1)``: the longest target is a
value. No graph node reads ``log_alpha`` (only autograd does), so its fake shape only fills the node's
``meta["val"]``, and the bound the targets' own shape gives (the padded width of 2-D targets, the total length of
1-D concatenated ones) is never smaller than the real one. The cost analysis measures such ops once on zeros, as it
does every op whose shape depends on values (cost.py); what that misses the runtime absorbs and reports.

``bounded_shapes()`` registers these kernels for the length of a trace and removes them after, so the user's process
(``torch.compile`` of another model, whose inductor would compile code for the bound's shape) never sees them. An
op that already has a fake kernel (one the user registered) keeps it. Any other data-dependent op still stops the
trace with a ``TraceError`` that names it and its source line (``errors.untraceable``).
"""
from __future__ import annotations

import contextlib

import torch

__all__ = ["BOUNDED", "bounded_shapes"]


def _ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    """``aten._ctc_loss.Tensor``: log_probs (frames, rows, classes); ``F.ctc_loss`` adds the rows of an unbatched
    one before it calls this."""
    frames, rows = log_probs.shape[0], log_probs.shape[1]
    longest = targets.shape[-1]          # no target is longer than the targets' own last dimension
    return log_probs.new_empty((rows,)), log_probs.new_empty((rows, frames, 2 * longest + 1))


# op name -> its bounded fake kernel (the op's own arguments, fake tensors in, fake tensors out)
BOUNDED = {"aten::_ctc_loss.Tensor": _ctc_loss}


@contextlib.contextmanager
def bounded_shapes():
    """For the block, each op in ``BOUNDED`` without a fake kernel of its own has the one given there."""
    library = torch.library.Library("aten", "FRAGMENT")
    try:
        for name, kernel in BOUNDED.items():
            with contextlib.suppress(RuntimeError):      # it has one already (the user's): that one stands
                torch.library.register_fake(name, kernel, lib=library)
        yield
    finally:
        library._destroy()
