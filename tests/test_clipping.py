"""Gradient clipping by the global norm (``clip_grad_norm=``): the update is eager ``clip_grad_norm_`` + step's.

The eager reference accumulates the same microbatches, clips ``model.parameters()`` and steps; Harmony must give
the same bits wherever the optimizer steps (host, device, streamed, mixed) and whatever tier holds the state, and
report the same norm. Data-parallel clipping is checked with the other 2-rank runs (test_data_parallel.py).
"""
import copy
import math

import pytest
import torch

import harmony
from harmony.errors import ConfigError
from harmony.runtime import ops
from models import CASES, eager_accumulate, run_compiled, training_state_bytes
from test_precision import _assert_bitwise, eager_mixed

CLIP = 0.05      # below every step's norm in these runs: every update is clipped


def _bitwise(case, frac, microbatches=4, clip=CLIP, norm_type=2.0, policy="harmony", **kw):
    model, data = CASES[case]()
    ref = eager_accumulate(model, data, microbatches, clip=clip, norm_type=norm_type)[0]
    ours = copy.deepcopy(model)
    sm, stats, _ = run_compiled(ours, data, microbatches, int(training_state_bytes(model) * frac), policy,
                                clip_grad_norm=clip, clip_norm_type=norm_type, **kw)
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), f"{name}: max diff {(a - b).abs().max().item()}"
    assert [s["grad_norm"] for s in stats] == ref.norms      # clip_grad_norm_'s return value, each step
    assert min(ref.norms) > clip                               # the runs did clip
    return sm, stats


def _step_places(sm) -> set:
    return {n.kwargs.get("where", "device") for n in sm.graph.nodes if n.op == "call_function" and n.target is ops.step}


@pytest.mark.parametrize("case", ["mlp", "gpt"])
def test_host_steps_under_swapping_equal_eager_clip_grad_norm(case):
    sm, _ = _bitwise(case, 0.5)
    assert _step_places(sm) == {"host"} and len(sm.plan.packs) > 1
    # every step follows the last backward: the norm needs every gradient
    names = [n.target.__name__ for n in sm.graph.nodes if n.op == "call_function"]
    assert max(i for i, t in enumerate(names) if t == "backward") < min(i for i, t in enumerate(names) if t == "step")
    assert "clip_grad_norm=0.05" in sm.report()


def test_device_steps_all_state_resident_equal_eager():
    sm, _ = _bitwise("gpt", 3.0)
    assert _step_places(sm) == {"device"}


def test_streamed_device_steps_equal_eager():
    sm, _ = _bitwise("mlp", 0.5, optimizer_on="device")
    assert any(n.kwargs.get("stream") for n in sm.graph.nodes if n.op == "call_function" and n.target is ops.step)


def test_sequential_policy_with_host_and_device_steps_equal_eager():
    sm, _ = _bitwise("mlp", 0.5, policy="sequential")
    assert _step_places(sm) == {"host", "device"}       # mixed placement: the swap pass kept one pack's state


def test_ondemand_policy_equals_eager():
    model, data = CASES["mlp"]()
    ref = eager_accumulate(model, data, 4, clip=CLIP, fused=False)[0]    # ondemand steps with torch's loop
    ours = copy.deepcopy(model)
    run_compiled(ours, data, 4, int(training_state_bytes(model) * 0.5), "ondemand", clip_grad_norm=CLIP)
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_optimizer_state_on_disk_equals_eager(tmp_path):
    model, _ = CASES["gpt"]()
    sm, _ = _bitwise("gpt", 0.3, host_memory_budget=int(training_state_bytes(model) * 0.85), offload_dir=tmp_path)
    assert "disk" in sm.plan.by_pack("optim_on").values()
    assert "every pack" in sm.report()       # the host holds every pack's gradients until the norm is known


def test_max_norm_and_a_norm_that_clips_nothing():
    _bitwise("mlp", 0.5, norm_type=math.inf)
    # a limit above the norm multiplies by exactly 1: the same bits as no clipping at all
    model, data = CASES["mlp"]()
    ref = eager_accumulate(model, data, 4)[0]
    ours = copy.deepcopy(model)
    _, stats, _ = run_compiled(ours, data, 4, int(training_state_bytes(model) * 0.5), clip_grad_norm=1e6)
    assert all(s["grad_norm"] < 1e6 for s in stats)
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_clips_the_fp32_unscaled_gradients(precision):
    """As an AMP recipe does: unscale, clip_grad_norm_ the fp32 gradients, step (fp16: through GradScaler)."""
    model, data = CASES["mlp"]()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    ref, _ = eager_mixed(model, data, 4, dtype, scaler=scaler, clip=CLIP)
    ours = copy.deepcopy(model)
    _, stats, _ = run_compiled(ours, data, 4, int(training_state_bytes(model) * 0.2), precision=precision,
                               clip_grad_norm=CLIP)
    _assert_bitwise(ours, ref)
    assert all(s["grad_norm"] > CLIP for s in stats)


def test_a_failed_step_leaves_no_clipping_state_behind():
    """An error inside a clipped step rolls back (runtime/transaction.py); the next steps equal eager's."""
    model, data = CASES["mlp"]()
    ref = eager_accumulate(model, data, 4, clip=CLIP)[0]
    ours = copy.deepcopy(model)
    sm = harmony.compile(ours, example_batch=data[0], memory_budget=int(training_state_bytes(model) * 0.5),
                         microbatches=4, clip_grad_norm=CLIP)
    x, y = data[0]
    with pytest.raises(Exception):
        sm(x, torch.full_like(y, 10 ** 6))          # an out-of-range label: eager raises the same IndexError
    assert sm.steps == 0 and sm.runtime.gate.deferred == []
    for batch in data:
        sm(*batch)
    sm.close()
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "1.0", True])
def test_bad_clip_values_are_config_errors(bad):
    with pytest.raises(ConfigError, match="clip_grad_norm"):
        harmony.Config(clip_grad_norm=bad)


@pytest.mark.parametrize("bad", [0, -2.0, "2", None, float("nan")])
def test_bad_norm_types_are_config_errors(bad):
    with pytest.raises(ConfigError, match="clip_norm_type"):
        harmony.Config(clip_grad_norm=1.0, clip_norm_type=bad)


def test_weights_on_disk_is_refused_with_clipping():
    with pytest.raises(ConfigError, match="weights_on='disk'"):
        harmony.Config(clip_grad_norm=1.0, weights_on="disk")
