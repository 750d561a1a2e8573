"""The loss every pipeline rank returns: what one process training the same microbatches returns, bit for bit.

Only the last pipeline rank computes the loss; it shares it with the others at the end of the step
(runtime/pipeline.py ``share_loss``), as one process's step returns it (``mean_loss``); a grid's pipelines share
theirs the same way (tests/test_hybrid.py).
"""
from __future__ import annotations

import pytest
import torch

import harmony
from models import CASES, training_state_bytes
from test_collectives import _spawn

MICROBATCHES = 4
ROWS = 8


def _case(weighting: str):
    model, data = CASES["gpt"](batch=ROWS)
    extra = {} if weighting == "auto" else {"loss_weighting": weighting}
    return model, data, int(training_state_bytes(model) * 0.5), extra


def _losses(rank, world, weighting):
    model, data, budget, extra = _case(weighting)
    sm = harmony.compile(model, data[0], memory_budget=budget, microbatches=MICROBATCHES, parallel="pipeline",
                         comm_timeout=20, **extra)
    try:
        return [sm(*b).item() for b in data]
    finally:
        sm.close()


def _one_process(weighting):
    """On one thread, as each rank runs (another thread count sums a matmul in another order)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _one_thread(weighting)
    finally:
        torch.set_num_threads(threads)


def _one_thread(weighting):
    model, data, budget, extra = _case(weighting)
    sm = harmony.compile(model, data[0], memory_budget=budget, microbatches=MICROBATCHES, **extra)
    try:
        return [sm(*b).item() for b in data]
    finally:
        sm.close()


@pytest.mark.parametrize("weighting", ["rows", "auto"])     # a pipeline weighs by rows under "auto" too
def test_every_pipeline_rank_returns_the_loss_one_process_returns(weighting):
    got = _spawn(2, _losses, weighting, timeout=240)
    expected = _one_process(weighting)
    for rank in range(2):
        assert not isinstance(got[rank], str), got[rank]
        assert got[rank] == expected, (rank, got[rank], expected)
