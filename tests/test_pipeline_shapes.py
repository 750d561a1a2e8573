"""A pipeline's batches as a DataLoader hands them: shorter sequences (dynamic padding) and a short last batch run the
compiled plan on every rank, each message saying its values' sizes (runtime/pipeline.py); every rank returns what
one process training the same microbatches returns, bit for bit, the loss rank's loss shared as one process's step
returns it (``mean_loss``: weighted by rows where the last microbatch is short)."""
from __future__ import annotations

import torch

import harmony
from harmony.errors import InputError
from models import CASES, training_state_bytes
from test_collectives import _spawn

MICROBATCHES = 4


def _case():
    model, data = CASES["gpt"](batch=8)
    # the example, a batch of shorter sequences, a last batch of 7 rows (microbatches of 2, 2, 2 and 1: a plain
    # mean of their four losses is not the batch's), and both at once
    idx, targets = data[1]
    batches = [data[0], (idx[:, :10], targets[:, :10]), (idx[:7], targets[:7]), (idx[:5, :12], targets[:5, :12]),
               data[2]]
    return model, batches, int(training_state_bytes(model) * 0.5)


def _train(sm, batches) -> dict:
    losses = [sm(*b).item() for b in batches]
    params = {n: t.detach().numpy().copy() for n, t in sm.training_state_dict()["model"].items()}
    return dict(losses=losses, params=params)


def _ranks(rank, world):
    model, batches, budget = _case()
    sm = harmony.compile(model, batches[0], memory_budget=budget, microbatches=MICROBATCHES, parallel="pipeline",
                         comm_timeout=20)
    try:
        out = _train(sm, batches)
        idx, targets = batches[1]
        rows = 6 if rank == 0 else 8
        try:
            sm(idx[:rows], targets[:rows])
            out["mismatch"] = "no error"
        except InputError as e:
            out["mismatch"] = str(e)
        return out
    finally:
        sm.close()


def _one_process():
    """On one thread, as each rank runs (another thread count sums a matmul in another order)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, batches, budget = _case()
        # a pipeline weighs by rows (its last stage's seeds are its microbatches' means): so does this one
        sm = harmony.compile(model, batches[0], memory_budget=budget, microbatches=MICROBATCHES,
                             loss_weighting="rows")
        try:
            return _train(sm, batches)
        finally:
            sm.close()
    finally:
        torch.set_num_threads(threads)


def test_pipeline_ranks_train_shorter_and_short_batches_as_one_process():
    got = _spawn(2, _ranks, timeout=300)
    expected = _one_process()
    merged = {}
    for rank in range(2):
        assert isinstance(got[rank], dict), got[rank]
        assert got[rank]["losses"] == expected["losses"], (rank, got[rank]["losses"], expected["losses"])
        assert "the ranks of a pipeline passed batches of different shapes" in got[rank]["mismatch"], rank
        merged.update(got[rank]["params"])
    assert merged.keys() == expected["params"].keys()
    for n, t in expected["params"].items():
        assert (merged[n] == t).all(), n
