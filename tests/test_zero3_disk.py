"""The disk tiers under data parallelism: replicated ranks with packs wholly on disk, and ``shard_state="full"``
with each rank's share of a pack in a file of its own (runtime/partitioned/disk.py, ZeRO-Infinity's
bandwidth-centric partitioning), on 2 and 3 gloo ranks; and ``"full"`` with a tied embedding and head.

One spawn per world size: every run trains bitwise like the replicated run with everything in host memory; a
partitioned rank writes 1/N of what a replicated rank with the same packs on disk writes and holds a fraction of
its host state; a checkpoint of the partitioned disk run round-trips; ZeRO-1 with weights on disk is refused.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import harmony
import harmony.data
from harmony.errors import BudgetError, ConfigError
from harmony.runtime import partitioned
from harmony.viz.report import tiers_of
from test_collectives import _digest, spawn_ok
from models import CASES, training_state_bytes
from test_zero3 import ADAMW, STEPS, _compile

# the tiny GPT's host needs never fall below its gradients and staging: a larger one in smaller packs, whose host
# budget (0.2 of its state on 2 ranks, 0.15 on 3) puts some packs' optimizer state on disk and others' weights too
LARGER = dict(width=128, layers=8)
# a tied embedding and head: the head's pack gathers the embedding pack's chunks (runtime/partitioned/)
TIED = {"tied_host": dict(shard_state=False), "tied_full": dict(shard_state="full"),
        "tied_full_disk": dict(shard_state="full", weights_on="disk")}
TIED_4BIT = {"tied_host_4bit": dict(shard_state=False), "tied_full_4bit": dict(shard_state="full")}
RUNS = {"host": dict(shard_state=False), "disk": dict(shard_state=False, weights_on="disk"),
        "full": dict(shard_state="full"), "full_disk": dict(shard_state="full", weights_on="disk")}
MIXED_BUDGET = {2: 0.2, 3: 0.15}


def _compile_larger(world, host_memory_budget=None, **kw):
    model, data = CASES["gpt"](batch=4 * world, **LARGER)
    state = training_state_bytes(model)
    budget = None if host_memory_budget is None else int(state * host_memory_budget)
    sm = harmony.compile(model, example_batch=harmony.data.shard(data[0]), microbatches=2,
                         memory_budget=state // 4, host_memory_budget=budget, **{**ADAMW, **kw})
    return model, data, sm


def _train(world, path=None, larger=False, **kw):
    kw = {"loss_weighting": "rows", **kw}   # replicated and partitioned runs weigh alike (shard_state="full": rows)
    model, data, sm = (_compile_larger(world, optimizer_on="host", **kw) if larger else
                       _compile(4 * world, optimizer_on="host", **kw))
    losses = [float(sm(*harmony.data.shard(data[i % len(data)]))) for i in range(STEPS)]
    stats = dict(sm.stats)
    out = dict(stats=stats, host_bytes=partitioned.host_state_bytes(sm.runtime.state),
               placed={p: (r.optim_on, r.master_on) for p, r in sm.program.plan.residency.items()},
               gathers=sum(n.target.__name__ == "gather" for n in sm.graph.nodes if n.op == "call_function"))
    shard = next((r for r in sm.program.reports if r.title.startswith("shard")), None)
    out["planned"] = dict(shard.totals) if shard is not None else {}
    disk = sm.runtime.state.disk or sm.runtime.state.params_disk
    if disk is not None:
        out["files"] = sum(f.stat().st_size for f in Path(disk.store.path).iterdir())
        out["planned_disk"] = tiers_of(sm.program)["disk_bytes"]    # what compile checks the disk's room against
    if path is not None:     # save, train on, load: the next step is the one after the save
        harmony.save(sm, path)
        sm(*harmony.data.shard(data[0]))
        harmony.load(sm, path)
        losses.append(float(sm(*harmony.data.shard(data[1]))))
    out["losses"] = losses
    out["synced"] = len(sm.sync_model())
    out["digest"] = _digest([p.detach() for p in model.parameters()])
    sm.close()
    return out


def _ranks(rank, world, path):
    out = {key: _train(world, **kw) for key, kw in RUNS.items()}
    out.update({key: _train(world, tie=True, **kw) for key, kw in TIED.items()})
    out.update({key: _train(world, tie=True, compression="4bit", **kw) for key, kw in TIED_4BIT.items()})
    out["larger_host"] = _train(world, larger=True, shard_state=False)
    out["larger_mixed"] = _train(world, larger=True, shard_state="full", host_memory_budget=MIXED_BUDGET[world])
    out["saved_host"] = _train(world, path=f"{path}/host-{world}")
    out["saved_disk"] = _train(world, path=f"{path}/disk-{world}", shard_state="full", weights_on="disk")
    refused = {}
    for key, kw in dict(zero1=dict(shard_state=True, weights_on="disk"),
                        tiny=dict(shard_state="full", host_memory_budget=100_000)).items():
        try:
            _compile(4 * world, optimizer_on="host", **kw)[2].close()
            refused[key] = "no error"
        except (ConfigError, BudgetError) as e:
            refused[key] = f"{type(e).__name__}: {e}"
    out["refused"] = refused
    return out


@pytest.fixture(scope="module")
def saved():
    with tempfile.TemporaryDirectory(prefix="harmony-zero3-disk-") as d:
        yield d


def _run(world, saved):
    return spawn_ok(world, _ranks, saved, timeout=500)


@pytest.fixture(scope="module")
def two(saved):
    return _run(2, saved)


@pytest.fixture(scope="module")
def three(saved):
    return _run(3, saved)


def _check(res, world):
    first = res[0]
    for r in range(world):
        got = res[r]
        # bitwise: every placement trains the replicated in-memory run's parameters
        assert {got[k]["digest"] for k in RUNS} == {first["host"]["digest"]}
        assert got["saved_disk"]["digest"] == got["saved_host"]["digest"] == first["saved_host"]["digest"]
        assert got["saved_disk"]["losses"] == got["saved_host"]["losses"]
        assert got["larger_mixed"]["digest"] == got["larger_host"]["digest"] == first["larger_host"]["digest"]
        assert {got[k]["digest"] for k in TIED} == {first["tied_host"]["digest"]} != {first["host"]["digest"]}
        assert {got[k]["digest"] for k in TIED_4BIT} == {first["tied_host_4bit"]["digest"]}
        # the head's pack gathers the tied weight from the embedding's chunks, as the plan counts
        tied = got["tied_full"]
        assert tied["stats"]["gather_wire_bytes"] == tied["planned"]["gather_wire_bytes_per_step"] > 0
        disk, full_disk, mixed = got["disk"], got["full_disk"], got["larger_mixed"]
        assert set(full_disk["placed"].values()) == {("disk", "disk")}
        # the budget put some packs' share on disk and kept others in memory
        assert {("disk", "host"), ("disk", "disk")} <= set(mixed["placed"].values()), mixed["placed"]
        # a partitioned rank writes its share of what a replicated rank writes (each within a 4 KiB page per file)
        files = len(full_disk["placed"])
        share = disk["stats"]["disk_write_bytes"] / world
        assert share - 4096 * files <= full_disk["stats"]["disk_write_bytes"] <= share * 1.05 + 4096 * files
        assert full_disk["files"] <= disk["files"] / world * 1.05 + 4096 * files
        for run in (disk, full_disk, mixed):    # the report's disk figure (a rank's share) is its files, to a page each
            assert abs(run["files"] - run["planned_disk"]) <= 4096 * len(run["placed"]) + 0.01 * run["files"]
        # it reads its chunks for each gather and its file for the step, no more: the plan's bytes
        planned = full_disk["planned"]
        slack = 4096 * (files + full_disk["gathers"])      # each read and file rounded up to 4 KiB pages
        assert 0 <= full_disk["stats"]["disk_read_bytes"] - planned["disk_read_bytes_per_step"] <= slack
        assert 0 <= full_disk["stats"]["disk_write_bytes"] - planned["disk_write_bytes_per_step"] <= 4096 * files
        # host memory between steps: none of the partitioned disk packs' state; the in-memory share's fraction
        assert full_disk["host_bytes"] < got["full"]["host_bytes"] / 20
        assert mixed["host_bytes"] < got["larger_host"]["host_bytes"] / world
        for key in [*RUNS, *TIED, *TIED_4BIT, "larger_host", "larger_mixed"]:
            assert got[key]["stats"]["measured_peak"] <= got[key]["stats"]["budget"], key
        assert got["full_disk"]["synced"] > 0
        refused = got["refused"]
        assert refused["zero1"].startswith("ConfigError") and "shard_state='full'" in refused["zero1"]
        assert refused["tiny"].startswith("BudgetError") and "this rank's share" in refused["tiny"]


@pytest.mark.slow
def test_two_ranks_disk_tiers_replicated_and_partitioned_train_bitwise_like_in_memory(two):
    _check(two, 2)


@pytest.mark.slow
def test_three_ranks_disk_tiers_replicated_and_partitioned_train_bitwise_like_in_memory(three):
    _check(three, 3)

