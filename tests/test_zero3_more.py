"""shard_state="full" with clipping by the global norm, with 4-bit compressed gradients (with and without error
feedback), and with the compressions the replicated run's own all-reduce averages (fp16, adaptive bits), on 2 and 3
gloo ranks.

One spawn per world size (module-scoped fixtures) runs every check of that world: the partitioned run trains
bitwise like the replicated run (``shard_state=False``) with the same clipping or the same compression.
"""
from __future__ import annotations

import pytest
import torch

import harmony
import harmony.data
from harmony.runtime import partitioned
from harmony.runtime.comm.compression import CompressionSpec
from test_collectives import _digest, _spawn
from test_zero3 import STEPS, _compile

CLIPS = {"l2": dict(clip_grad_norm=0.05), "inf": dict(clip_grad_norm=0.01, clip_norm_type=float("inf")),
         "l1": dict(clip_grad_norm=0.5, clip_norm_type=1.0)}
CODECS = {"4bit": dict(compression="4bit"),      # stochastic rounding: the same generator draws as the replicated run
          "2bit": dict(compression=CompressionSpec(bits=2, bucket_size=128, rounding="nearest")),
          # error feedback: each rank keeps the replicated run's residuals
          "4bit_ef": dict(compression=CompressionSpec(bits=4, error_feedback=True))}
# both: the norm is taken from the whole decoded gradients (the full quantized all-reduce runs)
BOTH = {"clip4": dict(compression="4bit", clip_grad_norm=0.05),
        "clip4_ef": dict(compression=CompressionSpec(bits=4, error_feedback=True), clip_grad_norm=0.05)}
# averaged by the replicated run's all-reduce, each rank keeping its chunks (PackShares.allreduce); adaptive: 3 warm-up
# steps in fp32, then the bits chosen, so 5 steps
THROUGH = {"fp16": dict(compression="fp16"), "adaptive": dict(compression="adaptive"),
           "adaptive_clip": dict(compression="adaptive", clip_grad_norm=0.05)}
THROUGH_STEPS = 5


def _train(world, shard_state, steps=STEPS, **kw):
    """``steps`` steps with the optimizer on the host: the parameters' digest, the norms, what the step measured."""
    model, data, sm = _compile(4 * world, shard_state=shard_state, optimizer_on="host", **kw)
    norms, stats = [], []
    for i in range(steps):
        sm(*harmony.data.shard(data[i % len(data)]))
        norms.append(sm.stats.get("grad_norm"))
        stats.append(dict(sm.stats))
    sm.sync_model()
    out = dict(norms=norms, stats=stats[-1], bits=[s.get("adaptive_bits") for s in stats],
               digest=_digest([p.detach() for p in model.parameters()]),
               host_bytes=partitioned.host_state_bytes(sm.runtime.state),
               largest=max(p.numel() * 4 for p in model.parameters()))
    report = next((r for r in sm.program.reports if r.title.startswith("shard")), None)
    out["totals"] = dict(report.totals) if report is not None else {}
    out["notes"] = list(report.notes) if report is not None else []
    sm.close()
    return out


def _ranks(rank, world):
    every = {**CLIPS, **CODECS, **BOTH}
    out = {key: {mode: _train(world, mode, **kw) for mode in (False, "full")} for key, kw in every.items()}
    out.update({key: {mode: _train(world, mode, THROUGH_STEPS, **kw) for mode in (False, "full")}
                for key, kw in THROUGH.items()})
    return out


def _run(world):
    res = _spawn(world, _ranks, timeout=500)
    assert sorted(res) == list(range(world)), res
    for r, v in res.items():
        assert isinstance(v, dict), f"rank {r}: {v}"
    return res


@pytest.fixture(scope="module")
def two():
    return _run(2)


@pytest.fixture(scope="module")
def three():
    return _run(3)


def _check_clipping(res, world, cases=CLIPS):
    for key in cases:
        for r in range(world):
            rep, full = res[r][key][False], res[r][key]["full"]
            assert full["digest"] == rep["digest"] == res[0][key]["full"]["digest"], key    # bitwise
            assert full["norms"] == rep["norms"] and all(n is not None for n in full["norms"]), key
        # the bound is below the norm: the clipped update is the one compared
        assert min(res[0][key][False]["norms"]) > cases[key]["clip_grad_norm"], (key, res[0][key][False]["norms"])


@pytest.mark.slow
def test_two_ranks_clipped_partitioned_train_bitwise_like_replicated_clipped(two):
    _check_clipping(two, 2)


@pytest.mark.slow
def test_three_ranks_clipped_partitioned_train_bitwise_like_replicated_clipped(three):
    _check_clipping(three, 3)


def _check_compressed(res, world):
    for key in CODECS:
        for r in range(world):
            rep, full = res[r][key][False], res[r][key]["full"]
            assert full["digest"] == rep["digest"] == res[0][key]["full"]["digest"], key    # bitwise
            t, s = full["totals"], full["stats"]
            assert s["reduce_scatter_wire_bytes"] == t["reduce_scatter_wire_bytes_per_step"] > 0, key
            # half of the quantized all-reduce's phases (plus the small tensors' fp32 all-reduce)
            assert s["reduce_scatter_wire_bytes"] < rep["stats"]["comm_wire_bytes"], key
            assert s["gather_wire_bytes"] == t["gather_wire_bytes_per_step"] > 0, key
            share = rep["host_bytes"] / world      # each rank's host holds its share (within one tensor)
            assert abs(full["host_bytes"] - share) <= 3 * full["largest"], (key, full["host_bytes"], share)
        # compressed: not the fp32 run's parameters
        assert res[0][key]["full"]["digest"] != res[0]["l2"][False]["digest"]
    # the residuals change the updates: error feedback is not the plain 4-bit run
    assert res[0]["4bit_ef"]["full"]["digest"] != res[0]["4bit"]["full"]["digest"]


@pytest.mark.slow
def test_two_ranks_compressed_partitioned_train_bitwise_like_replicated_compressed(two):
    _check_compressed(two, 2)


@pytest.mark.slow
def test_three_ranks_compressed_partitioned_train_bitwise_like_replicated_compressed(three):
    _check_compressed(three, 3)


def _check_through_allreduce(res, world):
    for key in THROUGH:
        for r in range(world):
            rep, full = res[r][key][False], res[r][key]["full"]
            assert full["digest"] == rep["digest"] == res[0][key]["full"]["digest"], key    # bitwise
            assert full["norms"] == rep["norms"] and full["bits"] == rep["bits"], key
            s, t = full["stats"], full["totals"]
            # the replicated run's all-reduce: its bytes, counted as the reduce-scatter's
            assert s["reduce_scatter_wire_bytes"] == s["comm_wire_bytes"] == rep["stats"]["comm_wire_bytes"] > 0, key
            # planned at the codec's bytes (adaptive: uniform 4-bit, which the chosen bits undercut)
            planned = t["reduce_scatter_wire_bytes_per_step"]
            assert (s["reduce_scatter_wire_bytes"] == planned if key == "fp16" else
                    s["reduce_scatter_wire_bytes"] <= planned), (key, s["reduce_scatter_wire_bytes"], planned)
            share = rep["host_bytes"] / world
            assert abs(full["host_bytes"] - share) <= 3 * full["largest"], (key, full["host_bytes"], share)
    assert any("replicated run's all-reduce" in n for n in res[0]["adaptive"]["full"]["notes"])   # the report says
    bits = res[0]["adaptive"]["full"]["bits"]
    assert bits[:3] == [None] * 3 and bits[3] == bits[4] and len(set(bits[4].values())) > 1   # chosen per layer
    assert res[0]["adaptive_clip"]["full"]["digest"] != res[0]["adaptive"]["full"]["digest"]
    assert res[0]["fp16"]["full"]["digest"] != res[0]["l2"][False]["digest"]


@pytest.mark.slow
def test_fp16_and_adaptive_bits_partitioned_train_bitwise_like_replicated(two, three):
    _check_through_allreduce(two, 2)
    _check_through_allreduce(three, 3)


@pytest.mark.slow
def test_clipped_and_compressed_partitioned_train_bitwise_like_replicated_clipped_and_compressed(two, three):
    for res, world in ((two, 2), (three, 3)):
        _check_clipping(res, world, BOTH)
        # the clipped compressed run is neither the plain compressed nor the plain clipped one
        assert res[0]["clip4"]["full"]["digest"] not in (res[0]["4bit"]["full"]["digest"],
                                                          res[0]["l2"]["full"]["digest"])
        assert res[0]["clip4_ef"]["full"]["digest"] != res[0]["clip4"]["full"]["digest"]


# -- one process ---------------------------------------------------------------------------------------
def test_quantized_layout_follows_the_codec_chunks_and_keeps_small_tensors_in_an_fp32_buffer():
    from harmony.passes.compress import _job_bytes
    spec = CompressionSpec(bits=4, bucket_size=128)
    sizes = {"w": (60, 50), "b": (50,), "v": (33, 40)}
    specs = {n: spec if len(s) > 1 else CompressionSpec("none") for n, s in sizes.items()}
    numel = {n: torch.Size(s).numel() for n, s in sizes.items()}
    for world in (2, 3):
        shares = [partitioned.layout([[(n, numel[n]) for n in sizes]], world, r, dict.fromkeys(sizes, 0),
                                     specs=specs) for r in range(world)]
        q, f = shares[0].segments       # the quantized buffer first (first seen), then the fp32 one
        assert q.names == ["w", "v"] and f.names == ["b"] and q.codec["bits"] == 4 and f.codec is None
        assert q.offsets == [0, 3072] and all(o % 128 == 0 for o in q.offsets)     # 3000 padded to whole buckets
        chunk = q.bounds[1]
        assert q.bounds == [r * chunk for r in range(world + 1)] and chunk % 128 == 0
        assert q.sent == _job_bytes([numel["w"], numel["v"]], spec, world) // 2     # the first half of the two
        assert sum(s.elements() for s in shares) == q.size + f.total
