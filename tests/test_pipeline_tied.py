"""A weight tied across pipeline stages (issue 64): the built-in GPT with its embedding tied to the output head, the
embedding on rank 0 and the head on the last rank, over 2 and 3 gloo ranks. Each of those ranks keeps a copy and its
own AdamW state; their gradients are summed over exactly those ranks before they step (passes/tied.py).

Eager adds the head's and the embedding's contributions microbatch by microbatch in autograd's order, a pipeline each
rank's accumulated part and then the sum: allclose to one process's eager gradient accumulation (not bitwise), and
the tied copies bitwise equal to each other.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import harmony
from models import CASES, eager_accumulate, training_state_bytes
from test_collectives import spawn_ok

MICROBATCHES = 4
RTOL, ATOL = 1e-6, 1e-6
# "adamw": the packs' state swapped under the budget and stepped on the host (the sum on the host copies, on the host
# thread ahead of the host step); "fits": everything resident (the sum on the host thread, joined before the step)
RUNS = {"adamw": dict(), "fits": dict(frac=3.0), "clip": dict(clip_grad_norm=0.05), "rr": dict(placement="round_robin")}


def _data():
    return CASES["gpt"](batch=8, tie=True)


def _train(frac=0.5, steps=3, keep=False, **extra):
    model, data = _data()
    extra = dict(dict(placement="contiguous"), **extra)
    sm = harmony.compile(model, data[0], memory_budget=int(training_state_bytes(model) * frac),
                         microbatches=MICROBATCHES, parallel="pipeline", comm_timeout=30, **extra)
    losses = [sm(*data[i % len(data)]).item() for i in range(steps)]
    mine = sm.training_state_dict()["model"]
    out = dict(params={n: t.detach().numpy().copy() for n, t in mine.items()}, losses=losses,
               tied=dict(sm.plan.stage.tied), rank_of=list(sm.plan.stage.rank_of), text=sm.report(),
               stats=dict(sm.stats), ops=[n.target.__name__ for n in sm.graph.nodes if n.op == "call_function"])
    if keep:
        out["sm"] = (sm, data)
    else:
        sm.close()
    return out


def _resume(path):
    """Save after one step; train two more, load, train the same two: the same parameters (the tied copy that was not
    written loads from the rank that wrote it, its optimizer state too)."""
    out = _train(steps=1, keep=True)
    sm, data = out.pop("sm")
    harmony.save(sm, path)
    saved = {n: t.detach().numpy().copy() for n, t in sm.training_state_dict()["model"].items()}
    after = []
    for _ in range(2):
        for b in data[1:3]:
            sm(*b)
        after.append({n: t.detach().clone() for n, t in sm.training_state_dict()["model"].items()})
        harmony.load(sm, path)
    sm.close()
    written = {d: sorted(json.loads((Path(path) / d / "manifest.json").read_text())["files"][0]["model"])
               for d in sorted(os.listdir(path))}
    return dict(same=all(torch.equal(after[0][n], after[1][n]) for n in after[0]), saved=saved, written=written,
                tied=after[1]["tok.weight"].numpy())


def _faults(rank, world):
    """A bad batch on one stage (the last rank's targets with the state swapped, the sum synchronous; rank 0's ids
    with it resident, the sum on the host thread): every rank raises, and the step is undone on every rank, bit for
    bit as a run that skipped it (test_jobwide.py's ``_run``, on the tied model)."""
    import test_jobwide
    test_jobwide._gpt = lambda batch=8: CASES["gpt"](batch=batch, tie=True)
    out = {}
    for name, fail_rank, bad, frac in (("last", world - 1, "y", 0.5), ("first", 0, "x", 3.0)):
        try:
            out[name] = test_jobwide._run(rank, world, fail_rank, 1, shard=False, bad=bad, frac=frac,
                                          parallel="pipeline")
        except Exception as e:         # noqa: BLE001
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _ranks(rank, world, path):
    if world == 3:
        return {"adamw": _train()}
    out = {key: _train(**extra) for key, extra in RUNS.items()}
    return dict(out, resume=_resume(path), faults=_faults(rank, world))


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    path = tmp_path_factory.mktemp("tied") / "ck"
    return dict(spawn_ok(2, _ranks, str(path), timeout=600), path=path)


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    return spawn_ok(3, _ranks, str(tmp_path_factory.mktemp("tied3")), timeout=600)


def _compare(got: dict, want: dict) -> None:
    """Each parameter within ``ATOL`` of eager's and the whole model within ``RTOL`` (relative, in norm)."""
    num = den = 0.0
    for n, a in got.items():
        b = want[n].detach().numpy()
        if n.endswith("qkv.bias"):   # the key's bias has no gradient in exact arithmetic (softmax ignores a shift):
            w = b.shape[0] // 3      # its gradient is rounding noise, which AdamW scales to lr-sized steps
            assert np.abs(a[w:2 * w] - b[w:2 * w]).max() < 1e-2, n
            a, b = np.r_[a[:w], a[2 * w:]], np.r_[b[:w], b[2 * w:]]
        assert np.abs(a - b).max() <= ATOL, (n, np.abs(a - b).max())
        num, den = num + float(((a - b) ** 2).sum()), den + float((b ** 2).sum())
    assert (num / den) ** 0.5 <= RTOL, (num / den) ** 0.5


def _check(res, world, key, clip=None):
    model, data = _data()
    ref, losses = eager_accumulate(model, data, MICROBATCHES, clip=clip)
    want = dict(ref.named_parameters())
    last = world - 1
    for r in range(world):
        got = res[r][key]
        assert got["tied"] == {"tok.weight": (0, last)}, got["tied"]
        assert np.allclose(got["losses"], losses, rtol=RTOL, atol=0), (got["losses"], losses)
        _compare(got["params"], want)
    a, b = res[0][key]["params"]["tok.weight"], res[last][key]["params"]["tok.weight"]
    assert np.array_equal(a, b)           # the copies take the same updates, bit for bit
    for r in range(1, last):
        assert "tok.weight" not in res[r][key]["params"] and "allreduce_tied" not in res[r][key]["ops"]
    assert res[0][key]["ops"].count("allreduce_tied") == res[last][key]["ops"].count("allreduce_tied") == 1
    assert res[last][key]["stats"]["tied_wire_bytes"] > 0
    text = " ".join(res[0][key]["text"].split())
    assert f"tok.weight tied across ranks 0 and {last}" in text, text


def test_two_ranks_tied_embedding_and_head_train_as_eager(two):
    _check(two, 2, "adamw")
    for r in (0, 1):     # summed where the gradient is: not brought back to the device for it
        assert "on the host copies" in " ".join(two[r]["adamw"]["text"].split()), r


def test_two_ranks_sum_overlaps_where_the_state_fits(two):
    _check(two, 2, "fits")
    assert "host thread from the last backward" in two[0]["fits"]["text"]


def test_two_ranks_round_robin_tied_weight(two):
    _check(two, 2, "rr")


def test_two_ranks_clip_counts_the_tied_gradient_once(two):
    _check(two, 2, "clip", clip=0.05)


def test_three_ranks_embedding_first_head_last(three):
    _check(three, 3, "adamw")


def test_two_ranks_checkpoint_writes_the_tied_weight_once_and_loads_back(two):
    written = two[0]["resume"]["written"]
    assert sorted(written) == ["rank-0-of-2", "rank-1-of-2"]
    assert "tok.weight" in written["rank-0-of-2"] and "tok.weight" not in written["rank-1-of-2"]
    for r in (0, 1):
        assert two[r]["resume"]["same"]
    assert np.array_equal(two[0]["resume"]["tied"], two[1]["resume"]["tied"])
    # into one process: every weight as the ranks held it when saved, the tied one once
    model, data = _data()
    sm = harmony.compile(model, data[0], memory_budget=int(training_state_bytes(model) * 0.5),
                         microbatches=MICROBATCHES)
    harmony.load(sm, two["path"])
    got = sm.training_state_dict()["model"]
    saved = dict(two[1]["resume"]["saved"], **two[0]["resume"]["saved"])
    assert sorted(got) == sorted(saved)
    for n, t in got.items():
        assert np.array_equal(t.numpy(), saved[n]), n
    assert np.array_equal(two[0]["resume"]["saved"]["tok.weight"], two[1]["resume"]["saved"]["tok.weight"])
    sm(*data[1])          # and it trains on
    sm.close()


def test_two_ranks_a_failed_step_on_one_stage_is_undone_on_both(two):
    from test_jobwide import _check as check_outcome
    for name, fail_rank in (("last", 1), ("first", 0)):
        check_outcome({r: two[r]["faults"][name] for r in (0, 1)}, 2, fail_rank)


# -- half precision: the gradients reach the host in the compute dtype, are summed as fp32 there ----------------
HALF = {"bf16": dict(precision="bf16"), "fp16": dict(precision="fp16", loss_scaling=dict(init_scale=2.0 ** 10))}


def _half(**kw) -> dict:
    model, data = _data()
    sm = harmony.compile(model, data[0], memory_budget=int(training_state_bytes(model) * 0.5),
                         microbatches=MICROBATCHES, **kw)
    losses = [sm(*data[i % len(data)]).item() for i in range(4)]
    out = dict(losses=losses, params={n: t.detach().float().numpy().copy()
                                      for n, t in sm.training_state_dict()["model"].items()},
               tied=[dict(n.kwargs) for n in sm.graph.nodes if n.op == "call_function"
                     and n.target.__name__ == "allreduce_tied"])
    sm.close()
    return out


def _half_ranks(rank, world):
    return {key: _half(parallel="pipeline", comm_timeout=30, **kw) for key, kw in HALF.items()}


@pytest.mark.slow
def test_two_ranks_half_precision_tied_copies_stay_equal_and_track_one_process():
    """bf16 and fp16 (loss scaling): the masters step on the host, so the sum runs on the host copies (the compute
    dtype's gradients made fp32 first); the copies bitwise equal, the losses one process's (on one thread, weighing
    the loss by rows as a pipeline does), the weights close to its (the tied contributions add in another order)."""
    got = spawn_ok(2, _half_ranks, timeout=400)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = {key: _half(loss_weighting="rows", **kw) for key, kw in HALF.items()}
    finally:
        torch.set_num_threads(threads)
    for key in HALF:
        a, b = got[0][key], got[1][key]
        assert a["tied"] and all(kw.get("where") == "host" for kw in a["tied"] + b["tied"]), key
        assert np.array_equal(a["params"]["tok.weight"], b["params"]["tok.weight"]), key
        assert a["losses"] == b["losses"] and np.allclose(a["losses"], ref[key]["losses"], rtol=1e-3), key
        merged, want = {**b["params"], **a["params"]}, ref[key]["params"]
        num = sum(float(((merged[n] - want[n]) ** 2).sum()) for n in want)
        assert (num / sum(float((w ** 2).sum()) for w in want.values())) ** 0.5 < 1e-2, key
