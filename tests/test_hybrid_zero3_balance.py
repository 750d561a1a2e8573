"""``balance=`` in a ZeRO-3 grid (``parallel=("pipeline", "data")``, ``shard_state="full"``, issue 64): 4 gloo ranks as
2 x 2 with logical devices, pipeline 0 on 6 rows in 3 microbatches and pipeline 1 on 2 rows in 2, at a budget where
every pack swaps. Each rank's swap search weighs its own microbatches, so the ranks of a replica group would hold
different packs' weights between visits; they keep only the holds all of them chose (passes/swap/agree.py) and gather
alike. The chunks train bitwise as tests/test_hybrid_balance.py's eager reference (each pipeline's accumulated
gradient weighted as the replica all-reduce weighs it); "auto" with an emulated slower pipeline gives it fewer rows
and trains; the checkpoint loads into an unbalanced ZeRO-3 grid; ``pipeline_group=`` with it is refused by name on
every rank."""
from __future__ import annotations

import pytest
import torch

import harmony
import harmony.data
from harmony.errors import ConfigError
from test_collectives import _spawn
from test_hybrid import _case, _compile, _mine
from test_hybrid_balance import STEPS, _balanced, _eager
from test_hybrid_zero3 import _whole

ZERO3 = dict(shard_state="full", frac=0.3)


def _ranks(rank, world, path) -> dict:
    model, data = _case()
    sm = _balanced(model, data, **ZERO3)
    losses = [sm(*data[i % len(data)]).item() for i in range(STEPS)]
    evaluated = sm.evaluate(*data[0]).item()        # each pipeline its rows, gathered alike; the global mean
    harmony.save(sm, path)
    out = dict(given=dict(params={n: t.numpy().copy() for n, t in _mine(sm).items()}, losses=losses,
                          evaluated=evaluated,
                          rows=sm.program.rows, text=sm.report(),
                          ops=[n.target.__name__ for n in sm.graph.nodes if n.op == "call_function"]))
    sm.close()
    model, data = _case()         # the checkpoint into an unbalanced ZeRO-3 grid (equal rows), which trains on
    sm = _compile(model, data, **ZERO3)
    info = harmony.load(sm, path)
    out["loaded"] = dict(params={n: t.numpy().copy() for n, t in _mine(sm).items()}, step=info.step)
    sm(*harmony.data.shard(data[0], pipeline_size=2))
    sm.close()
    model, data = _case()
    sm = _balanced(model, data, balance="auto", factors=(1, 1, 3, 3), **ZERO3)     # pipeline 1 emulated 3x slower
    out["auto"] = dict(rows=sm.program.rows, loss=sm(*data[0]).item())
    sm.close()
    try:
        _balanced(model, data, pipeline_group=1, **ZERO3).close()
        out["grouped"] = "no error"
    except ConfigError as e:
        out["grouped"] = str(e)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as pool:
        ref = pool.submit(_eager)
        res = _spawn(4, _ranks, str(tmp_path_factory.mktemp("zero3_balance") / "ckpt"), timeout=500, pg_timeout=60)
        res["ref"] = ref.result()
    for r in range(4):
        assert isinstance(res.get(r), dict), f"rank {r}: {res.get(r)}"
    return res


@pytest.mark.slow
def test_a_balanced_zero3_grid_trains_bitwise_as_eager_with_the_all_reduces_weighting(runs):
    ref = runs["ref"]
    pieces = {k: t for r in range(4) for k, t in runs[r]["given"]["params"].items()}
    whole = _whole(pieces, ref)          # (every element held by exactly one rank of its stage's replica group)
    assert set(whole) == set(ref) - {"losses"}
    for n, t in whole.items():
        assert torch.equal(t, ref[n]), f"{n} differs from eager accumulation"
    for r in range(4):
        got = runs[r]["given"]
        assert got["rows"] == ((0, 6) if r < 2 else (6, 8))
        assert "gather" in got["ops"] and "reduce_scatter" in got["ops"] and "allreduce" not in got["ops"], r
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert "full (ZeRO-3)" in got["text"] and "every rank of a replica group keeps the holds" in \
            " ".join(got["text"].split()), r
    evaluated = {runs[r]["given"]["evaluated"] for r in range(4)}
    model, data = _case()
    model.load_state_dict({n: t for n, t in ref.items() if n != "losses"}, strict=False)
    with torch.no_grad():
        eager = model.eval()(*data[0]).float().item()
    assert len(evaluated) == 1 and evaluated.pop() == pytest.approx(eager, rel=1e-5)
    for a in (0, 1):      # the two pipelines' ranks of a stage gather alike
        assert [o for o in runs[a]["given"]["ops"] if o == "gather"] == \
            [o for o in runs[a + 2]["given"]["ops"] if o == "gather"]


@pytest.mark.slow
def test_auto_in_a_zero3_grid_gives_the_slower_pipeline_fewer_rows(runs):
    rows = [runs[r]["auto"]["rows"] for r in range(4)]
    assert rows[0] == rows[1] and rows[2] == rows[3] and rows[0][0] == 0 and rows[2][1] == 8
    assert rows[0][1] - rows[0][0] > rows[2][1] - rows[2][0], rows
    assert len({runs[r]["auto"]["loss"] for r in range(4)}) == 1


@pytest.mark.slow
def test_pipeline_group_with_balance_in_a_zero3_grid_is_refused_by_name_on_every_rank(runs):
    for r in range(4):
        said = runs[r]["grouped"]
        assert "pipeline_group=" in said and "shard_state='full'" in said and "pipeline_group=None" in said, (r, said)


@pytest.mark.slow
def test_a_balanced_zero3_grids_checkpoint_loads_into_an_unbalanced_zero3_grid(runs):
    """The unbalanced grid plans its own packs (its microbatches differ), so its chunks are cut elsewhere: the
    weights its ranks hold together are the saved ones."""
    ref = runs["ref"]
    saved = _whole({k: t for r in range(4) for k, t in runs[r]["given"]["params"].items()}, ref)
    loaded = _whole({k: t for r in range(4) for k, t in runs[r]["loaded"]["params"].items()}, ref)
    assert saved.keys() == loaded.keys() and all(torch.equal(loaded[n], t) for n, t in saved.items())
    assert all(runs[r]["loaded"]["step"] == STEPS for r in range(4))
