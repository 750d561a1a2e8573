"""shard_state="full": parameters, gradients and optimizer state partitioned over 2 and 3 gloo ranks (ZeRO-3).

Each multi-process test spawns its ranks once (``spawn_ok`` from test_collectives) and runs several checks per
process group: the replicated run, ZeRO-1 (``shard_state=True``) and the partitioned run train bitwise alike; each
rank's host holds its share of the weights and optimizer state; a checkpoint round trip; what is refused.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import pytest
import torch

import harmony
import harmony.data
from harmony.errors import ConfigError
from harmony.runtime import ops, partitioned
from harmony.runtime.partitioned import shares as live_shares
from harmony.runtime.placeholders import is_placeholder
from models import CASES, training_state_bytes, withheld
from test_collectives import _digest, spawn_ok

ADAMW = dict(optimizer=torch.optim.AdamW, optimizer_kwargs=dict(lr=1e-3))
STEPS = 3


def _compile(batch, tie=False, frac=0.5, **kw):
    model, data = CASES["gpt"](batch=batch, tie=tie)
    sm = harmony.compile(model, example_batch=harmony.data.shard(data[0]), microbatches=2,
                         memory_budget=int(training_state_bytes(model) * frac), **{**ADAMW, **kw})
    return model, data, sm


def _train(rank, batch, shard_state, frac=0.5):
    """Three steps with the optimizer on the host (the plan ``shard_state="full"`` makes): parameters, bytes, ops."""
    model, data, sm = _compile(batch, frac=frac, shard_state=shard_state, optimizer_on="host")
    state, staged = sm.runtime.state, []
    for i in range(STEPS):
        sm(*harmony.data.shard(data[i % len(data)]))
        if state.shares is not None:     # the staging buffers the gathers received into, made so far
            staged.append((state.shares.staging.allocations, state.shares.carry is not None))
    out = dict(stats=dict(sm.stats), host_bytes=partitioned.host_state_bytes(state),
               largest=max(p.numel() * 4 for p in model.parameters()),
               placeholders=sum(is_placeholder(p.data) for p in model.parameters()), withheld=len(withheld(model)),
               ops=[n.target.__name__ for n in sm.graph.nodes if n.op == "call_function"],
               text=sm.report(), network=sm.simulate("a100-40gb").busy.get("network", 0.0), staged=staged)
    report = next((r for r in sm.program.reports if r.title.startswith("shard")), None)
    out["totals"] = dict(report.totals) if report is not None else {}
    try:
        model(*harmony.data.shard(data[0]))
        out["guard"] = "no error"
    except harmony.errors.OffloadError as e:
        out["guard"] = str(e)
    out["synced"] = len(sm.sync_model())
    out["digest"] = _digest([p.detach() for p in model.parameters()])
    sm.close()
    return out


def _resume(rank, world, path):
    """Save after one step, train two more, load, train the same two: the same parameters."""
    import torch.distributed as dist
    model, data, sm = _compile(4 * world, shard_state="full")
    sm(*harmony.data.shard(data[0]))
    harmony.save(sm, path)
    digests = []
    for _ in range(2):
        for b in data[1:3]:
            sm(*harmony.data.shard(b))
        sm.sync_model()
        digests.append(_digest([p.detach() for p in model.parameters()]))
        harmony.load(sm, path)
    sm.close()
    dist.barrier()
    return dict(digests=digests, files=sorted(p.name for p in Path(path).iterdir()))


@contextlib.contextmanager
def direct_gathers():
    """Every gather received piece by piece into the device copies (``Shares.gather_into``), as large parameters are;
    the tests' small ones would otherwise go through the staging buffer."""
    threshold, live_shares.DIRECT_BYTES = live_shares.DIRECT_BYTES, 0
    try:
        yield
    finally:
        live_shares.DIRECT_BYTES = threshold


def refusals(world: int, cases: dict) -> dict:
    """Each case compiled under shard_state="full": "no error", or the message of the ConfigError it raised."""
    out = {}
    for key, kw in cases.items():
        try:
            _compile(4 * world, shard_state="full", **kw)[2].close()
            out[key] = "no error"
        except ConfigError as e:
            out[key] = str(e)
    return out


def _refused(rank, world):
    """What shard_state="full" does not do yet: a ConfigError naming it and what to use instead."""
    return refusals(world, dict(device=dict(optimizer_on="device"),
                                adafactor=dict(optimizer=torch.optim.Adafactor)))


def _ranks(rank, world, path, other):
    out = {mode: _train(rank, 4 * world, mode) for mode in (False, True, "full")}
    if world == 2:
        # a budget that holds the whole training state: the replicated run keeps it all on the device; the
        # partitioned packs still swap (their state lives in chunks on the hosts), and train alike
        out["roomy"] = {mode: _train(rank, 4 * world, mode, frac=4.0) for mode in (False, "full")}
        out["resume"] = _resume(rank, world, path)
        out["refused"] = _refused(rank, world)
    else:       # the checkpoint the 2-rank run saved loads into 3 ranks
        model, data, sm = _compile(4 * world, shard_state="full")
        try:
            harmony.load(sm, other)
            out["other_world"] = "no error"
        except harmony.errors.CheckpointError as e:
            out["other_world"] = str(e)
        sm.close()
    return out


@pytest.fixture(scope="module")
def saved():
    with tempfile.TemporaryDirectory(prefix="harmony-zero3-") as d:
        yield Path(d) / "ckpt"


def _run(world, saved):
    return spawn_ok(world, _ranks, str(saved), str(saved), timeout=400)


@pytest.fixture(scope="module")
def two(saved):
    return _run(2, saved)


@pytest.fixture(scope="module")
def three(saved, two):          # after the 2-rank run: it loads the checkpoint that run saved
    return _run(3, saved)


def _check_partitioned(res, world):
    for r in range(world):
        rep, zero1, full = res[r][False], res[r][True], res[r]["full"]
        assert rep["digest"] == zero1["digest"] == full["digest"] == res[0]["full"]["digest"]   # bitwise
        # each rank's host holds its share of the fp32 weights and optimizer state (within one tensor)
        share = rep["host_bytes"] / world
        assert abs(full["host_bytes"] - share) <= 3 * rep["largest"], (full["host_bytes"], share)
        assert full["placeholders"] > 0 and rep["placeholders"] == 0      # the other ranks' parts are not held
        assert "gather" in full["ops"] and "reduce_scatter" in full["ops"]
        assert "allreduce" not in full["ops"] and "sync_state" not in full["ops"]
        t = full["totals"]
        assert t["master_bytes_by_rank"][r] == t["master_bytes_this_rank"] and sum(t["master_bytes_by_rank"]) \
            == t["master_bytes_whole"]
        s = full["stats"]
        assert s["gather_wire_bytes"] == t["gather_wire_bytes_per_step"] > 0
        assert s["reduce_scatter_wire_bytes"] == t["reduce_scatter_wire_bytes_per_step"] > 0
        assert s["h2d_bytes"] == s["predicted_h2d"] and s["measured_peak"] <= s["budget"]
        assert full["network"] > 0 and "== shard:" in full["text"]
        assert "shard_state='full'" in full["guard"] and full["synced"] > 0
        assert full["withheld"] == full["placeholders"] and rep["withheld"] == 0   # each refuses to be read
        # the gathers' staging buffers: made in the first step, reused after (a carried pack's refill, on the host
        # thread, may take one beside the copy thread's gather at another moment of another step)
        made = [n for n, carried in full["staged"] if not carried]
        assert made == [] or (made[0] > 0 and made == [made[0]] * len(made)), full["staged"]


@pytest.mark.slow
def test_two_ranks_partitioned_train_bitwise_like_replicated_with_half_the_host_state(two):
    _check_partitioned(two, 2)


@pytest.mark.slow
def test_a_budget_that_holds_everything_still_partitions_and_trains_like_replicated(two):
    for r in (0, 1):
        rep, full = two[r]["roomy"][False], two[r]["roomy"]["full"]
        assert rep["digest"] == full["digest"] == two[0]["roomy"]["full"]["digest"]
        assert "swap_in" not in rep["ops"] and "gather" not in rep["ops"]     # the replicated run: all resident
        assert "gather" in full["ops"] and "reduce_scatter" in full["ops"] and full["placeholders"] > 0
        assert full["stats"]["measured_peak"] <= full["stats"]["budget"]


@pytest.mark.slow
def test_two_ranks_checkpoint_round_trip_each_rank_its_shares(two):
    for r in (0, 1):
        res = two[r]["resume"]
        assert res["files"] == ["rank-0-of-2", "rank-1-of-2"] and res["digests"][0] == res["digests"][1]
    assert two[0]["resume"]["digests"] == two[1]["resume"]["digests"]


@pytest.mark.slow
def test_what_full_sharding_does_not_do_is_refused_by_name(two):
    got = two[0]["refused"]
    assert "shard_state=True" in got["device"]      # compression and clipping: tests/test_zero3_more.py
    assert "optimizer_on='device'" in got["device"]
    # the disk tiers work on each rank's share: tests/test_zero3_disk.py
    assert "element-wise" in got["adafactor"] and "Adafactor" in got["adafactor"]
    # a tied embedding and head trains under "full": tests/test_zero3_disk.py


@pytest.mark.slow
def test_three_ranks_partitioned_train_bitwise_like_replicated(three):
    _check_partitioned(three, 3)
    for r in range(3):
        msg = three[r]["other_world"]
        assert msg == "no error", msg       # resharded into 3 ranks (bitwise: tests/test_reshard.py)


# -- one process ---------------------------------------------------------------------------------------
def test_layout_cuts_equal_chunks_at_aligned_offsets_and_pieces_per_parameter():
    groups = [[("a", 1000), ("b", 10), ("c", 3000)]]
    for world in (2, 3, 4):
        shares = [partitioned.layout(groups, world, r, {"a": 0, "b": 1, "c": 0}) for r in range(world)]
        seg = shares[0].segments[0]
        assert seg.bounds[0] == 0 and seg.bounds[-1] == 4010 == shares[0].elements(-1)
        assert sum(s.elements() for s in shares) == 4010
        assert max(seg.share(r) for r in range(world)) - min(seg.share(r) for r in range(world)) <= 2 * 64
        for s in shares:
            for p in s.pieces:       # a piece starts where its parameter's 64-element lanes start
                name = p.name.split("[")[0].removeprefix(partitioned.PREFIX)
                start = int(p.name.split("[")[1].split(":")[0])
                assert start % 64 == 0 or p.start == seg.bounds[s.rank], p
                assert p.group == (1 if name == "b" else 0)
    big = [[(f"w{i}", 10 << 20) for i in range(4)]]       # 40 MiB each: fused buffers of at most 64 MiB
    assert len(partitioned.layout(big, 2, 0, {f"w{i}": 0 for i in range(4)}).segments) == 4


def test_full_sharding_needs_ranks_and_a_known_value():
    model, data = CASES["gpt"](batch=8)
    with pytest.raises(ConfigError, match="shard_state='full' .* trains alone"):
        harmony.compile(model, example_batch=data[0], shard_state="full")
    with pytest.raises(ConfigError, match="or 'full'"):
        harmony.Config(shard_state="half")
    assert os.environ.get("WORLD_SIZE") in (None, "1")
    assert ops.OPS[partitioned.gather].kind == "copy" and ops.OPS[partitioned.reduce_scatter].kind == "copy"
