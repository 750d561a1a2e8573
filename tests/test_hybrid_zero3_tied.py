"""A weight tied across the stages of a ZeRO-3 grid (``parallel=("pipeline", "data")``, ``shard_state="full"``, issue
64): the built-in GPT with its embedding tied to the output head, 4 gloo ranks as 2 pipelines of 2. Each stage's
replica group keeps its copy of the tied weight in chunks cut alike on both stages (the weight is an all-reduce group
of its own), reduce-scatters its copy's gradient over the replicas, and the ranks of a pipeline add their averaged
chunks (passes/tied.py): the replicated tied grid's arithmetic, so bitwise the same eager reference
(tests/test_hybrid_tied.py ``_eager``: each stage's contribution averaged over the pipelines, then summed) at a
budget where every pack swaps; under 4-bit gradients both stages' copies of the tied weight equal (and close to the
replicated tied grid's); a bad batch on either stage rolls back every rank; the checkpoint (``grid_zero3``, both
stages holding chunks of the tied weight) loads into the replicated grid and into one pipeline of 4;
``clip_grad_norm`` is refused by name.
"""
from __future__ import annotations

import pytest
import torch

import harmony
import harmony.data
from harmony.errors import ConfigError
from models import training_state_bytes
from test_hybrid_tied import _PIECE, MICROBATCHES, SGD, STEPS, TIED, _bitwise, _case, _compile, _train, spawn_tied

ZERO3 = dict(frac=0.3, shard_state="full")        # every pack swapped: gathered from the replica group for each use
RUNS = {"q4": dict(ZERO3, compression="4bit"), "q4_replicated": dict(frac=0.3, compression="4bit")}
# a bad batch at step 1: the last stage's targets out of range, or the first stage's token ids
FAULTS = {"fault_last": dict(fail_rank=1, **ZERO3), "fault_first": dict(fail_rank=0, **ZERO3)}


def _load(path, shape: str) -> dict:
    """The checkpoint loaded into the replicated grid or one pipeline of 4 ranks: what this rank holds then; and it
    trains on."""
    model, data = _case()
    if shape == "grid":
        sm, batch = _compile(model, data, 2.0), harmony.data.shard(data[0], pipeline_size=2)
    else:
        sm, batch = harmony.compile(model, data[0], memory_budget=int(training_state_bytes(model) * 2),
                                    microbatches=MICROBATCHES, parallel="pipeline", comm_timeout=60, **SGD), data[0]
    info = harmony.load(sm, path)
    out = dict(params={n: t.detach().numpy().copy() for n, t in sm.training_state_dict()["model"].items()},
               step=info.step)
    sm(*batch)
    sm.close()
    return out


def _more(rank, world, path) -> dict:
    """The ZeRO-3 tied grid trained and saved, its checkpoint loaded into other shapes, clipping refused."""
    out = dict(zero3=_train(**ZERO3))
    model, data = _case()
    sm = _compile(model, data, **ZERO3)
    for i in range(STEPS):
        sm(*harmony.data.shard(data[i % len(data)], pipeline_size=2))
    harmony.save(sm, path)
    sm.close()
    out["loaded"] = {shape: _load(path, shape) for shape in ("grid", "pipeline")}
    try:
        _train(steps=0, clip_grad_norm=0.05, **ZERO3)
        out["clip"] = "no error"
    except ConfigError as e:
        out["clip"] = str(e)
    return out


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    return spawn_tied(RUNS, FAULTS, _more, tmp_path_factory.mktemp("zero3_tied") / "ckpt")


def _tied_pieces(res, key, rank) -> dict:
    return {n: t for n, t in res[rank][key]["params"].items() if n.startswith(f"share:{TIED}[")}


@pytest.mark.slow
def test_a_zero3_grid_with_a_tied_weight_trains_bitwise_as_eager(grid):
    _bitwise(grid, "zero3")
    for r in range(4):
        got = grid[r]["zero3"]
        names = [name for name, _, _ in got["ops"]]
        assert "gather" in names and "reduce_scatter" in names and "allreduce" not in names, r
        (kw,) = [kw for name, _, kw in got["ops"] if name == "allreduce_tied"]
        assert kw["where"] == "host" and kw["names"] == (TIED,), (r, kw)
        assert got["host"], "every pack steps its chunks on the host"
    for a in (0, 1):      # the two stages of pipeline a (ranks 2a, 2a + 1): the same elements of the tied weight
        first, last = _tied_pieces(grid, "zero3", 2 * a), _tied_pieces(grid, "zero3", 2 * a + 1)
        assert first and first.keys() == last.keys(), (first.keys(), last.keys())
        assert all((first[n] == last[n]).all() for n in first)
    held = [int(_PIECE.fullmatch(n)[3]) - int(_PIECE.fullmatch(n)[2]) for r in (0, 2) for n in _tied_pieces(
        grid, "zero3", r)]
    assert sum(held) == grid["ref"][TIED].numel(), "stage 0's two replicas hold the tied weight between them"


@pytest.mark.slow
def test_under_four_bit_gradients_every_copy_of_the_tied_weight_in_a_zero3_grid_is_equal(grid):
    """Each stage's quantized reduce-scatter decodes its chunk of the average as every replica would, and the tied sum
    of the two stages' chunks is fp32: both stages' copies of each chunk equal. Not bitwise the replicated grid's
    4-bit run, whose tied weight shares its pack's quantized buffer (the chunks' codec sees its own buffer), but
    close to it."""
    for a in (0, 1):
        first, last = _tied_pieces(grid, "q4", 2 * a), _tied_pieces(grid, "q4", 2 * a + 1)
        assert first and first.keys() == last.keys()
        assert all((first[n] == last[n]).all() for n in first), a
    replicated = grid[0]["q4_replicated"]["params"][TIED].reshape(-1)
    got = {n: t for r in range(4) for n, t in _tied_pieces(grid, "q4", r).items()}
    for n, t in got.items():
        lo, hi = int(_PIECE.fullmatch(n)[2]), int(_PIECE.fullmatch(n)[3])
        assert torch.allclose(torch.from_numpy(t), torch.from_numpy(replicated[lo:hi]), atol=1e-2), n
    assert any(not torch.equal(torch.from_numpy(t), grid["ref"][TIED].reshape(-1)[int(_PIECE.fullmatch(n)[2]):
               int(_PIECE.fullmatch(n)[3])]) for n, t in got.items()), "the codec ran"
    assert grid[0]["q4"]["losses"] == pytest.approx(grid[0]["q4_replicated"]["losses"], rel=1e-2)
    for r in range(4):      # the codec's reduce-scatter: fewer bytes than fp32's
        sent = [grid[r][key]["stats"]["reduce_scatter_wire_bytes"] for key in ("q4", "zero3")]
        assert sent[0] < sent[1], (r, sent)


@pytest.mark.slow
@pytest.mark.parametrize("key", list(FAULTS))
def test_a_bad_batch_on_either_stage_rolls_back_every_rank_of_a_zero3_tied_grid(grid, key):
    for r in range(4):
        f = grid[r][key]
        failed = r == FAULTS[key]["fail_rank"]
        assert f["raised"].startswith("IndexError" if failed else "StepAbortedError"), (r, f["raised"])
        assert f["steps"] == 2 and f["differ"] == [], (r, f)


@pytest.mark.slow
def test_a_zero3_tied_grid_checkpoint_loads_into_the_replicated_grid_and_one_pipeline(grid):
    ref = grid["ref"]
    for shape in ("grid", "pipeline"):
        seen = set()
        for r in range(4):
            got = grid[r]["loaded"][shape]
            assert got["step"] == STEPS, (shape, r)
            for n, t in got["params"].items():
                assert torch.equal(torch.from_numpy(t), ref[n]), f"{shape} rank {r}: {n} differs from the saved"
                seen.add(n)
        assert seen == set(ref) - {"losses"}, shape


@pytest.mark.slow
def test_clipping_in_a_zero3_tied_grid_is_refused_by_name_on_every_rank(grid):
    for r in range(4):
        said = grid[r]["clip"]
        assert "clip_grad_norm" in said and TIED in said and "shard_state=True" in said, (r, said)
