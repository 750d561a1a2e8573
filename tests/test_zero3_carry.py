"""shard_state="full" with shares on disk: weights carried on the device across their pack's step
(runtime/partitioned/carry.py), and evaluation of a partitioned module.

One spawn of 2 gloo ranks. A pack the swap pass carries all-gathers its stepped chunks into the device copy at the
end of its step, and the next forward's gather takes that copy instead of reading this rank's chunks from disk. The
runs train bitwise like the replicated in-memory run; the rank reads what the plan says, less than without the
carry; a failed step, a rank that lost its copies alone, and an evaluation between steps leave the bits alone.
"""
from __future__ import annotations

import pytest
import torch

import harmony
import harmony.data
from harmony.errors import ConfigError
from harmony.runtime import ops, partitioned
from models import CASES, training_state_bytes
from test_collectives import _digest, spawn_ok
from test_zero3 import direct_gathers

ADAMW = dict(optimizer=torch.optim.AdamW, optimizer_kwargs=dict(lr=1e-3), optimizer_on="host")


def _compile(world, **kw):
    model, data = CASES["gpt"](batch=4 * world)
    # rows: the replicated and the partitioned runs weigh alike (shard_state="full" weighs by rows)
    sm = harmony.compile(model, example_batch=harmony.data.shard(data[0]), microbatches=2,
                         memory_budget=int(training_state_bytes(model) * 0.5),
                         **{**ADAMW, "loss_weighting": "rows", **kw})
    return model, data, sm


def _run(world, batches, evaluate_after=None, drop_on_rank0_after=None, direct=False, **kw):
    """Train on ``batches`` (None: a bad batch, whose step fails and is rolled back); evaluate after the step of that
    index; rank 0 alone forgets its carried copies after another. ``direct``: every gather (and the steps' refills
    of carried copies) received piece by piece into the copies."""
    if direct:
        with direct_gathers():
            return _run(world, batches, evaluate_after, drop_on_rank0_after, **kw)
    model, data, sm = _compile(world, **kw)
    out = dict(losses=[], carried=[], read=[], errors=0)
    for i, b in enumerate(batches):
        x, y = harmony.data.shard(data[b if b is not None else 0])
        if b is None:
            try:
                sm(x, torch.full_like(y, 10_000))
            except Exception:
                out["errors"] += 1
            continue
        out["losses"].append(float(sm(x, y)))
        out["carried"].append(sm.stats.get("carried_gathers"))
        out["read"].append(sm.stats.get("disk_read_bytes"))
        if i == evaluate_after:
            out["eval"] = float(sm.evaluate(*harmony.data.shard(data[-1])))
            out["eval_sent"] = sm.eval_stats.get("gather_wire_bytes")
        if i == drop_on_rank0_after and torch.distributed.get_rank() == 0:
            sm.runtime.state.shares.carry.drop()
    plan = sm.program.plan
    out["carried_packs"] = sorted(p for p, r in plan.residency.items() if r.carried)
    out["packs"] = len(plan.packs)
    g = [n for n in sm.graph.nodes if n.op == "call_function"]
    out["gathers"] = [(n.args[0], bool(n.kwargs.get("carried")), n.kwargs.get("reads"))
                      for n in g if n.target is partitioned.gather]
    # each carried pack's last release of its weights hands them to its step, which comes next but for its grads
    out["carry_then_step"] = all(any(n.target is ops.release and n.kwargs.get("carry") and n.args[0] == p
                                     for n in g[:[i for i, m in enumerate(g) if m.target is ops.step
                                                  and m.args[0] == p][0]])
                                 for p in out["carried_packs"])
    shard = next((r for r in sm.program.reports if r.title.startswith("shard")), None)
    out["planned_read"] = shard.totals.get("disk_read_bytes_per_step") if shard is not None else None
    out["peak"], out["budget"] = sm.stats["measured_peak"], sm.stats["budget"]
    sm.sync_model()        # partitioned: the weights into the model's parameters (every rank)
    out["digest"] = _digest([p.detach() for p in model.parameters()])
    sm.close()
    return out


def _mismatched(rank, world) -> str:
    """Ranks with different device budgets plan different packs and swaps, so different gathers."""
    model, data = CASES["gpt"](batch=4 * world)
    state = training_state_bytes(model)
    try:
        harmony.compile(model, example_batch=harmony.data.shard(data[0]), microbatches=2,
                        memory_budget=int(state * (0.5 if rank == 0 else 0.2)), shard_state="full",
                        weights_on="disk", **ADAMW).close()
        return "no error"
    except ConfigError as e:
        return f"ConfigError: {e}"


def _ranks(rank, world):
    good = [0, 1, 2]
    return dict(
        mismatched=_mismatched(rank, world),
        host=_run(world, good, evaluate_after=1, shard_state=False),
        disk=_run(world, good, shard_state=False, weights_on="disk"),
        full=_run(world, good, evaluate_after=1, shard_state="full"),
        carried=_run(world, good, evaluate_after=1, shard_state="full", weights_on="disk"),
        direct=_run(world, good, evaluate_after=1, shard_state="full", weights_on="disk", direct=True),
        failed=_run(world, [0, None, 1, 2], shard_state="full", weights_on="disk"),
        dropped=_run(world, good, drop_on_rank0_after=0, shard_state="full", weights_on="disk"),
    )


@pytest.fixture(scope="module")
def two():
    return spawn_ok(2, _ranks, timeout=400)


@pytest.mark.slow
def test_carried_weights_train_and_evaluate_bitwise_like_the_replicated_run(two):
    for r, got in two.items():
        for key in ("full", "carried", "direct", "failed", "dropped", "disk"):
            assert got[key]["digest"] == two[0]["host"]["digest"], (r, key)
            assert got[key]["losses"] == got["host"]["losses"], (r, key)      # this rank's share of each batch
        assert got["full"]["eval"] == got["carried"]["eval"] == got["direct"]["eval"] == got["host"]["eval"]
        assert got["direct"]["carried"] == got["carried"]["carried"] and got["direct"]["carried"][-1] > 0
        # the evaluation's own gathers are its figures (eval_stats), not the next step's
        assert got["full"]["eval_sent"] > 0 and got["host"]["eval_sent"] is None
        assert got["failed"]["errors"] == 1
        for key in ("host", "disk", "full", "carried", "failed", "dropped"):
            assert got[key]["peak"] <= got[key]["budget"], (r, key)


@pytest.mark.slow
def test_a_carried_pack_s_forward_gather_takes_the_copy_its_step_refilled(two):
    for r, got in two.items():
        c = got["carried"]
        packs = c["carried_packs"]
        assert packs, "the test GPT's device has room at the end of the backward: some pack is carried"
        assert c["carry_then_step"]
        # the first gather of each carried pack in the schedule is the carried one (its forward's)
        first = {}
        for p, carried, _ in c["gathers"]:
            first.setdefault(p, carried)
        assert {p for p, carried in first.items() if carried} == set(packs)
        # the first step has no copies yet; every later one takes one per carried pack
        assert c["carried"][0] == 0 and c["carried"][1:] == [len(packs)] * 2
        # after a failed step, and after rank 0 alone lost its copies, every rank gathers again for one step
        assert got["failed"]["carried"] == [0, 0, len(packs)]
        assert got["dropped"]["carried"] == [0, 0, len(packs)]


@pytest.mark.slow
def test_the_carry_saves_the_forward_s_reads_and_the_plan_counts_them(two):
    for r, got in two.items():
        c, disk = got["carried"], got["disk"]
        gathers = len(c["gathers"])
        # measured as planned, each read rounded up to 4 KiB pages (the first step gathers without copies)
        assert 0 <= c["read"][-1] - c["planned_read"] <= 4096 * (c["packs"] + gathers)
        # the step after the failed one had no copies to take: what the same step reads without the carry
        assert c["read"][-1] < got["failed"]["read"][1]
        # each rank reads at most its share of what a replicated rank reads with the same files on disk (issue 32's
        # target: 1/N + 5%), each read rounded up to 4 KiB pages
        assert c["read"][-1] <= disk["read"][-1] / 2 * 1.05 + 4096 * (c["packs"] + gathers)
        # a pack whose only gather before its step takes the carried copy reads its optimizer state alone
        assert any(reads == "state" for _, _, reads in c["gathers"])


@pytest.mark.slow
def test_ranks_that_planned_different_gathers_are_refused_at_compile_on_every_rank(two):
    for r, got in two.items():
        assert got["mismatched"].startswith("ConfigError"), got["mismatched"]
        assert f"rank {r} compiled another order of gathers" in got["mismatched"]
        assert "same memory_budget" in got["mismatched"]
