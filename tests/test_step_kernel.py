"""The optimizer step priced as the kernel that runs it (issue 63 item 1): its traffic, its rate and its tensor ops by
implementation (for-loop, foreach, fused), in the simulator's cost and the planner's.

Hand-built cases run on a unit device (1e9 bytes/s, 1e9 FLOP/s) with a host of 8e9 bytes/s, so a step's seconds are
exact binary fractions of its bytes.
"""
from __future__ import annotations

import pytest
import torch
import torch.fx

import harmony
from harmony.compiler import cost
from harmony.compiler.balance import ModelCost, step_seconds
from harmony.compiler.hardware import Device, Hardware
from harmony.errors import ConfigError
from harmony.runtime import ops
from harmony.runtime.optim import optimizer_kwargs
from harmony.runtime.plan import KERNEL_KWARGS, PackSpec, Plan, StepKernel, step_kernel_of, step_rate, step_traffic
from harmony.runtime.simulate import simulate

G = 10**9
UNIT = Device(name="unit", memory=100 * G, peak_flops={"fp32": 1e9}, h2d_bandwidth=1e9, d2h_bandwidth=1e9,
              memory_bandwidth=1e9)
HOST = Hardware((UNIT,), host_memory_bandwidth=8e9)


def _plan(kernel: StepKernel, params=1, optim=2 * G) -> Plan:
    names = [f"w{i}" for i in range(params)]
    spec = PackSpec(index=0, name="p0", module=None, inputs=[], outputs=[], params=names, buffers=[], owned=names,
                    mutated=[], random=False, param_bytes=G, out_bytes=0, fwd_flops=0, bwd_flops=0)
    spec.optim_bytes, spec.stepped = optim, names
    return Plan(packs=[spec], microbatches=1, microbatch_size=1, input_names=["x"], step_kernel=kernel)


def _step_seconds(kernel: StepKernel, hw, where="host", **plan) -> float:
    g = torch.fx.Graph()
    g.call_function(ops.step, (0,), {"where": where})
    g.output(None)
    return simulate(g, _plan(kernel, **plan), hw).step_seconds


def test_the_fused_kernel_moves_its_state_once_and_the_loop_forms_their_temporaries():
    assert step_traffic(G, 2 * G, "fused") == 3 * G + 4 * G         # reads P, G, O; writes P, O
    assert step_traffic(G, 2 * G, "for-loop") == step_traffic(G, 2 * G, "foreach") == 4 * (2 * G + 2 * G)
    assert step_traffic(G, 0, "fused") < step_traffic(G, 0, "for-loop")       # plain SGD too
    with pytest.raises(ConfigError, match="one of for-loop, foreach, fused"):
        step_traffic(G, 0, "vectorised")
    with pytest.raises(ConfigError, match="one of"):
        StepKernel("vectorised")


def test_the_kernel_is_read_from_the_arguments_as_compile_resolved_them():
    assert step_kernel_of(optimizer_kwargs(torch.optim.AdamW, {"lr": 1e-3})) == "fused"   # torch has it on the CPU
    assert step_kernel_of(optimizer_kwargs(torch.optim.AdamW, {"foreach": True})) == "foreach"
    assert step_kernel_of({"fused": False}) == step_kernel_of({}) == "for-loop"
    assert all(step_kernel_of(kw) == k for k, kw in KERNEL_KWARGS.items())


def test_the_optimizer_profile_names_the_kernel_and_counts_its_ops():
    loop = cost.optimizer_profile(torch.optim.AdamW, KERNEL_KWARGS["for-loop"])
    fused = cost.optimizer_profile(torch.optim.AdamW, KERNEL_KWARGS["fused"])
    each = cost.optimizer_profile(torch.optim.AdamW, KERNEL_KWARGS["foreach"])
    assert (loop["kernel"], each["kernel"], fused["kernel"]) == ("for-loop", "foreach", "fused")
    assert loop["ops_per_tensor"] >= 5 and fused["ops_per_tensor"] == 0 and each["ops_per_tensor"] < 5
    assert fused["ops_per_call"] > 0
    sgd = StepKernel.of(cost.optimizer_profile(torch.optim.SGD, {"lr": 0.1}))
    assert sgd.name == "for-loop" and sgd.ops(4) > sgd.ops(1) > 0
    assert StepKernel.of({"state_per_byte": 2.0}) == StepKernel()      # a profile without counts: the old default


def test_a_fused_host_step_costs_its_traffic_at_the_host_bandwidth_and_the_loop_more():
    fused = _step_seconds(StepKernel("fused", 4, 0), HOST)
    loop = _step_seconds(StepKernel("for-loop", 2, 10), HOST)
    assert fused == (3 * G + 4 * G) / 8e9 == 0.875
    assert loop == 16 * G / 8e9 == 2.0


def test_a_measured_step_rate_prices_its_kernel_and_the_others_fall_back_to_the_bandwidth():
    hw = HOST.replace(host_step_rates=(("fused", 7e9),))
    assert _step_seconds(StepKernel("fused", 4, 0), hw) == 1.0
    assert _step_seconds(StepKernel("for-loop", 2, 10), hw) == 2.0
    assert step_rate(hw, "fused", host=True) == 7e9 and step_rate(hw, "foreach", host=True) == 8e9
    assert step_rate(UNIT, "fused", host=True) == 1e9          # a bare device: its own bandwidth
    cpu = UNIT.replace(step_rates=[["fused", 3.5e9]])          # as JSON gives it back
    assert cpu.step_rates == (("fused", 3.5e9),) and step_rate(cpu, "fused", host=False) == 3.5e9


def test_a_device_step_pays_the_ops_its_kernel_dispatches():
    """On the CPU device each tensor op costs its latency: the fused kernel's few per call, the loop's per tensor."""
    slow = Hardware((UNIT.replace(kernel_latency=2**-10),))
    fused = _step_seconds(StepKernel("fused", 4, 0), slow, where="device", params=3, optim=0)
    loop = _step_seconds(StepKernel("for-loop", 2, 10), slow, where="device", params=3, optim=0)
    assert fused == 3 + 4 * 2**-10           # 3e9 bytes at 1e9 bytes/s, 4 ops
    assert loop == 8 + 32 * 2**-10           # 8e9 bytes, 2 + 3 x 10 ops


def test_balance_prices_a_ranks_step_at_its_devices_rate_for_the_kernel():
    base = dict(flops_const=0.0, flops_per_sample=0.0, act_const=0.0, act_per_sample=0.0, state_bytes=0.0,
                layer_bytes=0.0)
    fused = ModelCost(**base, step_bytes=step_traffic(G, 2 * G, "fused"), step_kernel="fused")
    loop = ModelCost(**base, step_bytes=step_traffic(G, 2 * G, "for-loop"), step_kernel="for-loop")
    dev = UNIT.replace(step_rates=(("fused", 7e9),))
    assert step_seconds(fused, dev, 0.5) == 0.5 and step_seconds(loop, dev, 0.5) == 8.0


def test_compile_prices_the_kernel_its_optimizer_arguments_resolve_to():
    """The plan carries the step as compile resolved the optimizer; the simulated host step of the fused default is
    shorter than the for-loop's on the same hardware, and the planner's host step agrees with the simulator's."""
    from harmony.models import GPT, GPTConfig, copy_task
    torch.manual_seed(0)
    c = GPTConfig(layers=2, width=32, vocab=32, seq=8)
    batch = next(iter(copy_task(c, 4, 1, seed=0)))
    hw = Hardware.detect(device="cpu").logical([64 * 2**20]).replace(host_memory_bandwidth=8e9)
    busy = {}
    for kw in ({}, {"foreach": False}):
        sm = harmony.compile(GPT(c), example_batch=batch, optimizer=torch.optim.AdamW, optimizer_kwargs=kw,
                             optimizer_on="host", hardware=hw)
        busy[sm.plan.step_kernel.name] = sm.simulate(hw).busy["host"]
    assert set(busy) == {"fused", "for-loop"}
    assert 0 < busy["fused"] < busy["for-loop"]
