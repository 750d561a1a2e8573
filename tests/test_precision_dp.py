"""Mixed precision under data parallelism (2 gloo ranks): bf16 and fp16 device copies, fp32 masters on the host.

The gradients reach the host in the compute dtype; the all-reduce averages fp32 copies of them, which become the
masters' gradients (runtime/comm/communicator.py; before, it looked for them on the masters, found none and sent
nothing, so the ranks drifted apart). Checked: the ranks agree bitwise; the run is one process's on the global batch
within bf16's rounding (SGD, so a gradient summed instead of averaged would show); ZeRO-1 and the partitioned state
(in memory, on disk, clipped) train bitwise like the replicated run; 4-bit gradients and fp16 loss scaling work, and
an overflow skips the step on every rank of a partitioned run.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import harmony
import harmony.data
from models import CASES, training_state_bytes
from test_collectives import _digest, spawn_ok

SGD = dict(optimizer=torch.optim.SGD, optimizer_kwargs=dict(lr=0.1))
STEPS = 3
RUNS = {"bf16": dict(precision="bf16"), "bf16_zero1": dict(precision="bf16", shard_state=True),
        "bf16_full": dict(precision="bf16", shard_state="full"),
        "bf16_full_disk": dict(precision="bf16", shard_state="full", weights_on="disk"),
        "bf16_full_disk_clip": dict(precision="bf16", shard_state="full", weights_on="disk", clip_grad_norm=0.05),
        "bf16_clip": dict(precision="bf16", clip_grad_norm=0.05),
        "bf16_4bit": dict(precision="bf16", compression="4bit"),
        "fp16": dict(precision="fp16"), "fp16_zero1": dict(precision="fp16", shard_state=True),
        "fp16_full": dict(precision="fp16", shard_state="full"),
        # a loss scale that overflows the first step: every rank skips it, whatever chunk it checks
        "fp16_full_overflow": dict(precision="fp16", shard_state="full", loss_scaling=dict(init_scale=2.0 ** 40)),
        "fp16_overflow": dict(precision="fp16", loss_scaling=dict(init_scale=2.0 ** 40))}


def _train(batch, data_parallel, **kw):
    model, data = CASES["gpt"](batch=batch)
    split = harmony.data.shard if data_parallel else (lambda b: b)
    # rows: the modes compared here weigh alike (shard_state="full" weighs by rows, data parallel would by tokens)
    sm = harmony.compile(model, example_batch=split(data[0]), microbatches=2 if data_parallel else 4,
                         memory_budget=int(training_state_bytes(model) * 0.5), loss_weighting="rows", **{**SGD, **kw})
    for i in range(STEPS):
        sm(*split(data[i % len(data)]))
    stats = dict(sm.stats)
    sm.sync_model()
    params = [p.detach().numpy().copy() for p in model.parameters()]
    sm.close()
    return dict(params=params, digest=_digest([torch.from_numpy(p) for p in params]), stats=stats)


def _ranks(rank, world):
    return {key: _train(4 * world, True, **kw) for key, kw in RUNS.items()}


@pytest.fixture(scope="module")
def two():
    return spawn_ok(2, _ranks, timeout=500)


def _diff(a, b) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


@pytest.mark.slow
def test_mixed_precision_data_parallel_averages_gradients_and_ranks_agree(two):
    for key in RUNS:
        assert two[0][key]["digest"] == two[1][key]["digest"], key
        s = two[0][key]["stats"]
        assert s.get("comm_wire_bytes", 0) > 0 or s.get("reduce_scatter_wire_bytes", 0) > 0, key     # sent
        assert s["measured_peak"] <= s["budget"], key
    # one process on the global batch, the same precision: within bf16's rounding of the gradients
    single = _train(8, False, precision="bf16")
    fp32 = _train(8, False)
    assert _diff(two[0]["bf16"]["params"], single["params"]) < 1e-3
    assert _diff(single["params"], fp32["params"]) > 0           # bf16 is not fp32: the comparison means something
    # sharded and partitioned state train bitwise like the replicated run in the same precision
    assert two[0]["bf16_zero1"]["digest"] == two[0]["bf16_full"]["digest"] == two[0]["bf16"]["digest"]
    # each rank's share on disk (runtime/partitioned/disk.py), and with clipping too: the same bits
    assert two[0]["bf16_full_disk"]["digest"] == two[0]["bf16"]["digest"]
    assert two[0]["bf16_full_disk_clip"]["digest"] == two[0]["bf16_clip"]["digest"] != two[0]["bf16"]["digest"]
    assert two[0]["fp16_zero1"]["digest"] == two[0]["fp16_full"]["digest"] == two[0]["fp16"]["digest"]
    over, over_full = two[0]["fp16_overflow"], two[0]["fp16_full_overflow"]
    assert over_full["digest"] == over["digest"] != two[0]["fp16"]["digest"]
    assert over_full["stats"]["skipped_steps"] == over["stats"]["skipped_steps"] >= 1
    # 4-bit gradients: compressed on the wire, so not the uncompressed run
    q = two[0]["bf16_4bit"]["stats"]
    assert q["comm_wire_bytes"] < q["comm_fp32_bytes"] and two[0]["bf16_4bit"]["digest"] != two[0]["bf16"]["digest"]
