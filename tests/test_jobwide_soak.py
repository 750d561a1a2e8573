"""Issue 61, item 6: a multi-rank fault soak. Two gloo ranks train under each mode with faults injected on random
ranks at random points of random steps (exceptions in the schedule's ops, bad batches, Ctrl-C); every rank must
report the same outcome for every step, a torn step is undone by loading the last checkpoint on every rank, and the
run ends bitwise equal to a reference run that trained on the steps that counted, nothing lost."""
from __future__ import annotations

import copy
import random
import signal

import pytest
import torch

import harmony
import harmony.data
from faults import fail_at, schedule_ops
from models import training_state_bytes
from test_collectives import _spawn
from test_jobwide import ADAMW, SGD, _bad, _gpt, _state

STEPS = 8
MODES = {"dp": ({}, True), "zero1": (dict(shard_state=True), True),
         "zero3": (dict(shard_state="full", **ADAMW), True), "pipeline": (dict(parallel="pipeline"), False)}
KINDS = ("exception", "bad batch", "ctrl-c")


def _outcome(sm, before: int, error: BaseException | None) -> str:
    if error is None:
        return "committed"
    if sm.runtime.torn is not None:
        return "torn"
    return "committed" if sm.steps > before else "rolled back"


def _soak(rank, world, mode, seed, tmp):
    kw, shard = MODES[mode]
    shard_ = harmony.data.shard if shard else (lambda b: b)
    model, data = _gpt()
    ref_model = copy.deepcopy(model)
    rng = random.Random(seed)            # the same draws on every rank: they agree on where each fault goes

    def compiled(m):
        return harmony.compile(m, example_batch=shard_(data[0]), microbatches=2, comm_timeout=60,
                               memory_budget=int(training_state_bytes(m) * 0.5), **{**SGD, **kw})
    sm = compiled(model)
    ops = len(schedule_ops(sm))
    counted, saved, log = [], [], []          # batches of the steps that count; those at the last save
    harmony.save(sm, tmp)
    for step in range(STEPS):
        b = step % len(data)
        batch = shard_(data[b])
        fault = None
        if rng.random() < 0.6:
            fault = (rng.choice(KINDS), rng.randrange(world), rng.randrange(ops))
            if fault[0] == "bad batch" and mode == "pipeline":       # what the stage that reads it gets wrong
                fault = (fault[0], fault[1], "x" if fault[1] == 0 else "y")
        mine = fault is not None and fault[1] == rank
        before, error = sm.steps, None
        try:
            if mine and fault[0] == "bad batch":
                sm(*_bad(batch, fault[2] if mode == "pipeline" else "x"))
            elif mine:
                how = dict(signum=signal.SIGINT) if fault[0] == "ctrl-c" else dict(error=RuntimeError("injected"))
                with fail_at(fault[2], **how):
                    sm(*batch)
            else:
                sm(*batch)
        except BaseException as e:        # noqa: BLE001 (Ctrl-C too)
            error = e
        outcome = _outcome(sm, before, error)
        log.append((step, fault and fault[:2], outcome, type(error).__name__ if error else None))
        if outcome == "torn":            # every rank back to the last checkpoint
            harmony.load(sm, tmp)
            counted = list(saved)
        elif outcome == "committed":
            counted.append(b)
            if step % 3 == 2:
                harmony.save(sm, tmp)
                saved = list(counted)
    got = _state(sm)
    sm.close()
    ref = compiled(ref_model)
    for b in counted:
        ref(*shard_(data[b]))
    want = _state(ref)
    ref.close()
    return dict(log=log, differ=[k for k in want if not torch.equal(got[k], want[k])], steps=len(counted))


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_faults_on_random_ranks_at_random_points_end_bitwise_as_the_steps_that_counted(mode, tmp_path):
    res = _spawn(2, _soak, mode, 61, str(tmp_path / "ckpt"), timeout=300)
    assert sorted(res) == [0, 1], res
    for r, v in res.items():
        assert isinstance(v, dict), f"rank {r}: {v}"
        assert v["differ"] == [], (r, v["differ"], v["log"])
    logs = [[(s, f, o) for s, f, o, _ in res[r]["log"]] for r in (0, 1)]
    assert logs[0] == logs[1], logs          # every step's outcome the same on every rank
    for r in (0, 1):
        for step, fault, outcome, raised in res[r]["log"]:
            if fault is not None and outcome != "committed":
                assert raised is not None, (r, step)
    print(mode, res[0]["log"])
