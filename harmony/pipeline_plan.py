"""A whole pipeline node planned in one process: every rank's packs and schedule, without ranks or weights.

>>> with torch.device("meta"):                     # a model too big for this machine: no memory is allocated
...     model = GPT(GPTConfig(layers=48, width=1600, heads=25, vocab=50257, seq=1024, tie=False))
>>> programs = plan_node(model, (ids, ids), Hardware.node("8x1080ti"), microbatches=16)
>>> node = simulate_programs(programs, Hardware.node("8x1080ti"))
>>> print(node.summary())                          # a row per device

Each rank is planned as ``harmony.compile(..., parallel="pipeline")`` plans it under torchrun: the model is
traced and costed once, then the passes (with the stage pass after the partition) run once per rank with that
rank's number, its device's figures and its budget. The stage pass places the packs and this rank's schedule is
built by passes/stage_schedule.py, the same code the real ranks run; only the stage pass's agreement among live
ranks (an all-gather) is skipped, as there are none. Nothing is run: the programs are for ``simulate_programs``,
reports and reading (``schedule_code(program)``).
"""
from __future__ import annotations

import dataclasses

import torch

from harmony.base.errors import ConfigError
from harmony.compiler.config import Config


def plan_node(model: torch.nn.Module, example_batch, hardware, *, world: int | None = None, memory_budget=None,
              config: Config | None = None, **options) -> list:
    """One ``Program`` per rank of a pipeline over ``world`` devices of ``hardware`` (default: all of them).

    ``memory_budget``: bytes per device (default: each device's memory); every other option as
    ``harmony.compile``'s (``microbatches``, ``placement``, ``policy``, ...). ``device="meta"`` is the default:
    build the model under ``torch.device("meta")`` and nothing is allocated.
    """
    from harmony import api
    from harmony.compiler import cost
    from harmony.compiler.ir import Program
    from harmony.compiler.passmanager import split_choices
    from harmony.compiler.trace import trace
    from harmony.passes.stage import check_config
    world = world or len(hardware.devices)
    if world > len(hardware.devices):
        raise ConfigError(f"world={world} but the hardware has {len(hardware.devices)} devices")
    if options.pop("parallel", "pipeline") != "pipeline":
        raise ConfigError("plan_node plans a pipeline: drop parallel=, or use harmony.compile for one device")
    options.setdefault("device", "meta")
    group = options.pop("pipeline_group", None)     # checked with parallel='pipeline' below
    if group == "auto":
        raise ConfigError("plan_node plans one pipeline_group: give a number (group_candidates(M) lists what "
                          "pipeline_group='auto' weighs on live ranks), and compare their simulate_programs")
    budget = memory_budget or hardware.devices[0].memory
    options = Config.of(config, memory_budget=budget, hardware=hardware, data_parallel=False, **options)
    names, batch = api._batch_items(example_batch)
    cfg = api._resolve(options, api._batch_size(batch))
    passes = tuple(cfg.passes)
    if "stage" not in split_choices(passes)[0]:
        at = split_choices(passes)[0].index("partition") + 1
        passes = passes[:at] + ("stage",) + passes[at:]
    cfg = dataclasses.replace(cfg, parallel="pipeline", world_size=world, passes=passes, pipeline_group=group)
    check_config(cfg)
    gm = trace(model, dict(zip(names, batch)) if names else tuple(batch), loss_fn=cfg.loss_fn,
               leaf_modules=cfg.leaf_modules, dtype=cfg.compute_dtype)
    fake = cost.annotate(gm, tuple(batch), cfg.microbatch_size, dtype=cfg.compute_dtype)
    profile = cost.optimizer_profile(cfg.optimizer, cfg.optimizer_kwargs)
    programs, measured = [], {}     # a pack's measured peaks are the same on every rank: measured once
    for rank in range(world):
        dev = hardware.devices[rank]
        mine = dataclasses.replace(cfg, rank=rank, memory_budget=memory_budget or dev.memory)
        mine.plan_for_device(dev, hardware)
        program = Program(model=model, gm=gm, example_batch=tuple(batch), config=mine,
                          batch_keys=tuple(names) if names else None)
        program.fake, program.optim_profile, program.pack_measurements = fake, profile, measured
        programs.append(api.run_passes(program, passes))
    return programs


def rank_inputs(program) -> tuple:
    """``(graph, plan, memory curve, state sizes)`` of a planned program: what ``simulate_node`` takes per device."""
    from harmony.compiler.verify import memory_curve, state_sizes
    return (program.schedule, program.plan, memory_curve(program, check_residency=False), state_sizes(program))


def simulate_programs(programs, hardware, replicas: int = 1):
    """The node's step with device r running ``programs[r]`` (``replicas``: each program run by that many devices
    in a row, e.g. one data-parallel plan on every device of the node)."""
    from harmony.runtime.simulate_node import simulate_node
    ranks = [rank_inputs(p) for p in programs]
    return simulate_node([r for r in ranks for _ in range(replicas)], hardware)


def node_hardware(cfg, hardware=None):
    """The node a pipeline rank simulates (``sm.simulate``, ``pipeline_group="auto"``): ``hardware`` (a
    ``Hardware``, one device per rank, or one device every rank is alike; a server preset of ``Hardware.node`` or a
    GPU preset), or None: this machine as one logical device per rank under the rank's budget and speed factor."""
    from harmony.compiler.hardware import Hardware
    from harmony.compiler.nodes import NODES
    world = cfg.world_size
    if hardware is None:
        return Hardware.this_machine(cache_dir=cfg.cache_dir).logical([cfg.memory_budget] * world,
                                                                      [cfg.speed_factor] * world)
    if isinstance(hardware, str):
        return Hardware.node(hardware) if hardware in NODES else Hardware.preset(hardware, count=world)
    if len(hardware.devices) < world:        # one device given for the rank: every rank's alike
        return hardware.replace(devices=tuple(hardware.devices[0] for _ in range(world)))
    return hardware


def another_rank(program, config):
    """A program to plan under ``config`` (another rank's) from ``program``'s trace, its fake run, its optimizer's
    profile and its table of measured packs (a pack measures the same on every rank: measured once)."""
    from harmony.compiler.ir import Program
    other = Program(model=program.model, gm=program.gm, example_batch=program.example_batch, config=config,
                    batch_keys=program.batch_keys)
    other.fake, other.optim_profile = program.fake, program.optim_profile
    other.pack_measurements = program.pack_measurements
    return other


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
    from harmony.base.errors import HarmonyError
    from harmony.compiler.passmanager import run_passes
    cfg = program.config
    hw = node_hardware(cfg, cfg.hardware)
    predicted: dict = {}
    for group in group_candidates(cfg.microbatches):
        programs = []
        try:
            for rank in range(cfg.world_size):
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
    from harmony.compiler.passmanager import run_passes
    mine, cfg = sm.program, sm.program.config
    hw = node_hardware(cfg, hardware)
    programs = [mine if rank == cfg.rank else run_passes(another_rank(mine, dataclasses.replace(cfg, rank=rank)),
                                                         cfg.passes)
                for rank in range(cfg.world_size)]
    sm.node_simulation = simulate_programs(programs, hw)
    return sm.node_simulation
