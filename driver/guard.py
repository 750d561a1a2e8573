"""One call at a time on a compiled module, and none once it is closed.

A ``ScheduledModule``'s steps, evaluations, checkpoints and state dicts read and write the same runtime state (the
tiers' tensors, the memory meter, the step's transaction): two of them at once, from two threads, interleave their
swaps and leave that state wrong for every later step. So each such call holds the module's lock (``Guard``): a
call from another thread waits until the running one has ended, as one step waits for the last. The lock is
re-entrant: a call made within another on the same thread (``sm(...)`` in eval mode runs ``sm.evaluate``) goes on.

``sm.close()`` takes the lock too (a step running in another thread ends first), releases the runtime and marks
the module closed: every guarded call after it raises ``ClosedError``, saying so.
"""
from __future__ import annotations

import contextlib
import functools
import threading

from harmony.base.errors import ClosedError


class Guard:
    """A module's lock, and whether it was closed."""

    def __init__(self):
        self.lock = threading.RLock()
        self.closed = False

    def refuse_closed(self, call: str) -> None:
        if self.closed:
            raise ClosedError(f"{call}: this module was closed (sm.close() released its runtime: its threads, "
                              f"buffers and offload files), so it runs nothing more. Save or read its state before "
                              f"closing it; to train or evaluate again, compile the model again (harmony.load "
                              f"restores a checkpoint into the new module).")


def guarded(call: str, reads: bool = False):
    """Run the decorated function, whose first argument is the module, holding the module's lock; refused once
    the module is closed. ``call`` names it in the error (``"sm(...)"``, ``"harmony.save"``). ``reads``: it only
    reads the training state, which a closed module still holds in memory (its weights, after training): refused
    only where some of that state lived in offload files, which ``close`` removed."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(sm, *args, **kwargs):
            guard = getattr(sm, "guard", None)
            if guard is None:       # a module assembled without one (never by harmony.compile)
                return fn(sm, *args, **kwargs)
            with guard.lock:
                if not (reads and not on_disk(sm)):
                    guard.refuse_closed(call)
                return fn(sm, *args, **kwargs)
        return run
    return wrap


def on_disk(sm) -> bool:
    """Whether some of the module's training state lives in files (weights or optimizer state on the disk tier)."""
    state = getattr(sm.runtime, "state", None)
    return state is not None and (getattr(state, "disk", None) is not None
                                  or getattr(state, "params_disk", None) is not None)


def close(sm) -> None:
    """``sm.close()``: once any running call has ended, release the runtime; a second close does nothing."""
    guard = getattr(sm, "guard", None)
    with guard.lock if guard is not None else contextlib.nullcontext():
        if guard is not None and guard.closed:
            return
        try:
            if sm.runtime is not None:
                sm.runtime.close()
        finally:
            if guard is not None:
                guard.closed = True
