"""The balance ILP: the known optimum on small clusters, and a clear error when the cluster is too small."""
import itertools
from dataclasses import dataclass

import pytest

from harmony.compiler.balance import ModelCost, balance, evaluate, step_seconds, swap_seconds, uniform
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


@dataclass(frozen=True)
class LinkedDev(Dev):
    h2d_bandwidth: float = 1e9


REPLICATED = ModelCost(flops_const=0.0, flops_per_sample=1e9, act_const=0.0, act_per_sample=1e8,
                       state_bytes=1e9, layer_bytes=1e8, replicated_bytes=2e9)


@pytest.mark.parametrize("link", [1e8, 1e9, 1e11])
def test_swap_copies_of_replicated_state_are_priced_and_the_ilp_still_finds_the_optimum(link):
    devices = [LinkedDev("fast-small", 1.5e9, 4e9, h2d_bandwidth=link), LinkedDev("slow-big", 8e9, 1e9),
               LinkedDev("mid", 3e9, 2e9)]
    plan = balance(REPLICATED, devices, global_batch=12, max_microbatches=4)
    best = brute_force_shares(REPLICATED, devices, 12)
    assert plan.step_seconds <= best.step_seconds * (1 + 1e-6)     # shares continuous in the ILP, gridded here
    assert plan.step_seconds == pytest.approx(evaluate(REPLICATED, devices, [(s.microbatch, s.microbatches)
                                                                              for s in plan.shares],
                                                       [s.state_share for s in plan.shares]).step_seconds)


def test_the_stepping_of_a_share_is_priced_so_an_emulated_slow_rank_gets_less_state():
    cost = ModelCost(flops_const=0.0, flops_per_sample=1e9, act_const=0.0, act_per_sample=1e8,
                     state_bytes=1e9, layer_bytes=1e8, step_bytes=4e9)
    devices = [Banded("fast", 3e9, 2e9), Banded("slow", 3e9, 2e9, speed_factor=4.0)]
    plan = balance(cost, devices, global_batch=10, max_microbatches=4)
    fast, slow = plan.shares
    assert fast.state_share > slow.state_share                 # the 4x slower rank steps less of the state
    assert step_seconds(cost, devices[1], 0.5) == pytest.approx(0.5 * 4e9 / 1e10 * 4.0)
    assert step_seconds(COST, devices[1], 0.5) == 0            # no step traffic given: not priced
    again = evaluate(cost, devices, [(s.microbatch, s.microbatches) for s in plan.shares],
                     [s.state_share for s in plan.shares])
    assert plan.step_seconds == pytest.approx(again.step_seconds)
    best = brute_force_shares(cost, devices, 10)
    assert plan.step_seconds <= best.step_seconds * (1 + 1e-6)


@dataclass(frozen=True)
class Banded(Dev):
    memory_bandwidth: float = 1e10


def test_a_slow_host_link_takes_work_off_a_device_that_must_swap():
    # fast-small swaps 1e8 bytes per sample of its microbatch (its activations push weights out)
    def devices(link):
        return [LinkedDev("fast-small", 2.1e9, 4e9, h2d_bandwidth=link), LinkedDev("slow-big", 8e9, 1e9)]
    quick = balance(REPLICATED, devices(1e12), global_batch=12, max_microbatches=4)
    slow = balance(REPLICATED, devices(2e8), global_batch=12, max_microbatches=4)
    assert quick.shares[0].samples == 10 and quick.step_seconds == pytest.approx(2.5)   # by FLOPs: 10 vs 2
    # microbatches of 3 (3 of them): 2 x 3e8 B of copies at 2e8 B/s = 3 s, as slow-big's 3 samples take
    assert slow.shares[0].samples == 9 and slow.step_seconds == pytest.approx(3.0)
    assert slow.shares[0].state_share == pytest.approx(0.0, abs=1e-9)   # its shard would only add copies
    assert swap_seconds(REPLICATED, devices(2e8)[0], slow.shares[0].microbatch, slow.shares[0].state_share) > 0
    assert swap_seconds(COST, devices(2e8)[0], 1, 0.5) == 0       # nothing replicated: nothing swapped


def brute_force_shares(cost, devices, batch, max_m=4, grid=20):
    best = None
    opts = [(b, m) for b in range(1, batch + 1) for m in range(1, max_m + 1) if b * m <= batch]
    splits = [c for c in itertools.product(range(grid + 1), repeat=len(devices) - 1) if sum(c) <= grid]
    for choice in itertools.product(opts, repeat=len(devices)):
        if sum(b * m for b, m in choice) != batch:
            continue
        for c in splits:
            shares = [x / grid for x in c] + [(grid - sum(c)) / grid]
            plan = evaluate(cost, devices, list(choice), shares)
            if plan.status == "fits" and (best is None or plan.step_seconds < best.step_seconds - 1e-12):
                best = plan
    return best


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


def test_a_speed_factor_makes_the_runtime_emulate_a_slower_device(monkeypatch):
    import torch

    import harmony
    import harmony.runtime.executor as executor
    from harmony.compiler.hardware import Hardware
    from models import CASES, training_state_bytes

    model, data = CASES["gpt"](batch=4)
    budget = training_state_bytes(model) // 2           # swaps: copies run beside compute, unstretched
    hw = Hardware.this_machine().logical([budget], speed_factors=[3])
    sm = harmony.compile(model, example_batch=data[0], hardware=hw, memory_budget=budget, microbatches=2,
                         optimizer=torch.optim.SGD, optimizer_kwargs=dict(lr=0.1))
    slept = []
    monkeypatch.setattr(executor.time, "sleep", slept.append)
    sm(*data[0])
    stretched = [n for n in sm.graph.nodes if n.op == "call_function" and n.target.__name__ in ("forward", "backward")
                 or n.op == "call_function" and n.target.__name__ == "step" and n.kwargs.get("where") != "host"]
    assert sm.runtime.speed_factor == 3.0 and len(stretched) > 4
    assert len(slept) == len(stretched) and all(s >= 0 for s in slept)      # each compute op, nothing else
    assert "emulated" in sm.simulate(hw).summary()
    sm.close()
    plain = harmony.compile(model, example_batch=data[0], memory_budget=budget, microbatches=2)
    slept.clear()
    plain(*data[0])
    assert slept == []
    plain.close()
    with pytest.raises(harmony.errors.ConfigError, match="slow a device down"):
        harmony.compile(model, example_batch=data[0], memory_budget=budget,
                        hardware=Hardware.this_machine().logical([budget], speed_factors=[0.5]))


def test_an_emulated_op_lasts_its_factor_times_its_cpu_time_not_its_wait_for_a_core(monkeypatch):
    import torch

    from harmony.runtime.executor import emulation_pause
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert emulation_pause(4.0, cpu=0.5, wall=0.5) == 1.5        # alone on its core: 3 x more
    assert emulation_pause(4.0, cpu=0.5, wall=1.0) == 1.0        # half its wall time waiting: not stretched
    assert emulation_pause(2.0, cpu=0.5, wall=1.5) == 0.0        # waited longer than the device would take
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)     # CPU on threads it does not see: the wall
    assert emulation_pause(4.0, cpu=0.1, wall=1.0) == 3.0


def test_balance_outside_data_parallel_and_bad_shares_are_config_errors():
    import harmony
    from harmony.compiler.balance import plan_ranks
    from harmony.compiler.hardware import Hardware
    from harmony.errors import ConfigError
    from models import CASES

    model, data = CASES["gpt"](batch=6)
    hw = Hardware.this_machine().logical([1 << 30] * 2)
    with pytest.raises(ConfigError, match="data_parallel"):
        harmony.compile(model, example_batch=data[0], hardware=hw, balance="auto", data_parallel=False)
    with pytest.raises(ConfigError, match="Hardware"):
        harmony.compile(model, example_batch=data[0], hardware="a100-40gb", balance="auto")
    devices = [Dev("a", 4e9, 1e9), Dev("b", 4e9, 1e9)]
    with pytest.raises(ConfigError, match="add up"):
        plan_ranks([3, 4], COST, devices, 6)
    with pytest.raises(ConfigError, match="equal"):
        plan_ranks("uniform", COST, devices, 7)
    with pytest.raises(ConfigError, match="one entry per rank"):
        plan_ranks([6], COST, devices, 6)
    plan = plan_ranks([(1, 2), (2, 2)], COST, devices, 6)
    assert [plan.rows(r) for r in range(2)] == [(0, 2), (2, 6)] and plan.weights() == [2 / 6, 4 / 6]
    assert [s.samples for s in plan_ranks([2, 4], COST, devices, 6, microbatches=2).shares] == [2, 4]


def test_the_model_cost_of_a_traced_model_plans_budgets_its_compile_meets():
    """The ILP's memory floor for a microbatch size is a budget the rank's own compile can plan under."""
    import torch

    import harmony
    from harmony.compiler import cost
    from harmony.compiler.balance import rank_memory_floor
    from harmony.driver.modes.balance import model_cost
    from harmony.compiler.ir import CompileConfig, Program
    from harmony.compiler.trace import trace
    from models import CASES

    model, data = CASES["gpt"](batch=4)
    gm = trace(model, data[0])
    program = Program(model=model, gm=gm, example_batch=data[0],
                      config=CompileConfig(memory_budget=0, microbatches=1, batch_size=1, optimizer=torch.optim.SGD,
                                           optimizer_kwargs=dict(lr=0.1, momentum=0.9)))
    program.optim_profile = cost.optimizer_profile(torch.optim.SGD, dict(lr=0.1, momentum=0.9))
    c = model_cost(program)
    params = sum(p.numel() for p in model.parameters())
    assert c.state_bytes == 4 * params                       # the sharded state: SGD's momentum in fp32
    buffers = sum(t.numel() * t.element_size() for t in gm.buffers())
    assert c.replicated_bytes == 8 * params + buffers        # weight and gradient in fp32, on every rank
    assert c.flops_per_sample > 0 and c.act_per_sample > 0 and c.ops_per_microbatch > 0
    assert program.config.batch_size == 1                     # restored after measuring at 1 and 2 samples
    for b in (2, 4):            # inside the line's span, and its end (the whole batch)
        budget = int(rank_memory_floor(c, None, b))
        sm = harmony.compile(model, example_batch=data[0], memory_budget=budget, microbatches=4 // b,
                             optimizer=torch.optim.SGD, optimizer_kwargs=dict(lr=0.1, momentum=0.9))
        sm(*data[0])
        assert sm.stats["measured_peak"] <= budget
        sm.close()
