"""The example batch as ``trace`` sees it: its tensors, their placeholder names, and whether the last is a target.

``Batch.of`` checks the batch against the model's forward signature before anything is traced, so a batch
the model cannot take is an ``InputError`` that names the signature, not a tracer's failure.
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

__all__ = ["Batch"]


@dataclasses.dataclass(frozen=True)
class Batch:
    names: tuple[str, ...]  # one placeholder name per tensor
    tensors: tuple[torch.Tensor, ...]
    keys: tuple[str, ...] | None  # a dict batch's keys: the model takes its inputs by name
    has_target: bool  # the last tensor is loss_fn's target

    @property
    def model_inputs(self) -> tuple[torch.Tensor, ...]:
        return self.tensors[:-1] if self.has_target else self.tensors

    def describe(self) -> str:
        parts = [f"{n} {str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for n, t in zip(self.names, self.tensors)]
        target = " (the last is loss_fn's target)" if self.has_target else ""
        return f"{len(parts)} tensors{target}: {', '.join(parts)}"

    @classmethod
    def of(cls, model: torch.nn.Module, batch: Any, loss_fn: Callable | None) -> Batch:
        if isinstance(batch, Mapping):
            keys, tensors = tuple(batch), tuple(batch.values())
            bad = [k for k in keys
                   if not isinstance(k, str) or not k.isidentifier() or keyword.iskeyword(k) or k == "self"]
            if bad:
                raise InputError(f"example_batch keys must be argument names of {signature_text(model)}; got {bad}")
        elif isinstance(batch, (tuple, list)):
            keys, tensors = None, tuple(batch)
        else:
            raise InputError(
                f"example_batch must be a tuple of tensors or a dict of argument name -> tensor, "
                f"got {type(batch).__name__}"
            )
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            kinds = [type(t).__name__ for t in tensors]
            raise InputError(f"example_batch must hold only tensors, got {kinds}")
        has_target = loss_fn is not None
        if len(tensors) < 1 + has_target:
            need = "the model's inputs followed by loss_fn's target" if has_target else "at least one tensor"
            raise InputError(f"example_batch holds {len(tensors)} tensors; it needs {need}")

        signature = forward_signature(model)
        model_part = tensors[:-1] if has_target else tensors
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
        tensors = _unaliased(tensors)
        if keys is not None:
            names = list(keys)
        else:
            names = _positional_names(signature, len(model_part)) + (["target"] if has_target else [])
            names = _unique_identifiers(names)
        return cls(tuple(names), tensors, keys, has_target)


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
