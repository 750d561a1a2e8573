"""``balance=`` in a grid (``parallel=("pipeline", "data")``, issue 64): pipelines of unequal speed get unequal rows of
the global batch. 4 gloo ranks as 2 x 2 with logical devices: given shares train bitwise as one process's eager
accumulation of each pipeline's rows with the replica all-reduce's weighting (and allclose to plain accumulation over
the global batch); "auto" gives the emulated slower pipeline fewer rows; the checkpoint loads into an unbalanced grid;
bad balance inputs are ConfigErrors on every rank. The solver itself is checked without ranks."""
from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import pytest
import torch

import harmony
import harmony.data
from harmony.compiler.balance import ModelCost
from harmony.compiler.grid_balance import per_replica, pipeline_seconds, plan_replicas
from harmony.compiler.hardware import Hardware
from harmony.errors import ConfigError
from harmony.runtime.optim import optimizer_kwargs
from models import call, split, training_state_bytes
from test_collectives import _spawn
from test_hybrid import GRID, SGD, _case, _compile, _mine, _optim

SHARES = [(2, 3), (1, 2)]      # pipeline 0: 6 rows in 3 microbatches; pipeline 1: 2 rows in 2
STEPS = 3


def _balanced(model, data, balance=SHARES, factors=(1, 1, 1, 1), frac=2.0, **kw):
    budget = int(training_state_bytes(model) * frac)
    hw = Hardware.this_machine().logical([budget] * 4, speed_factors=list(factors))
    kw = {**SGD, **GRID, "hardware": hw, **kw}
    return harmony.compile(model, data[0], balance=balance, **kw)


def _given(path) -> dict:
    model, data = _case()
    sm = _balanced(model, data)
    losses = [sm(*data[i % len(data)]).item() for i in range(STEPS)]    # the global batch: each pipeline its rows
    evaluated = sm.evaluate(*data[0]).item()          # the same: the global batch's mean on every rank
    harmony.save(sm, path)
    out = dict(params={n: t.numpy().copy() for n, t in _mine(sm).items()}, losses=losses, text=sm.report(),
               evaluated=evaluated,
               rows=sm.program.rows, microbatches=sm.plan.microbatches, balance=sm.program.reports[0].rows,
               weights={n.kwargs.get("weight") for n in sm.graph.nodes if n.op == "call_function"
                        and n.target.__name__ == "allreduce"}, optim=_optim(sm))
    sm.close()
    return out


def _auto() -> dict:
    model, data = _case()
    sm = _balanced(model, data, balance="auto", factors=(1, 1, 3, 3))     # pipeline 1 emulated 3x slower
    sm(*data[0])
    out = dict(rows=sm.program.rows, balance=sm.program.reports[0].rows, totals=sm.program.reports[0].totals,
               text=sm.report(), simulated=sm.simulate().step_seconds)      # this rank's server, its own rows
    sm.close()
    return out


def _loaded(path) -> dict:
    """The balanced grid's checkpoint loaded into an unbalanced grid (equal rows, no balance=), which trains on."""
    model, data = _case()
    sm = _compile(model, data)
    info = harmony.load(sm, path)
    out = dict(params={n: t.numpy().copy() for n, t in _mine(sm).items()}, optim=_optim(sm), step=info.step)
    sm(*harmony.data.shard(data[0], pipeline_size=2))
    sm.close()
    return out


BAD = {      # key -> (compile keywords, what the ConfigError names)
    "three_entries": (dict(balance=[(2, 2), (2, 1), (2, 1)]), "has 3 entries"),
    "ranks_disagree": (dict(balance=[(2, 3), (2, 3), (1, 2), (2, 1)]), "different shares"),
    "not_the_batch": (dict(balance=[(2, 2), (1, 2)]), "add up"),
    "two_devices": (dict(hardware=2), "2 devices but 4 ranks")}


def _refused() -> dict:
    out = {}
    for key, (kw, _) in BAD.items():
        model, data = _case()
        if key == "two_devices":
            kw = dict(hardware=Hardware.this_machine().logical([1 << 30] * 2))
        try:
            _balanced(model, data, **kw).close()
            out[key] = "no error"
        except ConfigError as e:
            out[key] = str(e)
    return out


def _ranks(rank, world, path):
    return dict(given=_given(path), auto=_auto(), loaded=_loaded(path), refused=_refused())


def _eager(mirror: bool = True) -> dict:
    """One process on one thread, each step over the global batch. ``mirror``: each pipeline's rows accumulated over
    its microbatches (loss / microbatches), its gradient scaled by its weight x pipelines, the two summed and halved
    (the replica all-reduce's arithmetic); else plain accumulation, each microbatch's loss x its rows / the batch."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, data = _case()
        model = copy.deepcopy(model)
        opt = SGD["optimizer"](model.parameters(), **optimizer_kwargs(SGD["optimizer"], SGD["optimizer_kwargs"]))
        losses = []
        for i in range(STEPS):
            x, y = data[i % len(data)]
            grads, start, total = [], 0, 0.0
            for b, m in SHARES:
                for mb in split((x[start:start + b * m], y[start:start + b * m]), m):
                    loss = call(model, mb)
                    (loss / m if mirror else loss * (b / x.shape[0])).backward()
                    total += loss.item() * b / x.shape[0]
                start += b * m
                if mirror:
                    scale = b * m / x.shape[0] * len(SHARES)
                    grads.append([p.grad.clone().mul_(scale) for p in model.parameters()])
                    model.zero_grad(set_to_none=True)
            if mirror:
                for p, g0, g1 in zip(model.parameters(), *grads):
                    p.grad = g0.add_(g1).div_(len(SHARES))
            opt.step()
            opt.zero_grad()
            losses.append(total)
        return dict({n: p.detach().clone() for n, p in model.named_parameters()}, losses=losses)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tmp_path_factory.mktemp("grid_balance") / "ckpt"


@pytest.fixture(scope="module")
def runs(ckpt):
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as pool:
        ref = pool.submit(lambda: (_eager(), _eager(mirror=False)))
        res = _spawn(4, _ranks, str(ckpt), timeout=500, pg_timeout=30)
        res["ref"], res["plain"] = ref.result()
    for r in range(4):
        assert isinstance(res.get(r), dict), f"rank {r}: {res.get(r)}"
    return res


@pytest.mark.slow
def test_a_balanced_grid_gives_its_pipelines_their_rows_and_trains_as_eager(runs):
    ref, plain, seen = runs["ref"], runs["plain"], set()
    for r in range(4):
        got = runs[r]["given"]
        assert got["rows"] == ((0, 6) if r < 2 else (6, 8)) and got["microbatches"] == (3 if r < 2 else 2)
        assert got["weights"] == {0.75 if r < 2 else 0.25}, got["weights"]
        for n, t in got["params"].items():
            assert torch.equal(torch.from_numpy(t), ref[n]), f"rank {r}: {n} differs from eager accumulation"
            assert torch.allclose(torch.from_numpy(t), plain[n], rtol=1e-5, atol=1e-6), f"rank {r}: {n}"
            seen.add(n)
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)      # the global batch's mean
        assert got["losses"] == runs[0]["given"]["losses"], "every rank returns the job's loss"
    assert seen == set(ref) - {"losses"}
    evaluated = {runs[r]["given"]["evaluated"] for r in range(4)}
    model, data = _case()
    model.load_state_dict({n: t for n, t in ref.items() if n != "losses"}, strict=False)
    with torch.no_grad():
        eager = model.eval()(*data[0]).float().item()
    assert len(evaluated) == 1 and evaluated.pop() == pytest.approx(eager, rel=1e-5)
    rows = runs[0]["given"]["balance"]
    assert [(row["samples"], row["microbatches"], row["weight"]) for row in rows] == [(6, 3, 0.75), (2, 2, 0.25)]
    text = runs[0]["given"]["text"]
    assert "each pipeline's share of the global batch" in text and "grid: 2 x 2" in text


@pytest.mark.slow
def test_auto_gives_the_slower_pipeline_fewer_rows_and_reports_each_pipelines_step(runs):
    a = [runs[r]["auto"] for r in range(4)]
    rows = a[0]["balance"]
    samples = [row["samples"] for row in rows]
    assert sum(samples) == 8 and samples[0] > samples[1], samples          # pipeline 1 is 3x slower
    assert a[0]["rows"] == a[1]["rows"] == (0, samples[0]) and a[2]["rows"] == a[3]["rows"] == (samples[0], 8)
    assert all(row["predicted_s"] > 0 for row in rows) and rows[1]["speed"] == "1/3x EMULATED"
    assert a[0]["totals"]["predicted_step_s"] == max(row["predicted_s"] for row in rows)
    assert all(x["simulated"] > 0 for x in a)
    assert "(this)" in str(a[2]["balance"][1]["pipeline"]) and "EMULATION" in a[0]["text"]


@pytest.mark.slow
def test_a_balanced_grids_checkpoint_loads_into_an_unbalanced_grid(runs):
    for r in range(4):
        got, mine = runs[r]["loaded"], runs[r]["given"]
        partner = runs[r ^ 2]["given"]          # ZeRO-1 (balance='s default): the stage's state from both owners
        assert got["step"] == STEPS
        assert got["params"].keys() == mine["params"].keys()
        assert all((got["params"][n] == t).all() for n, t in mine["params"].items()), r
        whole = {**mine["optim"], **partner["optim"]}
        assert got["optim"].keys() == whole.keys() and all((got["optim"][n] == t).all() for n, t in whole.items())


@pytest.mark.slow
def test_bad_balance_inputs_in_a_grid_are_config_errors_on_every_rank(runs):
    for key, (_, named) in BAD.items():
        for r in range(4):
            said = runs[r]["refused"][key]
            assert named in said, (key, r, said)


@dataclass(frozen=True)
class Dev:
    name: str
    memory: float = 4e9
    flops: float = 1e9
    speed_factor: float = 1.0


COST = ModelCost(flops_const=0.0, flops_per_sample=1e9, act_const=0.0, act_per_sample=1e8, state_bytes=1e9,
                 layer_bytes=1e8)


def test_the_split_follows_the_pipelines_speeds_and_is_the_best_there_is():
    fast, slow = [Dev("a"), Dev("b")], [Dev("c"), Dev("d", speed_factor=3.0)]
    plan = plan_replicas("auto", COST, [fast, slow], 12, budget=4e9)
    assert [s.samples for s in plan.shares] == [8, 4]          # slow's average stage: 2x fast's
    assert plan.step_seconds == pytest.approx(max(s.seconds for s in plan.shares))
    best = min(max(pipeline_seconds(COST, fast, k, 1), pipeline_seconds(COST, slow, 12 - k, 1)) for k in range(1, 12))
    assert plan.step_seconds == pytest.approx(best)
    # microbatches in groups: the first group crosses every stage, each later one waits for the slowest
    assert pipeline_seconds(COST, slow, 1, 4, group=1) == pytest.approx(0.5 + 1.5 + 3 * 1.5)
    assert pipeline_seconds(COST, slow, 1, 4) == pytest.approx(4 * (0.5 + 1.5))
    assert [s.samples for s in plan_replicas("uniform", COST, [fast, slow], 12, 4e9, 2).shares] == [6, 6]
    assert [s.samples for s in plan_replicas([3, (3, 3)], COST, [fast, slow], 12, 4e9, 3).shares] == [3, 9]


def test_auto_is_the_brute_force_optimum_over_three_pipelines_with_and_without_groups():
    cost = ModelCost(flops_const=5e8, flops_per_sample=1e9, act_const=0.0, act_per_sample=1e8, state_bytes=1e9,
                     layer_bytes=1e8)       # a fixed cost per microbatch: how many microbatches matters
    reps = [[Dev("a"), Dev("b", speed_factor=2.0)], [Dev("c", speed_factor=3.0)] * 2, [Dev("d")] * 2]
    opts = [(b, m) for b in range(1, 11) for m in range(1, 11) if b * m <= 10]
    for group in (None, 1):
        plan = plan_replicas("auto", cost, reps, 10, 4e9, group=group)
        best = min(max(pipeline_seconds(cost, d, b, m, group) for d, (b, m) in zip(reps, c))
                   for c in itertools.product(opts, repeat=3) if sum(b * m for b, m in c) == 10)
        assert plan.step_seconds == pytest.approx(best) and sum(s.samples for s in plan.shares) == 10, group


def test_an_entry_per_rank_is_its_pipelines_and_must_agree_within_it():
    assert per_replica([(2, 1), (2, 1), 4, 4], 2, 2) == [(2, 1), 4]
    assert per_replica([4, 6], 2, 2) == [4, 6]
    with pytest.raises(ConfigError, match="pipeline 1"):
        per_replica([4, 4, 4, 6], 2, 2)
    with pytest.raises(ConfigError, match="one entry per pipeline"):
        per_replica([4, 4, 4], 2, 2)
    with pytest.raises(ConfigError, match="equal"):
        plan_replicas("uniform", COST, [[Dev("a")] * 2] * 2, 7, 4e9)
