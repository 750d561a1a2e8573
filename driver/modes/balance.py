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
from harmony.base.units import nbytes
from harmony.compiler import balance as planner
from harmony.compiler import cost
from harmony.compiler.balance import ModelCost
from harmony.compiler.cost import Affine
from harmony.compiler.ir import CompileConfig, PassReport, Program
from harmony.compiler.meta import COST
from harmony.driver.modes.pipeline_plan import portable_inputs
from harmony.passes.partition import find_units, smallest_budget, tensor_bytes
from harmony.runtime.comm.failures import guarded
from harmony.runtime.comm.world import rank_and_world
from harmony.runtime.plan import optim_state_bytes, step_traffic
from harmony.runtime.simulate.node import shared_hosts, simulate_node


@dataclass
class Balanced:
    """This rank's part of a balanced plan: its rows of the global batch and what the report says of it."""

    batch: list                   # this rank's rows of every batch tensor
    rows: tuple[int, int]         # [start, stop) of the global batch
    shares: list[float]           # every rank's share of the optimizer state
    report: PassReport            # the balance's report, shown first among the passes'
    device: object                # this rank's compiler.hardware.Device

    def simulated(self, sm, hardware) -> None:
        """Add this rank's compiled plan simulated to the report: on its device alone, and where ranks share a host
        whose cores the hardware gives (``Hardware.host_cores``, ``hosts``), with every rank's plan together on
        the node (each rank's plan gathered from it), so ranks on one host slow each other as they do."""
        if sm.predicted is None:
            return
        sim = sm.simulate(hardware.replace(devices=(self.device,), hosts=()))
        totals = self.report.totals
        totals["simulated_step_s"] = sim.step_seconds
        self.report.notes.append(f"simulated_step_s: this rank's compiled plan simulated on its device "
                                 f"({self.device.name}), compute and all-reduces included; the slowest rank sets "
                                 f"the step")
        _, world = rank_and_world()
        if world < 2 or not shared_hosts(hardware, world):
            return
        import torch.distributed as dist
        every = [None] * world
        guarded("balance='s node simulation (every rank's plan, gathered)", dist.all_gather_object, every,
                portable_inputs(sm.program))
        node = simulate_node(every, hardware)
        sm.node_simulation = node
        totals["simulated_alone_s"], totals["simulated_step_s"] = sim.step_seconds, node.step_seconds
        self.report.notes[-1] = ("simulated_step_s: every rank's compiled plan simulated together on the node, its "
                                 "ranks sharing their host's cores and memory (" + "; ".join(node.sharing) +
                                 "); the slowest rank sets the step; simulated_alone_s: this rank's alone on its "
                                 "device")


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
    plan = plan_on_rank0(rank, lambda: planner.plan_ranks(spec, model_cost(program), devices, global_batch,
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
    guarded("balance='s plan from rank 0", dist.broadcast_object_list, box, src=0, peer=0)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value


def model_cost(program, kernel_ops_per_param_tensor: float = 2.7 + 5.8 + 2.7) -> ModelCost:
    """The ModelCost of a traced program (``program.gm`` on ``program.example_batch``).

    The sharded state is the optimizer state (what ``shard_state`` splits); parameters, gradients
    and buffers are replicated (``replicated_bytes``), each rank's plan swapping what its device
    cannot hold, so a memory row reads: the rank keeps its optimizer shard resident beside the
    working set of its microbatch.
    FLOPs per microbatch: forward, backward and the recompute of every pack's forward (an upper
    bound: the last pack does not recompute), affine in the microbatch size ``b``. Memory a rank
    needs besides any state share: the smallest budget the partition pass can plan under, every
    layer a pack of its own (measured as the pass measures packs, with its headroom), at ``b = 1``
    and at the whole batch, and the line through the two: the need is a maximum of affine terms
    (convex in ``b``), so the line is exact at both ends and above it in between. Tensor ops per
    microbatch: ``kernel_ops_per_param_tensor`` per parameter tensor, as the simulator counts them.
    """
    config, floors = program.config, []
    top = max(2, program.example_batch[0].shape[0])
    try:
        for b in (1, top):
            program.config = dataclasses.replace(config, batch_size=b, microbatches=1)
            program.pack_measurements = {}      # measured at another microbatch size: not reusable
            program.fake = cost.annotate(program.gm, program.example_batch, b)
            program.fake_batch_bytes = {ph.name: tensor_bytes(program.fake.vals[ph], floating=False)
                                        for ph in program.gm.graph.nodes if ph.op == "placeholder"}
            floors.append(smallest_budget(program, find_units(program)))
    finally:
        program.config, program.pack_measurements = config, {}
    act = Affine.fit(1, floors[0], top, floors[1])
    flops = Affine(0.0, 0.0)
    for node in program.gm.graph.nodes:
        c = node.meta.get(COST)
        if c is not None:
            flops = flops + c.fwd_flops + c.fwd_flops + c.bwd_flops
    params = list(program.gm.parameters())
    pbytes = sum(nbytes(p) for p in params)
    grads = sum(nbytes(p) for p in params if p.requires_grad)
    optim = sum(optim_state_bytes(program.optim_profile, nbytes(p)) for p in params
                if p.requires_grad)
    replicated = pbytes + grads + sum(nbytes(t) for t in program.gm.buffers())
    return ModelCost(flops_const=flops.c0, flops_per_sample=flops.c1, act_const=act.c0, act_per_sample=act.c1,
                     state_bytes=float(optim), layer_bytes=0.0, replicated_bytes=float(replicated),
                     step_bytes=step_traffic(pbytes, optim),
                     ops_per_microbatch=kernel_ops_per_param_tensor * len(params))
