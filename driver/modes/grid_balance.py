"""``balance=`` in a grid (``parallel=("pipeline", "data")``): each pipeline's rows of the global batch, by its speed.

Rank 0 plans every pipeline's share (compiler/grid_balance.py) and the packs every pipeline cuts the model into
(the partition of the pipeline with the most rows, under the grid's smallest device memory), and broadcasts both;
every rank then takes its pipeline's rows, microbatches and sample weight, plans under the common budget and the
slowest device's FLOP/s (so the ranks holding a stage place and cut alike), and runs at its own device's speed.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from harmony.base.errors import ConfigError
from harmony.compiler import cost
from harmony.compiler import grid_balance as planner
from harmony.compiler.ir import Program
from harmony.compiler.passmanager import split_choices
from harmony.driver.modes.balance import Balanced, model_cost, plan_on_rank0
from harmony.passes import partition
from harmony.passes.stage import grid_of as stage_grid


class GridBalanced(Balanced):
    """A grid rank's part of a balanced plan: its pipeline's rows."""

    def simulated(self, sm, hardware) -> None:
        """Nothing at compile: ``sm.simulate()`` simulates this rank's server (driver/modes/grid.py)."""


def plan_grid_rank(model, gm, batch, cfg) -> GridBalanced:
    """Plan every pipeline's share (rank 0 solves, every rank receives) and set ``cfg`` to this rank's."""
    grid, hardware = stage_grid(cfg), cfg.hardware
    devices = list(hardware.devices)
    if len(devices) != grid.world:
        raise ConfigError(f"hardware has {len(devices)} devices but {grid.world} ranks are running: balance= in a "
                          f"grid needs one device per rank, in rank order (pipeline 0's ranks first)")
    slow = [d.name for d in devices if d.speed_factor < 1]
    if slow:
        raise ConfigError(f"devices {slow} have speed_factor < 1: emulation can only slow a device down; divide "
                          f"every factor by the smallest so the fastest device is 1")
    replicas = [[devices[r] for r in grid.pipeline_ranks(k)] for k in range(grid.replicas)]
    global_batch = batch[0].shape[0] if batch else 0
    budget = int(min(d.memory for d in devices))
    cfg.memory_budget = budget
    cfg.plan_for_device(devices[cfg.rank], hardware)      # this rank's speed, which its runtime emulates
    # the planner's time model of the slowest device on every rank, so that every rank places the packs alike
    cfg.flops = min(d.flops / d.speed_factor for d in devices)
    cfg.copy_bandwidth = min(d.h2d_bandwidth for d in devices)
    probe = dataclasses.replace(cfg, memory_budget=0, microbatches=1, batch_size=1)
    program = Program(model=model, gm=gm, example_batch=tuple(batch), config=probe)
    program.optim_profile = cost.optimizer_profile(cfg.optimizer, cfg.optimizer_kwargs)
    given = split_choices(cfg.passes)[1].get("partition")

    def solve():
        plan = planner.plan_replicas(cfg.balance, model_cost(program), replicas, global_batch, budget,
                                     cfg.microbatches, _group(cfg))
        return plan, given if given is not None else _common_packs(program, plan, cfg, batch)

    t0 = time.perf_counter()
    plan, packs = plan_on_rank0(cfg.rank, solve)
    seconds = time.perf_counter() - t0
    mine = plan.shares[grid.replica]
    start, stop = plan.rows(grid.replica)
    cfg.microbatches, cfg.batch_size = mine.microbatches, mine.samples
    cfg.global_batch, cfg.sample_weight = global_batch, mine.samples / global_batch
    cfg.passes = tuple(("partition", packs) if split_choices([e])[0] == ["partition"] else e for e in cfg.passes)
    how = "pipeline step model" if cfg.balance == "auto" else "uniform" if cfg.balance == "uniform" else "given"
    report = planner.report(plan, replicas, grid, how, budget, cfg.shard_state)
    report.seconds = seconds
    rows = [t[start:stop] if isinstance(t, torch.Tensor) and t.dim() > 0 else t for t in batch]
    return GridBalanced(rows, (start, stop), [1.0] * grid.world, report, devices[cfg.rank])


def _group(cfg) -> int | None:
    return cfg.pipeline_group if isinstance(cfg.pipeline_group, int) else None


def _common_packs(program: Program, plan, cfg, batch) -> list[str]:
    """The partition (its packs' first nodes) of the pipeline with the most rows (the largest microbatch among
    those): every pipeline cuts the model there, so each stage's replica group holds the same parameters."""
    ref = max(plan.shares, key=lambda s: (s.samples, s.microbatch))
    config = dataclasses.replace(cfg, microbatches=ref.microbatches, batch_size=ref.samples)
    rows = tuple(t[:ref.samples] if isinstance(t, torch.Tensor) and t.dim() > 0 else t for t in batch)
    probe = Program(model=program.model, gm=program.gm, example_batch=rows, config=config)
    probe.optim_profile = program.optim_profile
    probe.fake = cost.annotate(program.gm, rows, ref.microbatch, dtype=cfg.compute_dtype)
    partition.run(probe, None)
    return list(probe.partition_choice)
