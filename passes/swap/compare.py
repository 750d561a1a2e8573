"""Graphs first where the compute outlasts the copies, checked in simulation before the swap pass takes it.

The swap pass ranks what it keeps on the device by the copy traffic it saves per byte held, a recompute priced as
the bytes the host link moves in its time. Behind a fast link (an H100's pinned copies, some 50 GB/s) the step's
compute outlasts its copies several times over: the recompute a kept graph saves is on the step's critical path,
the traffic a held weight saves is hidden behind compute all the same, and that ranking keeps no graph (the
partition's cost model, ``PackCost.kept_graphs``, puts graphs first there). Graphs first is not always faster
either: the room they take may be what let the first pack step on the device, whose host step otherwise ends
the step. So where the plan's hardware is known, its copies overlap its compute (not the CPU device's) and the
compute outlasts the copies with every pack swapped (``Program.compute_to_copies``), the swap pass also makes the
choice that ranks graphs before any traffic, and keeps whichever the simulator finds faster on that hardware.
"""
from __future__ import annotations

from harmony.base.tiers import Tier
from harmony.compiler.hardware import Hardware
from harmony.compiler.ir import copy_graph
from harmony.compiler.verify import memory_curve
from harmony.passes import prefetch
from harmony.passes.swap.graph import Choice
from harmony.runtime.simulate import simulate

GRAPHS_FIRST = 1e3    # times a graph's value per byte: before any traffic (a byte held saves at most a few moved)


def graphs_first(program, graphs: list) -> list | None:
    """``graphs`` (the swap pass's candidates) ranked before any traffic, where that choice is worth simulating;
    None where it is not (no graph, copies holding the compute up, copies outlasting compute, no hardware)."""
    cfg = program.config
    if not graphs or cfg.copies_block or program.compute_to_copies <= 1 or hardware(cfg) is None \
            or program.plan.stage is not None:
        return None
    return [(value * GRAPHS_FIRST, held, what) for value, held, what in graphs]


def hardware(cfg):
    """The hardware the plan is for, as the simulator takes it; None without one, under ``balance``, or where
    devices share a host link through a switch: the swap pass simulates one device, which would miss the contention
    the graphs-first choice's added traffic meets there (benchmarks/pipeline.py's switched 4 x GTX 1080 Ti vDP
    simulated slower with it)."""
    if cfg.hardware is None or cfg.balance is not None:
        return None
    hw = Hardware.of(cfg.hardware)
    return None if hw.switches else hw


def simulated(program, fits, choices: list[Choice], sizes: dict) -> list[float]:
    """Each choice's step as the simulator predicts it on the plan's hardware, its swap_ins hoisted as the prefetch
    pass will; ``fits`` builds a choice's schedule (the caller builds the one it takes again afterwards)."""
    plan, hw = program.plan, hardware(program.config)
    before = {p.index: (plan.at(p.index).step_on, plan.at(p.index).optim_on) for p in plan.packs}
    seconds = []
    for choice in choices:
        fits(choice)
        program.schedule = copy_graph(program.schedule)   # the prefetch below changes it; fits keeps what it built
        for p in choice.device:     # as the swap pass marks a pack it steps on the device
            plan.at(p).step_on = plan.at(p).optim_on = Tier.DEVICE
        prefetch.run(program, None)
        curve = memory_curve(program, check_residency=False)     # (copies out in flight hold memory until they land)
        seconds.append(simulate(program.schedule, plan, hw, memory=curve, sizes=sizes).step_seconds)
        for p, (step_on, optim_on) in before.items():
            plan.at(p).step_on, plan.at(p).optim_on = step_on, optim_on
    return seconds
