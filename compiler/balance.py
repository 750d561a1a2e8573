"""Heterogeneous balance (Cephalo): each rank's share of the compute and of the training state, by an ILP.

Mismatched devices should not get equal work. Cephalo decouples the two things a
data-parallel rank holds: its share of the *compute* (its batch, as a microbatch size
and a count of microbatches) and its share of the *training state* (an uneven shard of
parameters, gradients and optimizer state). Fast devices with little memory take many
small microbatches and a small shard; slow devices with much memory hold more state.

The integer program, solved exactly with PuLP and HiGHS (``harmony.base.ilp``):

    minimise   T
    subject to T >= m_d * (c0 + c1 * b_d) / F_d + s_d * U / B_d   for every rank d   (compute, its step)
               T >= 2 * max(0, R + s_d * S + W + a0 + a1 * b_d - memory_d) / link_d   (its swap copies)
               sum_d b_d * m_d = global batch
               s_d * S + W + a0 + a1 * b_d <= memory_d   for every rank d   (shard + working set + activations)
               sum_d s_d = 1,  s_d >= 0

with one binary per rank and (b, m) option. ``c0 + c1 b`` is a microbatch's forward,
backward and recompute FLOPs from the cost model, ``F_d`` the device's sustained FLOP/s
(stretched by an emulation speed factor), ``S`` the sharded training state, ``W`` the
largest layer gathered for compute, ``a0 + a1 b`` the activations a microbatch keeps, ``R``
the state every rank holds whole (``replicated_bytes``: 0 under Cephalo's full sharding)
and ``link_d`` the device's host link: the replicated state that does not fit moves about
twice a step, overlapping compute (``swap_seconds``). ``U / B_d`` is the optimizer step over
the whole state on device d (memory traffic over memory bandwidth, stretched like compute):
the rank holding a share of the state also does that share of the stepping.
Gradients are then averaged with weights by sample count, so the update equals the one a
homogeneous cluster makes on the same global batch.

From ``harmony.compile(..., hardware=Hardware(devices=[one per rank]), balance="auto")``
(``plan_ranks``): ``model_cost`` (driver/modes/balance.py) reads the ModelCost off the traced model's cost
annotations (FLOPs and the partition's smallest working set, each affine in the
microbatch size), rank 0 solves, every rank takes its row of the plan. There ``S`` is the
optimizer state, which ``shard_state`` splits in the planned shares (runtime/shard.py, ZeRO
stage 1: a rank keeps and steps its share of the parameters, contiguous by bytes, and
broadcasts them after the step), so a memory row says a rank keeps its optimizer shard
resident beside its working set; parameters and gradients stay replicated, each rank's plan
swapping what its device cannot hold: the second time row prices those copies.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import pulp

from harmony.base import ilp
from harmony.base.errors import BudgetError, ConfigError
from harmony.base.units import fmt_bytes
from harmony.compiler.ir import PassReport

GB = 1e9     # the unit of the integer program's memory rows


@dataclass(frozen=True)
class ModelCost:
    """What the balance needs of a model, per microbatch of ``b`` samples (from the cost model)."""

    flops_const: float          # FLOPs of a microbatch that do not grow with b
    flops_per_sample: float     # forward + backward (+ recompute) FLOPs per sample
    act_const: float            # activation bytes a microbatch keeps, constant part
    act_per_sample: float       # ... per sample
    state_bytes: float          # training state sharded over the ranks (from harmony.compile: the optimizer
                                # state, runtime/shard.py; Cephalo shards parameters and gradients too)
    layer_bytes: float          # the largest layer's working set, gathered for compute
    ops_per_microbatch: float = 0.0   # tensor ops a microbatch dispatches, each costing the device's kernel_latency
    replicated_bytes: float = 0.0     # state every rank holds whole (parameters, gradients, buffers), swapped by
                                      # each rank's own plan: not in the memory rows
    step_bytes: float = 0.0           # memory traffic of one optimizer step over the whole model: a rank's
                                      # share of the state is its share of the stepping


@dataclass
class RankShare:
    rank: int
    device: str
    microbatch: int
    microbatches: int
    state_share: float
    seconds: float
    memory: float

    @property
    def samples(self) -> int:
        return self.microbatch * self.microbatches


@dataclass
class BalancePlan:
    shares: list[RankShare]
    step_seconds: float
    global_batch: int
    solve_seconds: float
    status: str
    notes: list[str] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return self.global_batch / self.step_seconds

    def rows(self, rank: int) -> tuple[int, int]:
        """``rank``'s rows ``[start, stop)`` of the global batch: the ranks' shares in rank order."""
        start = sum(s.samples for s in self.shares[:rank])
        return start, start + self.shares[rank].samples

    def weights(self) -> list[float]:
        """Each rank's weight in the gradient average: its share of the samples."""
        return [s.samples / self.global_batch for s in self.shares]


def rank_time(cost: ModelCost, device, b: int, m: int) -> float:
    """Seconds of compute of ``m`` microbatches of ``b`` samples on ``device``, stretched by its speed factor.

    The all-reduce, which every rank pays alike, leaves the choice unchanged and is not counted (the
    optimizer step is, by share: ``step_seconds``); the simulator predicts each rank's whole step.
    """
    flops = getattr(device, "effective_flops", device.flops)
    dispatch = cost.ops_per_microbatch * getattr(device, "kernel_latency", 0.0)
    per_microbatch = (cost.flops_const + cost.flops_per_sample * b) / flops + dispatch
    return m * per_microbatch * getattr(device, "speed_factor", 1.0)


SWAP_PASSES = 2.0     # bytes a step moves per byte of replicated state that does not stay on the device


def step_seconds(cost: ModelCost, device, share: float) -> float:
    """Seconds of the optimizer step over a rank's share of the state: memory-bound, as the op table costs it
    (runtime/ops/), stretched by an emulation speed factor like the compute it follows."""
    bandwidth = getattr(device, "memory_bandwidth", None)
    if not bandwidth or not cost.step_bytes:
        return 0.0
    return share * cost.step_bytes / bandwidth * getattr(device, "speed_factor", 1.0)


def swap_seconds(cost: ModelCost, device, b: int, share: float) -> float:
    """Seconds of host-link traffic a rank's plan adds when its replicated state does not fit.

    What stays on the device: the optimizer shard and the working set (the memory row), then as
    much of the replicated parameters and gradients as the rest of the memory holds; each byte
    that does not fit moves about ``SWAP_PASSES`` times a step (a weight comes in for the forward
    and for the backward; a gradient goes out once). Copies overlap compute (prefetch), so a rank
    takes the larger of the two; an emulated speed factor stretches compute, not copies.
    """
    link = getattr(device, "h2d_bandwidth", None)
    over = cost.replicated_bytes + share * cost.state_bytes + rank_memory_floor(cost, device, b) - device.memory
    return SWAP_PASSES * max(0.0, over) / link if link else 0.0


def rank_memory_floor(cost: ModelCost, device, b: int) -> float:
    """Device bytes a rank needs besides its state shard."""
    return cost.layer_bytes + cost.act_const + cost.act_per_sample * b


def evaluate(cost: ModelCost, devices, choice: list[tuple[int, int]], shares=None) -> BalancePlan:
    """Step time of a given split (``choice[d] = (microbatch, count)``), with state shares that fit if any do."""
    n = len(devices)
    room = [d.memory - rank_memory_floor(cost, d, b) for d, (b, _) in zip(devices, choice)]
    if shares is None:   # shares by free memory
        total = sum(max(r, 0) for r in room)
        shares = [max(r, 0) / total if total > 0 else 1 / n for r in room]
    ranks = [RankShare(i, d.name, b, m, s, max(rank_time(cost, d, b, m) + step_seconds(cost, d, s),
                                               swap_seconds(cost, d, b, s)),
                       rank_memory_floor(cost, d, b) + s * cost.state_bytes)
             for i, (d, (b, m), s) in enumerate(zip(devices, choice, shares))]
    ok = all(r.memory <= d.memory for r, d in zip(ranks, devices))
    return BalancePlan(ranks, max(r.seconds for r in ranks), sum(b * m for b, m in choice), 0.0,
                       "fits" if ok else "does not fit")


def balance(cost: ModelCost, devices, global_batch: int, max_microbatches: int = 16,
            time_limit: float = 30.0, same_shape: bool = False) -> BalancePlan:
    """The split of ``global_batch`` and of the training state over ``devices`` that minimises step time.

    ``same_shape``: every rank runs the same microbatch size and count, and only the state shares differ
    (``shard_state="full"``, whose ranks must run the same schedule: each gather is a collective)."""
    start = time.perf_counter()
    n = len(devices)
    floor = sum(rank_memory_floor(cost, d, 1) for d in devices)
    total = sum(d.memory for d in devices)
    if floor + cost.state_bytes > total:
        missing = floor + cost.state_bytes - total
        raise BudgetError(
            f"the cluster's {fmt_bytes(total)} cannot hold the {fmt_bytes(cost.state_bytes)} of sharded state plus "
            f"each rank's working set ({fmt_bytes(floor)} at one sample per microbatch): {fmt_bytes(missing)} "
            f"missing. Add devices, offload optimizer state to the host, or use a smaller model.",
            min_budget=int(missing))
    prob = pulp.LpProblem("balance", pulp.LpMinimize)
    T = prob.add_variable("T", lowBound=0)
    share = [prob.add_variable(f"s{d}", lowBound=0, upBound=1) for d in range(n)]
    pick = {}
    for d, dev in enumerate(devices):
        for b in range(1, global_batch + 1):
            if rank_memory_floor(cost, dev, b) > dev.memory:
                break
            for m in range(1, min(max_microbatches, global_batch // b) + 1):
                pick[d, b, m] = prob.add_variable(f"x_{d}_{b}_{m}", cat=pulp.LpBinary)
    prob += T
    for d, dev in enumerate(devices):
        opts = [(b, m) for (dd, b, m) in pick if dd == d]
        prob += pulp.lpSum(pick[d, b, m] for b, m in opts) == 1
        prob += T >= (pulp.lpSum(rank_time(cost, dev, b, m) * pick[d, b, m] for b, m in opts)
                      + step_seconds(cost, dev, 1.0) * share[d])
        # memory rows in GB, not bytes: coefficients near 1 keep the solver's tolerances meaningful
        floor_d = pulp.lpSum(rank_memory_floor(cost, dev, b) / GB * pick[d, b, m] for b, m in opts)
        prob += share[d] * (cost.state_bytes / GB) + floor_d <= dev.memory / GB
        link = getattr(dev, "h2d_bandwidth", None)
        if link and cost.replicated_bytes:     # replicated state that does not fit: its copies (swap_seconds)
            over = prob.add_variable(f"over{d}", lowBound=0)       # GB
            prob += over >= (cost.replicated_bytes - dev.memory) / GB + share[d] * (cost.state_bytes / GB) + floor_d
            prob += T >= SWAP_PASSES * GB / link * over
    if same_shape:           # every rank picks rank 0's option (one that fits every rank)
        for (d, b, m), x in pick.items():
            prob += x == (pick[0, b, m] if all((e, b, m) in pick for e in range(n)) else 0)
    prob += pulp.lpSum(b * m * x for (d, b, m), x in pick.items()) == global_batch
    prob += pulp.lpSum(share) == 1
    if not ilp.solve(prob, time_limit):
        raise BudgetError(f"no split of batch {global_batch} over {n} devices fits their memory "
                          f"(solver: {ilp.status(prob)}); use more microbatches or more devices")
    choice = []
    for d in range(n):
        b, m = next((b, m) for (dd, b, m), x in pick.items() if dd == d and x.value() > 0.5)
        choice.append((b, m))
    plan = evaluate(cost, devices, choice, [max(0.0, s.value()) for s in share])
    plan.solve_seconds = time.perf_counter() - start
    plan.status = "optimal"
    return plan


def uniform(cost: ModelCost, devices, global_batch: int, microbatches: int = 1) -> BalancePlan:
    """Equal batch and equal state share on every rank (ordinary data parallelism)."""
    n = len(devices)
    b = global_batch // n // microbatches
    return evaluate(cost, devices, [(b, microbatches)] * n, [1 / n] * n)


def given_shares(spec, microbatches: int, name) -> list[tuple[int, int]]:
    """``(microbatch size, microbatches)`` of each explicit ``balance`` entry: a pair, or a sample count that
    ``microbatches`` divides; ``ConfigError`` naming the entry (``name(r)``) otherwise."""
    choice = []
    for r, item in enumerate(spec):
        if isinstance(item, int) and not isinstance(item, bool) and item > 0 and item % microbatches == 0:
            choice.append((item // microbatches, microbatches))
        elif (isinstance(item, (list, tuple)) and len(item) == 2
              and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in item)):
            choice.append((int(item[0]), int(item[1])))
        else:
            raise ConfigError(f"{name(r)}={item!r}: give (microbatch size, microbatches) or a sample count that "
                              f"microbatches={microbatches} divides")
    return choice



def plan_ranks(spec, cost: ModelCost, devices, global_batch: int, microbatches: int = 1,
               max_microbatches: int = 16, same_shape: bool = False) -> BalancePlan:
    """Each rank's share of ``global_batch`` under ``spec``.

    ``"auto"``: the ILP (``balance``). ``"uniform"``: ``global_batch / ranks`` each, in
    ``microbatches`` microbatches. A list, one entry per rank: ``(microbatch size, count)`` pairs,
    or sample counts, each run in ``microbatches`` microbatches. ``same_shape``: every rank gets the
    same microbatch size and count (``balance``'s), and a list that differs is refused.
    """
    n = len(devices)
    if spec == "auto":
        return balance(cost, devices, global_batch, max_microbatches=max_microbatches, same_shape=same_shape)
    if spec == "uniform":
        per = global_batch // n
        if global_batch % n or per % microbatches:
            raise ConfigError(f"balance='uniform': the global batch of {global_batch} does not split into {n} equal "
                              f"shares of {microbatches} equal microbatches; use balance='auto' or explicit shares")
        return uniform(cost, devices, global_batch, microbatches)
    if isinstance(spec, (list, tuple)) and len(spec) == n:
        choice = given_shares(spec, microbatches, lambda r: f"balance[{r}]")
        if same_shape and len(set(choice)) > 1:
            raise ConfigError(f"balance={list(spec)!r} gives the ranks different microbatches ({choice}), but under "
                              f"shard_state='full' every rank runs the same schedule (each gather of a pack is a "
                              f"collective all ranks join); give every rank the same (microbatch size, "
                              f"microbatches): the state shares still follow the devices, or use shard_state=True")
        if sum(b * m for b, m in choice) != global_batch:
            raise ConfigError(f"balance={list(spec)!r} shares {sum(b * m for b, m in choice)} samples but the global "
                              f"batch (example_batch) has {global_batch}; the shares must add up to it")
        return evaluate(cost, devices, choice)
    raise ConfigError(f"balance={spec!r}: use 'auto' (the ILP), 'uniform', or one entry per rank ({n}): "
                      f"(microbatch size, microbatches) pairs or sample counts")


def report(plan: BalancePlan, devices, rank: int, how: str, sharded: bool | str = True):
    """The balance step's ``PassReport``: every rank's choice, this rank's marked, emulation said aloud."""
    rep = PassReport(f"balance: each rank's share of the global batch ({how})")
    common = min(d.memory for d in devices) if sharded == "full" else None
    for s, d in zip(plan.shares, devices):
        f = getattr(d, "speed_factor", 1.0)
        rep.rows.append(dict(rank=f"{s.rank}{' (this)' if s.rank == rank else ''}", device=d.name,
                             budget_MiB=(common or d.memory) / 2**20,
                             speed="1x" if f == 1 else f"1/{f:g}x EMULATED",
                             samples=s.samples, microbatch=s.microbatch, microbatches=s.microbatches,
                             weight=s.samples / plan.global_batch, state_share_planned=s.state_share,
                             predicted_s=s.seconds, planned_MiB=s.memory / 2**20))
    rep.totals = dict(global_batch=plan.global_batch, predicted_step_s=plan.step_seconds, status=plan.status,
                      solve_s=plan.solve_seconds)
    if any(getattr(d, "speed_factor", 1.0) != 1 for d in devices):
        rep.notes.append("speed factors are EMULATION: a rank's runtime sleeps each compute op out to factor x its "
                         "time alone on a core, and the simulator stretches its compute stream alike; no device "
                         "is slower")
    if sharded == "full":
        rep.notes.append("state shares are applied to the PARAMETERS, GRADIENTS AND OPTIMIZER STATE (ZeRO-3, "
                         "shard_state='full'): each rank keeps its share of every pack's fp32 weights and their "
                         "optimizer state on its host (or disk) and steps it; a pack's weights are all-gathered for "
                         "compute and its gradients reduce-scattered to the owners. Every rank runs the same "
                         "microbatches and plans under the smallest device's memory (budget_MiB), so all plan the "
                         "same gathers: each is a collective")
    elif sharded:
        rep.notes.append("state shares are applied to the OPTIMIZER STATE (ZeRO stage 1, runtime/shard.py): each "
                         "rank keeps and steps the parameters of its share (contiguous, by bytes) and broadcasts "
                         "them after the step; parameters and gradients are replicated on every rank (swapping what "
                         "its budget cannot hold); planned_MiB counts the whole share as the ILP does, the rank's "
                         "own compile plans its parameters, gradients and optimizer shard under budget_MiB")
    else:
        rep.notes.append("state shares are planned (Cephalo's uneven shards) but not applied (shard_state=False): the "
                         "runtime replicates the training state, so every rank holds all of it (swapping what its "
                         "budget cannot hold); the rank's own compile plans its whole state under budget_MiB")
    rep.notes.append("gradients are weighted by samples / global batch in the all-reduce, so the update equals "
                     "a homogeneous cluster's on the same global batch; predicted_s: the ILP's compute time "
                     "(forward, backward, recompute), not the whole step (see simulated_step_s)")
    return rep
