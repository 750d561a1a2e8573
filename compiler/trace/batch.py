"""The example batch as ``trace`` sees it: its tensors, their placeholder names, its constants, and whether the last
item is a target.

``Batch.of`` checks the batch against the model's forward signature before anything is traced, so a batch
the model cannot take is an ``InputError`` that names the signature, not a tracer's failure.

A batch is a tuple (the forward takes its items by position) or any ``Mapping`` (a dict, a Hugging Face
``BatchEncoding``: by name, in its key order). Its tensors are the graph's inputs. Its other items -- flags and
options such as ``use_cache=False``, ``return_loss=True``, an int, a string, None, a tuple of those -- are
constants of the trace (``BatchForm.constants``): the traced step calls the model with them fixed, and a batch
with other values needs another trace (driver/constants.py).
"""
from __future__ import annotations

import dataclasses
import inspect
import keyword
from collections.abc import Mapping
from typing import Any, Callable

import torch

from harmony.base.errors import InputError
from harmony.compiler.trace.errors import forward_signature, signature_text

__all__ = ["Batch", "BatchForm", "constant_kind", "forward_default"]

_SCALARS = (bool, int, float, str, type(None))


def constant_kind(value: Any) -> bool:
    """Whether ``value`` can be a constant of the trace: a bool, int, float, str or None, or a tuple of them."""
    if isinstance(value, tuple):
        return all(constant_kind(v) for v in value)
    return isinstance(value, _SCALARS)


def forward_default(model: torch.nn.Module, name: str) -> Any:
    """The default of ``model.forward``'s argument ``name``; ``inspect.Parameter.empty`` where it has none."""
    signature = forward_signature(model)
    param = signature.parameters.get(name) if signature is not None else None
    return param.default if param is not None else inspect.Parameter.empty


@dataclasses.dataclass(frozen=True)
class BatchForm:
    """How a batch is laid out: every item's name in its order, whether the model takes them by name, and which
    are constants of the trace (with their values). Kept in ``TraceInfo.form``, so that a program can rebuild
    its batch with other tensors or other constants (``rebuild``)."""

    names: tuple[str, ...]        # every item: a Mapping's keys, else the forward's argument names ("target" last)
    keyed: bool                   # a Mapping batch: the model takes its inputs by name
    constants: dict[str, Any]     # the items that are not tensors, by name, in the batch's order

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(n for n in self.names if n not in self.constants)

    def items(self, tensors, constants: Mapping | None = None) -> list:
        """Every item in order: ``tensors`` (in ``tensor_names`` order) in their places, the constants in theirs
        (``constants`` where given, else the form's own)."""
        constants = self.constants if constants is None else constants
        it = iter(tensors)
        return [constants[n] if n in self.constants else next(it) for n in self.names]

    def rebuild(self, tensors, constants: Mapping | None = None) -> dict | tuple:
        """The batch as the user gives it (a dict or a tuple) with these tensors and constants."""
        items = self.items(tensors, constants)
        return dict(zip(self.names, items)) if self.keyed else tuple(items)


@dataclasses.dataclass(frozen=True)
class Batch:
    names: tuple[str, ...]  # one placeholder name per tensor
    tensors: tuple[torch.Tensor, ...]
    has_target: bool  # the last item is loss_fn's target (a tensor)
    form: BatchForm   # every item's name, by name or position, and the constants

    @property
    def model_inputs(self) -> tuple[torch.Tensor, ...]:
        return self.tensors[:-1] if self.has_target else self.tensors

    def describe(self) -> str:
        parts = [f"{n} {str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for n, t in zip(self.names, self.tensors)]
        target = " (the last is loss_fn's target)" if self.has_target else ""
        fixed = f"; constants {describe_constants(self.form.constants)}" if self.form.constants else ""
        return f"{len(parts)} tensors{target}: {', '.join(parts)}{fixed}"

    @classmethod
    def of(cls, model: torch.nn.Module, batch: Any, loss_fn: Callable | None) -> Batch:
        if isinstance(batch, Mapping):
            keys, items = tuple(batch), tuple(batch.values())
            bad = [k for k in keys
                   if not isinstance(k, str) or not k.isidentifier() or keyword.iskeyword(k) or k == "self"]
            if bad:
                raise InputError(f"example_batch keys must be argument names of {signature_text(model)}; got {bad}")
        elif isinstance(batch, (tuple, list)):
            keys, items = None, tuple(batch)
        else:
            raise InputError(
                f"example_batch must be a tuple of tensors or a dict (any Mapping, such as a Hugging Face "
                f"BatchEncoding) of argument name -> tensor, got {type(batch).__name__}"
            )
        names = _item_names(model, keys, len(items), loss_fn is not None)
        odd = [f"{n}={type(v).__name__}" for n, v in zip(names, items)
               if not isinstance(v, torch.Tensor) and not constant_kind(v)]
        if odd:
            raise InputError(
                f"example_batch holds {', '.join(odd)}: a batch holds tensors, and constants the model's forward "
                f"takes as they are (bool, int, float, str, None, or a tuple of them, such as use_cache=False). "
                f"Turn the item into a tensor, or leave it out of the batch and set it on the model"
            )
        has_target = loss_fn is not None
        if has_target and items and not isinstance(items[-1], torch.Tensor):
            raise InputError(
                f"example_batch's last item is loss_fn's target and must be a tensor, got "
                f"{type(items[-1]).__name__} ({items[-1]!r}); a batch holds the model's inputs (tensors, and "
                f"constants such as flags) followed by the target"
            )
        tensors = tuple(v for v in items if isinstance(v, torch.Tensor))
        if len(tensors) < 1 + has_target:
            need = "the model's inputs followed by loss_fn's target" if has_target else "at least one tensor"
            raise InputError(f"example_batch holds {len(tensors)} tensors; it needs {need}")

        signature = forward_signature(model)
        model_part = items[:-1] if has_target else items
        if signature is not None:
            try:
                if keys is None:
                    signature.bind(*model_part)
                else:
                    signature.bind(**dict(zip(keys, model_part)))
            except TypeError as error:
                hints = [] if has_target else ["if the last tensor is a target, pass loss_fn=..."]
                hints += ["pass a dict to give the tensors by argument name"] if keys is None else []
                raise InputError(
                    f"{signature_text(model)} cannot take the batch: {error}. "
                    f"The batch holds {len(tensors)} tensors"
                    + (" (the last is loss_fn's target)" if has_target else "")
                    + (f"; {'; '.join(hints)}" if hints else "")
                ) from None
        constants = {n: v for n, v in zip(names, items) if not isinstance(v, torch.Tensor)}
        form = BatchForm(tuple(names), keys is not None, constants)
        return cls(form.tensor_names, _unaliased(tensors), has_target, form)


def describe_constants(constants: Mapping) -> str:
    """``use_cache=False, return_loss=True``."""
    return ", ".join(f"{n}={v!r}" for n, v in constants.items())


def _item_names(model: torch.nn.Module, keys: tuple | None, count: int, has_target: bool) -> list[str]:
    """A name per item: a Mapping's keys; else the forward's positional argument names (``batch_i`` past them, or
    for all where they are not distinct identifiers), and ``target`` for loss_fn's."""
    if keys is not None:
        return list(keys)
    names = _positional_names(forward_signature(model), count - has_target) + (["target"] if has_target else [])
    return _unique_identifiers(names)


def _unaliased(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    # torch.export merges inputs that alias one another: with labels=input_ids
    # passed as one tensor the graph would read labels where it needs
    # input_ids. Distinct copies keep the two inputs distinct in the graph.
    seen: set[int] = set()
    result = []
    for tensor in tensors:
        storage = tensor.untyped_storage().data_ptr() if tensor.device.type != "meta" else id(tensor)
        result.append(tensor.clone() if storage in seen or id(tensor) in seen else tensor)
        seen |= {storage, id(tensor)}
    return tuple(result)


def _positional_names(signature: inspect.Signature | None, count: int) -> list[str]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    named = [p.name for p in signature.parameters.values() if p.kind in kinds] if signature else []
    return [named[i] if i < len(named) else f"batch_{i}" for i in range(count)]


def _unique_identifiers(names: list[str]) -> list[str]:
    ok = [n.isidentifier() and not keyword.iskeyword(n) and n != "self" for n in names]
    if all(ok) and len(set(names)) == len(names):
        return names
    return [f"batch_{i}" for i in range(len(names))]
