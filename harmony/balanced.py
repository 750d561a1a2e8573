"""``compile(..., balance=...)``: data parallelism over mismatched devices (Cephalo), one plan per rank.

The balance is a planning step before the passes, not a pass: it decides the batch,
microbatch count and memory budget of this rank, which every pass (``partition`` first)
works with. compiler/balance.py holds the integer program; this module runs it once (on
rank 0), hands every rank its share, and compiles this rank's plan through ``compile``'s
own machinery.
"""
from __future__ import annotations

import os
import time

import torch

from harmony.api import ScheduledModule, _run_passes, shard_over_ranks
from harmony.base.errors import ConfigError, HarmonyError
from harmony.base.units import parse_bytes
from harmony.compiler import cost
from harmony.compiler.ir import CompileConfig, Program
from harmony.compiler.trace import trace
from harmony.data import resolve as resolve_data_parallel


def compile_balanced(model, names, batch, spec, t0, *, optimizer, optimizer_kwargs, memory_budget, microbatches,
                      policy, loss_fn, leaf_modules, passes, device, hardware, optimizer_on, host_memory_budget,
                      offload_dir, data_parallel, compression, min_size, shard_state=True,
                      recompute="auto") -> "ScheduledModule":
    """``compile(..., balance=...)``: plan every rank's share, then compile this rank's plan on its rows.

    1. trace the model on the global batch and measure its costs and smallest plannable budget
       at microbatches of 1 and 2 samples (affine in the microbatch size): the ILP's ``ModelCost``;
    2. rank 0 plans (``balance.plan_ranks``: the ILP, uniform or the user's shares) and
       broadcasts the plan, or the error, so every rank acts on the same one;
    3. this rank compiles as usual on its rows of the batch, with its microbatches, its
       device's memory as the budget and its speed factor for emulation; the compress pass
       weights its gradients by its share of the samples.
    """
    from harmony.compiler import balance as planner
    from harmony.compiler.hardware import Hardware
    from harmony.data import rank_and_world

    if data_parallel is False:
        raise ConfigError("balance= splits a global batch over data-parallel ranks: it needs data_parallel=None "
                          "or True under torchrun, not False")
    if memory_budget is not None:
        raise ConfigError("with balance=, each rank's memory budget is its device's memory in hardware=: leave "
                          "memory_budget unset and give Hardware(devices=[...]) (hw.logical(budgets) on the CPU)")
    if not isinstance(hardware, Hardware):
        raise ConfigError(f"balance= needs hardware=Hardware(devices=[one per rank]) (on the CPU: "
                          f"Hardware.this_machine().logical(budgets, speed_factors)), got {hardware!r}")
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ConfigError(f"microbatches={microbatches!r} must be a positive integer")
    fields = resolve_data_parallel(True if data_parallel is None else data_parallel, compression, min_size)
    world = fields["world_size"]
    rank, _ = rank_and_world()
    devices = list(hardware.devices)
    if len(devices) != world:
        raise ConfigError(f"hardware has {len(devices)} devices but {world} ranks are running: balance= needs one "
                          f"device per rank, in rank order")
    slow = [d.name for d in devices if d.speed_factor < 1]
    if slow:
        raise ConfigError(f"devices {slow} have speed_factor < 1: emulation can only slow a device down; divide "
                          f"every factor by the smallest so the fastest device is 1")
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        raise ConfigError(f"optimizer must be a torch.optim.Optimizer class, got {optimizer!r}")
    global_batch = batch[0].shape[0] if batch else 0
    example = dict(zip(names, batch)) if names else tuple(batch)
    gm = trace(model, example, loss_fn=loss_fn, leaf_modules=leaf_modules)
    t_trace = time.perf_counter()
    probe = CompileConfig(memory_budget=0, microbatches=1, batch_size=1, policy=policy, optimizer=optimizer,
                          optimizer_kwargs=dict(optimizer_kwargs or {}), optimizer_on=optimizer_on)
    program = Program(model=model, gm=gm, example_batch=tuple(batch), config=probe)
    program.optim_profile = cost.optimizer_profile(optimizer, probe.optimizer_kwargs)
    t_plan = time.perf_counter()
    plan = plan_on_rank0(rank, lambda: planner.plan_ranks(spec, planner.model_cost(program), devices, global_batch,
                                                            microbatches))
    t_cost = time.perf_counter()
    mine, dev = plan.shares[rank], devices[rank]
    start, stop = plan.rows(rank)
    batch = [t[start:stop] if isinstance(t, torch.Tensor) and t.dim() > 0 else t for t in batch]
    config = CompileConfig(memory_budget=int(dev.memory), microbatches=mine.microbatches, batch_size=mine.samples,
                           policy=policy, optimizer=optimizer, optimizer_kwargs=dict(optimizer_kwargs or {}),
                           optimizer_on=optimizer_on,
                           host_memory_budget=None if host_memory_budget is None
                           else parse_bytes(host_memory_budget, "host_memory_budget"),
                           offload_dir=None if offload_dir is None else os.fspath(offload_dir),
                           global_batch=global_batch, sample_weight=mine.samples / global_batch,
                           speed_factor=float(dev.speed_factor), recompute=recompute, **fields)
    config.flops, config.copy_bandwidth = dev.flops / dev.speed_factor, dev.h2d_bandwidth
    if shard_state:     # the planned state shares, applied to the optimizer state (runtime/shard.py)
        shard_over_ranks(config, gm, [s.state_share for s in plan.shares])
    program = Program(model=model, gm=gm, example_batch=tuple(batch), config=config)
    program.fake = cost.annotate(gm, tuple(batch), config.microbatch_size)
    program.optim_profile = cost.optimizer_profile(optimizer, config.optimizer_kwargs)
    t_passes = time.perf_counter()
    program = _run_passes(program, passes)
    how = "integer program" if spec == "auto" else "uniform" if spec == "uniform" else "given shares"
    report = planner.report(plan, devices, rank, how, sharded=bool(shard_state))
    report.seconds = t_cost - t_plan
    program.reports.insert(0, report)
    program.rows = (start, stop)
    sm = ScheduledModule(program, device)
    if sm.predicted is not None:
        sim = sm.simulate(hardware.replace(devices=(dev,)))
        report.totals["simulated_step_s"] = sim.step_seconds
        report.notes.append(f"simulated_step_s: this rank's compiled plan simulated on its device ({dev.name}), "
                            f"compute and all-reduces included; the slowest rank sets the step")
    sm.compile_seconds = dict(trace=t_trace - t0, balance=t_cost - t_trace, cost=t_passes - t_cost,
                              passes=time.perf_counter() - t_passes, total=time.perf_counter() - t0)
    return sm


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
