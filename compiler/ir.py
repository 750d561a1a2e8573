"""The program a pass receives and returns: the model graph, its packs, the schedule graph, reports."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from harmony.compiler.config import CompileConfig
from harmony.compiler.meta import SCHEDULE
from harmony.compiler.trace import TRACE_INFO
from harmony.compiler.trace.batch import BatchForm
from harmony.runtime.plan import Plan


@dataclass
class PassReport:
    """What one pass did, in numbers: ``rows`` is a table (list of dicts), ``totals`` a dict."""

    title: str
    rows: list[dict] = field(default_factory=list)
    totals: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class PassResult:
    program: "Program"
    report: PassReport


@dataclass
class Program:
    model: torch.nn.Module
    gm: torch.fx.GraphModule           # the model graph (trace), annotated by cost
    example_batch: tuple
    config: CompileConfig
    fake: Any = None                   # FakeRun of the cost analysis (fake values at the microbatch size)
    fake_batch_bytes: dict = field(default_factory=dict)  # one microbatch of each model input
    pack_measurements: dict = field(default_factory=dict)  # (pack nodes, last) -> figures
    optim_profile: dict = field(default_factory=dict)   # bytes of optimizer state per parameter byte, ...
    units: list[list[torch.fx.Node]] = field(default_factory=list)  # narrowest-cut layers, in order
    plan: Plan | None = None           # packs (partition), residency (swap)
    schedule: torch.fx.Graph | None = None
    capabilities: set[str] = field(default_factory=set)
    reports: list[PassReport] = field(default_factory=list)
    history: list[tuple[str, str]] = field(default_factory=list)  # (pass name, schedule code after it)
    predicted_peak: int = 0
    rows: tuple | None = None          # this rank's rows [start, stop) of the global batch (balance)
    partition_choice: list | None = None   # the first node of each pack (partition.first_nodes): plain data, which
                                           # passes=(("partition", names), ...) applies again without searching
    compute_to_copies: float = 1.0     # how many times the step's compute outlasts its copies, every pack swapped
                                       # (PackCost.compute_and_copies); the swap pass weighs recompute by it
    swap_choice: Any = None            # what the swap pass kept on the device (passes.swap.graph.Choice): plain data,
                                       # which passes=(..., ("swap", choice), ...) applies again without searching
    batch_keys: tuple | None = None    # a Mapping batch's keys, its constants' too (the model takes its inputs by
                                       # name); None: a tuple
    step_hooks: list = field(default_factory=list)   # fn(sm) -> stats a pass adds to ``sm.stats`` after each step
                                                     # (module-level functions: a checkpoint pickles them by name)

    @property
    def batch_form(self) -> BatchForm | None:
        """How the traced batch is laid out (compiler/trace/batch.py): every item's name, by name or position, and
        its constants; None for a graph ``trace`` did not make."""
        info = self.gm.meta.get(TRACE_INFO) if self.gm is not None else None
        return getattr(info, "form", None)

    @property
    def constants(self) -> dict:
        """The batch's items that are not tensors (``use_cache=False``, ...), by name: the model was traced with
        them fixed; they are not inputs of the plan (``plan.input_names``)."""
        form = self.batch_form
        return dict(form.constants) if form is not None else {}


def calls(graph: torch.fx.Graph) -> list:
    """The schedule's op nodes (``call_function``), in order."""
    return [n for n in graph.nodes if n.op == "call_function"]


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of ``graph`` whose nodes keep their names and (shallow copies of) their meta."""
    g = torch.fx.Graph()
    env: dict = {}
    for n in graph.nodes:
        m = env[n] = add_node(g, n.op, n.target, torch.fx.node.map_arg(n.args, env.__getitem__),
                              torch.fx.node.map_arg(n.kwargs, env.__getitem__), n.name, n.type)
        if m.name != n.name:      # the namespace renames what shadows a builtin
            m.name = n.name
        m.meta.update(n.meta)     # into the new node's own dict: assigning goes through Node.__setattr__'s index upkeep
    return g


def add_call(graph: torch.fx.Graph, target, args: tuple, kwargs: dict | None = None) -> torch.fx.Node:
    """``graph.call_function(target, args, kwargs)`` at the graph's insert point, as ``add_node`` makes it."""
    return add_node(graph, "call_function", target, args, kwargs)


def emit(g: torch.fx.Graph, fn, *args, name=None, **kwargs) -> torch.fx.Node:
    """A call of the runtime op ``fn`` in the schedule ``g``, named ``name`` where given, tagged with its pack (the
    first argument where it is an int) for the passes that follow."""
    node = add_call(g, fn, args, kwargs)
    if name:
        node.name = g._graph_namespace.create_name(name, node)
    node.meta[SCHEDULE] = {"pack": args[0] if args and isinstance(args[0], int) else None}
    return node


# Graph.create_node walks every call's arguments with pytree to warn of raw SymInts: most of the swap pass's
# time, which builds a whole schedule graph (copy and inserts) for each plan it tries. A schedule's arguments are
# pack indices, names, flags and nodes, never symbolic, so its nodes are made by create_node's other steps alone.
# Where the graph's internals are not these (another torch), or a module owns the graph (its hooks), create_node
# makes them (tests/test_ir.py pins the two alike).
_INTERNALS = ("_graph_namespace", "_insert", "_find_nodes_lookup_table", "_len", "_target_to_str")
_FAST = all(hasattr(torch.fx.Graph(), a) for a in _INTERNALS)


def add_node(graph: torch.fx.Graph, op: str, target, args: tuple = (), kwargs: dict | None = None,
             name: str | None = None, type_expr=None) -> torch.fx.Node:
    """``graph.create_node(op, target, args, kwargs, name, type_expr)`` without its scan for raw SymInts."""
    if not _FAST or graph.owning_module is not None:
        return graph.create_node(op, target, args, kwargs, name, type_expr)
    name = graph._graph_namespace.create_name(name if name is not None else graph._target_to_str(target), None)
    n = torch.fx.Node(graph, name, op, target, tuple(args), dict(kwargs) if kwargs else {}, type_expr)
    graph._graph_namespace.associate_name_with_obj(name, n)
    graph._insert(n)
    graph._find_nodes_lookup_table.insert(n)
    graph._len += 1
    return n
