"""prefetch: start each swap_in as early as the budget allows, so the copy overlaps compute.

A ``swap_in`` reserves its device bytes when issued and copies on the copy stream;
its ``wait`` stays before the first op that needs the state. Hoisting it past ops
raises the predicted memory of every op it passes by the bytes it brings, so it moves
to the earliest point after the previous release of the same state at which the
predicted curve still fits the budget. Swap-ins are taken in schedule order, and the
curve is updated after each move. An ``unstash`` that brings a kept forward's graph back
from the host (the swap pass's ``offloaded`` packs) moves the same way, over one forward
or backward at most: its copy runs on the copy stream too, and the backward waits for it.
"""
from __future__ import annotations

import time

import torch.fx

from harmony.compiler.ir import PassReport, PassResult, Program
from harmony.compiler.verify import memory_curve
from harmony.runtime import ops

GRAPH_AHEAD = 1    # forwards and backwards a stashed graph's copy back may overlap (more holds it longer for nothing)

NAME = "prefetch"
REQUIRES = {"residency"}
PROVIDES = {"prefetch"}


def run(program: Program, ctx) -> PassResult:
    start = time.perf_counter()
    report = PassReport("prefetch: swap_in hoisted over compute")
    budget = program.config.usable_budget
    curve = memory_curve(program, check_residency=False)
    peak_at = list(curve.peak_at)
    nodes = list(curve.nodes)
    moved = graphs = hoisted_ops = 0
    for j in range(len(nodes)):
        node, op = nodes[j], ops.op_of(nodes[j])
        graph_back = op.unstashes and _brings_graph(node)
        if not (op.fetches and op.state_copy) and not graph_back:     # a swap_in, or a graph coming back
            continue
        size = curve.before[j + 1] - curve.before[j] if j + 1 < len(nodes) else 0
        if size <= 0:
            continue
        i, passed = j, 0
        while i > 0:
            prev, before = nodes[i - 1], ops.op_of(nodes[i - 1])
            if graph_back and (prev in node.all_input_nodes or passed == GRAPH_AHEAD):
                break          # a graph comes back beside the op before its backward, not sooner
            if (before.state_copy or before.joins) and prev.args and (prev.args[0] == node.args[0] or before.joins):
                break          # never across a release/swap of the same pack, nor another copy's wait
            if peak_at[i - 1] + size > budget:
                break
            passed += before.runs_forward or before.runs_backward
            i -= 1
        if i == j:
            continue
        for k in range(i, j):
            peak_at[k] += size
        nodes.insert(i, nodes.pop(j))
        peak_at.insert(i, peak_at.pop(j))
        nodes[i + 1].prepend(node)
        graphs += graph_back
        moved += not graph_back
        hoisted_ops += j - i
    check = memory_curve(program, check_residency=False)
    report.totals = dict(swap_ins_hoisted=moved, graphs_hoisted=graphs, ops_overlapped=hoisted_ops,
                         predicted_peak_MiB=check.peak / 2**20, seconds=time.perf_counter() - start)
    return PassResult(program, report)


def _brings_graph(node) -> bool:
    """Whether an ``unstash`` brings back a kept forward's graph (what its stash sent is a ``forward(keep=True)``)."""
    stash = node.args[0]
    value = stash.args[0] if isinstance(stash, torch.fx.Node) and stash.args else None
    op = ops.op_of(value) if isinstance(value, torch.fx.Node) else None
    return op is not None and op.runs_forward and bool(value.kwargs.get("keep"))
