"""A grid (``parallel=("pipeline", "data")``) with what a single pipeline has: ``clip_grad_norm=``, weights and
optimizer state on disk, ``pipeline_group="auto"``; each bitwise one process's eager accumulation over each
pipeline's rows, averaged over the pipelines (tests/test_hybrid.py's reference). And CGX's layer-wise adaptive
bits, chosen by each stage's replica group for its packs' gradients; fp16's overflow agreed across the job.

Clipping: each pipeline rank takes the per-tensor norms of its packs' averaged gradients (every all-reduce joined
first, passes/compress.py), the ranks gather them (runtime/pipeline.py ``norm_exchange``), and every rank clips by
the global norm of the averaged gradient, as ``clip_grad_norm_`` does in one process."""
from __future__ import annotations

import pytest
import torch

from test_collectives import _spawn
from test_hybrid import _eager, _train

CLIP = 0.05        # below the gradient's norm at every step: every step clips
RUNS = {"clip": dict(clip_grad_norm=CLIP), "disk": dict(weights_on="disk", frac=0.3),
        "auto": dict(pipeline_group="auto", frac=0.6),
        "adaptive": dict(compression="adaptive", steps=5),       # 3 warm-up steps in fp32, then bits
        # the first step overflows fp16 (skipped on every rank, the scale halved), the others step
        "fp16": dict(precision="fp16", loss_scaling=dict(init_scale=2.0 ** 18, growth_interval=2), steps=6)}


def _ranks(rank, world):
    return {key: _train(**kw) for key, kw in RUNS.items()}


@pytest.fixture(scope="module")
def runs():
    got = _spawn(4, _ranks, timeout=400, pg_timeout=30)
    for r in range(4):
        assert isinstance(got[r], dict), f"rank {r}: {got[r]}"
    return got


def _bitwise(got, key, ref):
    seen = set()
    for r in range(4):
        for n, t in got[r][key]["params"].items():
            assert torch.equal(torch.from_numpy(t), ref[n]), f"{key}: rank {r}: {n} differs from eager"
            seen.add(n)
    assert seen == set(ref) - {"losses", "norms"}, key


@pytest.mark.slow
def test_a_grid_clips_by_the_global_norm_of_the_averaged_gradient_bitwise(runs):
    ref = _eager(clip=CLIP)
    assert min(ref["norms"]) > CLIP
    _bitwise(runs, "clip", ref)
    for r in range(4):
        assert "share_norms" in runs[r]["clip"]["ops"]
        assert runs[r]["clip"]["stats"]["grad_norm"] == ref["norms"][-1], r


@pytest.mark.slow
def test_a_grid_trains_from_disk_and_picks_its_group_bitwise(runs):
    ref = _eager()
    _bitwise(runs, "disk", ref)
    _bitwise(runs, "auto", ref)
    for r in range(4):
        assert runs[r]["disk"]["stats"]["disk_read_bytes"] > 0, r
    for r in range(4):
        assert "chosen by pipeline_group='auto'" in runs[r]["auto"]["text"], r


@pytest.mark.slow
def test_a_grid_chooses_adaptive_bits_per_stage_and_its_replicas_stay_equal(runs):
    for a, b in ((0, 2), (1, 3)):           # the two replicas of each stage
        pa, pb = runs[a]["adaptive"]["params"], runs[b]["adaptive"]["params"]
        assert pa.keys() == pb.keys() and all((pa[n] == pb[n]).all() for n in pa), (a, b)
        assert runs[a]["adaptive"]["stats"]["comm_ratio"] > 1, a      # compressed after the warm-up


@pytest.mark.slow
def test_a_grid_skips_an_fp16_overflow_on_every_rank(runs):
    stats = [runs[r]["fp16"]["stats"] for r in range(4)]
    assert all(s["skipped_steps"] == stats[0]["skipped_steps"] for s in stats), stats
    assert 1 <= stats[0]["skipped_steps"] < 6, stats[0]["skipped_steps"]       # skipped, then stepped
    for a, b in ((0, 2), (1, 3)):
        pa, pb = runs[a]["fp16"]["params"], runs[b]["fp16"]["params"]
        assert all((pa[n] == pb[n]).all() for n in pa), (a, b)
