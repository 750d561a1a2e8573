"""``sm.evaluate`` under ``parallel="pipeline"``: every rank runs its packs' eval-mode forwards in the step's order,
the loss rank's loss is every rank's, and a failure on one rank is the job's (driver/evaluate.py,
passes/eval_schedule.py ``lower_stage``)."""
from __future__ import annotations

import torch

import harmony
from harmony.errors import InputError, StepAbortedError
from models import CASES, training_state_bytes
from test_collectives import _spawn

MICROBATCHES = 4


def _compile(**extra):
    model, data = CASES["gpt"](batch=8)
    budget = int(training_state_bytes(model) * 0.5)
    return harmony.compile(model, data[0], memory_budget=budget, microbatches=MICROBATCHES, **extra), data


def _outcome(fn) -> str:
    try:
        fn()
        return "no error"
    except Exception as e:  # noqa: BLE001 - reported to the parent
        return f"{type(e).__name__}: {e}"


def _ranks(rank, world):
    sm, data = _compile(parallel="pipeline", comm_timeout=20)
    sm(*data[0])
    first = sm.evaluate(*data[1]).item()
    again = sm.evaluate(*data[1]).item()
    idx, targets = data[1]
    bad = idx.clone()
    bad[0, 0] = 10 ** 6             # an id out of the embedding's range: the first rank's forward fails
    failed = _outcome(lambda: sm.evaluate(bad if rank == 0 else idx, targets))
    short = _outcome(lambda: sm.evaluate(idx[:4] if rank == 1 else idx, targets[:4] if rank == 1 else targets))
    losses = [sm(*b).item() for b in data[1:]]
    params = {n: t.detach().numpy().copy() for n, t in sm.training_state_dict()["model"].items()}
    sm.close()
    return dict(first=first, again=again, failed=failed, short=short, losses=losses, params=params)


def _one_process():
    """The same calls in one process, on one thread as each rank runs (another thread count sums a matmul in
    another order): no failed evaluation between the steps."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sm, data = _compile()
        sm(*data[0])
        first = sm.evaluate(*data[1]).item()
        losses = [sm(*b).item() for b in data[1:]]
        params = {n: t.detach().clone() for n, t in sm.training_state_dict()["model"].items()}
        sm.close()
        return first, losses, params
    finally:
        torch.set_num_threads(threads)


def test_a_pipeline_evaluates_as_one_process_and_a_rank_failure_is_the_jobs():
    got = _spawn(2, _ranks, timeout=300)
    first, losses, params = _one_process()
    for rank in (0, 1):
        assert isinstance(got[rank], dict), got[rank]
    for rank, run in got.items():
        assert run["first"] == run["again"] == first, (rank, run["first"], first)
        assert run["losses"] == losses, rank       # the evaluations changed nothing the steps read
    # the first rank's bad id: its own IndexError there, the last rank learns it at their next message
    assert got[0]["failed"].startswith("IndexError"), got[0]["failed"]
    assert got[1]["failed"].startswith(StepAbortedError.__name__) and "evaluation" in got[1]["failed"] \
        and "rank 0 failed" in got[1]["failed"], got[1]["failed"]
    # a batch of another shape on one rank: refused on every rank before anything runs
    assert all(got[r]["short"].startswith(InputError.__name__) for r in (0, 1)), (got[0]["short"], got[1]["short"])
    merged = {**got[0]["params"], **got[1]["params"]}
    assert merged.keys() == params.keys()
    for n, t in params.items():
        assert torch.equal(torch.from_numpy(merged[n]), t), n
