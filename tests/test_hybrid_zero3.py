"""A grid (``parallel=("pipeline", "data")``) with ``shard_state="full"`` (ZeRO-3 over each stage's replica group): each
rank keeps one chunk of every parameter of its stage's packs and its optimizer state, gathers a pack's weights from
its replica group before the pack runs and reduce-scatters the gradients over it after the pack's last backward (the
data-parallel ZeRO-3 runtime, runtime/partitioned/, on the replica group). 4 gloo ranks as 2 x 2: bitwise one
process's eager accumulation (tests/test_hybrid.py ``_eager``, which the replicated grid equals) in fp32, bitwise the
replicated grid under 4-bit gradients; the two ranks of a replica group hold disjoint chunks that cover the stage; a
bad batch on one rank rolls back every rank; the checkpoint (``grid_zero3``: every rank its chunks) loads into itself,
into the replicated grid, into one pipeline of 4 and into 4 data-parallel ranks; clipping bitwise eager's, fp16 the
replicated grid's, chunks on disk with carried weights, ``sm.sync_model()``. And 2 x 3 (three replicas: the chunks cut
in three, reduce-scattered by an all-reduce over the replica group) bitwise the replicated grid."""
from __future__ import annotations

import os
import re

import pytest
import torch

import harmony
import harmony.data
from models import training_state_bytes
from test_hybrid import MICROBATCHES, SGD, STEPS, _case, _compile, _eager, _fault, _mine, _optim, _train, spawn_grid
from test_hybrid_more import CLIP

# 0.3 of the model's training state per device: a stage's packs swap (ZeRO-3 gathers them; a plan that keeps a
# pack's weights on the device has no partitioned pack to gather)
ZERO3 = dict(shard_state="full", frac=0.3)
# the first steps overflow (skipped on every rank), then it steps; weighed by rows as shard_state="full" weighs
# (the replicated grid would weigh a token loss by tokens, whose fp16 gradients overflow at other scales)
FP16 = dict(precision="fp16", loss_scaling=dict(init_scale=2.0 ** 18, growth_interval=2), steps=4,
            loss_weighting="rows")
_PIECE = re.compile(r"share:(.+)\[(\d+):(\d+)\]")
SHAPES = {"grid": {}, "grid_zero3": ZERO3, "pipeline": dict(parallel="pipeline"), "data": {}}


def _load(path, shape: str) -> dict:
    """The checkpoint loaded into a module of ``shape`` (``SHAPES``): what this rank holds then, and that it trains
    on."""
    model, data = _case()
    if shape.startswith("grid"):
        sm, batch = _compile(model, data, **SHAPES[shape]), harmony.data.shard(data[0], pipeline_size=2)
    else:
        batch = data[0] if shape == "pipeline" else harmony.data.shard(data[0])
        sm = harmony.compile(model, batch, memory_budget=int(training_state_bytes(model) * 2),
                             microbatches=MICROBATCHES, comm_timeout=30, **SGD, **SHAPES[shape])
    info = harmony.load(sm, path)
    out = dict(params={n: t.numpy().copy() for n, t in _mine(sm).items()}, optim=_optim(sm), step=info.step)
    sm(*batch)
    sm.close()
    return out


def _on_disk() -> dict:
    """Each rank's chunks in a file on its own disk (``weights_on="disk"``): the swap pass carries a pack's gathered
    weights across its step, whose refill all-gathers the stepped chunks over the replica group
    (runtime/partitioned/carry.py); then ``sm.sync_model()``: the whole trained model on every rank."""
    model, data = _case()
    sm = _compile(model, data, weights_on="disk", **ZERO3)
    carried = 0
    for i in range(STEPS):
        sm(*harmony.data.shard(data[i % len(data)], pipeline_size=2))
        carried += sm.stats.get("carried_gathers", 0)
    synced = sm.sync_model()
    out = dict(carried=carried, synced=len(synced),
               model={n: p.detach().numpy().copy() for n, p in model.named_parameters()})
    sm.close()
    return out


def _ranks(rank, world, path):
    return dict(zero3=_train(save=path, **ZERO3), disk=_on_disk(), clip=_train(clip_grad_norm=CLIP, **ZERO3),
                fp16=_train(**FP16, **ZERO3), fp16_replicated=_train(**FP16, frac=0.3),
                roomy=_train(shard_state="full", frac=2.0), q4=_train(compression="4bit", **ZERO3),
                q4_replicated=_train(compression="4bit", frac=0.3), fault=_fault(rank, **ZERO3),
                loaded={shape: _load(path, shape) for shape in SHAPES})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tmp_path_factory.mktemp("grid_zero3") / "ckpt"


@pytest.fixture(scope="module")
def runs(ckpt):
    return spawn_grid(_ranks, ckpt)


def _whole(pieces: dict, shapes: dict) -> dict:
    """Whole flat tensors from ``share:<name>[a:b]`` pieces (each element from exactly one piece), by name."""
    out, seen = {}, {}
    for key, t in pieces.items():
        name, a, b = _PIECE.fullmatch(key).groups()
        a, b = int(a), int(b)
        flat = out.setdefault(name, torch.full((shapes[name].numel(),), float("nan")))
        cover = seen.setdefault(name, torch.zeros(shapes[name].numel(), dtype=torch.int32))
        flat[a:b] = torch.from_numpy(t).reshape(-1)
        cover[a:b] += 1
    for name, cover in seen.items():
        assert (cover == 1).all(), f"{name}: elements held by no rank or by two"
    return {n: t.view(shapes[n].shape) for n, t in out.items()}


def _stage(runs, key: str, a: int) -> dict:
    """Stage ``a``'s parameters whole, from the chunks its two replicas (ranks a and a + 2) hold."""
    ref = runs["ref"]
    return _whole({**runs[a][key]["params"], **runs[a + 2][key]["params"]}, ref)


@pytest.mark.slow
def test_a_zero3_grid_trains_bitwise_as_eager_accumulation(runs):
    ref, seen = runs["ref"], set()
    for a in (0, 1):
        for n, t in _stage(runs, "zero3", a).items():
            assert torch.equal(t, ref[n]), f"stage {a}: {n} differs from eager accumulation"
            seen.add(n)
    assert seen == set(ref) - {"losses"}, "every parameter is held by one stage's replicas"
    for r in range(4):
        got = runs[r]["zero3"]
        assert "gather" in got["ops"] and "reduce_scatter" in got["ops"] and "allreduce" not in got["ops"], r
        assert got["losses"] == runs[0]["zero3"]["losses"] and got["evaluated"] == runs[0]["zero3"]["evaluated"]
        assert "full (ZeRO-3)" in got["text"] and "replica group" in got["text"] and "shard:" in got["text"], r
    assert runs[0]["zero3"]["losses"] == pytest.approx(ref["losses"], rel=1e-5)


@pytest.mark.slow
def test_chunks_on_disk_carry_weights_across_the_step_and_sync_model_gives_every_rank_the_whole_model(runs):
    ref = runs["ref"]
    for r in range(4):
        got = runs[r]["disk"]
        assert got["carried"] > 0, "a carried pack's refill and take ran over the replica group"
        assert got["synced"] and got["model"].keys() == set(ref) - {"losses"}
        for n, t in got["model"].items():
            assert torch.equal(torch.from_numpy(t), ref[n]), f"rank {r}: {n} differs from eager accumulation"


@pytest.mark.slow
def test_a_zero3_grid_clips_by_the_global_norm_of_the_averaged_gradient_bitwise(runs):
    """Each rank takes its chunks' gradient norms from the whole averaged buffer in the reduce-scatter, and the
    pipeline's exchange of norms carries them (``GradClip.known``)."""
    ref = _eager(clip=CLIP)
    assert min(ref["norms"]) > CLIP
    for a in (0, 1):
        for n, t in _stage(runs, "clip", a).items():
            assert torch.equal(t, ref[n]), f"stage {a}: {n} differs from eager clip_grad_norm_"


@pytest.mark.slow
def test_a_zero3_grid_whose_budget_holds_everything_still_partitions_and_trains_bitwise(runs):
    """A budget of twice the state: the replicated grid would keep it all on the device; the partitioned packs still
    swap (their state lives in chunks on the hosts) and train as eager accumulation."""
    ref = runs["ref"]
    for a in (0, 1):
        for n, t in _stage(runs, "roomy", a).items():
            assert torch.equal(t, ref[n]), f"stage {a}: {n} differs from eager accumulation"
    for r in range(4):
        got = runs[r]["roomy"]
        assert "gather" in got["ops"] and "reduce_scatter" in got["ops"], r
        assert got["stats"]["measured_peak"] <= got["stats"]["budget"], r


@pytest.mark.slow
def test_fp16_in_a_zero3_grid_skips_and_steps_bitwise_as_the_replicated_grid(runs):
    for a in (0, 1):
        replicated = runs[a]["fp16_replicated"]
        for n, t in _stage(runs, "fp16", a).items():
            assert torch.equal(t, torch.from_numpy(replicated["params"][n])), f"stage {a}: {n}"
    for r in range(4):
        got, want = runs[r]["fp16"], runs[r]["fp16_replicated"]
        assert got["losses"] == want["losses"]
        assert got["stats"]["skipped_steps"] == want["stats"]["skipped_steps"] == 2, got["stats"]["skipped_steps"]
        assert got["stats"]["loss_scale"] == want["stats"]["loss_scale"]


@pytest.mark.slow
def test_under_four_bit_gradients_a_zero3_grid_is_bitwise_the_replicated_grid(runs):
    ref = runs["ref"]
    for a in (0, 1):
        replicated = runs[a]["q4_replicated"]["params"]
        assert all((runs[a + 2]["q4_replicated"]["params"][n] == t).all() for n, t in replicated.items())
        for n, t in _stage(runs, "q4", a).items():
            assert torch.equal(t, torch.from_numpy(replicated[n])), f"stage {a}: {n} differs from the replicated grid"
    assert any(not torch.equal(t, ref[n]) for n, t in _stage(runs, "q4", 0).items()), "the codec ran"
    assert runs[0]["q4"]["stats"]["reduce_scatter_wire_bytes"] < runs[0]["zero3"]["stats"]["reduce_scatter_wire_bytes"]


@pytest.mark.slow
def test_each_rank_holds_a_disjoint_share_covering_its_stage(runs):
    ref = runs["ref"]
    for a in (0, 1):
        mine, partner = runs[a]["zero3"], runs[a + 2]["zero3"]
        assert not set(mine["params"]) & set(partner["params"])
        stage = _stage(runs, "zero3", a)         # (``_whole`` asserts every element is on exactly one of the two)
        whole = sum(ref[n].numel() * 4 for n in stage)
        held = [mine["stats"]["host_state_bytes"], partner["stats"]["host_state_bytes"]]
        # each rank's host: its chunks of the weights and their momentum (SGD), the two together twice the stage's
        assert sum(held) == 2 * whole and max(held) < 1.5 * whole, (held, whole)
        assert min(held) > 0.5 * whole, "about half each"
        assert set(mine["optim"]) == {f"{n}:momentum_buffer" for n in mine["params"]}


@pytest.mark.slow
def test_a_bad_batch_on_one_rank_rolls_back_every_rank_of_a_zero3_grid(runs):
    for r in range(4):
        f = runs[r]["fault"]
        assert f["raised"].startswith("IndexError" if r == 1 else "StepAbortedError"), (r, f["raised"])
        assert f["steps"] == 2 and f["differ"] == [], (r, f)


@pytest.mark.slow
def test_a_zero3_grid_checkpoint_loads_into_itself_the_replicated_grid_one_pipeline_and_data_parallel(runs, ckpt):
    ref = runs["ref"]
    assert sorted(os.listdir(ckpt)) == [f"rank-{r}-of-4" for r in range(4)]
    saved = {n: t for a in (0, 1) for n, t in _stage(runs, "zero3", a).items()}
    momentum = {}
    for a in (0, 1):
        optim = {k.rsplit(":", 1)[0]: t for r in (a, a + 2) for k, t in runs[r]["zero3"]["optim"].items()}
        momentum.update(_whole(optim, ref))
    for r in range(4):
        own = runs[r]["loaded"]["grid_zero3"]
        assert own["step"] == STEPS
        assert own["params"].keys() == runs[r]["zero3"]["params"].keys()
        assert all((own["params"][n] == t).all() for n, t in runs[r]["zero3"]["params"].items()), r
        assert all((own["optim"][n] == t).all() for n, t in runs[r]["zero3"]["optim"].items()), r
    for shape in ("grid", "pipeline", "data"):
        seen = set()
        for r in range(4):
            got = runs[r]["loaded"][shape]
            assert got["step"] == STEPS, (shape, r)
            for n, t in got["params"].items():
                assert torch.equal(torch.from_numpy(t), saved[n]), f"{shape} rank {r}: {n} differs from the saved"
                seen.add(n)
            for k, t in got["optim"].items():
                assert torch.equal(torch.from_numpy(t), momentum[k.rsplit(":", 1)[0]]), (shape, r, k)
        assert seen == set(saved), shape


def _three_replicas(rank, world) -> dict:
    """2 x 3: three pipelines, so each stage's chunks are cut in three and reduce-scattered by gloo's all-reduce of
    the replicated buffer over the replica group (runtime/partitioned/reduce.py ``all_reduce_chunk``), not swapped."""
    from models import CASES
    out = {}
    for key, kw in (("zero3", dict(shard_state="full")), ("replicated", {})):
        model, data = CASES["gpt"](batch=12)
        sm = harmony.compile(model, harmony.data.shard(data[0], pipeline_size=2), microbatches=MICROBATCHES,
                             memory_budget=int(training_state_bytes(model) * 0.3), parallel=("pipeline", "data"),
                             pipeline_size=2, comm_timeout=60, **SGD, **kw)
        for i in range(STEPS):
            sm(*harmony.data.shard(data[i % len(data)], pipeline_size=2))
        out[key] = {n: t.numpy().copy() for n, t in _mine(sm).items()}
        sm.close()
    return out


@pytest.mark.slow
def test_a_two_by_three_zero3_grid_trains_bitwise_as_the_replicated_grid():
    from test_collectives import _spawn
    got = _spawn(6, _three_replicas, timeout=500, pg_timeout=60)
    for r in range(6):
        assert isinstance(got.get(r), dict), f"rank {r}: {got.get(r)}"
    replicated = {n: torch.from_numpy(t) for r in range(6) for n, t in got[r]["replicated"].items()}
    pieces = {k: t for r in range(6) for k, t in got[r]["zero3"].items()}
    for stage in (0, 1):          # a stage's three replicas (ranks stage, stage + 2, stage + 4): a chunk each
        held = [set(got[r]["zero3"]) for r in (stage, stage + 2, stage + 4)]
        assert all(held) and not (held[0] & held[1] or held[0] & held[2] or held[1] & held[2]), stage
    for n, t in _whole(pieces, replicated).items():
        assert torch.equal(t, replicated[n]), f"{n} differs from the replicated grid"
    assert {_PIECE.fullmatch(k).group(1) for k in pieces} == set(replicated)
