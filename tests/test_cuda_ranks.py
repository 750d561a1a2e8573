"""Several processes on one GPU (issue 63's item 4): ZeRO-3 (``shard_state="full"``) and ``parallel="pipeline"`` with
CUDA devices, two gloo ranks sharing the card, each under its own memory budget. Bitwise: ZeRO-3 as the replicated
data-parallel run on the same card, the pipeline as one process training the same microbatches there.

Skipped where CUDA is absent (CI runs on CPUs); ``benchmarks/gpu.sh`` runs it on the GPU machine in a stage of its own
after tests/test_cuda.py (``CUDA_TESTS`` selects). Deterministic kernels, as there: the ranks and the reference run
the same ones, and every optimizer step runs on the host in each (a device step runs torch's CUDA kernel, which can
differ from the CPU's in the last bit, and the plans may choose differently). Each budget covers the CUDA libraries'
workspaces on top of its share of the state, as tests/test_cuda.py's ``gpu_budget``.

``HARMONY_RANKS_DEVICE=cpu`` runs the same tests on the CPU device (a dry run of their control flow where no card is).
"""
from __future__ import annotations

import os

import pytest
import torch

import harmony
import harmony.data
from models import CASES, training_state_bytes
from test_collectives import _spawn

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
DEVICE = os.environ.get("HARMONY_RANKS_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")

ADAMW = dict(optimizer=torch.optim.AdamW, optimizer_kwargs=dict(lr=1e-3), optimizer_on="host")
STEPS = 3


def _budget(model) -> int:
    """Half the training state, plus what the CUDA libraries take in this process (its own context and workspaces)."""
    if DEVICE != "cuda":
        return int(training_state_bytes(model) * 0.5)
    from harmony.compiler.hardware.machine import cuda_library_bytes
    return int(training_state_bytes(model) * 0.5) + cuda_library_bytes(torch.device(DEVICE))


def _state(sm) -> dict:
    return {n: t.detach().cpu().numpy().copy() for n, t in sm.training_state_dict()["model"].items()}


def _data_parallel(rank, world, shard_state):
    torch.use_deterministic_algorithms(True)
    model, data = CASES["gpt"](batch=8)
    budget = _budget(model)
    sm = harmony.compile(model, example_batch=harmony.data.shard(data[0]), microbatches=2, device=DEVICE,
                         memory_budget=budget, shard_state=shard_state, comm_timeout=60, **ADAMW)
    try:
        losses, made = [], []
        shares = sm.runtime.state.shares
        for i in range(STEPS):
            losses.append(sm(*harmony.data.shard(data[i % len(data)])).item())
            made.append(shares.staging.allocations if shares is not None else 0)
        out = dict(losses=losses, peak=sm.stats["measured_peak"], budget=budget, staged=made,
                   gathers=[n.target.__name__ for n in sm.graph.nodes if n.op == "call_function"].count("gather"),
                   pinned=shares is not None and all(c.is_pinned() for c in shares.chunks.values()),
                   carried=shares is not None and shares.carry is not None)
        sm.sync_model()      # every rank's model whole again (ZeRO-3 holds a share of each parameter)
        out["params"] = {n: p.detach().cpu().numpy().copy() for n, p in model.named_parameters()}
        return out
    finally:
        sm.close()


def test_zero3_two_ranks_on_one_card_train_as_the_replicated_run():
    got = {s: _spawn(2, _data_parallel, s, timeout=400) for s in (None, "full")}
    for s, res in got.items():
        assert sorted(res) == [0, 1] and all(isinstance(v, dict) for v in res.values()), (s, res)
        for v in res.values():
            assert v["peak"] <= v["budget"], (s, v["peak"], v["budget"])
    for v in got["full"].values():     # the chunks pinned, the gathers' staging buffers made in the first step only
        assert v["gathers"] > 0 and v["staged"][0] > 0 and v["pinned"] == (DEVICE == "cuda"), v
        # (a carried pack's refill, on the host thread, may hold one beside a gather in a later step)
        assert v["carried"] or v["staged"] == [v["staged"][0]] * STEPS, v["staged"]
    for rank in range(2):
        replicated, zero3 = got[None][rank], got["full"][rank]
        assert zero3["losses"] == replicated["losses"], rank
        for n, t in replicated["params"].items():
            assert (zero3["params"][n] == t).all(), (rank, n)


def _case():
    model, data = CASES["gpt"](batch=8)
    return model, data[:STEPS], _budget(model)


def _pipeline(rank, world):
    torch.use_deterministic_algorithms(True)
    model, batches, budget = _case()
    sm = harmony.compile(model, batches[0], memory_budget=budget, microbatches=4, parallel="pipeline",
                         device=DEVICE, comm_timeout=60, **ADAMW)
    try:
        return dict(losses=[sm(*b).item() for b in batches], params=_state(sm), peak=sm.stats["measured_peak"],
                    budget=budget)
    finally:
        sm.close()


def test_pipeline_two_ranks_on_one_card_train_as_one_process():
    got = _spawn(2, _pipeline, timeout=400)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # as each rank runs: the host's optimizer steps sum in its thread count's order
    torch.use_deterministic_algorithms(True)
    try:
        model, batches, budget = _case()
        # a pipeline weighs by rows (its last stage's seeds are its microbatches' means): so does this one
        sm = harmony.compile(model, batches[0], memory_budget=budget, microbatches=4, device=DEVICE,
                             loss_weighting="rows", **ADAMW)
        expected = dict(losses=[sm(*b).item() for b in batches], params=_state(sm))
        sm.close()
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(threads)
    merged = {}
    for rank in range(2):
        assert isinstance(got.get(rank), dict), got
        assert got[rank]["losses"] == expected["losses"], (rank, got[rank]["losses"], expected["losses"])
        assert got[rank]["peak"] <= got[rank]["budget"], rank
        merged.update(got[rank]["params"])
    assert merged.keys() == expected["params"].keys()
    for n, t in expected["params"].items():
        assert (merged[n] == t).all(), n
