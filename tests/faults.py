"""Fault injection for the tests: make the Nth schedule op of a step raise, or deliver a signal there."""
from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading

import harmony.runtime.executor as executor


@contextlib.contextmanager
def fail_at(index: int, error=None, signum: int | None = None, kinds: tuple = ()):
    """Inside the block, the ``index``-th op the executor runs (counting only ops whose name is in ``kinds``, if
    given) raises ``error`` before it executes, or sends this process ``signum`` after it executes. Yields a dict
    whose "hit" says whether it happened and "op" names the op."""
    real = executor.op_of
    seen = {"n": 0, "hit": False, "op": None}

    def op_of(node):
        op = real(node)
        if kinds and op.name not in kinds:
            return op
        n = seen["n"]
        seen["n"] += 1
        if n != index:
            return op

        def execute(rt, *args, **kwargs):
            seen["hit"], seen["op"] = True, node.name
            if error is not None:
                raise error
            out = op.execute(rt, *args, **kwargs)
            # to the main thread, where Python runs signal handlers: a process-directed signal may be taken by any
            # thread that does not block it (a copy or OpenMP thread), so when the handler runs would depend on it
            signal.pthread_kill(threading.main_thread().ident, signum)
            return out
        return dataclasses.replace(op, execute=execute)

    executor.op_of = op_of
    try:
        yield seen
    finally:
        executor.op_of = real


def schedule_ops(sm) -> list[str]:
    """The names of the ops one step runs, in order."""
    return [n.target.__name__ for n in sm.graph.nodes if n.op == "call_function"]
