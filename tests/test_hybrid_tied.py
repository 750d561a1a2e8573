"""A weight tied across the stages of a grid (``parallel=("pipeline", "data")``, issue 64): the built-in GPT with its
embedding tied to the output head, 4 gloo ranks as 2 pipelines of 2, the embedding on each pipeline's first rank and
the head on its last. Each stage's replica all-reduce averages its copy's gradient over the replicas, then the tied
sum adds the two stages' averages (passes/tied.py), in that order on every rank whether the packs' state is resident,
swapped, or stepped on the host.

The reference is one process's eager gradient accumulation over the global batch that keeps the embedding's and the
head's contributions apart until the end, as the stages do: an untied copy of the model runs each pipeline's rows
(its microbatches accumulated), each contribution is averaged over the pipelines, and the tied weight's gradient is
their sum. fp32 and SGD: bitwise. Under 4-bit gradients: every rank's copy of every parameter equal. A bad batch on
either stage rolls the step back on every rank. ``shard_state="full"``: tests/test_hybrid_zero3_tied.py.
"""
from __future__ import annotations

import copy
import re

import pytest
import torch

import harmony
import harmony.data
from harmony.runtime.optim import optimizer_kwargs
from models import CASES, call, split, training_state_bytes
from test_collectives import _spawn

SGD = dict(optimizer=torch.optim.SGD, optimizer_kwargs=dict(lr=0.1, momentum=0.9))
GRID = dict(parallel=("pipeline", "data"), pipeline_size=2, comm_timeout=60)
MICROBATCHES = 2
STEPS = 3
TIED, HEAD = "tok.weight", "head.weight"
_PIECE = re.compile(r"share:(.+)\[(\d+):(\d+)\]")
# budget as a share of the model's training state per rank: 2.0 every stage's state resident (the sum on the host
# thread, joined before the step); 0.3 every pack swapped and stepped on the host (the sum on the host copies); 0.5
# the first stage resident and the last one's packs on the host, or (optimizer_on="device") swapped and stepped on the
# device (the sum synchronous, before the step): each stage of a pipeline in its own way, one order on all
RUNS = {"fits": dict(frac=2.0), "host": dict(frac=0.3), "mixed": dict(frac=0.5),
        "device": dict(frac=0.5, optimizer_on="device"), "zero1": dict(frac=0.5, shard_state=True),
        "fits_q4": dict(frac=2.0, compression="4bit"), "host_q4": dict(frac=0.3, compression="4bit"),
        "clip": dict(frac=0.5, clip_grad_norm=0.05),      # below the gradient's norm at every step: every step clips
        "bf16": dict(frac=0.3, precision="bf16"),
        "fp16": dict(frac=0.3, precision="fp16", loss_scaling=dict(init_scale=2.0 ** 10))}
# a bad batch on one stage: the last stage's targets with every pack on the host (its sum on the host copies), the
# first stage's ids with it resident and the last stage's packs on the host
FAULTS = {"fault_last": dict(fail_rank=1, frac=0.3), "fault_first": dict(fail_rank=0, frac=0.5)}
MODES = {"fits": ("async", "async"), "host": ("host", "host"), "mixed": ("async", "host"),
         "device": ("async", "sync"), "zero1": ("async", "host")}     # each stage's tied sum: how it runs


def _case():
    return CASES["gpt"](batch=8, tie=True)     # 3 blocks, width 64: the global batch of 8 rows, 4 a pipeline


def _compile(model, data, frac, **kw):
    return harmony.compile(model, harmony.data.shard(data[0], pipeline_size=2), microbatches=MICROBATCHES,
                           memory_budget=int(training_state_bytes(model) * frac), **{**SGD, **GRID, **kw})


def _train(frac, steps=STEPS, **kw):
    model, data = _case()
    sm = _compile(model, data, frac, **kw)
    losses = [sm(*harmony.data.shard(data[i % len(data)], pipeline_size=2)).item() for i in range(steps)]
    out = dict(params={n: t.detach().numpy().copy() for n, t in sm.training_state_dict()["model"].items()},
               losses=losses, text=sm.report(), stats=dict(sm.stats),
               ops=[(n.target.__name__, tuple(a if isinstance(a, (int, str)) else None for a in n.args), dict(n.kwargs))
                    for n in sm.graph.nodes if n.op == "call_function"],
               host=[p for p, r in sorted(sm.plan.residency.items()) if r.step_on == "host"])
    sm.close()
    return out


def _fault(rank, fail_rank, frac, **kw) -> dict:
    """A bad batch on ``fail_rank`` at step 1 (the first stage's token ids, or the last stage's targets, out of
    range: an IndexError): every rank raises, and ends bitwise as a run that skipped that step; the job trains on."""
    model, data = _case()
    ref_model = copy.deepcopy(model)
    sm, raised = _compile(model, data, frac, **kw), None
    for i in range(STEPS):
        x, y = harmony.data.shard(data[i % len(data)], pipeline_size=2)
        if i == 1 and rank == fail_rank:
            x, y = x.clone(), y.clone()
            (x if fail_rank % 2 == 0 else y)[-1, -1] = 10_000
        try:
            sm(x, y)
        except Exception as e:       # noqa: BLE001
            if i != 1:
                raise
            raised = f"{type(e).__name__}: {e}"
    got, steps = sm.training_state_dict()["model"], sm.steps
    sm.close()
    ref = _compile(ref_model, data, frac, **kw)
    for i in (0, 2):
        ref(*harmony.data.shard(data[i % len(data)], pipeline_size=2))
    want = ref.training_state_dict()["model"]
    ref.close()
    return dict(raised=raised, steps=steps, differ=[n for n in want if not torch.equal(got[n], want[n])])


def _ranks(rank, world, runs, faults, more, args):
    out = {key: _train(**kw) for key, kw in runs.items()}
    out.update({key: _fault(rank, **kw) for key, kw in faults.items()})
    if more is not None:
        out.update(more(rank, world, *args))
    return out


def _untied(model):
    """A copy of ``model`` whose head has a weight of its own (the tied weight's value)."""
    untied = copy.deepcopy(model)
    untied.head.weight = torch.nn.Parameter(model.tok.weight.detach().clone())
    return untied


def _eager(replicas=2, clip=None):
    """One process, SGD: each step, each pipeline's rows run through an untied copy of the model (its microbatches
    accumulated, loss / microbatches); each parameter's gradient averaged over the pipelines as the replica
    all-reduce does (summed in replica order, divided by their number); the tied weight's the sum of the averaged
    embedding's and head's (two ranks: the order of the sum leaves its bits alone); one update of the tied model."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)       # the ranks' threads: another count sums in another order
    try:
        model, data = _case()
        model = copy.deepcopy(model)
        opt = SGD["optimizer"](model.parameters(), **optimizer_kwargs(SGD["optimizer"], SGD["optimizer_kwargs"]))
        losses = []
        for i in range(STEPS):
            grads, total = [], 0.0
            for r in range(replicas):
                untied = _untied(model)
                for mb in split(harmony.data.shard(data[i % len(data)], r, replicas), MICROBATCHES):
                    loss = call(untied, mb)
                    (loss / MICROBATCHES).backward()
                    total += loss.item() / (MICROBATCHES * replicas)
                grads.append({n: p.grad for n, p in untied.named_parameters()})
            mean = {}
            for n in grads[0]:
                summed = grads[0][n].clone()
                for g in grads[1:]:
                    summed.add_(g[n])
                mean[n] = summed.div_(replicas)
            for n, p in model.named_parameters():
                p.grad = mean[TIED] + mean[HEAD] if n == TIED else mean[n]
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
            losses.append(total)
        return dict({n: p.detach().clone() for n, p in model.named_parameters()}, losses=losses)
    finally:
        torch.set_num_threads(threads)


def spawn_tied(runs: dict, faults: dict = FAULTS, more=None, *args) -> dict:
    """``_train(**kw)`` for each ``key: kw`` of ``runs`` and ``_fault(rank, **kw)`` for each of ``faults`` on 4 gloo
    ranks as 2 x 2, then ``more(rank, world, *args)``'s dict (a module-level function) on each, the eager reference
    computed meanwhile (tests/test_hybrid_zero3_tied.py uses it too)."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as pool:
        ref = pool.submit(_eager)
        res = _spawn(4, _ranks, runs, faults, more, args, timeout=600, pg_timeout=60)
        res["ref"] = ref.result()
    for r in range(4):
        assert isinstance(res.get(r), dict), f"rank {r}: {res.get(r)}"
    return res


@pytest.fixture(scope="module")
def grid():
    return spawn_tied(RUNS)


def _bitwise(res, key, ref=None):
    ref, seen = ref or res["ref"], set()
    for r in range(4):
        got = res[r][key]
        for n, t in got["params"].items():
            piece = _PIECE.fullmatch(n)       # shard_state="full": this rank's chunk of a parameter, flat
            want = ref[n] if piece is None else ref[piece[1]].reshape(-1)[int(piece[2]):int(piece[3])]
            assert torch.equal(torch.from_numpy(t).reshape(want.shape), want), f"{key}: rank {r}: {n} differs"
            seen.add(n if piece is None else piece[1])
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5), (key, r)
    assert seen == set(ref) - {"losses"}, key


def _mode(res, key, rank) -> str:
    """How this rank's tied sum ran: on the host copies, synchronously, or on the host thread joined by a wait."""
    (kw,) = [kw for name, _, kw in res[rank][key]["ops"] if name == "allreduce_tied"]
    return "host" if kw.get("where") == "host" else "sync" if kw.get("sync") else "async"


@pytest.mark.slow
@pytest.mark.parametrize("key", list(MODES))
def test_a_grid_with_tied_weights_trains_bitwise_as_eager_wherever_the_state_lives(grid, key):
    _bitwise(grid, key)
    for r in range(4):
        assert _mode(grid, key, r) == MODES[key][r % 2], (key, r)
        assert bool(grid[r][key]["host"]) == (MODES[key][r % 2] == "host"), (key, r, grid[r][key]["host"])
    if key == "host":      # the gradient summed where it is: not brought back to the device for it
        for r in range(4):
            assert "on the host copies" in " ".join(grid[r][key]["text"].split())
            ops = grid[r][key]["ops"]
            (pack,) = [args[0] for name, args, _ in ops if name == "allreduce_tied"]
            last = max(i for i, (name, args, _) in enumerate(ops) if name == "backward" and args[0] == pack)
            assert ("swap_in", (pack, "grads")) not in [(name, args[:2]) for name, args, _ in ops[last:]], r


@pytest.mark.slow
@pytest.mark.parametrize("key", ["fits_q4", "host_q4", "bf16", "fp16"])
def test_four_bit_gradients_and_half_precision_keep_every_copy_of_the_tied_weight_equal(grid, key):
    """The replicas of each stage equal, and the two stages' copies of the tied weight too: each stage's quantized
    average is decoded alike on its replicas, and the sum of the two averages is fp32 (half precision: the compute
    dtype's gradients made fp32 on the host first)."""
    for a, b in ((0, 2), (1, 3)):
        pa, pb = grid[a][key]["params"], grid[b][key]["params"]
        assert pa.keys() == pb.keys()
        for n in pa:
            assert (pa[n] == pb[n]).all(), f"{key}: ranks {a} and {b} differ in {n}"
    for r in (1, 2, 3):
        assert (grid[r][key]["params"][TIED] == grid[0][key]["params"][TIED]).all(), (key, r)
    ref = grid["ref"]
    assert not torch.equal(torch.from_numpy(grid[0][key]["params"][TIED]), ref[TIED]), "codec or half ran"
    assert grid[0][key]["losses"] == pytest.approx(ref["losses"], rel=1e-2)
    if key.endswith("q4"):
        assert grid[0][key]["stats"]["comm_ratio"] > 4
    else:
        assert _mode(grid, key, 0) == _mode(grid, key, 1) == "host"     # the fp32 masters step on the host


@pytest.mark.slow
@pytest.mark.parametrize("key", list(FAULTS))
def test_a_failed_step_on_one_stage_rolls_back_every_rank_and_the_job_trains_on(grid, key):
    fail_rank = FAULTS[key]["fail_rank"]
    for r in range(4):
        f = grid[r][key]
        if r == fail_rank:
            assert f["raised"].startswith("IndexError"), f["raised"]
        else:
            assert f["raised"].startswith("StepAbortedError") and f"rank {fail_rank}" in f["raised"], (r, f)
        assert f["steps"] == 2 and f["differ"] == [], (r, f)


@pytest.mark.slow
def test_a_tied_grid_clips_by_the_global_norm_counting_the_tied_gradient_once(grid):
    """The norms' exchange after every sum is in (the first stage's on the host thread, the last stage's on the host
    copies): bitwise ``clip_grad_norm_`` over the tied model's parameters in the reference."""
    _bitwise(grid, "clip", _eager(clip=RUNS["clip"]["clip_grad_norm"]))
    assert [_mode(grid, "clip", r) for r in range(4)] == ["async", "host"] * 2
