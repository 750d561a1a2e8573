"""prefetch: start each swap_in as early as the budget allows, so the copy overlaps compute.

A ``swap_in`` reserves its device bytes when issued and copies on the copy stream;
its ``wait`` stays before the first op that needs the state. Hoisting it past ops
raises the predicted memory of every op it passes by the bytes it brings, so it moves
to the earliest point after the previous release of the same state at which the
predicted curve still fits the budget. Swap-ins are taken in schedule order, and the
curve is updated after each move.
"""
from __future__ import annotations

import time

from harmony.compiler.ir import PassReport, PassResult, Program
from harmony.compiler.verify import memory_curve
from harmony.runtime import ops

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
    moved = hoisted_ops = 0
    for j in range(len(nodes)):
        node = nodes[j]
        if node.target is not ops.swap_in:
            continue
        size = curve.before[j + 1] - curve.before[j] if j + 1 < len(nodes) else 0
        if size <= 0:
            continue
        i = j
        while i > 0:
            prev = nodes[i - 1]
            if prev.target in (ops.release, ops.swap_in, ops.wait) and prev.args and \
                    (prev.args[0] == node.args[0] or prev.target is ops.wait):
                break          # never across a release/swap of the same pack, nor another copy's wait
            if peak_at[i - 1] + size > budget:
                break
            i -= 1
        if i == j:
            continue
        for k in range(i, j):
            peak_at[k] += size
        nodes.insert(i, nodes.pop(j))
        peak_at.insert(i, peak_at.pop(j))
        nodes[i + 1].prepend(node)
        moved += 1
        hoisted_ops += j - i
    check = memory_curve(program, check_residency=False)
    report.totals = dict(swap_ins_hoisted=moved, ops_overlapped=hoisted_ops,
                         predicted_peak_MiB=check.peak / 2**20, seconds=time.perf_counter() - start)
    return PassResult(program, report)
