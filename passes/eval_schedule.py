"""The evaluation schedule: every pack's forward over the batch, and nothing else, within the training budget.

It runs between two training steps on the state as the steps leave it, so its plan starts where
theirs does: what the training plan keeps on the device for the whole run (``resident_state``) is
there, the weights a disk step carries to the next forward are there, everything else is on the
host or on disk. Each pack then gets ``swap_in`` + ``wait`` of its weights, the forward of every
microbatch (``keep=False``: no graph is kept, nothing is stashed, nothing is recomputed later), and
a ``release`` after it; its weights come in once per evaluation (the harmony policy's order, "pack
major"). A swap of state that is already on the device moves nothing (the runtime's holds count),
and the release of a pack the disk tier carries leaves its weights for the next step
(``carry=True``, as the step that carried them does). The prefetch pass then starts each swap_in as
early as the budget allows. Where the pack-major order does not fit (every microbatch's activations
at a pack boundary at once, which a sequential plan never holds), one microbatch at a time goes
through every pack ("microbatch major"), its weights swapped in for each.

Under ``parallel="pipeline"`` (and a grid) each rank runs its own packs' forwards in the training schedule's
order of microbatch groups across the ranks (passes/stage_schedule.py ``global_order``, forwards only), so the
ranks' messages meet as a step's do: a ``recv`` of each value another rank's pack made, a ``send`` of each value
another rank reads, and the loss rank's loss shared with every rank at the end (``share_loss``).

This is not a pass of the pipeline (``passes=``): ``harmony.driver.evaluate`` builds it on the first
``sm.evaluate(...)`` from the compiled program, and the runtime runs it (``Runtime.evaluate``).
"""
from __future__ import annotations

import dataclasses
import time

import torch.fx

from harmony.base.errors import BudgetError, PassError
from harmony.base.units import fmt_bytes
from harmony.compiler.ir import PassReport, Program, calls
from harmony.compiler.verify import MemoryCurve, memory_curve
from harmony.passes import prefetch
from harmony.passes.schedule import Builder
from harmony.passes.shard import rewrite
from harmony.passes.stage_schedule import StageBuilder, global_order
from harmony.runtime import ops
from harmony.runtime.pipeline import share_loss

ORDERS = ("pack major", "microbatch major")


def lower(program: Program, order: str = "pack major") -> torch.fx.Graph:
    """Forward-only ops with each pack's weights swapped in around its forwards (``order``: see the docstring)."""
    if program.plan.stage is not None:
        return lower_stage(program)
    b = Builder(program)
    plan = program.plan
    packs, m = range(len(plan.packs)), range(plan.microbatches)
    visits = [(p, list(m)) for p in packs] if order == "pack major" else [(p, [mb]) for mb in m for p in packs]
    for p, mbs in visits:
        carried = plan.at(p).carried
        fetch = b.emit(ops.swap_in, p, "params", **({"carried": True} if carried else {}))
        b.emit(ops.wait, fetch)
        for mb in mbs:
            b.forward(p, mb, keep=False)
        b.emit(ops.release, p, "params", **({"carry": True} if carried else {}))
    b.g.output(None)
    return b.g


def lower_stage(program: Program) -> torch.fx.Graph:
    """A pipeline rank's forward-only ops: its packs' forwards in the step's order across the ranks (every rank
    must run the same order, whatever its own memory, or a rank would wait for a message its sender sends later),
    each run of one pack's forwards between a ``swap_in`` of its weights and their ``release``."""
    b = StageBuilder(program)
    cfg = program.config
    current = None

    def release():
        carried = program.plan.at(b.mine[current]).carried
        b.emit(ops.release, b.mine[current], "params", **({"carry": True} if carried else {}))

    for event in global_order(b.n, b.m, cfg.policy, cfg.pipeline_group, b.st.rank_of):
        if event[0] not in ("F", "FB") or event[1] not in b.mine:
            continue
        if event[1] != current:
            if current is not None:
                release()
            current, p = event[1], b.mine[event[1]]
            carried = program.plan.at(p).carried
            b.emit(ops.wait, b.emit(ops.swap_in, p, "params", **({"carried": True} if carried else {})))
        b.forward(current, event[2], keep=False)
    if current is not None:
        release()
    b.emit(share_loss, b.st.loss_rank, **({} if b.st.weight is None else {"weight": b.st.weight}))
    b.g.output(None)
    return b.g


def build(program: Program, plan) -> tuple[torch.fx.Graph, MemoryCurve, PassReport]:
    """The evaluation schedule of a compiled ``program`` whose packs run as in ``plan`` (its eval-mode forwards),
    its predicted memory, and what was chosen.

    Raises ``BudgetError`` where neither order fits the budget the training plan was made for."""
    start = time.perf_counter()
    budget = program.config.usable_budget
    view = dataclasses.replace(program, plan=plan, reports=[], history=[])
    tried = []
    for order in ORDERS if plan.stage is None else ("the step's order",):
        view.schedule = lower(view, order)
        curve = memory_curve(view, check_residency=False)
        tried.append((order, curve.peak))
        if curve.peak <= budget:
            break
    else:
        need = program.config.budget_for(min(peak for _, peak in tried))
        raise BudgetError(f"the evaluation schedule does not fit memory_budget="
                          f"{fmt_bytes(program.config.memory_budget)}: its predicted peak is "
                          f"{', '.join(f'{fmt_bytes(p)} {o}' for o, p in tried)}, over the {fmt_bytes(budget)} the "
                          f"planner may fill; compile with more microbatches or a memory_budget of about "
                          f"{fmt_bytes(need)}", min_budget=need)
    hoisted = prefetch.run(view, None).report.totals
    if any(r.shares is not None for r in plan.residency.values()):   # shard_state="full": gathers, as in training
        view.schedule = rewrite(view.schedule, plan, program.config.world_size)
    curve = memory_curve(view, check_residency=True)
    if curve.missing:     # a planner bug, not the user's: say where
        node, kind, name = curve.missing[0]
        raise PassError(f"evaluation schedule: {node.format_node()} uses {kind} of {name!r}, not on the device there")
    counts: dict[str, int] = {}
    for n in calls(view.schedule):
        counts[n.target.__name__] = counts.get(n.target.__name__, 0) + 1
    report = PassReport("evaluation schedule: forward only", [dict(op=k, count=v) for k, v in counts.items()],
                        totals=dict(order=order, swap_ins_hoisted=hoisted["swap_ins_hoisted"],
                                    predicted_peak_MiB=curve.peak / 2**20, h2d_MiB=curve.moved["h2d"] / 2**20,
                                    d2h_MiB=curve.moved["d2h"] / 2**20, seconds=time.perf_counter() - start))
    if len(tried) > 1:
        report.notes.append(f"pack major peaks at {fmt_bytes(tried[0][1])}, over the {fmt_bytes(budget)} the "
                            f"planner may fill: one microbatch at a time through every pack instead")
    return view.schedule, curve, report
