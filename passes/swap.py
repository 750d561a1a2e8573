"""swap: insert the data movement the budget forces, and nothing else.

1. If every pack's state and every activation fit at once, everything stays resident
   and no op is inserted (the nothing-to-do case).
2. Otherwise each visit of a pack (a run of ops on it) gets ``swap_in`` + ``wait``
   before its first op and ``release`` after its last, for the kinds of state the ops
   need: parameters (forward), plus gradients (backward), plus optimizer state (step).
3. Activation handles that live across the peak are stashed to the host after their
   first use and unstashed before each later use, largest first, until the predicted
   peak fits.
4. Packs are then made resident, most traffic saved per byte first, while it fits.
"""
from __future__ import annotations

import time

import torch.fx

from harmony.compiler.ir import PassReport, PassResult, Program
from harmony.compiler.meta import SCHEDULE
from harmony.compiler.verify import memory_curve
from harmony.errors import BudgetError
from harmony.runtime import ops
from harmony.units import fmt_bytes

NAME = "swap"
REQUIRES = {"schedule"}
PROVIDES = {"residency"}
KINDS = ("params", "grads", "optim")
NEEDS = {"forward": ("params",), "backward": ("params", "grads"), "step": ("params", "grads", "optim")}


def _calls(graph):
    return [n for n in graph.nodes if n.op == "call_function"]


def _visits(graph):
    """Runs of consecutive compute ops on the same pack: (pack, first node, last node, kinds needed)."""
    out, cur = [], None
    for n in _calls(graph):
        name = n.target.__name__
        if name not in NEEDS:
            continue
        p = n.args[0]
        if cur and cur[0] == p:
            cur[2] = n
            cur[3].update(NEEDS[name])
        else:
            cur = [p, n, n, set(NEEDS[name])]
            out.append(cur)
    return out


def insert_swaps(graph: torch.fx.Graph, resident: set) -> None:
    for p, first, last, kinds in _visits(graph):
        for kind in KINDS:
            if kind not in kinds or (p, kind) in resident:
                continue
            # optimizer state is only needed by the step: bring it in just for that op
            lo = first if kind != "optim" else next(n for n in _range(first, last) if n.target is ops.step)
            with graph.inserting_before(lo):
                h = graph.call_function(ops.swap_in, (p, kind))
                h.name = graph._graph_namespace.create_name(f"{kind}{p}", h)
                w = graph.call_function(ops.wait, (h,))
            hi = last if kind != "optim" else lo
            with graph.inserting_after(hi):
                r = graph.call_function(ops.release, (p, kind))
            for x in (h, w, r):
                x.meta[SCHEDULE] = {"pack": p, "kind": kind}


def _range(a, b):
    n = a
    while True:
        yield n
        if n is b:
            return
        n = n.next


def stash_value(graph: torch.fx.Graph, value: torch.fx.Node) -> bool:
    """Send ``value`` to the host and bring it back before its later uses.

    A value used twice (a pack's input: its forward now, its recompute later) stays for
    its first use and is stashed after it; a value used once is stashed at once.
    """
    users = [u for u in _calls(graph) if value in u.all_input_nodes]
    if not users:
        return False
    keep = users[:1] if len(users) >= 2 else []
    with graph.inserting_after(keep[0] if keep else value):
        s = graph.call_function(ops.stash, (value,))
    s.meta[SCHEDULE] = {"pack": None}
    for u in users[len(keep):]:
        with graph.inserting_before(u):
            un = graph.call_function(ops.unstash, (s,))
        un.meta[SCHEDULE] = {"pack": None}
        u.replace_input_with(value, un)
    return True


def _stash_until_fits(program: Program, budget: int) -> int:
    """Stash the activation handles live across the predicted peak, the pack with most bytes there first."""
    graph = program.schedule
    stashed = 0
    tried = set()
    while True:
        curve = memory_curve(program, check_residency=False)
        if curve.peak <= budget:
            return stashed
        at = curve.argmax()
        order = {n: i for i, n in enumerate(curve.nodes)}
        groups: dict = {}
        sizes = {}
        for n in curve.nodes:   # pack outputs (forward) and gradients of pack inputs (backward)
            if n.target in (ops.forward, ops.backward) and n not in tried and not n.kwargs.get("keep"):
                users = [order[u] for u in n.users if u in order]
                if users and order[n] < at <= max(users):
                    key = (n.target, n.args[0])
                    groups.setdefault(key, []).append(n)
                    spec = program.plan.packs[n.args[0]]
                    sizes[key] = sizes.get(key, 0) + (spec.out_bytes if n.target is ops.forward else spec.in_bytes)
        if not groups:
            return -1
        key = max(groups, key=sizes.__getitem__)
        # every microbatch of that pack alike, also the ones not live at this peak
        for n in curve.nodes:
            if (n.target, n.args[0]) == key and n not in tried and not n.kwargs.get("keep"):
                tried.add(n)
                stashed += stash_value(graph, n)
        tried.update(groups[key])


def _drop_swaps(graph: torch.fx.Graph, pack: int, kinds) -> None:
    for n in list(_calls(graph)):
        if n.target in (ops.swap_in, ops.release) and n.args[0] == pack and n.args[1] in kinds:
            if n.target is ops.swap_in:
                for w in list(n.users):
                    graph.erase_node(w)
            graph.erase_node(n)


def run(program: Program, ctx) -> PassResult:
    start = time.perf_counter()
    plan, budget = program.plan, program.config.usable_budget
    all_state = {(p.index, k) for p in plan.packs for k in KINDS}
    report = PassReport("swap: data movement")
    if program.config.policy == "ondemand":
        report.notes.append("policy ondemand: no planned movement; the runtime fetches state when an op "
                            "touches it and evicts the least recently used state when the budget is hit")
        return PassResult(program, report)
    plan.resident = set(all_state)
    if memory_curve(program, check_residency=False).peak <= budget:
        report.notes.append("everything fits the budget: all state stays resident, no swap inserted")
        report.totals = dict(resident_packs=len(plan.packs), swaps=0, stashes=0)
        return PassResult(program, report)
    plan.resident = set()
    insert_swaps(program.schedule, plan.resident)
    stashed = _stash_until_fits(program, budget)
    curve = memory_curve(program, check_residency=False)
    if stashed < 0 or curve.peak > budget:
        at = curve.nodes[curve.argmax()]
        need = int(program.config.memory_budget * curve.peak / budget * 1.05) + 1
        raise BudgetError(
            f"no schedule fits memory_budget={fmt_bytes(program.config.memory_budget)}: with every pack swapped "
            f"and every activation stashed, the predicted peak is {fmt_bytes(curve.peak)} at {at.name}, over "
            f"the {fmt_bytes(budget)} the planner may fill. Raise memory_budget to about {fmt_bytes(need)} "
            f"({need} bytes) or use more microbatches.", min_budget=need)
    # keep packs resident where it still fits: most bytes moved per byte held first
    resident_rows = []
    for p in sorted(plan.packs, key=lambda s: -(s.param_bytes + s.buffer_bytes)):
        for kinds in (("params", "grads", "optim"), ("params", "grads"), ("params",)):
            trial = plan.resident | {(p.index, k) for k in kinds}
            saved = program.schedule
            g = _copy(saved)
            _drop_swaps(g, p.index, kinds)
            program.schedule, old = g, plan.resident
            plan.resident = trial
            if memory_curve(program, check_residency=False).peak <= budget:
                resident_rows.append(dict(pack=p.index, resident="+".join(kinds)))
                break
            program.schedule, plan.resident = saved, old
    counts = {}
    for n in _calls(program.schedule):
        counts[n.target.__name__] = counts.get(n.target.__name__, 0) + 1
    report.rows = resident_rows
    curve = memory_curve(program, check_residency=False)
    report.totals = dict(swap_ins=counts.get("swap_in", 0), releases=counts.get("release", 0),
                         stashes=counts.get("stash", 0), unstashes=counts.get("unstash", 0),
                         resident=len(resident_rows), predicted_peak_MiB=curve.peak / 2**20,
                         h2d_MiB=curve.moved["h2d"] / 2**20, d2h_MiB=curve.moved["d2h"] / 2**20,
                         seconds=time.perf_counter() - start)
    report.notes.append("forced by the budget: the state of all packs does not fit at once")
    return PassResult(program, report)


def _copy(graph: torch.fx.Graph) -> torch.fx.Graph:
    g = torch.fx.Graph()
    env = {}
    for n in graph.nodes:
        env[n] = g.node_copy(n, lambda x: env[x])
        env[n].name = n.name
        env[n].meta = dict(n.meta)
    return g
