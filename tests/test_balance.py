"""The balance ILP: the known optimum on small clusters, and a clear error when the cluster is too small."""
import itertools
from dataclasses import dataclass

import pytest

from harmony.compiler.balance import ModelCost, balance, evaluate, uniform
from harmony.errors import BudgetError


@dataclass(frozen=True)
class Dev:
    name: str
    memory: float
    flops: float
    speed_factor: float = 1.0


COST = ModelCost(flops_const=0.0, flops_per_sample=1e9, act_const=0.0, act_per_sample=1e8,
                 state_bytes=2e9, layer_bytes=1e8)


def brute_force(cost, devices, batch, max_m=4):
    best = None
    opts = [(b, m) for b in range(1, batch + 1) for m in range(1, max_m + 1) if b * m <= batch]
    for choice in itertools.product(opts, repeat=len(devices)):
        if sum(b * m for b, m in choice) != batch:
            continue
        plan = evaluate(cost, devices, list(choice))
        if plan.status == "fits" and (best is None or plan.step_seconds < best.step_seconds - 1e-12):
            best = plan
    return best


@pytest.mark.parametrize("devices", [
    [Dev("fast", 4e9, 4e9), Dev("slow", 4e9, 1e9)],
    [Dev("fast-small", 1.5e9, 4e9), Dev("slow-big", 8e9, 1e9), Dev("mid", 3e9, 2e9)],
    [Dev("a", 3e9, 2e9), Dev("b", 3e9, 2e9, speed_factor=2.0)],
])
def test_balance_finds_the_brute_force_optimum(devices):
    plan = balance(COST, devices, global_batch=12, max_microbatches=4)
    best = brute_force(COST, devices, 12)
    assert plan.step_seconds == pytest.approx(best.step_seconds)
    assert sum(s.samples for s in plan.shares) == 12
    assert sum(s.state_share for s in plan.shares) == pytest.approx(1.0)
    for s, d in zip(plan.shares, devices):
        assert s.memory <= d.memory * (1 + 1e-9)
    assert sum(plan.weights()) == pytest.approx(1.0)


def test_fast_small_devices_take_compute_and_big_slow_ones_take_state():
    devices = [Dev("fast-small", 1.5e9, 4e9), Dev("slow-big", 8e9, 1e9)]
    plan = balance(COST, devices, global_batch=10, max_microbatches=4)
    fast, slow = plan.shares
    assert fast.samples > slow.samples and fast.state_share < slow.state_share
    assert plan.step_seconds < uniform(COST, devices, 10).step_seconds


def test_a_cluster_too_small_names_what_is_missing():
    devices = [Dev("a", 1e9, 1e9), Dev("b", 1e9, 1e9)]
    with pytest.raises(BudgetError, match="missing") as e:
        balance(ModelCost(0, 1e9, 0, 1e8, 4e9, 1e8), devices, 8)
    assert e.value.min_budget > 0
