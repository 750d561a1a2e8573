"""Issue 61: a multi-rank fault soak. Two and three gloo ranks train under each mode (data parallel replicated,
ZeRO-1, ZeRO-3, a pipeline, ``balance=``) with faults injected on random ranks at random points of random steps:
an exception in a forward or in a backward, a bad batch, Ctrl-C, and once per run a rank SIGKILLed mid-step, after
which the test restarts every rank from the last checkpoint (as torchrun --max-restarts would) and the job goes on
from the step after it. Every rank must report the same outcome for every step, a torn step is undone by loading
the last checkpoint on every rank, and the run ends bitwise equal to a reference run that trained on the steps that
counted: nothing lost.

CI runs a few steps per run (``STEPS``); ``HARMONY_SOAK_STEPS=300`` runs a long soak by hand. Each run prints per mode:
steps, faults injected per kind, recovered, lost.
"""
from __future__ import annotations

import copy
import json
import os
import random
import signal
from collections import Counter
from pathlib import Path

import pytest
import torch

import harmony
import harmony.data
from faults import fail_at, schedule_ops
from models import training_state_bytes
from test_collectives import _spawn
from test_jobwide import ADAMW, SGD, _bad, _gpt, _state

STEPS = int(os.environ.get("HARMONY_SOAK_STEPS", "5"))
MODES = {"dp": {}, "zero1": dict(shard_state=True), "zero3": dict(shard_state="full", **ADAMW),
         "pipeline": dict(parallel="pipeline"), "balance": dict(balance="uniform")}
KINDS = ("forward", "backward", "bad batch", "ctrl-c")
TIMEOUT = 30


def _fault(seed: int, step: int, world: int, mode: str, ops: Counter, kill: tuple) -> tuple | None:
    """The fault of ``step`` (the same draw on every rank, and again when a restarted job runs the step again):
    (kind, rank, where) or None. The kill is ``kill``'s step's, once."""
    if step == kill[0]:
        return ("sigkill", kill[1], kill[2])
    rng = random.Random(seed * 7919 + step)
    if rng.random() >= 0.6 or step == STEPS - 1:     # the last step trains: some step after the faults counts
        return None
    kind, rank = rng.choice(KINDS), rng.randrange(world)
    if kind == "bad batch":
        # a pipeline's first stage reads the ids, its last the targets (a middle stage reads neither)
        where = "x" if mode != "pipeline" or rank == 0 else "y"
        rank = rank if mode != "pipeline" or rank in (0, world - 1) else 0
        return (kind, rank, where)
    n = ops["forward"] if kind == "forward" else ops["backward"] if kind == "backward" else sum(ops.values())
    return (kind, rank, rng.randrange(max(n, 1)))


def _compiled(m, world, mode, batch):
    kw = MODES[mode]
    budget = int(training_state_bytes(m) * 0.5)
    where = dict(memory_budget=budget)
    if mode == "balance":       # each rank's budget is its (logical) device's
        from harmony.compiler.hardware import Hardware
        where = dict(hardware=Hardware.this_machine().logical([budget] * world), data_parallel=True)
    return harmony.compile(m, example_batch=batch, microbatches=2, comm_timeout=TIMEOUT, **where, **{**SGD, **kw})


def _step(sm, rank, batch, fault, mode) -> BaseException | None:
    """One step on this rank, with this rank's part of ``fault``; what it raised."""
    mine = fault is not None and fault[1] == rank
    try:
        if mine and fault[0] == "bad batch":
            sm(*_bad(batch, fault[2]))
        elif mine:
            how = dict(signum=signal.SIGINT) if fault[0] == "ctrl-c" else \
                dict(signum=signal.SIGKILL) if fault[0] == "sigkill" else dict(error=RuntimeError("injected"))
            kinds = (fault[0],) if fault[0] in ("forward", "backward") else ()
            with fail_at(fault[2], kinds=kinds, **how):
                sm(*batch)
        else:
            sm(*batch)
    except BaseException as e:        # noqa: BLE001 (Ctrl-C too)
        return e
    return None


def _soak(rank, world, mode, seed, tmp, kill):
    """Train steps from the last checkpoint's (a restart) or from the start; return the log, and once the steps
    are done, which tensors differ from the reference."""
    shard = harmony.data.shard if mode not in ("pipeline", "balance") else (lambda b: b)
    model, data = _gpt(batch=4 * world)
    ref_model = copy.deepcopy(model)
    sm = _compiled(model, world, mode, shard(data[0]))
    ops = Counter(schedule_ops(sm))
    book = Path(tmp) / "book.json"       # the steps that counted at the last save, written with it
    first, counted, saved = 0, [], []
    if book.exists():                    # a restart: every rank from the last checkpoint
        harmony.load(sm, Path(tmp) / "ckpt")
        first, counted = json.loads(book.read_text())
        saved = list(counted)
    else:
        harmony.save(sm, Path(tmp) / "ckpt")
    log = []
    for step in range(first, STEPS):
        b = step % len(data)
        fault = _fault(seed, step, world, mode, ops, kill)
        before = sm.steps
        error = _step(sm, rank, shard(data[b]), fault, mode)
        outcome = "committed" if error is None or sm.steps > before else \
            "torn" if sm.runtime.torn is not None else "rolled back"
        log.append((step, fault and fault[:2], outcome, type(error).__name__ if error else None))
        if fault is not None and fault[0] == "sigkill":
            return dict(log=log, killed=step)      # the job is gone: the test restarts it
        if outcome == "torn":                      # every rank back to the last checkpoint
            harmony.load(sm, Path(tmp) / "ckpt")
            counted = list(saved)
        elif outcome == "committed":
            counted.append(b)
            if step % 2 == 1:
                harmony.save(sm, Path(tmp) / "ckpt")
                saved = list(counted)
                if rank == 0:
                    book.write_text(json.dumps([step + 1, counted]))
    got = _state(sm)
    sm.close()
    ref = _compiled(ref_model, world, mode, shard(data[0]))
    for b in counted:
        ref(*shard(data[b]))
    want = _state(ref)
    ref.close()
    return dict(log=log, differ=[k for k in want if not torch.equal(got[k], want[k])], steps=len(counted))


def kills(world: int, mode: str) -> bool:
    """Whether this run kills a rank: each mode at one of the two world sizes, every mode at the long soak's (a
    restart costs a whole new job: a compile on every rank, most of a short run's time)."""
    return STEPS > 5 or (world + list(MODES).index(mode)) % 2 == 0


def _run(world, mode, tmp: Path) -> dict:
    """The soak of one mode: its first job until the kill, then the restarted job to the end; what each rank saw."""
    seed = 61 * world + 7 * list(MODES).index(mode)     # each run its own draws
    rng = random.Random(seed)
    kill_step = rng.randrange(2, max(STEPS, 3))       # after the first save (step 1), so a checkpoint holds steps
    kill = (kill_step if kills(world, mode) else -1, rng.randrange(world), rng.randrange(8))
    jobs = []
    for job in range(2):      # the restarted job runs the killed step again, without the kill
        res = _spawn(world, _soak, mode, seed, str(tmp), kill if job == 0 else (-1, 0, 0), timeout=300)
        jobs.append(res)
        if not any(isinstance(v, dict) and "killed" in v for v in res.values()):
            break
    return dict(jobs=jobs, kill=kill)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", list(MODES))
def test_faults_on_random_ranks_at_random_points_end_bitwise_as_the_steps_that_counted(mode, world, tmp_path):
    out = _run(world, mode, tmp_path)
    jobs, kill = out["jobs"], out["kill"]
    last = jobs[-1]
    assert sorted(last) == list(range(world)), last
    for r, v in last.items():
        assert isinstance(v, dict) and "differ" in v, f"rank {r}: {v}"
        assert v["differ"] == [], (r, v["differ"], v["log"])
        assert v["steps"] >= 1, v["log"]
    for res in jobs:        # every step's outcome the same on every rank that lived through it
        logs = [[(s, f, o) for s, f, o, _ in v["log"] if f is None or f[0] != "sigkill"]
                for v in res.values() if isinstance(v, dict)]
        assert all(log == logs[0] for log in logs), logs
        for v in res.values():
            for step, fault, outcome, raised in v["log"] if isinstance(v, dict) else ():
                if fault is not None and outcome != "committed":
                    assert raised is not None, (step, fault)
    restarted = len(jobs) == 2
    assert restarted == (0 <= kill[0] < STEPS), jobs[0]
    kinds = Counter()
    for res in jobs:       # what one rank that lived through each job saw (every rank drew the same faults)
        alive = next(v for v in res.values() if isinstance(v, dict))
        kinds.update(f[0] for _, f, _, _ in alive["log"] if f is not None)
    faults, lost = sum(kinds.values()), len(last[0]["differ"])
    # recovered: every fault's step had one outcome on every rank (above), the kill's job restarted, and the run
    # ended bitwise the reference's
    print(f"\n{mode}, {world} ranks: {STEPS} steps, {last[0]['steps']} counted; faults injected {faults} "
          f"({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))}); recovered {faults if not lost else 0}; "
          f"lost {lost}")
