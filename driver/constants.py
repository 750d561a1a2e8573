"""A call's constants: the items of ``sm(...)``'s batch that are not tensors, checked against the trace's.

The example batch's non-tensor items (``use_cache=False``, ``return_loss=True``, an int, a string, None, a tuple
of them) are constants of the trace (compiler/trace/batch.py): the traced step calls the model with them fixed,
and the plan's inputs are the tensors alone. A call gives them again, by name or in their places, or leaves
them out. ``split_call`` takes them out of the call's arguments before the tensors are checked:

- the same values as the example batch's: the compiled plan (or the plan of the batch's shapes) runs;
- other values: ``sm(...)`` traces and plans the step again for them, once (driver/shapes.py keys its plans by
  shapes and constants; ``changed`` says what differs, for the log); ``sm.evaluate(...)`` refuses
  (``same_as_compiled``): its schedule is the compiled plan's;
- a constant the example batch had and the call leaves out, or one the call adds: an ``InputError`` naming
  it, unless the value the call means is the model's default for that argument (leaving out
  ``use_cache=True`` where ``forward`` defaults to it is the same call).

A lone ``Mapping`` passed by position, ``sm(batch)``, is taken as its items by name, as ``sm(**batch)``.
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch

from harmony.base.errors import InputError
from harmony.compiler.trace.batch import constant_kind, describe_constants, forward_default

__all__ = ["batch_example", "changed", "constants_key", "key_text", "same_as_compiled", "split_call"]


def split_call(program, batch: tuple, named: dict) -> tuple[tuple, dict, dict]:
    """The call's tensors by position and by name, apart from its constants, and the constants the step runs with
    (in the example batch's order). ``InputError`` for a constant missing, added, or of a kind no trace takes."""
    if len(batch) == 1 and isinstance(batch[0], Mapping):       # sm(batch): the Mapping's items by name
        twice = [k for k in batch[0] if k in named]
        if twice:
            raise InputError(f"sm(batch, ...) got {', '.join(map(repr, twice))} both in the batch and by keyword")
        batch, named = (), {**batch[0], **named}
    form = program.batch_form
    if form is None or not (form.constants or any(_is_constant(v) for v in named.values())):
        return tuple(batch), dict(named), {}
    given: dict = {}
    positional = []
    for i, x in enumerate(batch):        # a tuple batch's constants come in their places
        name = form.names[i] if not form.keyed and i < len(form.names) else None
        if name in form.constants:
            given[name] = x
        else:
            positional.append(x)
    tensors = {}
    for k, v in named.items():
        if k in form.constants:
            given[k] = v
        elif k in form.tensor_names or isinstance(v, torch.Tensor):
            if _is_constant(v):
                raise InputError(f"sm(...) got {k}={v!r} where example_batch had a tensor: the batch's tensors are "
                                 f"the plan's inputs. Pass a tensor, or compile with an example_batch that holds "
                                 f"{k}={v!r}")
            tensors[k] = v          # a tensor, or something batch_of refuses by name
        elif not _is_default(program.model, k, v):
            raise InputError(f"sm(...) got {k}={v!r}, which example_batch did not have: the step was traced "
                             f"without it. Leave it out, or compile with an example_batch that holds {k}={v!r}")
    for name, value in given.items():
        if not constant_kind(value):
            raise InputError(f"sm(...) got {name}={type(value).__name__}, which example_batch gave as "
                             f"{form.constants[name]!r}, a constant of the trace: pass a bool, int, float, str, None, "
                             f"or a tuple of them")
    for name, value in form.constants.items():
        if name not in given:
            if not _is_default(program.model, name, value):
                raise InputError(f"sm(...) is missing {name!r}, which example_batch gave as {value!r} (a constant of "
                                 f"the traced step, not the model's default); pass {name}={value!r}, or compile "
                                 f"with an example_batch without it")
            given[name] = value
    return tuple(positional), tensors, {n: given[n] for n in form.constants}


def constants_key(constants: Mapping) -> tuple:
    """What a plan is cached by for its constants: each name with its value's type and ``repr`` (``True`` and ``1``
    are other traces; a float is told apart to its last bit)."""
    return tuple((n, _frozen(v)) for n, v in constants.items())


def key_text(key: tuple) -> str:
    """``use_cache=False, mode='gelu'``: a ``constants_key`` as the call gave it."""
    return ", ".join(f"{n}={_text(v)}" for n, v in key)


def batch_example(program, tensors, constants: Mapping | None = None):
    """The batch to trace ``program``'s model with: ``tensors`` (in the plan's order) and ``constants`` (the
    program's where None) in their places, laid out as the example batch was (a dict or a tuple)."""
    form = program.batch_form
    if form is None:
        return dict(zip(program.batch_keys, tensors)) if program.batch_keys else tuple(tensors)
    return form.rebuild(tensors, constants or None)


def changed(compiled: Mapping, constants: Mapping) -> str:
    """``use_cache=True (compiled with False)``: the constants that differ from the compiled ones."""
    return ", ".join(f"{n}={constants[n]!r} (compiled with {compiled[n]!r})" for n in constants
                     if n in compiled and _frozen(constants[n]) != _frozen(compiled[n]))


def same_as_compiled(program, constants: Mapping, what: str) -> None:
    """``InputError`` where ``constants`` are not those the program was traced with: ``what`` (``sm.evaluate``) runs
    the compiled plan only."""
    differs = changed(program.constants, constants)
    if differs:
        raise InputError(f"{what}(...) got {differs}: it runs the step as example_batch traced it "
                         f"({describe_constants(program.constants)}), and other constants may change the traced graph. "
                         f"Pass the compiled values, or compile with an example_batch that has these ones "
                         f"(sm(...) trains with other constants by tracing again)")


def _is_constant(value) -> bool:
    return not isinstance(value, torch.Tensor) and constant_kind(value)


def _is_default(model, name: str, value) -> bool:
    """Whether ``value`` is ``model.forward``'s default for ``name`` (giving it is the same call as leaving it out)."""
    default = forward_default(model, name)
    return default is not inspect.Parameter.empty and constant_kind(default) and _frozen(default) == _frozen(value)


def _text(frozen) -> str:
    kind, value = frozen
    if kind != "tuple":
        return value
    return "(" + ", ".join(map(_text, value)) + ("," if len(value) == 1 else "") + ")"


def _frozen(value):
    if isinstance(value, tuple):
        return ("tuple", tuple(_frozen(v) for v in value))
    return type(value).__name__, repr(value)
