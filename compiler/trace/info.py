"""``TraceInfo``: how a graph was traced (``gm.meta[TRACE_INFO]``), and which sizes of its inputs it runs at."""
from __future__ import annotations

import dataclasses

import torch
import torch.fx

from harmony.compiler.trace.batch import BatchForm


@dataclasses.dataclass(frozen=True)
class TraceInfo:
    """How a graph was traced; stored in ``gm.meta[TRACE_INFO]``."""

    frontend: str  # "fx" or "export": the front end that produced the graph
    seconds: float
    inputs: tuple[str, ...]  # placeholder names, in call order
    constants: tuple[str, ...]  # tensor attributes of gm that are not the model's state
    notes: tuple[str, ...] = ()  # e.g. why fx was not used
    # Per input, per dimension: None where the graph runs any size there (up to the traced one: the plan is made
    # for it), or the size it is fixed to. fx graphs compute every size from their inputs as eager code does;
    # export's keeps symbolic the dimensions the model lets vary (``Dim.AUTO``), from 2 up.
    sizes: tuple[tuple[int | None, ...], ...] = ()
    least: int = 1     # the smallest size a dimension but the rows marked None takes
    form: BatchForm | None = None  # the batch's items by name, and the constants the model was called with

    def runs_at(self, shapes) -> str | None:
        """Why the graph cannot run a batch of ``shapes`` (one per input) as traced, or None where it can: every
        dimension no larger than the traced one, and any that differs free to."""
        for name, shape, sizes in zip(self.inputs, shapes, self.sizes):
            if len(shape) != len(sizes):
                return f"{name} has {len(shape)} dimensions, not {len(sizes)}"
            for d, (n, fixed) in enumerate(zip(shape, sizes)):
                if fixed is not None and n != fixed:
                    return f"{name}'s dimension {d} is fixed to {fixed} by the model's trace"
                if fixed is None and d > 0 and n < self.least:     # rows: microbatches of any size, as always
                    return f"{name}'s dimension {d} is {n}; the trace holds from {self.least} up"
        return None


def sizes_of(gm: torch.fx.GraphModule, used: str, tensors: tuple) -> tuple[tuple[int | None, ...], ...]:
    """``TraceInfo.sizes``: fx graphs read every size off their inputs; export's placeholders say which it kept
    symbolic (an int where the model fixed it: a weight's width, a table's length)."""
    if used == "fx":
        return tuple((None,) * t.dim() for t in tensors)
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    if len(vals) != len(tensors) or not all(isinstance(v, torch.Tensor) for v in vals):
        return tuple(tuple(t.shape) for t in tensors)     # not known: each size as traced
    return tuple(tuple(None if isinstance(n, torch.SymInt) else int(n) for n in v.shape) for v in vals)
