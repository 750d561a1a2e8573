"""fp16 with loss scaling under ``parallel="pipeline"``: each rank unscales and checks its own packs' gradients, the
ranks agree on an overflow at the end of the step (the found-inf flag rides on a meet of their words,
runtime/precision.py ``overflow_agreement``), and all skip or all step: bitwise one process's fp16 run, skipped
steps and scale included. An overflow in the last rank's gradients alone (``Poked``: a parameter only the loss
reads) skips the step on the first rank too."""
from __future__ import annotations

import torch

import harmony
from models import CASES, training_state_bytes
from test_collectives import _spawn
from test_jobwide_overflow import SGD, Poked, _batches

MICROBATCHES = 4
# the first steps overflow (skipped, the scale halved), then the scale grows every 2 clean steps
SCALING = dict(init_scale=2.0 ** 20, growth_interval=2)


def _run(**extra) -> dict:
    model, data = CASES["gpt"](batch=8)
    sm = harmony.compile(model, data[0], memory_budget=int(training_state_bytes(model) * 0.5),
                         microbatches=MICROBATCHES, precision="fp16", loss_scaling=SCALING, **extra)
    try:
        losses, skipped, scales = [], [], []
        for b in data * 3:
            losses.append(sm(*b).item())
            skipped.append(sm.stats["skipped_steps"])
            scales.append(sm.loss_scale)
        params = {n: t.detach().float().numpy().copy() for n, t in sm.training_state_dict()["model"].items()}
        return dict(losses=losses, skipped=skipped, scales=scales, params=params)
    finally:
        sm.close()


def _ranks(rank, world):
    return _run(parallel="pipeline", comm_timeout=30)


def _one_process():
    """On one thread, as each rank runs; by rows, as a pipeline weighs its loss."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(loss_weighting="rows")
    finally:
        torch.set_num_threads(threads)


def test_pipeline_ranks_skip_an_overflowing_fp16_step_together_bitwise_as_one_process():
    got = _spawn(2, _ranks, timeout=400)
    ref = _one_process()
    # skipped_steps counts: the first skips, later ones step
    assert ref["skipped"][0] == 1 and ref["skipped"][-1] < len(ref["skipped"]) - 2, ref["skipped"]
    merged = {}
    for rank in (0, 1):
        assert isinstance(got[rank], dict), got[rank]
        for key in ("losses", "skipped", "scales"):
            assert got[rank][key] == ref[key], (rank, key, got[rank][key], ref[key])
        merged.update(got[rank]["params"])
    assert merged.keys() == ref["params"].keys()
    for n, t in ref["params"].items():
        assert (merged[n] == t).all(), n


def _poked(**extra) -> dict:
    torch.manual_seed(0)
    model = Poked()
    data = _batches(2)
    sm = harmony.compile(model, example_batch=data[0], microbatches=2, precision="fp16",
                         loss_scaling=dict(init_scale=2.0 ** 8), **{**SGD, **extra})
    try:
        scales = []
        for batch in data:
            sm(*batch)
            scales.append(sm.loss_scale)
        params = {n: t.detach().float().numpy().copy() for n, t in sm.training_state_dict()["model"].items()}
        return dict(scales=scales, skipped=sm.stats["skipped_steps"], params=params,
                    packs=len(sm.plan.stage.local) if sm.plan.stage is not None else None)
    finally:
        sm.close()


def _poked_ranks(rank, world):
    return _poked(parallel="pipeline", comm_timeout=30, memory_budget=1 << 20)


def test_an_overflow_in_one_stages_gradients_skips_the_step_on_every_rank():
    got = _spawn(2, _poked_ranks, timeout=300)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = _poked(loss_weighting="rows")
    finally:
        torch.set_num_threads(threads)
    assert ref["skipped"] == 1 and ref["scales"][1] == ref["scales"][0] / 2, ref      # the overflow is real
    merged = {}
    for rank in (0, 1):
        assert isinstance(got[rank], dict), got[rank]
        assert got[rank]["skipped"] == 1 and got[rank]["scales"] == ref["scales"], (rank, got[rank]["scales"])
        merged.update(got[rank]["params"])
    for n, t in ref["params"].items():
        assert (merged[n] == t).all(), n
