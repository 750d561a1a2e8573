"""shard_state="full" under ``balance``: uneven shares of every pack's parameters (Cephalo's uneven shards, ZeRO-3).

The balance plan's state shares cut each pack's buffers, so each rank's host holds and steps its share; every rank
runs the same microbatches and plans under the smallest device's memory and the slowest device's speed, so that
all plan the same gathers. One spawn per world size runs every check of that world: the partitioned run trains
bitwise like the replicated balanced run (``shard_state=False``), fp32 and with 4-bit gradients; each rank's host
holds its share (within one tensor); a checkpoint of uneven shares loads back, and into equal shares.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import harmony
import harmony.data
from harmony.errors import ConfigError
from harmony.runtime import partitioned
from models import CASES, training_state_bytes
from test_collectives import _digest, spawn_ok
from test_zero3 import direct_gathers

ADAMW = dict(optimizer=torch.optim.AdamW, optimizer_kwargs=dict(lr=1e-3))
MEMORY = (0.5, 0.8, 1.2)          # each device's memory, of the training state: uneven state shares
STEPS = 3


def _compile(world, mode, balance, speeds=None, **kw):
    """Balanced over devices of ``MEMORY`` (``speeds``: emulated factors), or with ``balance=None`` an ordinary
    data-parallel compile of equal shares."""
    from harmony.compiler.hardware import Hardware
    model, data = CASES["gpt"](batch=4 * world)
    if balance is None:
        sm = harmony.compile(model, example_batch=harmony.data.shard(data[0]), microbatches=2, shard_state=mode,
                             memory_budget=int(training_state_bytes(model) * MEMORY[0]), optimizer_on="host",
                             **{**ADAMW, **kw})
        return model, data, sm
    hw = Hardware.this_machine().logical([int(training_state_bytes(model) * f) for f in MEMORY[:world]],
                                         speed_factors=speeds)
    sm = harmony.compile(model, example_batch=data[0], hardware=hw, data_parallel=True, balance=balance,
                         shard_state=mode, optimizer_on="host", **{**ADAMW, **kw})
    return model, data, sm


def _train(world, mode, **kw):
    """``mode`` "direct": "full" with every gather received piece by piece into the copies."""
    with direct_gathers() if mode == "direct" else contextlib.nullcontext():
        model, data, sm = _compile(world, "full" if mode == "direct" else mode, [(2, 2)] * world, **kw)
        for i in range(STEPS):
            sm(*data[i % len(data)])               # the global batch: each rank takes its rows
        sm.sync_model()
    report = next((r for r in sm.program.reports if r.title.startswith("shard")), None)
    out = dict(digest=_digest([p.detach() for p in model.parameters()]), stats=dict(sm.stats),
               host_bytes=partitioned.host_state_bytes(sm.runtime.state), packs=len(sm.plan.packs),
               largest=max(p.numel() * 4 for p in model.parameters()),
               planned=[row["state_share_planned"] for row in sm.program.reports[0].rows],
               totals=dict(report.totals) if report is not None else {}, text=sm.report())
    sm.close()
    return out


def _checkpoint(rank, world, root):
    """Uneven shares save after one step; the same module loads and trains two more steps, and so does a module of
    equal shares (no balance) that loads the same checkpoint: the same parameters."""
    import torch.distributed as dist
    model, data, sm = _compile(world, "full", [(2, 2)] * world)
    sm(*data[0])
    harmony.save(sm, root)
    digests = {}
    for key in ("uneven", "equal"):
        if key == "equal":
            sm.close()
            model, _, sm = _compile(world, "full", None)
        harmony.load(sm, root)
        for b in data[1:3]:
            sm(*(harmony.data.shard(b) if key == "equal" else b))
        sm.sync_model()
        digests[key] = _digest([p.detach() for p in model.parameters()])
    sm.close()
    dist.barrier()
    return digests


def _ranks(rank, world, root):
    out = {f"{key}/{mode}": _train(world, mode, **kw) for key, kw in (("fp32", {}), ("4bit", dict(compression="4bit")))
           for mode in (False, "full", "direct")}
    if world == 2:
        out["checkpoint"] = _checkpoint(rank, world, root)
        auto = _compile(world, "full", "auto", speeds=[1, 3])[2]     # the ILP keeps one shape, shares follow speed
        out["auto"] = [(r["microbatch"], r["microbatches"], r["state_share_planned"]) for r in
                       auto.program.reports[0].rows]
        auto.close()
        try:
            _compile(world, "full", [(3, 2), (1, 2)])[2].close()
            out["different_shapes"] = "no error"
        except ConfigError as e:
            out["different_shapes"] = str(e)
    return out


def _check(res, world):
    for key in ("fp32", "4bit"):
        planned = res[0][f"{key}/full"]["planned"]
        assert max(planned) - min(planned) > 0.1, planned            # uneven indeed
        for r in range(world):
            rep, full = res[r][f"{key}/False"], res[r][f"{key}/full"]
            assert full["digest"] == rep["digest"] == res[0][f"{key}/False"]["digest"], (key, r)   # bitwise
            direct = res[r][f"{key}/direct"]        # chunks received straight into the copies: the same bits
            assert direct["digest"] == full["digest"], (key, r)
            assert direct["stats"]["gather_wire_bytes"] == full["stats"]["gather_wire_bytes"]
            t, s = full["totals"], full["stats"]
            by_rank = t["master_bytes_by_rank"]
            assert by_rank[r] == t["master_bytes_this_rank"] and sum(by_rank) == t["master_bytes_whole"]
            # each rank's host holds its planned share of the fp32 weights and optimizer state (within one tensor)
            assert abs(full["host_bytes"] - planned[r] * rep["host_bytes"]) <= 3 * rep["largest"], \
                (key, r, full["host_bytes"], planned[r] * rep["host_bytes"])
            assert abs(by_rank[r] / t["master_bytes_whole"] - planned[r]) < 0.05, (by_rank, planned)
            assert s["gather_wire_bytes"] == t["gather_wire_bytes_per_step"] > 0
            assert s["reduce_scatter_wire_bytes"] == t["reduce_scatter_wire_bytes_per_step"] > 0
            if world == 2 and key == "fp32":    # two ranks swap chunks: each sends the other its share alone
                assert s["reduce_scatter_wire_bytes"] == by_rank[1 - r] < rep["stats"]["comm_wire_bytes"]
            assert s["measured_peak"] <= s["budget"] and s["h2d_bytes"] == s["predicted_h2d"]
            assert "PARAMETERS, GRADIENTS AND OPTIMIZER STATE" in full["text"]
        # every rank plans the same packs under "full"; the replicated ranks, under their own memories, need not
        assert len({res[r][f"{key}/full"]["packs"] for r in range(world)}) == 1
    # 4-bit with uneven shares: each rank's chunk is cut from the whole quantized all-reduce (the replicated bytes)
    assert res[0]["4bit/full"]["stats"]["reduce_scatter_wire_bytes"] == \
        res[0]["4bit/False"]["stats"]["comm_wire_bytes"]


@pytest.mark.slow
def test_two_ranks_uneven_shares_train_bitwise_like_replicated_and_checkpoints_reshard(tmp_path):
    res = spawn_ok(2, _ranks, str(tmp_path / "ckpt"), timeout=400)
    _check(res, 2)
    for r in range(2):
        assert res[r]["checkpoint"]["uneven"] == res[r]["checkpoint"]["equal"] == res[0]["checkpoint"]["uneven"]
    (b0, m0, s0), (b1, m1, s1) = res[0]["auto"]
    assert (b0, m0) == (b1, m1) and s0 > s1 > 0             # the emulated slow rank steps less of the state
    msg = res[0]["different_shapes"]
    assert "same (microbatch size, microbatches)" in msg and "shard_state=True" in msg


@pytest.mark.slow
def test_three_ranks_uneven_shares_train_bitwise_like_replicated(tmp_path):
    _check(spawn_ok(3, _ranks, str(tmp_path / "ckpt"), timeout=400), 3)


# -- one process ---------------------------------------------------------------------------------------
def test_layout_cuts_uneven_shares_at_aligned_offsets():
    groups = [[("a", 1000), ("b", 10), ("c", 3000)]]
    fractions = [0.2, 0.5, 0.3]
    shares = [partitioned.layout(groups, 3, r, {"a": 0, "b": 0, "c": 0}, fractions=fractions) for r in range(3)]
    seg = shares[0].segments[0]
    assert seg.bounds[0] == 0 and seg.bounds[-1] == 4010
    assert sum(s.elements() for s in shares) == 4010
    for r, f in enumerate(fractions):        # each share within one vector lane group of its fraction
        assert abs(seg.share(r) - f * 4010) <= 64, (r, seg.bounds)
        for p in shares[r].pieces:
            start = int(p.name.split("[")[1].split(":")[0])
            assert start % 64 == 0 or p.start == seg.bounds[r], p
    for r in range(3):         # a gather: each rank receives the others' chunks at their own lengths, no padding
        assert partitioned.received(shares[r], 0) == 4010 - seg.share(r)
    equal = partitioned.layout(groups, 3, 0, {"a": 0, "b": 0, "c": 0}, fractions=[1 / 3] * 3)
    assert equal.segments[0].bounds == partitioned.layout(groups, 3, 0, {"a": 0, "b": 0, "c": 0}).segments[0].bounds


def test_two_ranks_reduce_scatter_fp32_by_swapping_chunks_unless_whole_gradients_are_needed():
    groups = [[("a", 1000), ("b", 10), ("c", 3000)]]
    for r in (0, 1):
        seg = partitioned.layout(groups, 2, r, dict.fromkeys("abc", 0), fractions=[0.3, 0.7]).segments[0]
        assert seg.pairwise and seg.sent == 4 * seg.share(1 - r)
        whole = partitioned.layout(groups, 2, r, dict.fromkeys("abc", 0), pairwise=False).segments[0]  # clipping
        assert not whole.pairwise and whole.sent == 4 * 4010      # the ring all-reduce's bytes
    three = partitioned.layout(groups, 3, 0, dict.fromkeys("abc", 0)).segments[0]
    assert not three.pairwise           # three ranks: gloo's all-reduce, whose sums a swap would not reproduce
    from harmony.runtime.comm.compression import CompressionSpec
    q = CompressionSpec(bits=4)
    mixed = partitioned.layout(groups, 2, 0, dict.fromkeys("abc", 0), specs={"a": q, "c": q}).segments
    assert not any(s.pairwise for s in mixed)     # a call with quantized buffers goes through the codec


def test_a_rank_with_a_zero_share_owns_nothing_and_receives_every_chunk_in_each_gather():
    groups = [[("a", 1000), ("b", 10), ("c", 3000)]]
    shares = [partitioned.layout(groups, 2, r, dict.fromkeys("abc", 0), fractions=[1.0, 0.0]) for r in (0, 1)]
    seg = shares[1].segments[0]
    assert shares[1].elements() == 0 and shares[1].pieces == [] and shares[0].elements() == 4010
    assert seg.share(1) == 0 and partitioned.received(shares[1], 0) == 4010     # it sends nothing, receives all
    assert partitioned.received(shares[0], 0) == 0
