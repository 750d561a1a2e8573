"""A pipeline node seen from one rank: the group size ``pipeline_group="auto"`` weighs, and every rank's plan
simulated together (``sm.simulate()`` of a pipeline rank; ``simulate_programs`` for plans made by
``harmony.driver.node.plan_node``, which plans a whole node in one process).
"""
from __future__ import annotations

import dataclasses

from harmony.base.errors import HarmonyError
from harmony.compiler.hardware import Hardware
from harmony.compiler.hardware.nodes import NODES
from harmony.compiler.passmanager import run_passes
from harmony.compiler.verify import memory_curve, state_sizes
from harmony.driver.replan import another_rank
from harmony.passes.stage import pipeline_ranks
from harmony.runtime.simulate.node import simulate_node


def rank_inputs(program) -> tuple:
    """``(graph, plan, memory curve, state sizes)`` of a planned program: what ``simulate_node`` takes per device."""
    return (program.schedule, program.plan, memory_curve(program, check_residency=False), state_sizes(program))


def portable_inputs(program) -> tuple:
    """``rank_inputs`` to send to another rank (pickled): the plan without its packs' modules, whose weights the
    simulation does not read."""
    graph, plan, memory, sizes = rank_inputs(program)
    lean = dataclasses.replace(plan, packs=[dataclasses.replace(p, module=None) for p in plan.packs])
    return graph, lean, memory, sizes


def simulate_programs(programs, hardware, replicas: int = 1):
    """The node's step with device r running ``programs[r]`` (``replicas``: each program run by that many devices
    in a row, e.g. one data-parallel plan on every device of the node)."""
    ranks = [rank_inputs(p) for p in programs]
    return simulate_node([r for r in ranks for _ in range(replicas)], hardware)


def node_hardware(cfg, hardware=None):
    """The node a pipeline rank simulates (``sm.simulate``, ``pipeline_group="auto"``): ``hardware`` (a
    ``Hardware``, one device per rank, or one device every rank is alike; a server preset of ``Hardware.node`` or a
    GPU preset), or None: this machine as one logical device per rank under the rank's budget and speed factor."""
    world = len(pipeline_ranks(cfg))
    if hardware is None:
        return Hardware.this_machine(cache_dir=cfg.cache_dir).logical([cfg.memory_budget] * world,
                                                                      [cfg.speed_factor] * world,
                                                                      getattr(cfg, "link_bandwidth", 0.0) or None)
    if isinstance(hardware, str):
        return Hardware.node(hardware) if hardware in NODES else Hardware.preset(hardware, count=world)
    if len(hardware.devices) < world:        # one device given for the rank: every rank's alike
        return hardware.replace(devices=tuple(hardware.devices[0] for _ in range(world)))
    return hardware


def group_candidates(microbatches: int) -> list[int]:
    """The group sizes ``pipeline_group="auto"`` weighs: M, then halving (rounded up) down to 1."""
    out = [microbatches]
    while out[-1] > 1:
        out.append(-(-out[-1] // 2))
    return out


def choose_group(program, passes) -> tuple[int, dict]:
    """``pipeline_group="auto"``: the group size whose node step the simulator predicts shortest (ties: the larger,
    fewer swaps), with each candidate's predicted step (None where a rank's plan failed).

    Every rank plans the whole node for each candidate from the same trace (offline: nothing is sent) and
    simulates it, so all ranks choose alike; the stage pass then checks that they did. Each rank takes every other
    rank's device and budget to be its own (as ``sm.simulate`` does): ranks with different budgets may choose
    differently, and the stage pass then refuses the plan on every rank. Its cost is the planning of every rank
    once per candidate."""
    cfg = program.config
    hw = node_hardware(cfg, cfg.hardware)
    predicted: dict = {}
    for group in group_candidates(cfg.microbatches):
        programs = []
        try:
            for rank in pipeline_ranks(cfg):
                config = dataclasses.replace(cfg, rank=rank, pipeline_group=group, offline=True)
                programs.append(run_passes(another_rank(program, config), passes))
        except HarmonyError:
            predicted[group] = None
            continue
        predicted[group] = simulate_programs(programs, hw).step_seconds
    feasible = [g for g, t in predicted.items() if t is not None]
    if not feasible:
        return cfg.microbatches, predicted          # the real planning then says why
    return min(feasible, key=lambda g: (predicted[g], -g)), predicted


def simulate_rank_node(sm, hardware=None):
    """A pipeline rank's whole node simulated (``sm.simulate()`` of a rank): this rank's program as compiled, every
    other rank's planned here from the same trace (its passes with its rank number; nothing is sent), all simulated
    together. The result is kept as ``sm.node_simulation``, which ``sm.report()`` shows, a row per device."""
    mine, cfg = sm.program, sm.program.config
    hw = node_hardware(cfg, hardware)
    programs = [mine if rank == cfg.rank else run_passes(another_rank(mine, dataclasses.replace(cfg, rank=rank)),
                                                         cfg.passes)
                for rank in pipeline_ranks(cfg)]
    sm.node_simulation = simulate_programs(programs, hw)
    return sm.node_simulation
