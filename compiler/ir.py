"""The program a pass receives and returns: the model graph, its packs, the schedule graph, reports."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from harmony.compiler.config import CompileConfig
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
    pack_measurements: dict = field(default_factory=dict)  # (pack nodes, last) and pack_signature -> figures
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
    batch_keys: tuple | None = None    # a dict batch's keys (the model takes its inputs by name); None: a tuple
    step_hooks: list = field(default_factory=list)   # fn(sm) -> stats a pass adds to ``sm.stats`` after each step
                                                     # (module-level functions: a checkpoint pickles them by name)


def calls(graph: torch.fx.Graph) -> list:
    """The schedule's op nodes (``call_function``), in order."""
    return [n for n in graph.nodes if n.op == "call_function"]


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of ``graph`` whose nodes keep their names and (shallow copies of) their meta."""
    g = torch.fx.Graph()
    env: dict = {}
    for n in graph.nodes:
        env[n] = g.node_copy(n, lambda x: env[x])
        env[n].name = n.name
        env[n].meta = dict(n.meta)
    return g
