"""Heterogeneous balance (Cephalo): each rank's share of the compute and of the training state, by an ILP.

Mismatched devices should not get equal work. Cephalo decouples the two things a
data-parallel rank holds: its share of the *compute* (its batch, as a microbatch size
and a count of microbatches) and its share of the *training state* (an uneven shard of
parameters, gradients and optimizer state). Fast devices with little memory take many
small microbatches and a small shard; slow devices with much memory hold more state.

The integer program, solved exactly with PuLP/CBC:

    minimise   T
    subject to T >= m_d * (c0 + c1 * b_d) / F_d          for every rank d   (its compute time)
               sum_d b_d * m_d = global batch
               s_d * S + W + a0 + a1 * b_d <= memory_d   for every rank d   (shard + working set + activations)
               sum_d s_d = 1,  s_d >= 0

with one binary per rank and (b, m) option. ``c0 + c1 b`` is a microbatch's forward,
backward and recompute FLOPs from the cost model, ``F_d`` the device's sustained FLOP/s
(stretched by an emulation speed factor), ``S`` the sharded training state, ``W`` the
largest layer gathered for compute, ``a0 + a1 b`` the activations a microbatch keeps.
Gradients are then averaged with weights by sample count, so the update equals the one a
homogeneous cluster makes on the same global batch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import pulp

from harmony.errors import BudgetError
from harmony.units import fmt_bytes


@dataclass(frozen=True)
class ModelCost:
    """What the balance needs of a model, per microbatch of ``b`` samples (from the cost model)."""

    flops_const: float          # FLOPs of a microbatch that do not grow with b
    flops_per_sample: float     # forward + backward (+ recompute) FLOPs per sample
    act_const: float            # activation bytes a microbatch keeps, constant part
    act_per_sample: float       # ... per sample
    state_bytes: float          # training state to shard (params, grads, optimizer state)
    layer_bytes: float          # the largest layer's working set, gathered for compute


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

    def weights(self) -> list[float]:
        """Each rank's weight in the gradient average: its share of the samples."""
        return [s.samples / self.global_batch for s in self.shares]


def rank_time(cost: ModelCost, device, b: int, m: int) -> float:
    flops = getattr(device, "effective_flops", device.flops) / getattr(device, "speed_factor", 1.0)
    return m * (cost.flops_const + cost.flops_per_sample * b) / flops


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
    ranks = [RankShare(i, d.name, b, m, s, rank_time(cost, d, b, m), rank_memory_floor(cost, d, b) + s * cost.state_bytes)
             for i, (d, (b, m), s) in enumerate(zip(devices, choice, shares))]
    ok = all(r.memory <= d.memory for r, d in zip(ranks, devices))
    return BalancePlan(ranks, max(r.seconds for r in ranks), sum(b * m for b, m in choice), 0.0,
                       "fits" if ok else "does not fit")


def balance(cost: ModelCost, devices, global_batch: int, max_microbatches: int = 16,
            time_limit: float = 30.0) -> BalancePlan:
    """The split of ``global_batch`` and of the training state over ``devices`` that minimises step time."""
    start = time.perf_counter()
    n = len(devices)
    floor = sum(rank_memory_floor(cost, d, 1) for d in devices)
    total = sum(d.memory for d in devices)
    if floor + cost.state_bytes > total:
        missing = floor + cost.state_bytes - total
        raise BudgetError(
            f"the cluster's {fmt_bytes(total)} cannot hold the {fmt_bytes(cost.state_bytes)} training state plus "
            f"each rank's working set ({fmt_bytes(floor)} at one sample per microbatch): {fmt_bytes(missing)} "
            f"missing. Add devices, offload optimizer state to the host, or use a smaller model.",
            min_budget=int(missing))
    prob = pulp.LpProblem("balance", pulp.LpMinimize)
    T = pulp.LpVariable("T", lowBound=0)
    share = [pulp.LpVariable(f"s{d}", lowBound=0, upBound=1) for d in range(n)]
    pick = {}
    for d, dev in enumerate(devices):
        for b in range(1, global_batch + 1):
            if rank_memory_floor(cost, dev, b) > dev.memory:
                break
            for m in range(1, min(max_microbatches, global_batch // b) + 1):
                pick[d, b, m] = pulp.LpVariable(f"x_{d}_{b}_{m}", cat="Binary")
    prob += T
    for d, dev in enumerate(devices):
        opts = [(b, m) for (dd, b, m) in pick if dd == d]
        prob += pulp.lpSum(pick[d, b, m] for b, m in opts) == 1
        prob += T >= pulp.lpSum(rank_time(cost, dev, b, m) * pick[d, b, m] for b, m in opts)
        prob += (share[d] * cost.state_bytes
                 + pulp.lpSum(rank_memory_floor(cost, dev, b) * pick[d, b, m] for b, m in opts) <= dev.memory)
    prob += pulp.lpSum(b * m * x for (d, b, m), x in pick.items()) == global_batch
    prob += pulp.lpSum(share) == 1
    status = prob.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit))
    if pulp.LpStatus[status] != "Optimal":
        raise BudgetError(f"no split of batch {global_batch} over {n} devices fits their memory "
                          f"(solver: {pulp.LpStatus[status]}); use more microbatches or more devices")
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
