"""parallel="pipeline" (issue 31): packs placed across 2 and 3 gloo ranks, bitwise against eager gradient
accumulation; each rank within its budget and holding its packs' state only; checkpoints per rank; a dead rank.

Each multi-process fixture spawns its ranks once (``_spawn`` from test_collectives) and runs every check of that
world size in them; the eager references are computed in the parent meanwhile. Tensors come back as numpy arrays
(a rank exits at once after reporting: shared-memory tensors would not outlive it).
"""
from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
import torch

import harmony
from harmony.errors import CheckpointError, CommunicationError, ConfigError, InputError
from harmony.passes import stage
from harmony.passes.stage_schedule import global_order
from models import CASES, eager_accumulate, training_state_bytes, withheld
from test_collectives import _spawn

MICROBATCHES = 4
RUNS = {"gpt": ("gpt", 0.5, "contiguous"), "gpt_tight": ("gpt", 0.3, "round_robin"),
        "hf": ("hf-gpt2", 0.5, "contiguous"),
        # clipped by the global norm over every rank's packs (the bound below the norm: every step clips)
        "gpt_clip": ("gpt", 0.5, "round_robin", dict(clip_grad_norm=0.05)),
        # bf16 compute, fp32 masters on the host: bitwise one process's Harmony in bf16 (the reference below)
        "gpt_bf16": ("gpt", 0.5, "contiguous", dict(precision="bf16")),
        # each rank's packs' weights and optimizer state in files between steps
        "gpt_disk": ("gpt", 0.5, "contiguous", dict(weights_on="disk")),
        # stages balanced over the layers; one microbatch at a time through a rank's packs, handed on after each
        "gpt_group1": ("gpt", 0.2, "layers", dict(pipeline_group=1)),
        # round robin one microbatch at a time: the interleaved pipeline (a rank's next pack runs microbatch 0 while
        # its first pack runs the next ones)
        "gpt_rr_group1": ("gpt", 0.3, "round_robin", dict(pipeline_group=1)),
        # the group size the node's simulation predicts fastest, the same on every rank (the stage pass checks)
        "gpt_auto": ("gpt", 0.2, "layers", dict(pipeline_group="auto"))}


def _data(case):
    return CASES[case](batch=8) if case == "gpt" else CASES[case]()


def _call(sm, batch):
    return sm(**batch) if isinstance(batch, dict) else sm(*batch)


def _train(case, frac, placement, extra=None, steps=3, keep=False):
    """Compile on this rank (the whole batch) and train ``steps`` batches: this rank's parameters, its stats."""
    model, data = _data(case)
    budget = int(training_state_bytes(model) * frac)
    sm = harmony.compile(model, data[0], memory_budget=budget, microbatches=MICROBATCHES, parallel="pipeline",
                         placement=placement, comm_timeout=20, **(extra or {}))
    losses, stats = [], []
    for i in range(steps):
        losses.append(_call(sm, data[i % len(data)]).item())
        stats.append(dict(sm.stats))
    mine = sm.training_state_dict()["model"]
    unread = withheld(model)       # the other ranks' packs' parameters: reading one raises OffloadError
    out = dict(params={n: t.detach().numpy().copy() for n, t in mine.items()}, losses=losses, stats=stats,
               packs=list(sm.plan.stage.local), rank_of=list(sm.plan.stage.rank_of), text=sm.report(),
               held=sum(1 for _ in model.parameters()) - len(unread), n_params=sum(1 for _ in model.parameters()),
               ops=[n.target.__name__ for n in sm.graph.nodes if n.op == "call_function"])
    if keep:
        out["sm"] = (sm, data)
    else:
        sm.close()
    return out


def _resume(rank, path, world):
    """Save after one step, train two more, load, train the same two: the same parameters."""
    out = _train("gpt", 0.5, "contiguous", steps=1, keep=True)
    sm, data = out.pop("sm")
    harmony.save(sm, path)
    rows = 6 if rank == 0 else 8
    short = {k: t[:rows] for k, t in data[1].items()} if isinstance(data[1], dict) else \
        tuple(t[:rows] for t in data[1])
    try:                # ranks passing batches of different shapes: refused on every rank before anything is sent
        _call(sm, short)
        other_shape = "no error"
    except InputError as e:
        other_shape = str(e)
    after = []
    for _ in range(2):
        for b in data[1:3]:
            _call(sm, b)
        after.append({n: t.detach().clone() for n, t in sm.training_state_dict()["model"].items()})
        harmony.load(sm, path)
    sm.close()
    return dict(same=all(torch.equal(after[0][n], after[1][n]) for n in after[0]), files=sorted(os.listdir(path)),
                other_shape=other_shape)


def _ranks(rank, world, path):
    out = {key: _train(*args) for key, args in RUNS.items()}
    if world == 2:
        out["resume"] = _resume(rank, path, world)
        return out
    out["dead"] = _dead(rank, world, path)    # the last rank dies there
    return out


def _dead(rank, world, path):
    """Load a checkpoint of 2 ranks into 3 (resharded), then the last rank dies between steps: the others fail."""
    out = _train("gpt", 0.5, "contiguous", steps=1, keep=True)
    sm, data = out.pop("sm")
    try:
        harmony.load(sm, path)
        wrong_world = "no error"
    except CheckpointError as e:
        wrong_world = str(e)
    if rank == world - 1:
        os._exit(1)                        # dies without a word
    start = time.monotonic()
    try:
        _call(sm, data[1])
        _call(sm, data[2])
        return dict(wrong_world=wrong_world, error=("no error", time.monotonic() - start, ""))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        return dict(wrong_world=wrong_world, error=(type(e).__name__, time.monotonic() - start, str(e)))


def _references():
    """Eager gradient accumulation, on one thread as the ranks run (another thread count sums matmuls in another
    order: not the same bits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _eager()
    finally:
        torch.set_num_threads(threads)


def _eager():
    out = {}
    for key, (case, frac, _, *extra) in RUNS.items():
        model, data = _data(case)
        extra = extra[0] if extra else {}
        clip = extra.get("clip_grad_norm")
        nbytes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
        if "precision" in extra:      # one process's Harmony at that precision, the same microbatches and budget
            sm = harmony.compile(model, data[0], memory_budget=int(training_state_bytes(model) * frac),
                                 microbatches=MICROBATCHES, precision=extra["precision"])
            losses = [_call(sm, data[i % len(data)]).item() for i in range(3)]
            params = {n: t.detach().clone() for n, t in sm.training_state_dict()["model"].items()}
            sm.close()
            out[key] = dict(params=params, losses=losses, bytes=nbytes, norms=[], clip=None)
            continue
        ref, losses = eager_accumulate(model, data, MICROBATCHES, clip=clip)
        out[key] = dict(params={n: p.detach().clone() for n, p in ref.named_parameters()}, losses=losses,
                        bytes=nbytes, norms=ref.norms, clip=clip)
    return out


def _run(world, path, **spawn):
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as pool:
        refs = pool.submit(_references)
        res = _spawn(world, _ranks, str(path), **spawn)
        res["ref"] = refs.result()
    return res


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tmp_path_factory.mktemp("pipeline") / "ckpt"


@pytest.fixture(scope="module")
def two(ckpt):
    res = _run(2, ckpt, timeout=400)
    for r in (0, 1):
        assert isinstance(res.get(r), dict), f"rank {r}: {res.get(r)}"
    return res


@pytest.fixture(scope="module")
def three(ckpt, two):      # after ``two``: it loads the checkpoint two ranks saved
    res = _run(3, ckpt, timeout=400, pg_timeout=20, wait_for=[0, 1])
    for r in (0, 1):
        assert isinstance(res.get(r), dict), f"rank {r}: {res.get(r)}"
    return res


def _check_training(res, ranks):
    for key in RUNS:
        ref = res["ref"][key]
        got = {}
        for r in ranks:
            run = res[r][key]
            assert run["losses"] == res[ranks[0]][key]["losses"], f"{key}: rank {r}'s loss differs"
            assert set(got).isdisjoint(run["params"]), f"{key}: a parameter on two ranks"
            got.update(run["params"])
            on_disk = RUNS[key][3:] and RUNS[key][3].get("weights_on") == "disk"
            for s in run["stats"]:               # within its budget; the state it holds is its packs' only
                assert s["measured_peak"] <= s["budget"], (key, r, s["measured_peak"], s["budget"])
                if on_disk:      # read from its files every step, not held between steps (but AdamW's step counts)
                    assert s["disk_read_bytes"] > 0 and s["state_optim_bytes"] == 4 * len(run["params"]), (key, r)
                    continue
                weights = sum(ref["bytes"][n] for n in run["params"] if n in ref["bytes"])
                assert s["state_weight_bytes"] == weights, (key, r)
                assert s["state_optim_bytes"] == 2 * weights + 4 * len(run["params"]), (key, r)   # AdamW + step
            assert {"send", "recv", "share_loss"} <= set(run["ops"]) and "stage: packs across" in run["text"]
            if ref["clip"] is not None:     # every rank knows the global norm, clip_grad_norm_'s to the bit
                assert [s["grad_norm"] for s in run["stats"]] == ref["norms"], (key, r)
                assert min(ref["norms"]) > ref["clip"] and "share_norms" in run["ops"]
        assert got.keys() == ref["params"].keys()
        held = [res[r][key]["held"] for r in ranks]     # each parameter readable on the rank that holds it only
        on_disk = RUNS[key][3:] and RUNS[key][3].get("weights_on") == "disk"     # ... and none between steps
        whole = res[ranks[0]][key]["n_params"]
        assert held == [0] * len(ranks) if on_disk else (0 not in held and sum(held) == whole), (key, held)
        for n, t in ref["params"].items():
            assert torch.equal(torch.from_numpy(got[n]), t), f"{key}: {n} differs from eager gradient accumulation"
        assert abs(res[ranks[0]][key]["losses"][0] - ref["losses"][0]) < 1e-5
        assert sorted(set(res[ranks[0]][key]["rank_of"])) == list(ranks)     # every rank holds packs


@pytest.mark.slow
def test_two_ranks_train_bitwise_as_eager_within_their_budgets(two):
    _check_training(two, [0, 1])
    assert "round_robin" in two[0]["gpt_tight"]["text"]


def test_a_rank_hands_each_group_of_microbatches_on_once_its_packs_ran_it(two):
    """pipeline_group=1: rank 0 sends microbatch 0 after one forward of each of its packs (by default, after its
    first packs ran every microbatch: test_grouped_order...), the same bits (_check_training)."""
    run = two[0]["gpt_group1"]
    ops = run["ops"]
    first = ops[:ops.index("send")].count("forward")
    assert len(run["packs"]) > 1 and first == len(run["packs"]), (first, run["packs"])
    assert "in groups of 1" in run["text"] and f"in groups of {MICROBATCHES}" in two[0]["gpt"]["text"]
    rr = two[0]["gpt_rr_group1"]      # round robin: rank 0 waits for its second pack's input after two forwards
    assert len(rr["packs"]) > 1 and rr["ops"][:rr["ops"].index("recv")].count("forward") == 2, rr["ops"][:12]
    auto = [two[r]["gpt_auto"]["text"] for r in (0, 1)]
    assert all("chosen by pipeline_group='auto'" in t and "4: " in t and "1: " in t for t in auto)


@pytest.mark.slow
def test_two_ranks_resume_from_their_checkpoints(two):
    for r in (0, 1):
        assert two[r]["resume"]["same"]
        assert two[r]["resume"]["files"] == ["rank-0-of-2", "rank-1-of-2"]
        assert "the ranks of a pipeline passed batches of different shapes" in two[r]["resume"]["other_shape"]


@pytest.mark.slow
def test_three_ranks_train_bitwise_and_a_dead_rank_fails_the_others(three):
    for key in RUNS:        # rank 2 died before reporting: its packs are checked against eager by ranks 0 and 1
        ref = three["ref"][key]
        for r in (0, 1):
            run = three[r][key]
            assert run["losses"] == three[0][key]["losses"] and abs(run["losses"][0] - ref["losses"][0]) < 1e-5
            for n, t in run["params"].items():
                assert torch.equal(torch.from_numpy(t), ref["params"][n]), f"{key}: {n}"
            assert all(s["measured_peak"] <= s["budget"] for s in run["stats"])
        assert sorted(set(three[0][key]["rank_of"])) == [0, 1, 2]
    for r in (0, 1):
        assert three[r]["dead"]["wrong_world"] == "no error", three[r]["dead"]   # resharded: tests/test_reshard.py
        kind, seconds, msg = three[r]["dead"]["error"]
        assert kind == CommunicationError.__name__, three[r]["dead"]
        assert "rank" in msg


# -- in one process ------------------------------------------------------------------------------
def test_one_process_is_refused():
    model, data = CASES["gpt"](batch=8)
    with pytest.raises(ConfigError, match="nproc_per_node"):
        harmony.compile(model, data[0], microbatches=2, parallel="pipeline")
    with pytest.raises(ConfigError, match="parallel"):
        harmony.Config(parallel="pipe")
    with pytest.raises(ConfigError, match="placement"):
        harmony.Config(placement="zigzag")
    assert harmony.Config(placement="layers").placement == "layers"
    for group, parallel in ((0, "pipeline"), (True, "pipeline"), (2.0, "pipeline"), (2, None)):
        with pytest.raises(ConfigError, match=f"pipeline_group={group!r}"):
            harmony.Config(pipeline_group=group, parallel=parallel)


@pytest.mark.parametrize("field,value,named", [
    ("shard_state", True, "shard_state=True"), ("data_parallel", True, "data_parallel=True"),
    ("balance", "auto", "balance="),
    ("policy", "ondemand", "ondemand"), ("compression", SimpleNamespace(kind="4bit"), "compression="),
    ("policy", "sequential", "policy='sequential' and pipeline_group=")])
def test_unsupported_combinations_are_refused_by_name(field, value, named):
    cfg = dict(world_size=2, precision="fp32", compression=None, adaptive=False, balance=None, shard_state=False,
               data_parallel=False, weights_on="auto", clip_grad_norm=None, policy="harmony", pipeline_group=None)
    cfg[field] = value
    if value == "sequential":
        cfg["pipeline_group"] = 1
    with pytest.raises(ConfigError, match="not supported yet") as e:
        stage.check_config(SimpleNamespace(**cfg))
    assert named in str(e.value)


def test_contiguous_placement_is_the_exact_min_max():
    assert stage.contiguous([1, 1, 1, 1], 2) == [0, 0, 1, 1]
    assert stage.contiguous([4, 1, 1, 1, 1], 2) == [0, 1, 1, 1, 1]
    assert stage.contiguous([1, 2, 3], 3) == [0, 1, 2]
    costs = [3, 1, 4, 1, 5, 9, 2, 6]
    rank_of = stage.contiguous(costs, 3)
    worst = max(sum(c for c, r in zip(costs, rank_of) if r == k) for k in range(3))
    assert worst == 14 and rank_of == sorted(rank_of)      # 3 1 4 1 | 5 9 | 2 6 -> 9, 14, 8 (no split does better)
    assert stage.place(costs, 3, "round_robin") == [0, 1, 2, 0, 1, 2, 0, 1]


def test_grouped_order_runs_each_group_through_the_packs_and_steps_after_the_last():
    order = global_order(3, 4, "harmony", 2)
    assert order[:6] == [("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("F", 1, 1), ("FB", 2, 0), ("FB", 2, 1)]
    assert order[12:17] == [("S", 2), ("B", 1, 0), ("B", 1, 1), ("B", 0, 0), ("B", 0, 1)]
    assert order[-4:] == [("S", 1), ("B", 0, 2), ("B", 0, 3), ("S", 0)]
    for p in range(2):      # every pack accumulates microbatches 0..3 in order, as one device does
        assert [e[2] for e in order if e[:2] == ("B", p)] == [0, 1, 2, 3]
    assert global_order(3, 4, "harmony") == global_order(3, 4, "harmony", 4) == global_order(3, 4, "harmony", 9)


def _check_valid_order(order, n, m):
    """A single-device order: every op once, each pack's microbatches in order, each after what it reads."""
    at = {e: i for i, e in enumerate(order)}
    assert len(at) == len(order) == 2 * n * m - m + n
    for p in range(n):
        f = "FB" if p == n - 1 else "F"
        assert [e[2] for e in order if e[:2] == (f, p)] == list(range(m))
        assert p == n - 1 or [e[2] for e in order if e[:2] == ("B", p)] == list(range(m))
        for mb in range(m):
            assert p == 0 or at[(f, p, mb)] > at[("F", p - 1, mb)]
            if p < n - 1:
                assert at[("B", p, mb)] > at[("FB" if p == n - 2 else "B", p + 1, mb)]
        assert at[("S", p)] == at[("FB" if p == n - 1 else "B", p, m - 1)] + 1


def test_the_order_is_a_wavefront_that_interleaves_round_robin_packs():
    for n, m in ((2, 1), (3, 4), (5, 5), (6, 8)):
        for group in range(1, m + 1):
            plain = global_order(n, m, "harmony", group)
            _check_valid_order(plain, n, m)
            contiguous = sorted(p * 3 // n for p in range(n))    # each rank's packs together: each runs as before
            node = global_order(n, m, "harmony", group, contiguous)
            for k in set(contiguous):
                assert [e for e in node if contiguous[e[1]] == k] == [e for e in plain if contiguous[e[1]] == k]
            rr = global_order(n, m, "harmony", group, [p % 3 for p in range(n)])
            _check_valid_order(rr, n, m)
            if group == m:           # one group: pack-major, as Harmony's grouping
                assert rr == plain
    mine = [e for e in global_order(4, 4, "harmony", 1, [0, 1, 0, 1]) if e[0] == "F" and e[1] in (0, 2)]
    assert mine == [("F", 0, 0), ("F", 0, 1), ("F", 2, 0), ("F", 0, 2), ("F", 2, 1), ("F", 0, 3), ("F", 2, 2),
                    ("F", 2, 3)]      # rank 0: its second pack on microbatch 0 as soon as rank 1 has sent it


def test_each_rank_runs_the_single_device_order_of_its_packs():
    order = global_order(3, 2, "harmony")
    assert order[:4] == [("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("F", 1, 1)]
    assert order[4:7] == [("FB", 2, 0), ("FB", 2, 1), ("S", 2)]
    assert order[-3:] == [("B", 0, 0), ("B", 0, 1), ("S", 0)]
    seq = global_order(2, 2, "sequential")
    assert seq == [("F", 0, 0), ("FB", 1, 0), ("B", 0, 0), ("F", 0, 1), ("FB", 1, 1), ("B", 0, 1), ("S", 1), ("S", 0)]
