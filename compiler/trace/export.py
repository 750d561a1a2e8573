"""The ``torch.export`` front end of ``trace``, and what its graphs need to run where they did not trace.

An exported graph is specialised to the dtypes it saw: each ``.to(x.dtype)``, ``.to(device)``,
``softmax(dtype=...)`` and ``zeros(dtype=...)`` records the dtype as a constant, and each ``.to``
also records an ``aten._assert_tensor_metadata`` check of the dtype and device. A graph traced on
fp32 state then casts a bf16 copy's activations back to fp32 midway (GPT-2's
``position_embeds.to(inputs_embeds.device)``) and mixes dtypes in the next matmul. So a model
trained in a compute dtype is exported with its float state and float inputs in that dtype:
the graph's constants are then the ones an eager ``model.to(dtype)`` computes with, deliberate
upcasts included (Llama's rotary ``inv_freq.float()``, RMSNorm's fp32 variance). The state it
exports over is uninitialised (``torch.empty``: export reads shapes and dtypes, never values),
so it costs no compute. The metadata checks are dropped whatever the dtype: they compute
nothing, and ``retarget`` makes the device constants name the device the graph runs on.
"""
from __future__ import annotations

import contextlib
import io
import logging
import sys

import torch
import torch.fx
from torch.nn.utils.stateless import _reparametrize_module

from harmony.compiler.fake import fake_state_if_empty
from harmony.compiler.trace.bounded import bounded_shapes
from harmony.compiler.trace.sizes import symbolic_len

__all__ = ["drop_metadata_asserts", "export_graph", "graph_modules", "retarget", "torch_output_held"]


def export_graph(step: torch.nn.Module, tensors: tuple[torch.Tensor, ...],
                 dtype: torch.dtype | None = None) -> torch.fx.GraphModule:
    """``step`` exported (non-strict, the batch dimension dynamic) over ``tensors``, in ``dtype`` if given."""
    # Dim.AUTO keeps dim 0 symbolic unless the model specialises it, so one
    # graph serves every microbatch size.
    dynamic = tuple({d: torch.export.Dim.AUTO for d in range(t.dim())} if t.dim() > 0 else None for t in tensors)
    if dtype is not None:
        tensors = tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)
    # a model built without its weights is exported on fake twins of its state (compiler/fake.py)
    # ops whose output shapes depend on values (ctc_loss) traced with shapes bounded by their inputs' (bounded.py);
    # len(x) the symbol x.shape[0] is, not the example's rows (sizes.py)
    with torch_output_held(), _state_in(step, dtype), bounded_shapes(), symbolic_len(), \
            fake_state_if_empty(step, tensors) as (_, tensors):
        program = torch.export.export(step, tensors, strict=False, dynamic_shapes=dynamic)
    # ep.module() would add a guard node that rejects other batch sizes.
    gm = program.module(check_guards=False)
    drop_metadata_asserts(gm)
    return gm


@contextlib.contextmanager
def _state_in(module: torch.nn.Module, dtype: torch.dtype | None):
    """``module``'s float parameters and buffers replaced, for the block, by uninitialised ones in ``dtype``."""
    if dtype is None:
        yield
        return
    swapped = {}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:   # tie_weights: one name a tensor
        if t.is_floating_point() and t.dtype != dtype:
            twin = torch.empty_like(t, dtype=dtype)
            swapped[name] = torch.nn.Parameter(twin, t.requires_grad) if isinstance(t, torch.nn.Parameter) else twin
    with _reparametrize_module(module, swapped, tie_weights=True):
        yield


def graph_modules(module: torch.nn.Module) -> list[torch.fx.GraphModule]:
    """The GraphModules in ``module``, nested ones too (export wraps no-grad regions in submodules)."""
    return [m for m in module.modules() if isinstance(m, torch.fx.GraphModule)]


def drop_metadata_asserts(gm: torch.fx.GraphModule) -> None:
    """Remove export's ``aten._assert_tensor_metadata`` checks: each pins the dtype and device a ``.to(...)`` saw
    at trace time, which a GPU (and any dtype but the traced one) then fails; they compute nothing."""
    target = torch.ops.aten._assert_tensor_metadata.default
    for m in graph_modules(gm):
        dead = [n for n in m.graph.nodes if n.op == "call_function" and n.target is target and not n.users]
        for n in dead:
            m.graph.erase_node(n)
        if dead:
            m.recompile()


def retarget(module: torch.nn.Module, device: torch.device, managed: set[int]) -> None:
    """Make a graph traced on the CPU run on ``device``: device arguments recorded as the CPU (export's
    ``arange(..., device=cpu)``, ``_to_copy(device=cpu)``) name ``device``, and tensor constants the graph
    reads (not the training state, ``managed``: ids of the tensors the runtime moves) are copied there once."""
    cpu = torch.device("cpu")

    def swap(v):
        return device if isinstance(v, torch.device) and v == cpu else v
    for m in graph_modules(module):
        for n in m.graph.nodes:
            if n.op == "call_function":
                n.args = torch.fx.node.map_aggregate(n.args, swap)
                n.kwargs = torch.fx.node.map_aggregate(n.kwargs, swap)
            elif n.op == "get_attr":
                *parents, leaf = n.target.split(".")
                owner = m.get_submodule(".".join(parents))
                value = getattr(owner, leaf, None)
                if isinstance(value, torch.Tensor) and id(value) not in managed and value.device != device:
                    moved = value.to(device)
                    if leaf in getattr(owner, "_buffers", {}):
                        owner._buffers[leaf] = moved
                    else:
                        object.__setattr__(owner, leaf, moved)
        m.recompile()


@contextlib.contextmanager
def torch_output_held():
    """Hold what torch logs or prints while it tries to trace.

    On failure torch dumps partial graphs and fake-tensor tracebacks to stderr
    ahead of our own error; that text goes into a note on the exception
    instead (shown with the chained cause). On success it is replayed.
    """
    records: list[logging.LogRecord] = []
    holder = _RecordList(records)
    loggers = [logging.getLogger("torch")] + [
        logger
        for name, logger in logging.root.manager.loggerDict.items()
        if name.startswith("torch.") and not name.startswith("torch.__trace")  # structured trace, not console
        and isinstance(logger, logging.Logger) and logger.handlers
    ]
    saved = [(logger, logger.handlers) for logger in loggers]
    printed = io.StringIO()
    for logger in loggers:
        logger.handlers = [holder]
    try:
        with contextlib.redirect_stderr(printed):
            yield
    except Exception as error:
        held = [text for text in (*map(holder.format, records), printed.getvalue()) if text.strip()]
        if held:
            error.add_note("torch output while tracing:\n" + "\n".join(held))
        raise
    finally:
        for logger, handlers in saved:
            logger.handlers = handlers
    for record in records:
        logging.getLogger(record.name).handle(record)
    sys.stderr.write(printed.getvalue())


class _RecordList(logging.Handler):
    def __init__(self, records: list[logging.LogRecord]):
        super().__init__()
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
