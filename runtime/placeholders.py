"""Placeholders: what a parameter's ``.data`` holds while its weights live elsewhere (in files,
runtime/tiers/params_disk.py; in other ranks' shares, runtime/partitioned/; on other pipeline ranks,
driver/modes/pipeline.py).

One NaN broadcast to the parameter's shape and dtype: no memory. Inside the runtime a placeholder is never read
(a ``swap_in`` or gather replaces it first). In the user's model it would read as NaN without a word, so a parameter
of the user's model that holds one is a ``Withheld`` parameter (``withhold``): anything that would read its values
raises ``OffloadError`` saying where the weights are and how to get them (``sm.sync_model()``), while what describes
it (shape, dtype, device, ``requires_grad``, ``.grad``) still answers. It becomes its own class again the moment real
weights are set into it, so the runtime's steps pay nothing for the guard.
"""
from __future__ import annotations

import gc
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from harmony.base.errors import ConfigError, OffloadError

_NAN: dict[torch.dtype, torch.Tensor] = {}

# What only describes a tensor: a withheld parameter answers these; every other operation would read its values.
# (Properties such as .shape, .grad, .data, .T are always allowed; a view they return is withheld in turn.)
_DESCRIBE = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "stride", "element_size", "is_contiguous", "storage_offset",
    "data_ptr", "untyped_storage", "is_floating_point", "is_complex", "get_device", "requires_grad_",
    "register_hook", "register_post_accumulate_grad_hook", "__len__", "__format__", "_is_view"})


def placeholder(t: torch.Tensor) -> torch.Tensor:
    """A tensor of ``t``'s shape and dtype that holds no memory: one NaN broadcast to the shape."""
    if t.dtype not in _NAN:
        _NAN[t.dtype] = torch.full((), float("nan"), dtype=t.dtype)
    return _NAN[t.dtype].expand(t.shape)


def is_placeholder(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() > 0 and t.numel() > 1 and all(s == 0 for s in t.stride())


def withhold(t: torch.Tensor) -> None:
    """``t`` holds a placeholder from now on; a parameter of the user's model (``mark``) refuses to be read."""
    point(t, placeholder(t))


def point(t: torch.Tensor, data: torch.Tensor) -> None:
    """``t.data = data``; a parameter of the user's model that now holds a placeholder refuses to be read."""
    if t.device.type == "meta" and data.device.type != "meta":    # a model built under harmony.empty_weights
        take(t, data)
    else:
        t.data = data
    _withhold_if_placeholder(t, data)


def take(t: torch.Tensor, data: torch.Tensor) -> None:
    """``t``, a tensor on the meta device, holds ``data`` from now on: the same Python object (the model, the traced
    graph and the optimizers hold it), its attributes kept. ``t.data = data`` cannot move a tensor off the meta
    device, so the two objects' contents are swapped (``torch.utils.swap_tensors``)."""
    made = type(t)(data, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else data
    made.__dict__.update(t.__dict__)
    if weakref.getweakrefs(t):
        _forget_meta_fakes()
    if weakref.getweakrefs(t):
        raise ConfigError(f"a parameter of shape {list(t.shape)} built under harmony.empty_weights() cannot be made: "
                          f"something outside torch's fake-tensor caches holds a weak reference to it "
                          f"({weakref.getweakrefs(t)[0]!r}); build the model with its weights")
    torch.utils.swap_tensors(t, made)


def _forget_meta_fakes() -> None:
    """Drop meta parameters from torch's weak caches of fake tensors (a fake mode keeps one entry per tensor it saw:
    the trace's and the cost analysis's saw the empty model's parameters): ``swap_tensors`` refuses a tensor anything
    holds a weak reference to. A cache makes a fake again for a tensor it no longer holds. One scan drops them all,
    so the parameters taken after it find no reference left."""
    for cache in gc.get_objects():
        if isinstance(cache, WeakIdKeyDictionary):
            for key in [k for k in cache.keys() if isinstance(k, torch.nn.Parameter) and k.device.type == "meta"]:
                del cache[key]


def mark(name: str, p: torch.nn.Parameter, where: str) -> None:
    """``p`` is the user's parameter ``name``, which holds a placeholder whenever its weights are ``where``."""
    if getattr(p, "_harmony_user", None) is None:
        p._harmony_user = (name, type(p), where)
    _withhold_if_placeholder(p, p.data)


def _withhold_if_placeholder(t: torch.Tensor, data: torch.Tensor) -> None:
    """A marked parameter of the user's model whose ``data`` is a placeholder becomes a ``WithheldParameter``."""
    if getattr(t, "_harmony_user", None) is not None and not isinstance(t, WithheldParameter) \
            and is_placeholder(data):
        t.__class__ = WithheldParameter


def _refusal(t, use: str) -> OffloadError:
    name, _, where = getattr(t, "_harmony_user", None) or ("?", None, "elsewhere")
    return OffloadError(f"{use} of parameter {name!r} of the model passed to harmony.compile: its weights live "
                        f"{where} between steps, and it holds a placeholder here (reading it would give NaN). Call "
                        f"sm.sync_model() after the last step to read the trained weights into the model, or use "
                        f"sm.state_dict() / harmony.save, which read them where they are")


def _guarded(func, args, kwargs):
    name = getattr(func, "__name__", "")
    prop = name in ("__get__", "__set__")
    if not prop and name not in _DESCRIBE:
        withheld = next((a for a in args if isinstance(a, (WithheldParameter, _WithheldView))), None)
        raise _refusal(withheld, f"{name or func}()")
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*args, **(kwargs or {}))
    if name == "__set__" and func.__self__.__name__ == "data" and isinstance(args[0], WithheldParameter) \
            and not is_placeholder(args[1]):
        args[0].__class__ = args[0]._harmony_user[1]      # real weights again: the parameter's own class
    if prop and isinstance(out, torch.Tensor) and is_placeholder(out):
        view = out.as_subclass(_WithheldView)     # .data, .T, ...: still a placeholder, still refuses
        view._harmony_user = getattr(args[0], "_harmony_user", None)
        return view
    return out


class WithheldParameter(torch.nn.Parameter):
    """A parameter of the user's model whose weights live elsewhere between steps: reading it raises OffloadError."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _guarded(func, args, kwargs)

    def __repr__(self) -> str:
        name, _, where = self._harmony_user
        return (f"WithheldParameter({name!r}, shape={tuple(self.shape)}, dtype={self.dtype}: its weights live "
                f"{where}; sm.sync_model() reads them into the model)")

    def __deepcopy__(self, memo):
        raise _refusal(self, "copy.deepcopy")

    def __reduce_ex__(self, proto):
        raise _refusal(self, "pickling")


class _WithheldView(torch.Tensor):
    """``.data`` (or another view) of a withheld parameter: refuses as the parameter does."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _guarded(func, args, kwargs)

    __repr__ = WithheldParameter.__repr__
    __deepcopy__ = WithheldParameter.__deepcopy__
    __reduce_ex__ = WithheldParameter.__reduce_ex__
