"""A grid (``parallel=("pipeline", "data")``) with ``shard_state="optimizer"`` (ZeRO-1, the same as True): each
stage's optimizer state split over its replica group, each rank stepping its share and broadcasting the stepped
weights to the group (runtime/shard.py ``sync_state`` on the replica group). Bitwise the replicated grid's eager
reference (tests/test_hybrid.py ``_eager``); each rank holds only its share; a bad batch on one rank rolls back every
rank; its checkpoint (``grid_zero1``: every rank its packs' weights and its share of their optimizer state) loads into
the replicated grid and into the sharded one."""
from __future__ import annotations

import os

import pytest
import torch

import harmony
import harmony.data
from harmony.compiler.config import Config
from harmony.runtime.shard import owners_among
from test_hybrid import _case, _compile, _fault, _mine, _optim, _train, spawn_grid

ZERO1 = dict(shard_state="optimizer")


def _load_into(path) -> dict:
    """The ZeRO-1 grid's checkpoint loaded into the replicated grid and into the ZeRO-1 grid: what this rank holds,
    and that it trains on."""
    out = {}
    for name, kw in (("replicated", {}), ("zero1", ZERO1)):
        model, data = _case()
        sm = _compile(model, data, **kw)
        info = harmony.load(sm, path)
        out[name] = dict(params={n: t.numpy().copy() for n, t in _mine(sm).items()}, optim=_optim(sm),
                         step=info.step)
        sm(*harmony.data.shard(data[0], pipeline_size=2))
        sm.close()
    return out


def _frozen(**kw) -> dict:
    """The model's second half frozen (as a user fine-tuning its first layers): the last stage has no parameter to
    step or broadcast, so it makes no ``sync_state``, and the other stage's meet before its broadcasts must not wait
    for it (a meet of its replica group, not of the job)."""
    model, data = _case()
    names = [n for n, _ in model.named_parameters()]
    for n, p in model.named_parameters():
        p.requires_grad_(n not in names[len(names) // 2:])
    sm = _compile(model, data, **kw)
    losses = [sm(*harmony.data.shard(data[i % len(data)], pipeline_size=2)).item() for i in range(3)]
    out = dict(losses=losses, params={n: t.numpy().copy() for n, t in _mine(sm).items()},
               syncs=sum(n.target.__name__ == "sync_state" for n in sm.graph.nodes if n.op == "call_function"))
    sm.close()
    return out


def _ranks(rank, world, path):
    trained = _train(save=path, **ZERO1)
    return dict(zero1=trained, fault=_fault(rank, **ZERO1), loaded=_load_into(path),
                frozen={"zero1": _frozen(**ZERO1), "replicated": _frozen()})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tmp_path_factory.mktemp("grid_zero1") / "ckpt"


@pytest.fixture(scope="module")
def runs(ckpt):
    return spawn_grid(_ranks, ckpt)


@pytest.mark.slow
def test_a_zero1_grid_trains_bitwise_as_the_replicated_grids_eager_reference(runs):
    ref, seen = runs["ref"], set()
    for r in range(4):
        got = runs[r]["zero1"]
        for n, t in got["params"].items():
            assert torch.equal(torch.from_numpy(t), ref[n]), f"rank {r}: {n} differs from eager accumulation"
            seen.add(n)
        assert "sync_state" in got["ops"] and "allreduce" in got["ops"], got["ops"]
        assert "split over its replica group" in got["text"], r
    assert seen == set(ref) - {"losses"}


@pytest.mark.slow
def test_each_rank_holds_only_its_share_of_its_stages_optimizer_state(runs):
    for a, b in ((0, 2), (1, 3)):            # the two ranks of each stage's replica group
        za, zb = runs[a]["zero1"], runs[b]["zero1"]
        assert za["params"].keys() == zb["params"].keys()
        stage = {n + ":momentum_buffer" for n in za["params"]}
        owned_a, owned_b = set(za["optim"]), set(zb["optim"])
        assert owned_a and owned_b and not owned_a & owned_b, (a, b)
        assert owned_a | owned_b == stage, "each parameter's state on exactly one rank of its replica group"
        stage_bytes = sum(t.nbytes for t in za["params"].values())          # momentum: one buffer per parameter
        held = [za["stats"]["state_optim_bytes"], zb["stats"]["state_optim_bytes"]]
        assert sum(held) == stage_bytes and max(held) < stage_bytes, (held, stage_bytes)


@pytest.mark.slow
def test_a_bad_batch_on_one_rank_rolls_back_every_rank_of_a_zero1_grid(runs):
    for r in range(4):
        f = runs[r]["fault"]
        assert f["raised"].startswith("IndexError" if r == 1 else "StepAbortedError"), (r, f["raised"])
        assert f["steps"] == 2 and f["differ"] == [], (r, f)


@pytest.mark.slow
def test_a_zero1_grid_checkpoint_loads_into_the_replicated_grid_and_into_itself(runs, ckpt):
    assert sorted(os.listdir(ckpt)) == [f"rank-{r}-of-4" for r in range(4)]
    for r in range(4):      # every rank writes its packs' weights and its share of their optimizer state
        assert any(f.startswith("pack") for f in os.listdir(ckpt / f"rank-{r}-of-4")), r
    for r in range(4):
        mine, partner = runs[r]["zero1"], runs[r ^ 2]["zero1"]
        whole = {**mine["optim"], **partner["optim"]}          # the stage's optimizer state, from both owners
        for name, want in (("replicated", whole), ("zero1", mine["optim"])):
            got = runs[r]["loaded"][name]
            assert got["step"] == 3, (name, r)
            assert got["params"].keys() == mine["params"].keys()
            assert all((got["params"][n] == t).all() for n, t in mine["params"].items()), (name, r)
            assert got["optim"].keys() == want.keys(), (name, r, sorted(got["optim"]))
            assert all((got["optim"][n] == t).all() for n, t in want.items()), (name, r)


def test_shard_state_optimizer_is_zero1_and_a_grids_owners_are_its_replica_ranks():
    assert Config(shard_state="optimizer").shard_state is True
    got = owners_among([("a", 400), ("b", 400), ("c", 100), ("d", 300)], [1, 3])
    assert got == {"a": 1, "b": 1, "c": 3, "d": 3}
    with pytest.raises(harmony.errors.ConfigError, match="'optimizer' is True"):
        Config(shard_state="half")


@pytest.mark.slow
def test_a_zero1_grid_whose_last_stage_trains_nothing_steps_as_the_replicated_grid(runs):
    for r in range(4):
        zero1, replicated = runs[r]["frozen"]["zero1"], runs[r]["frozen"]["replicated"]
        assert zero1["syncs"] == (1 if r in (0, 2) else 0), r        # stage 0's ranks broadcast; stage 1's have none
        assert zero1["losses"] == replicated["losses"], r
        for n, t in replicated["params"].items():
            assert (zero1["params"][n] == t).all(), (r, n)
