"""``compile(..., balance=...)``: data parallelism over mismatched devices (Cephalo), one plan per rank.

The balance is a planning step inside ``compile``'s one pipeline, not a pass and not a second
compile: once the model is traced, it decides this rank's share of the global batch, its
microbatch count, its memory budget (its device's memory) and its share of the optimizer state,
and ``compile`` goes on as for any rank with that configuration. compiler/balance.py holds the
integer program; this module runs it once (on rank 0) and hands every rank its share.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from harmony.base.errors import ConfigError, HarmonyError
from harmony.compiler import cost
from harmony.compiler.ir import CompileConfig, PassReport, Program


@dataclass
class Balanced:
    """This rank's part of a balanced plan: its rows of the global batch and what the report says of it."""

    batch: list                   # this rank's rows of every batch tensor
    rows: tuple[int, int]         # [start, stop) of the global batch
    shares: list[float]           # every rank's share of the optimizer state
    report: PassReport            # the balance's report, shown first among the passes'
    device: object                # this rank's compiler.hardware.Device

    def simulated(self, sm, hardware) -> None:
        """Add this rank's compiled plan simulated on its device to the report."""
        if sm.predicted is None:
            return
        sim = sm.simulate(hardware.replace(devices=(self.device,)))
        self.report.totals["simulated_step_s"] = sim.step_seconds
        self.report.notes.append(f"simulated_step_s: this rank's compiled plan simulated on its device "
                                 f"({self.device.name}), compute and all-reduces included; the slowest rank sets "
                                 f"the step")


def plan_this_rank(model, gm, batch, spec, config: CompileConfig, hardware, sharded: bool) -> Balanced:
    """Plan every rank's share (rank 0 solves, every rank receives) and set ``config`` to this rank's.

    1. the model's costs and smallest plannable budget at microbatches of 1 and 2 samples (affine in the
       microbatch size): the ILP's ``ModelCost``;
    2. rank 0 plans (``balance.plan_ranks``: the ILP, uniform or the user's shares) and broadcasts the
       plan, or the error, so every rank acts on the same one;
    3. ``config`` becomes this rank's: its samples and microbatches, its device's memory as the budget,
       its device's speed; the compress pass weights its gradients by its share of the samples. ``sharded``:
       the plan's state shares are applied to the optimizer state (``compile`` does it; the report says so).
    """
    import time

    from harmony.compiler import balance as planner
    from harmony.runtime.world import rank_and_world

    rank, _ = rank_and_world()
    devices, world = list(hardware.devices), config.world_size
    if len(devices) != world:
        raise ConfigError(f"hardware has {len(devices)} devices but {world} ranks are running: balance= needs one "
                          f"device per rank, in rank order")
    for dev in devices:
        if dev.speed_factor < 1:
            raise ConfigError(f"devices {[d.name for d in devices if d.speed_factor < 1]} have speed_factor < 1: "
                              f"emulation can only slow a device down; divide every factor by the smallest so the "
                              f"fastest device is 1")
    global_batch = batch[0].shape[0] if batch else 0
    probe = dataclasses.replace(config, memory_budget=0, microbatches=1, batch_size=1)
    program = Program(model=model, gm=gm, example_batch=tuple(batch), config=probe)
    program.optim_profile = cost.optimizer_profile(config.optimizer, config.optimizer_kwargs)
    t0 = time.perf_counter()
    full = config.shard_state == "full"
    plan = plan_on_rank0(rank, lambda: planner.plan_ranks(spec, planner.model_cost(program), devices, global_batch,
                                                            config.microbatches, same_shape=full))
    seconds = time.perf_counter() - t0
    mine, dev = plan.shares[rank], devices[rank]
    start, stop = plan.rows(rank)
    # shard_state="full": every rank plans its packs and swaps under the smallest device's memory (and below, the
    # slowest device's speed), so that all plan the same gathers (the state shares live on the hosts; a device holds
    # the packs it computes); each rank's runtime still runs at its own device's speed
    budget = min(d.memory for d in devices) if full else dev.memory
    config.memory_budget, config.microbatches, config.batch_size = int(budget), mine.microbatches, mine.samples
    config.global_batch, config.sample_weight = global_batch, mine.samples / global_batch
    config.plan_for_device(dev, hardware)
    if full:        # the planner's time model too: the slowest device's FLOP/s and host link on every rank
        config.flops = min(d.flops / d.speed_factor for d in devices)
        config.copy_bandwidth = min(d.h2d_bandwidth for d in devices)
    how = "integer program" if spec == "auto" else "uniform" if spec == "uniform" else "given shares"
    report = planner.report(plan, devices, rank, how, sharded=sharded)
    report.seconds = seconds
    rows = [t[start:stop] if isinstance(t, torch.Tensor) and t.dim() > 0 else t for t in batch]
    return Balanced(rows, (start, stop), [s.state_share for s in plan.shares], report, dev)


def plan_on_rank0(rank: int, solve):
    """``solve()`` on rank 0, its result (or its Harmony error, raised again) on every rank."""
    import torch.distributed as dist

    box = [None]
    if rank == 0:
        try:
            box[0] = ("ok", solve())
        except HarmonyError as e:
            box[0] = ("error", e)
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value
