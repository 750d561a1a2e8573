"""``len()`` of a tensor, kept symbolic while torch.export traces.

torch.export keeps the batch's sizes symbolic (``Dim.AUTO``), and ``x.shape[0]`` or ``x.size(0)`` stays a symbol the
graph computes from its input. ``len(x)`` does not: Python's ``len`` must return an ``int``, so the symbol is forced
to the example's number (a guard) and every size computed from it is fixed to the example batch's. A contrastive
loss's ``torch.arange(len(logits))`` (CLIP's) then builds the example's rows of targets whatever the microbatch, and
the graph refuses to run microbatches of any other size.

``symbolic_len()`` replaces the builtin ``len`` for the length of a trace with one that gives a tensor's first size
as ``x.shape[0]`` does: a symbol where export keeps one. Where the user's code needs a Python int of it (``range``,
an ``if``, a list's length) the symbol is forced there as it was before, so nothing traces worse; where it flows into
a torch call (``arange``, ``view``, ``zeros``) it stays symbolic and the graph serves every batch size. Anything but
a plain tensor (lists, dicts, a tensor subclass with its own ``__len__``) goes to Python's own ``len``, and the
builtin is restored after the trace.
"""
from __future__ import annotations

import builtins
import contextlib

import torch

__all__ = ["symbolic_len"]

_LEN = builtins.len


def _len(obj, /):
    if isinstance(obj, torch.Tensor) and type(obj).__len__ is torch.Tensor.__len__ and obj.dim() > 0:
        return obj.shape[0]
    return _LEN(obj)


@contextlib.contextmanager
def symbolic_len():
    """For the block, ``len(tensor)`` is ``tensor.shape[0]`` (a symbol under export); any other ``len`` as Python's."""
    builtins.len = _len
    try:
        yield
    finally:
        builtins.len = _LEN
