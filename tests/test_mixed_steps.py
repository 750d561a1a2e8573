"""bf16 with some packs stepped on the device beside the host's steps (driver/mixed_steps.py, passes/offload.py).

Where the device computes much faster than the host updates, compile moves the last packs to step onto the device
(their fp32 masters and state brought in one parameter at a time) and keeps the count the simulator finds fastest.
Checked: on a GPU's figures the plan splits the steps and predicts a shorter step than the host alone, the report
says what each count predicted; on the CPU device (host and device share the cores) nothing is weighed; and a split
plan, forced here, trains bitwise as eager mixed precision with every byte moved as predicted.
"""
from __future__ import annotations


import pytest
import torch

import harmony
from harmony.driver import mixed_steps
from harmony.compiler.hardware import Hardware
from harmony.models import GPT, GPTConfig
from models import CASES, training_state_bytes
from test_precision import train_bf16_as_eager


def _planned(**kw):
    """A GPT of 16 layers planned (not run) for an H100 in bf16 under a quarter of its training state."""
    c = GPTConfig(vocab=512, seq=256, layers=16, width=512, heads=8, tie=False)
    with torch.device("meta"):
        m = GPT(c)
    x = torch.zeros(8, 256, dtype=torch.long, device="meta")
    hw = Hardware.preset("h100-sxm")
    hw = hw.replace(devices=(hw.devices[0].replace(dtype="bf16"),), host_memory_bandwidth=100e9)
    return harmony.compile(m, (x, x), device="meta", memory_budget=4 * c.n_params(), microbatches=4,
                           precision="bf16", hardware=hw, **kw), hw


def test_on_a_gpu_the_last_packs_step_on_the_device_where_the_simulator_finds_it_faster():
    sm, hw = _planned()
    cfg = sm.program.config
    on = [p for p, where in sm.plan.by_pack("step_on").items() if where == "device"]
    tried = cfg.steps_predicted
    k = cfg.device_steps
    assert 0 < k == len(on) < len(sm.plan.packs) and tried[k] < tried[0]   # a split: some packs on each side
    assert tried[k + 1] >= tried[k] and max(tried) == k + 1                  # the search stopped past the best
    order = list(dict.fromkeys(n.args[0] for n in sm.graph.nodes if n.op == "call_function"
                               and n.target.__name__ == "step"))
    assert sorted(on) == sorted(order[-len(on):])             # the packs that step last
    assert sm.simulate(hw).step_seconds == pytest.approx(tried[cfg.device_steps])
    assert "chosen by compile" in sm.report() and "step on the device" in sm.report()
    host, _ = _planned(optimizer_on="host")                   # asked for: every pack on the host, nothing weighed
    assert set(host.plan.by_pack("step_on").values()) == {"host"} and host.program.config.steps_predicted is None


def test_nothing_is_weighed_on_the_cpu_device_or_where_the_user_chose():
    model, data = CASES["gpt"]()
    sm = harmony.compile(model, example_batch=data[0], memory_budget=int(training_state_bytes(model) * 0.2),
                         microbatches=4, precision="bf16")
    assert not mixed_steps.wanted(sm.program.config) and sm.program.config.steps_predicted is None
    assert set(sm.plan.by_pack("step_on").values()) == {"host"}


@pytest.mark.parametrize("policy", ["harmony", "sequential"])
def test_a_split_plan_trains_bitwise_as_eager_mixed_precision(monkeypatch, policy):
    """The two last-stepped packs on the device, the rest on the host (the choice forced: the CPU device weighs
    none), bitwise eager's, every byte moved and the peak as predicted."""
    monkeypatch.setattr(mixed_steps, "wanted", lambda cfg: True)
    monkeypatch.setattr(mixed_steps, "choose", lambda program, passes: (2, {0: 2.0, 1: 1.5, 2: 1.0}))
    sm, _ = train_bf16_as_eager("gpt", policy)
    where = sm.plan.by_pack("step_on")
    assert list(where.values()).count("device") == 2 and "host" in where.values()


def test_a_mixed_precision_plan_is_costed_at_its_compute_dtype():
    """bf16 multiplies at bf16's rate: a hardware description given in fp32 (a preset's default) is costed at its
    bf16 figure, so the planner does not take the compute for 13x slower than it is (which hid the host's steps)."""
    c = GPTConfig(vocab=512, seq=64, layers=2, width=64, heads=2, tie=False)
    with torch.device("meta"):
        m = GPT(c)
    x = torch.zeros(4, 64, dtype=torch.long, device="meta")
    for precision, dtype in (("bf16", "bf16"), ("fp32", "fp32")):
        sm = harmony.compile(m, (x, x), device="meta", memory_budget=16 * c.n_params(), precision=precision,
                             hardware="h100-sxm")
        dev = sm.program.config.hardware.devices[0]
        assert dev.dtype == dtype and sm.program.config.flops == dev.peak_flops[dtype]
