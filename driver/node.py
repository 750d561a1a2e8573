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
reports and reading (``schedule_code(program)``). ``simulate_programs`` is in driver/modes/pipeline_plan.py.
"""
from __future__ import annotations

import dataclasses

import torch

from harmony.base.errors import ConfigError
from harmony.compiler import cost
from harmony.compiler.config import Config
from harmony.compiler.config_checks import HYBRID
from harmony.compiler.ir import Program
from harmony.compiler.passmanager import run_passes
from harmony.compiler.trace import trace
from harmony.driver.compile import batch_items, batch_size, resolve, tensors_of
from harmony.driver.modes.grid import Grid
from harmony.driver.modes.pipeline import Pipeline
from harmony.driver.modes.pipeline_plan import simulate_programs
from harmony.passes.stage import check_config
from harmony.runtime.comm.grid import grid_of

__all__ = ["plan_node", "simulate_programs"]


def plan_node(model: torch.nn.Module, example_batch, hardware, *, world: int | None = None, memory_budget=None,
              config: Config | None = None, replicas: int = 1, **options) -> list:
    """One ``Program`` per rank of a pipeline over ``world`` devices of ``hardware`` (default: all of them).

    ``memory_budget``: bytes per device (default: each device's memory); every other option as
    ``harmony.compile``'s (``microbatches``, ``placement``, ``policy``, ``compression``, ...). ``device="meta"`` is
    the default: build the model under ``torch.device("meta")`` and nothing is allocated. ``replicas=R`` > 1: the
    first server's pipeline of a grid of R servers (``parallel=("pipeline", "data")``, driver/modes/grid.py), each
    rank's packs' gradients all-reduced over R ranks after their last backward; ``example_batch`` is one pipeline's
    rows.
    """
    world = world or len(hardware.devices)
    if world > len(hardware.devices):
        raise ConfigError(f"world={world} but the hardware has {len(hardware.devices)} devices")
    if options.pop("parallel", "pipeline") not in ("pipeline", HYBRID):
        raise ConfigError("plan_node plans a pipeline: drop parallel=, or use harmony.compile for one device")
    if replicas != 1:
        grid_of(world * replicas, world)        # a grid that cannot be: said here
    options.setdefault("device", "meta")
    group = options.pop("pipeline_group", None)     # checked with parallel='pipeline' below
    if group == "auto":
        raise ConfigError("plan_node plans one pipeline_group: give a number (group_candidates(M) lists what "
                          "pipeline_group='auto' weighs on live ranks), and compare their simulate_programs")
    budget = memory_budget or hardware.devices[0].memory
    options = Config.of(config, memory_budget=budget, hardware=hardware, data_parallel=False, **options)
    names, batch = batch_items(example_batch)
    cfg, _ = resolve(options, batch_size(batch))
    passes = Pipeline().passes(cfg.passes)     # the stage pass after the partition
    cfg = dataclasses.replace(cfg, parallel="pipeline", world_size=world, passes=passes, pipeline_group=group)
    if replicas > 1:     # the grid's first pipeline: its ranks' all-reduces over R, nothing live to meet
        cfg = dataclasses.replace(cfg, parallel=HYBRID, pipeline_size=world, world_size=world * replicas,
                                  data_parallel=True, offline=True)
        Grid().check(cfg, None)
    else:
        check_config(cfg)
    gm = trace(model, dict(zip(names, batch)) if names else tuple(batch), loss_fn=cfg.loss_fn,
               leaf_modules=cfg.leaf_modules, dtype=cfg.compute_dtype)
    batch = tensors_of(batch)
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
        programs.append(run_passes(program, passes))
    return programs
