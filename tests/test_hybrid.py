"""parallel=("pipeline", "data") (issue 64): 4 gloo ranks as 2 pipelines of 2, bitwise against one process's eager
gradient accumulation; every replica equal under 4-bit gradients; a failed step rolled back on every rank; a 2 x 2
checkpoint loaded into one pipeline of 4 and into 4 data-parallel ranks; bad grids and what a grid does not do yet
refused by name (``balance=`` itself: tests/test_hybrid_balance.py).

The ranks are spawned once (``_spawn`` from test_collectives, one thread each) and run every check; the eager
reference is computed in the parent meanwhile, on one thread too (another thread count sums in another order).
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

import harmony
import harmony.data
from harmony.errors import ConfigError
from harmony.runtime.comm.grid import Grid, grid_of
from harmony.runtime.optim import optimizer_kwargs
from models import CASES, call, split, training_state_bytes
from test_collectives import _spawn

SGD = dict(optimizer=torch.optim.SGD, optimizer_kwargs=dict(lr=0.1, momentum=0.9))
GRID = dict(parallel=("pipeline", "data"), pipeline_size=2, comm_timeout=30)
MICROBATCHES = 2
STEPS = 3


def _case():
    return CASES["gpt"](batch=8)        # 3 blocks, width 64: the global batch of 8 rows, 4 a pipeline


def _compile(model, data, frac=2.0, **kw):
    budget = int(training_state_bytes(model) * frac)
    kw = {**SGD, **GRID, "memory_budget": budget, **kw}
    return harmony.compile(model, harmony.data.shard(data[0], pipeline_size=2), microbatches=MICROBATCHES, **kw)


def _mine(sm) -> dict:
    return {n: t.detach().clone() for n, t in sm.training_state_dict()["model"].items()}


def _optim(sm) -> dict:
    """Each parameter's optimizer state tensors this rank holds, as numpy arrays."""
    return {f"{n}:{k}": v.detach().numpy().copy() for n, st in sm.training_state_dict()["optimizer"].items()
            for k, v in st.items() if isinstance(v, torch.Tensor) and v.dim() > 0}


def _train(steps=STEPS, save=None, **kw):
    model, data = _case()
    sm = _compile(model, data, **kw)
    losses = [sm(*harmony.data.shard(data[i % len(data)], pipeline_size=2)).item() for i in range(steps)]
    evaluated = None
    if save is not None:
        evaluated = sm.evaluate(*harmony.data.shard(data[0], pipeline_size=2)).item()   # the pipelines' mean
        harmony.save(sm, save)
        node = sm.simulate()        # this rank's server: its pipeline's ranks, their all-reduces on the shared link
        simulated = dict(devices=len(node.devices), step=node.step_seconds,
                         reduces=sum(1 for d in node.devices for e in d.events if e.name.startswith("ar")))
    out = dict(params={n: t.numpy().copy() for n, t in _mine(sm).items()}, losses=losses, text=sm.report(),
               optim=_optim(sm), files=sorted(os.listdir(save)) if save else None,
               simulated=simulated if save is not None else None, evaluated=evaluated,
               stats=dict(sm.stats), ops=[n.target.__name__ for n in sm.graph.nodes if n.op == "call_function"])
    sm.close()
    return out


def _fault(rank, **kw):
    """A bad batch on rank 1 (the last stage of pipeline 0) at step 1: every rank raises, and ends bitwise as a run
    that skipped that step (both compiled with ``kw``); the job trains on."""
    model, data = _case()
    ref_model = copy.deepcopy(model)
    sm = _compile(model, data, **kw)
    raised = None
    for i in range(STEPS):
        x, y = harmony.data.shard(data[i % len(data)], pipeline_size=2)
        if i == 1 and rank == 1:
            y = y.clone()
            y[-1, -1] = 10_000       # an out-of-range target: IndexError in the loss
        try:
            sm(x, y)
        except Exception as e:       # noqa: BLE001
            if i != 1:
                raise
            raised = f"{type(e).__name__}: {e}"
    got, steps = _mine(sm), sm.steps
    sm.close()
    ref = _compile(ref_model, data, **kw)
    for i in (0, 2):
        ref(*harmony.data.shard(data[i % len(data)], pipeline_size=2))
    want = _mine(ref)
    ref.close()
    return dict(raised=raised, steps=steps, differ=[n for n in want if not torch.equal(got[n], want[n])])


REFUSED = {      # option -> what the refusal names
    "ondemand": (dict(policy="ondemand"), "policy='ondemand'"),
    "not_a_multiple": (dict(pipeline_size=3), "multiple"),
    "one_rank_pipelines": (dict(pipeline_size=1), "at least 2"),
    "one_pipeline": (dict(pipeline_size=4), "no replica")}


def _refusals() -> dict:
    """Each refused combination compiled on every rank: the ConfigError's text (every rank refuses alike, before
    any collective)."""
    out = {}
    for key, (kw, _) in REFUSED.items():
        model, data = _case()
        try:
            _compile(model, data, **kw)
            out[key] = "no error"
        except ConfigError as e:
            out[key] = str(e)
    return out


def _ranks(rank, world, path):
    return dict(fp32=_train(save=path), q4=_train(compression="4bit"), fault=_fault(rank), refused=_refusals())


def _load_into(rank, world, path):
    """The 2 x 2 grid's checkpoint loaded into one pipeline of 4 ranks and into 4 data-parallel ranks: what each
    rank holds then."""
    out = {}
    for name, kw in (("pipeline", dict(parallel="pipeline")), ("data", {})):
        model, data = _case()
        batch = data[0] if name == "pipeline" else harmony.data.shard(data[0])
        sm = harmony.compile(model, batch, memory_budget=int(training_state_bytes(model) * 2),
                             microbatches=MICROBATCHES, comm_timeout=30, **SGD, **kw)
        info = harmony.load(sm, path)
        out[name] = dict(params={n: t.numpy().copy() for n, t in _mine(sm).items()}, optim=_optim(sm),
                         step=info.step, steps=sm.steps)
        sm(*batch)        # and it trains on
        sm.close()
    return out


def _eager(replicas=2, clip=None):
    """One process: each step, each pipeline's rows accumulated over its microbatches (loss / microbatches), the
    pipelines' gradients summed and divided by their number (as the replica all-reduce does), one update (after
    ``clip_grad_norm_(clip)``: the norms in ``norms``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, data = _case()
        model = copy.deepcopy(model)
        opt = SGD["optimizer"](model.parameters(), **optimizer_kwargs(SGD["optimizer"], SGD["optimizer_kwargs"]))
        losses, norms = [], []
        for i in range(STEPS):
            grads, total = [], 0.0
            for r in range(replicas):
                for mb in split(harmony.data.shard(data[i % len(data)], r, replicas), MICROBATCHES):
                    loss = call(model, mb)
                    (loss / MICROBATCHES).backward()
                    total += loss.item() / (MICROBATCHES * replicas)
                grads.append([p.grad for p in model.parameters()])
                model.zero_grad(set_to_none=True)
            for p, *gs in zip(model.parameters(), *grads):
                summed = gs[0].clone()
                for g in gs[1:]:
                    summed.add_(g)
                p.grad = summed.div_(replicas)
            if clip is not None:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
            opt.step()
            opt.zero_grad()
            losses.append(total)
        return dict({n: p.detach().clone() for n, p in model.named_parameters()}, losses=losses,
                    **({"norms": norms} if clip is not None else {}))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tmp_path_factory.mktemp("grid") / "ckpt"


def spawn_grid(fn, path) -> dict:
    """``fn(rank, world, path)`` on 4 gloo ranks as 2 x 2, the eager reference (``_eager``) computed meanwhile in
    ``["ref"]``; every rank must have returned a dict."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as pool:
        ref = pool.submit(_eager)
        res = _spawn(4, fn, str(path), timeout=400, pg_timeout=30)
        res["ref"] = ref.result()
    for r in range(4):
        assert isinstance(res.get(r), dict), f"rank {r}: {res.get(r)}"
    return res


@pytest.fixture(scope="module")
def grid(ckpt):
    return spawn_grid(_ranks, ckpt)


@pytest.mark.slow
def test_a_grid_checkpoint_loads_into_one_pipeline_and_into_data_parallel_ranks(grid, ckpt):
    saved, optim = {}, {}
    for r in range(4):
        saved.update(grid[r]["fp32"]["params"])
        optim.update(grid[r]["fp32"]["optim"])
    assert grid[0]["fp32"]["files"] == [f"rank-{r}-of-4" for r in range(4)]
    held = {r: os.listdir(ckpt / f"rank-{r}-of-4") for r in range(4)}
    assert any(f.startswith("pack") for f in held[0]) and any(f.startswith("pack") for f in held[1])
    assert not any(f.startswith("pack") for f in held[2] + held[3]), "each stage is written once, by pipeline 0"
    res = _spawn(4, _load_into, str(ckpt), timeout=400, pg_timeout=30)
    for r in range(4):
        assert isinstance(res.get(r), dict), f"rank {r}: {res.get(r)}"
    for name in ("pipeline", "data"):
        seen = set()
        for r in range(4):
            got = res[r][name]
            assert got["step"] == STEPS and got["steps"] == STEPS, (name, r, got["step"])
            for n, t in got["params"].items():
                assert (t == saved[n]).all(), f"{name} rank {r}: {n} differs from the grid's"
                seen.add(n)
            for n, t in got["optim"].items():
                assert (t == optim[n]).all(), f"{name} rank {r}: optimizer state {n} differs from the grid's"
        assert seen == set(saved), name


@pytest.mark.slow
def test_a_two_by_two_grid_trains_bitwise_as_eager_accumulation(grid):
    ref, seen = grid["ref"], {}
    for r in range(4):
        got = grid[r]["fp32"]["params"]
        assert got, f"rank {r} holds no parameters"
        for n, t in got.items():
            assert torch.equal(torch.from_numpy(t), ref[n]), f"rank {r}: {n} differs from eager accumulation"
            seen.setdefault(n, set()).add(r)
    assert set(seen) == set(ref) - {"losses"}, "every parameter is held by some rank"
    assert all(len(rs) == 2 for rs in seen.values()), "each parameter on one rank of each pipeline"
    assert grid[0]["fp32"]["params"].keys() == grid[2]["fp32"]["params"].keys()
    ops = grid[0]["fp32"]["ops"]
    assert "allreduce" in ops and "send" in ops and "share_loss" in ops
    sim = grid[0]["fp32"]["simulated"]
    assert sim["devices"] == 2 and sim["step"] > 0 and sim["reduces"] >= 2, sim     # sm.simulate(): the server
    text = grid[0]["fp32"]["text"]
    assert "grid: 2 x 2" in text and "replica" in text
    losses = [grid[r]["fp32"]["losses"] for r in range(4)]
    assert all(lo == losses[0] for lo in losses), "every rank returns the job's mean loss"
    assert losses[0] == pytest.approx(ref["losses"], rel=1e-5)
    evaluated = [grid[r]["fp32"]["evaluated"] for r in range(4)]     # sm.evaluate: every rank the job's mean
    model, data = _case()
    model.load_state_dict({n: t for n, t in ref.items() if n != "losses"}, strict=False)
    with torch.no_grad():
        eager = model.eval()(*data[0]).float().item()
    assert all(e == evaluated[0] for e in evaluated) and evaluated[0] == pytest.approx(eager, rel=1e-5)


@pytest.mark.slow
def test_four_bit_gradients_keep_every_replica_equal(grid):
    for a, b in ((0, 2), (1, 3)):
        pa, pb = grid[a]["q4"]["params"], grid[b]["q4"]["params"]
        assert pa.keys() == pb.keys()
        for n in pa:
            assert (pa[n] == pb[n]).all(), f"ranks {a} and {b} differ in {n} under 4-bit gradients"
    ref = grid["ref"]
    moved = [n for n, t in grid[0]["q4"]["params"].items() if not torch.equal(torch.from_numpy(t), ref[n])]
    assert moved, "4-bit gradients change the bits (the codec ran)"
    assert grid[0]["q4"]["stats"]["comm_ratio"] > 4


@pytest.mark.slow
def test_a_failed_step_on_one_rank_rolls_back_every_rank_and_the_job_trains_on(grid):
    for r in range(4):
        f = grid[r]["fault"]
        if r == 1:
            assert f["raised"].startswith("IndexError"), f["raised"]
        else:
            assert f["raised"].startswith("StepAbortedError") and "rank 1" in f["raised"], (r, f["raised"])
        assert f["steps"] == 2 and f["differ"] == [], (r, f)


@pytest.mark.slow
def test_what_a_grid_does_not_do_is_refused_by_name_on_every_rank(grid):
    for key, (_, named) in REFUSED.items():
        for r in range(4):
            said = grid[r]["refused"][key]
            assert named in said, (key, r, said)
            assert "torchrun" in said or "use " in said, (key, said)      # and what to do instead


def test_plan_node_plans_a_grids_pipeline_and_the_link_between_servers_costs_its_all_reduces():
    from harmony import Hardware
    from harmony.driver.node import plan_node, simulate_programs
    from harmony.models import GPT, GPTConfig
    hw = Hardware.node("4x1080ti")
    with torch.device("meta"):
        model = GPT(GPTConfig(layers=4, width=64, heads=2, vocab=128, seq=32, tie=False))
        ids = torch.zeros(8, 32, dtype=torch.long)
        alone = plan_node(model, (ids, ids), hw, microbatches=4)
        grid = plan_node(model, (ids, ids), hw, microbatches=4, replicas=2, compression="4bit")
    def reduces(p):
        return [n.kwargs for n in p.schedule.nodes if n.op == "call_function" and n.target.__name__ == "allreduce"]
    assert all(reduces(p) and all(kw["world"] == 2 for kw in reduces(p)) for p in grid)
    assert not any(reduces(p) for p in alone)
    slow, fast = (simulate_programs(grid, hw.replace(network_bandwidth=b)).step_seconds for b in (1e5, 1e12))
    assert slow > fast >= simulate_programs(alone, hw).step_seconds
    with pytest.raises(ConfigError, match="multiple|no replica|at least"):
        plan_node(model, (ids, ids), hw, microbatches=4, replicas=0)


def test_grids_that_cannot_be_formed_say_what_to_launch():
    assert grid_of(4, 2, 3) == Grid(2, 2, 3) and Grid(2, 2, 3).replica_ranks() == [1, 3]
    assert Grid(2, 2, 3).pipeline_ranks() == [2, 3]
    for world, size, named in [(6, 4, "multiple"), (4, 1, "at least 2"), (2, 2, "no replica")]:
        with pytest.raises(ConfigError, match=named) as e:
            grid_of(world, size)
        assert "torchrun" in str(e.value) or "parallel=" in str(e.value)


@pytest.mark.parametrize("kw,named", [
    (dict(parallel=("pipeline", "tensor")), "the one combination"),
    (dict(parallel=("pipeline", "data"), data_parallel=False), "data_parallel=False"),
    (dict(pipeline_size=2), "pipeline_size"),
    (dict(parallel=("pipeline", "data"), pipeline_size=0), "pipeline_size")])
def test_bad_grid_options_are_config_errors(kw, named):
    model, data = _case()
    with pytest.raises(ConfigError, match=named):
        harmony.compile(model, data[0], **kw)


def test_pipeline_with_data_parallel_true_is_the_grid():
    from harmony.compiler.config import Config
    assert Config(parallel="pipeline", data_parallel=True).parallel == ("pipeline", "data")
    assert Config(parallel=["data", "pipeline"]).parallel == ("pipeline", "data")


def test_one_process_is_refused_with_how_to_launch():
    model, data = _case()
    with pytest.raises(ConfigError, match="torchrun --nnodes"):
        harmony.compile(model, data[0], parallel=("pipeline", "data"), pipeline_size=2)


def test_shard_gives_each_pipeline_its_rows():
    x = torch.arange(8)
    assert [harmony.data.shard(x, r, 4, pipeline_size=2).tolist() for r in range(4)] == \
        [[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7], [4, 5, 6, 7]]
    with pytest.raises(ConfigError, match="pipeline_size"):
        harmony.data.shard(x, 0, 4, pipeline_size=3)
