"""Placeholders: what a parameter's ``.data`` holds while its weights live in files (runtime/diskparams.py).

One NaN broadcast to the parameter's shape and dtype: no memory, and any use of it outside a ``swap_in`` shows as
NaN; the user's model refuses to be read while it holds one (harmony/usermodel.py).
"""
from __future__ import annotations

import torch

_NAN: dict[torch.dtype, torch.Tensor] = {}


def placeholder(t: torch.Tensor) -> torch.Tensor:
    """A tensor of ``t``'s shape and dtype that holds no memory: one NaN broadcast to the shape."""
    if t.dtype not in _NAN:
        _NAN[t.dtype] = torch.full((), float("nan"), dtype=t.dtype)
    return _NAN[t.dtype].expand(t.shape)


def is_placeholder(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() > 0 and t.numel() > 1 and all(s == 0 for s in t.stride())
