"""What a model's forward does besides computing tensors, which a traced step does not do again.

Tracing runs the forward's Python once; the compiled step replays only its tensor operations. A ``print`` in
``forward`` prints at compile and never again, a counter (``self.calls += 1``) counts one call: silently, unless
someone says so. ``watch`` notices the two kinds that can be seen from outside: text the forward printed while it
was traced, and a module attribute holding a number, string or flag that the forward changed. Each becomes a
warning and a note of the trace's report. Side effects on other objects (a global, a list) are not seen.
"""
from __future__ import annotations

import contextlib
import io
import sys
import warnings

import torch

_PLAIN = (bool, int, float, str)


class _Tee(io.TextIOBase):
    """Writes go on to the real stream (the user still sees them) and are counted."""

    def __init__(self, stream):
        self.stream, self.text = stream, []

    def write(self, s: str) -> int:
        self.text.append(s)
        return self.stream.write(s)

    def flush(self) -> None:
        self.stream.flush()


def _plain_attributes(model: torch.nn.Module) -> dict:
    """(module path, attribute) -> value, for every module attribute that is a plain number, string or flag (not
    ``training``, which tracing sets)."""
    out = {}
    for path, m in model.named_modules():
        for k, v in vars(m).items():
            if isinstance(v, _PLAIN) and k != "training" and not k.startswith("__"):
                out[(path, k)] = v
    return out


@contextlib.contextmanager
def watch(model: torch.nn.Module, notes: list[str]):
    """Inside the block the model's forward is traced; afterwards ``notes`` gets a line for each side effect seen,
    and each is warned about once."""
    before = _plain_attributes(model)
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        yield
    found = []
    printed = "".join(tee.text).strip()
    if printed:
        first = printed.splitlines()[0]
        found.append(f"the forward printed while it was traced ({first[:60]!r}{' ...' if len(printed) > 60 else ''}):"
                     f" a print in forward runs once, at compile, not at every step")
    after = _plain_attributes(model)
    changed = [(k, before[k], after[k]) for k in before if k in after and after[k] != before[k]]
    if changed:
        each = ", ".join(f"{p + '.' if p else ''}{a} {old!r} -> {new!r}" for (p, a), old, new in changed[:4])
        found.append(f"the forward changed module attribute{'s' if len(changed) > 1 else ''} while it was traced "
                     f"({each}{' ...' if len(changed) > 4 else ''}): the compiled step replays the forward's tensor "
                     f"operations only, so Python state a forward keeps (a counter, a flag) changed once, at compile, "
                     f"and does not change at each step; keep such state outside forward, or in a buffer")
    for line in found:
        warnings.warn(f"harmony.compile: {line}", UserWarning, stacklevel=4)
    notes.extend(found)
