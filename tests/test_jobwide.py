"""Issue 61: a rank's failed step is the job's, handled together on every rank.

Each rank function trains one compiled module with a fault on one rank at one step, and a second module, compiled
alike, that skips that step: every rank raises (the failing rank its own error, the others ``StepAbortedError``
naming it), nothing hangs, and afterwards both modules hold the same parameters, bit for bit.
"""
from __future__ import annotations

import copy

import pytest
import torch

import harmony
import harmony.data
from models import CASES, training_state_bytes
from test_collectives import _spawn

SGD = dict(optimizer=torch.optim.SGD, optimizer_kwargs=dict(lr=0.1, momentum=0.9))
ADAMW = dict(optimizer=torch.optim.AdamW, optimizer_kwargs=dict(lr=1e-3))
TIMEOUT = 20


def _gpt(batch=8):
    return CASES["gpt"](batch=batch)     # 3 blocks, width 64, vocab 64


def _bad(batch, where="x"):
    """An out-of-range token id (IndexError in the embedding) or target (in the loss)."""
    x, y = batch[0].clone(), batch[1].clone()
    (x if where == "x" else y)[-1, -1] = 10_000
    return x, y


def _state(sm) -> dict:
    return {k: v.detach().clone() for k, v in sm.training_state_dict()["model"].items()}


def _run(rank, world, fail_rank, fail_step, steps=3, inject=None, frac=0.5, shard=True, bad="x", batch=8, **kw):
    """Train ``steps`` batches (of ``batch`` rows) with a fault on ``fail_rank`` at ``fail_step`` (a bad batch, or
    ``inject``: a context manager factory wrapping that rank's call); then a reference that skips the step. What
    each raised, and whether the two ended bitwise equal."""
    model, data = _gpt(batch)
    ref_model = copy.deepcopy(model)
    data = [data[i % len(data)] for i in range(steps)]
    shard_ = harmony.data.shard if shard else (lambda b: b)

    def compiled(m):
        budget = int(training_state_bytes(m) * frac)
        where = dict(memory_budget=budget)
        if kw.get("balance") is not None:      # each rank's budget is its device's (here: logical devices)
            from harmony.compiler.hardware import Hardware
            where = dict(hardware=Hardware.this_machine().logical([budget] * world), data_parallel=True)
        return harmony.compile(m, example_batch=shard_(data[0]), microbatches=2, comm_timeout=TIMEOUT, **where,
                               **{**SGD, **kw})
    sm = compiled(model)
    raised = None
    for i, batch in enumerate(data):
        mine = shard_(batch)
        if i == fail_step and rank == fail_rank and inject is None:
            mine = _bad(mine, bad)
        try:
            if i == fail_step and rank == fail_rank and inject is not None:
                with inject():
                    sm(*mine)
            else:
                sm(*mine)
        except Exception as e:        # noqa: BLE001
            if i != fail_step:
                raise
            raised = f"{type(e).__name__}: {e}"
    steps_done = sm.steps
    got = _state(sm)
    sm.close()
    ref = compiled(ref_model)
    for i, batch in enumerate(data):
        if i != fail_step:
            ref(*shard_(batch))
    want = _state(ref)
    ref.close()
    same = [k for k in want if not torch.equal(got[k], want[k])]
    return dict(raised=raised, steps=steps_done, differ=same)


def _check(res, world, fail_rank, own="IndexError"):
    assert sorted(res) == list(range(world)), res
    for r, v in res.items():
        assert isinstance(v, dict), f"rank {r}: {v}"
        if r == fail_rank:
            assert v["raised"].startswith(own), v["raised"]
        else:
            assert v["raised"].startswith("StepAbortedError"), v["raised"]
            assert f"rank {fail_rank}" in v["raised"] and own in v["raised"], v["raised"]
        assert v["differ"] == [], (r, v["differ"])


def _dp_cases(rank, world):
    out = {}
    for name, kw in [("dp", {}), ("zero3", dict(shard_state="full", **ADAMW)),      # ZeRO-1: the soak's
                     ("balance", dict(balance="uniform"))]:
        try:
            out[name] = _run(rank, world, 1, 1, shard=name != "balance", **kw)    # balance=: the global batch
        except Exception as e:         # noqa: BLE001
            out[name] = f"{type(e).__name__}: {e}"
    return out


def test_a_bad_batch_on_one_rank_aborts_the_step_on_every_rank_data_parallel():
    res = _spawn(2, _dp_cases, timeout=240)
    for name in ("dp", "zero3", "balance"):
        _check({r: v[name] if isinstance(v, dict) else v for r, v in res.items()}, 2, 1)


def _zero3_words_cases(rank, world):
    """ZeRO-3 where the words ride in the pad of a reduce-scatter's all-reduce (runtime/partitioned/meet.py
    ``apart``): two ranks under clipping (every rank needs the whole average: no swap of chunks), three ranks with
    and without clipping."""
    out = {}
    for name, kw in [("clip", dict(clip_grad_norm=0.5))] + ([("plain", {})] if world > 2 else []):
        try:
            out[name] = _run(rank, world, world - 1, 1, batch=4 * world, shard_state="full", **ADAMW, **kw)
        except Exception as e:         # noqa: BLE001
            out[name] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_bad_batch_on_one_rank_aborts_the_step_on_every_rank_zero3_words_in_the_pad(world):
    res = _spawn(world, _zero3_words_cases, timeout=300)
    for name in ("clip", "plain") if world > 2 else ("clip",):
        _check({r: v[name] if isinstance(v, dict) else v for r, v in res.items()}, world, world - 1)


def _pipeline_cases(rank, world):
    out = {}
    for name, fail_rank, bad in [("last", world - 1, "y")]:       # a bad id on the first stage: the soak's
        try:
            out[name] = _run(rank, world, fail_rank, 1, shard=False, bad=bad, parallel="pipeline")
        except Exception as e:         # noqa: BLE001
            out[name] = f"{type(e).__name__}: {e}"
    return out


def test_a_bad_batch_on_one_stage_aborts_the_step_on_every_rank_pipeline():
    res = _spawn(2, _pipeline_cases, timeout=240)
    for name, fail_rank in (("last", 1),):
        _check({r: v[name] if isinstance(v, dict) else v for r, v in res.items()}, 2, fail_rank)


# -- 2. shapes agreed before any collective ----------------------------------------------------------
def _shape_cases(rank, world):
    """Per mode, batches of other shapes on rank 1 (fewer rows, a longer sequence than compiled; under data
    parallelism, shapes each needing a plan of its own, one per rank, and one shape that rank 1 alone cannot plan):
    every rank must raise InputError, then all train on together."""
    from harmony.compiler.hardware import Hardware
    out = {}
    modes = [("pipeline", dict(parallel="pipeline"), False), ("zero3", dict(shard_state="full", **ADAMW), True),
             ("balance", dict(balance="uniform"), False), ("dp", dict(shape_plans="each"), True)]
    for name, kw, shard in modes:
        model, data = _gpt()
        shard_ = harmony.data.shard if shard else (lambda b: b)
        budget = int(training_state_bytes(model) * 0.5)
        where = dict(hardware=Hardware.this_machine().logical([budget] * world), data_parallel=True) \
            if name == "balance" else dict(memory_budget=budget)
        sm = harmony.compile(model, example_batch=shard_(data[0]), microbatches=2, comm_timeout=60,
                             **where, **{**SGD, **kw})
        x, y = shard_(data[1])
        if name == "dp":
            cases = [((x[:, :8], y[:, :8]), (x[:, :12], y[:, :12]))]
        else:
            cases = [((x, y), (x[:-2], y[:-2])), ((x, y), (torch.cat([x, x], 1), torch.cat([y, y], 1)))]
        got = []
        for case in cases:
            try:
                sm(*case[rank])
                got.append("no error")
            except Exception as e:      # noqa: BLE001
                got.append(f"{type(e).__name__}: {e}")
        if name == "dp":     # one shape on both ranks, which rank 1 alone cannot plan (its plan's layout differs)
            import harmony.driver.shapes as shapes
            real = shapes._layout_differs
            if rank == 1:
                shapes._layout_differs = lambda *a: "a layout of its own (injected)"
            try:
                sm(x[:, :10], y[:, :10])
                got.append("no error")
            except Exception as e:      # noqa: BLE001
                got.append(f"{type(e).__name__}: {e}")
            shapes._layout_differs = real
        try:
            sm(*shard_(data[2]))
            got.append("ok")
        except Exception as e:      # noqa: BLE001
            got.append(f"{type(e).__name__}: {e}")
        sm.close()
        out[name] = got
    return out


def test_ranks_passing_different_shapes_are_refused_alike_in_every_mode():
    res = _spawn(2, _shape_cases, timeout=300)
    assert sorted(res) == [0, 1], res
    for r, v in res.items():
        assert isinstance(v, dict), f"rank {r}: {v}"
        for name, got in v.items():
            assert all(g.startswith("InputError") for g in got[:-1]) and got[-1] == "ok", (r, name, got)


# -- 1. a torn step is every rank's -------------------------------------------------------------------
def _torn(rank, world, tmp):
    """A failure in the last backward on rank 1, after the optimizer updated the last pack on every rank: every
    rank raises, then refuses to train on or save (TornStepError) until each accepts the mix. Then a torn record
    on rank 1 alone (a failure after its step's last collective, which its peer could not hear of): every rank
    refuses the next step alike."""
    from faults import fail_at, schedule_ops
    from harmony.compiler.hardware import Hardware
    from harmony.runtime.transaction import torn_record
    model, data = _gpt()
    # nominal speeds, not this machine's measured (and, under load, varying) profile: the plan then steps packs
    # before the last backward on every rank, which is what makes a failure there torn
    sm = harmony.compile(model, example_batch=harmony.data.shard(data[0]), microbatches=2, comm_timeout=TIMEOUT,
                         memory_budget=int(training_state_bytes(model) * 0.5), hardware=Hardware.detect(device="cpu"),
                         **SGD)
    sm(*harmony.data.shard(data[0]))
    out = {}
    ops = [o for o in schedule_ops(sm) if o in ("backward", "step")]
    last = ops.count("backward") - 1
    if "step" not in ops[:len(ops) - 1 - ops[::-1].index("backward")]:
        return f"the plan steps nothing before its last backward, so no failure there tears: {ops}"
    try:
        if rank == 1:
            with fail_at(last, RuntimeError("boom"), kinds=("backward",)):
                sm(*harmony.data.shard(data[1]))
        else:
            sm(*harmony.data.shard(data[1]))
    except Exception as e:        # noqa: BLE001
        out["raised"] = f"{type(e).__name__}: {e}"
    for what, call in (("next", lambda: sm(*harmony.data.shard(data[2]))), ("save", lambda: harmony.save(sm, tmp))):
        try:
            call()
            out[what] = "no error"
        except Exception as e:    # noqa: BLE001
            out[what] = f"{type(e).__name__}: {e}"
    sm.accept_partial_step()
    sm(*harmony.data.shard(data[2]))
    if rank == 1:
        sm.runtime.torn = torn_record(sm.runtime, [1], [1, 0])
    try:
        sm(*harmony.data.shard(data[0]))
        out["alone"] = "no error"
    except Exception as e:        # noqa: BLE001
        out["alone"] = f"{type(e).__name__}: {e}"
    if rank == 1:
        sm.accept_partial_step()
    sm(*harmony.data.shard(data[0]))
    out["steps"] = sm.steps
    sm.close()
    return out


def test_a_torn_step_on_any_rank_is_refused_on_every_rank(tmp_path):
    res = _spawn(2, _torn, str(tmp_path / "ckpt"), timeout=240)
    assert sorted(res) == [0, 1], res
    for r, v in res.items():
        assert isinstance(v, dict), f"rank {r}: {v}"
        assert v["raised"].startswith("RuntimeError" if r == 1 else "StepAbortedError"), v["raised"]
        for what in ("next", "save", "alone"):
            assert v[what].startswith("TornStepError"), (r, what, v[what])
        assert "rank 1" in v["alone"], v["alone"]
        assert v["steps"] == 3, v          # the torn step counts on no rank


# -- 3. a rank that dies is a CommunicationError on the others ------------------------------------------
def _dies_in_a_gather(rank, world):
    import signal

    from faults import fail_at
    model, data = _gpt()
    sm = harmony.compile(model, example_batch=harmony.data.shard(data[0]), microbatches=2, comm_timeout=TIMEOUT,
                         memory_budget=int(training_state_bytes(model) * 0.5), shard_state="full", **ADAMW)
    sm(*harmony.data.shard(data[0]))
    try:
        if rank == 1:    # killed right after its second gather of the step is under way
            with fail_at(1, signum=signal.SIGKILL, kinds=("gather",)):
                sm(*harmony.data.shard(data[1]))
        sm(*harmony.data.shard(data[1]))
        return "no error"
    except Exception as e:        # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def test_a_rank_dying_in_a_zero3_gather_is_a_communication_error_naming_the_op():
    res = _spawn(2, _dies_in_a_gather, timeout=240, wait_for={0})
    assert res[0].startswith("CommunicationError"), res[0]
    assert "gather" in res[0] and "restart all ranks" in res[0], res[0]
