"""Branches on tensor values: a Python ``if`` on a tensor, taken as on the example batch and checked on every batch.

A forward that decides in Python from a tensor's value (``if labels.max() >= self.config.vocab_size: raise ...``,
``if mask.any():``, ``assert (x > 0).all()``) cannot be captured as it stands: torch.fx has no value to branch on
and torch.export stops at a guard on data (``GuardOnDataDependentSymNode``). torch's own compilers meet such a
guard by deciding it for the inputs they see and checking the decision when the code runs again; so does this:

* ``record`` runs the step eagerly once on the example batch (no gradient, random state and buffers restored)
  and notes each ``bool()`` of a tensor made by the user's code: where (file and line) and what it gave;
* tracing again under ``replaying`` answers each such ``bool()`` with the recorded outcome and puts a
  ``harmony::branch_check`` node into the graph in its place, reading the same condition tensor;
* at run time the node checks that every batch takes the same side. One that would take the other raises an
  ``InputError`` naming the line and the condition before the step's optimizer update, so the step's transaction
  rolls back as for any bad batch. A branch whose other side only raises (a check on the labels) is then the same
  check; one whose other side computes something else is refused rather than computed by the wrong side.

Outcomes are matched by source line, in the order that line ran (a loop's ``if`` runs once a pass), so a branch
that eager code reaches and the trace does not (a fast path tracing skips) costs nothing. Only ``bool()`` of a
tensor is answered: ``t.item()`` whose number is compared in Python, and ``int(t)`` used as a size, still stop the
trace with a ``TraceError`` that names the line.
"""
from __future__ import annotations

import contextlib
import linecache
import sys
from collections import defaultdict
from typing import Iterator

import torch
import torch.fx
from torch.overrides import TorchFunctionMode

from harmony.base.errors import InputError
from harmony.compiler.fake import fake_state_if_empty
from harmony.compiler.trace.errors import is_library

__all__ = ["Branches", "branch_check", "record", "replaying", "replayed"]


@torch.library.custom_op("harmony::branch_check", mutates_args=())
def branch_check(condition: torch.Tensor, taken: bool, where: str) -> None:
    """Raise ``InputError`` unless ``bool(condition) == taken``: the side of ``where``'s branch the trace took."""
    if bool(condition) != taken:
        raise InputError(
            f"this batch takes the other side of a branch on tensor values than the example batch did: the "
            f"condition at {where}\nis {not taken} for this batch and was {taken} for the example batch the model "
            f"was compiled with; the compiled step holds only the side it traced. Nothing was updated. If the "
            f"model raises on that side (a check of the labels), fix the batch; if it computes something else "
            f"there, compile with an example batch that takes that side, or express the branch "
            f"with torch.where / torch.cond.")


@branch_check.register_fake
def _(condition: torch.Tensor, taken: bool, where: str) -> None:
    return None


BRANCH_CHECK = torch.ops.harmony.branch_check.default
torch.fx.node.has_side_effect(BRANCH_CHECK)     # no user reads its result: keep it through dead-code removal


class Branches:
    """The outcomes of ``bool()`` on tensors in the user's code, by source line, in the order each line ran."""

    def __init__(self) -> None:
        self.outcomes: dict[tuple[str, int], list[bool]] = defaultdict(list)
        self.where: dict[tuple[str, int], str] = {}
        self.used: dict[tuple[str, int], int] = defaultdict(int)
        self.checked: list[str] = []             # each line answered from the record while tracing, once

    def __bool__(self) -> bool:
        return bool(self.outcomes)

    def restart(self) -> None:
        """Before a front end traces: every outcome unused again."""
        self.used.clear()
        self.checked.clear()

    def next(self) -> tuple[bool, str] | None:
        """The recorded outcome for the ``bool()`` the user's code is making now, and where, or None if none."""
        key = _user_line()
        if key is None or self.used[key] >= len(self.outcomes.get(key, ())):
            return None
        taken = self.outcomes[key][self.used[key]]
        self.used[key] += 1
        if self.where[key] not in self.checked:
            self.checked.append(self.where[key])
        return taken, self.where[key]


def _user_line() -> tuple[str, int] | None:
    f = sys._getframe(1)
    while f is not None and is_library(f.f_code.co_filename):
        f = f.f_back
    return None if f is None else (f.f_code.co_filename, f.f_lineno)


def _describe(key: tuple[str, int]) -> str:
    code = linecache.getline(*key).strip()
    return f"{key[0]}:{key[1]}" + (f": {code}" if code else "")


class _Recorder(TorchFunctionMode):
    def __init__(self, branches: Branches):
        super().__init__()
        self.branches = branches

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.__bool__:
            key = _user_line()
            if key is not None:
                self.branches.outcomes[key].append(bool(out))
                self.branches.where[key] = _describe(key)
        return out


def record(step: torch.nn.Module, tensors: tuple) -> Branches:
    """The branches on tensor values the step takes on ``tensors``, run eagerly (nothing kept: no gradient, the
    random state and the buffers restored). Empty when the step cannot run eagerly (then the trace's own error
    stands) or the model has no weights to run on."""
    branches = Branches()
    saved = [(b, b.detach().clone()) for b in step.buffers()]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), fake_state_if_empty(step, tensors) as (mode, _):
            if mode is None:
                with _Recorder(branches):
                    step(*tensors)
    except Exception:
        return Branches()
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)
    return branches


class _Replayer(TorchFunctionMode):
    """torch.export's ``bool()`` of a (fake) tensor answered from the record, a check put in the graph instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__bool__ and _ACTIVE:
            answer = _ACTIVE[-1].next()
            if answer is not None:
                taken, where = answer
                torch.ops.harmony.branch_check(args[0], taken, where)
                return taken
        return func(*args, **(kwargs or {}))


_ACTIVE: list[Branches] = []


def replayed(proxy: torch.fx.Proxy) -> bool | None:
    """torch.fx's ``bool()`` of a proxy answered from the record, its check added to the graph; None if none."""
    answer = _ACTIVE[-1].next() if _ACTIVE else None
    if answer is None:
        return None
    taken, where = answer
    proxy.tracer.create_proxy("call_function", BRANCH_CHECK, (proxy, taken, where), {})
    return taken


@contextlib.contextmanager
def replaying(branches: Branches | None) -> Iterator[None]:
    """Trace with ``branches`` answering ``bool()`` of tensors (nothing when None or empty)."""
    if not branches:
        yield
        return
    _ACTIVE.append(branches)
    try:
        with _Replayer():
            yield
    finally:
        _ACTIVE.pop()
