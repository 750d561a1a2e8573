"""Issue 61: every collective path names its failure: a peer that dies is a ``CommunicationError`` naming the op and
what to do on the ranks left, never a raw gloo ``RuntimeError`` (runtime/comm/failures.py ``guarded``).

In each case rank 1 dies (``os._exit``) right where it would join the collective, and rank 0 makes it.
"""
from __future__ import annotations

import os

import pytest

import harmony
import harmony.data
from models import training_state_bytes
from test_collectives import _spawn
from test_jobwide import ADAMW, SGD, _gpt


def _left(fn, *args):
    """Rank 0's error where rank 1 has died and rank 0 calls ``fn(*args)``."""
    res = _spawn(2, _dies_then, fn, *args, timeout=120, wait_for={0})
    return res[0]


def _dies_then(rank, world, fn, *args):
    if rank == 1:
        os._exit(0)
    try:
        fn(*args)
        return "no error"
    except Exception as e:      # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def _network():
    from harmony.runtime.comm.process_group import measure_network
    measure_network(nbytes=1 << 16)


def _adaptive_bits():
    from harmony.runtime.comm.adaptive_bits import choose_bits_across_ranks
    choose_bits_across_ranks({"w": {2: 0.5, 4: 0.1, 8: 0.01}}, {"w": 4096}, 4)


def _balance_plan():
    from harmony.driver.modes.balance import plan_on_rank0
    plan_on_rank0(0, lambda: "a plan")


@pytest.mark.parametrize("fn, op", [(_network, "network measurement"), (_adaptive_bits, "adaptive bits"),
                                    (_balance_plan, "balance=")])
def test_a_dead_peer_in_a_collective_outside_the_step_is_a_communication_error(fn, op):
    got = _left(fn)
    assert got.startswith("CommunicationError") and op in got and "restart all ranks" in got, got


def _module_call(rank, world, kw, call, exits_in, tmp):
    """Both ranks compile and step once; then rank 1 dies inside ``torch.distributed.<exits_in>`` of ``call``."""
    import torch.distributed as dist
    model, data = _gpt()
    shard = kw.get("parallel") != "pipeline"
    batch = harmony.data.shard(data[0]) if shard else data[0]
    sm = harmony.compile(model, example_batch=batch, microbatches=2, comm_timeout=60,
                         memory_budget=int(training_state_bytes(model) * 0.5), **{**SGD, **kw})
    sm(*batch)
    if rank == 1:
        setattr(dist, exits_in, lambda *a, **k: os._exit(0))
    try:
        harmony.save(sm, tmp) if call == "save" else sm.sync_model()
        return "no error"
    except Exception as e:      # noqa: BLE001
        return f"{type(e).__name__}: {e}"


@pytest.mark.slow
@pytest.mark.parametrize("kw, call, exits_in, op", [
    (dict(shard_state="full", **ADAMW), "save", "all_gather_object", "harmony.save"),
    (dict(parallel="pipeline"), "sync", "all_gather_object", "sync_model"),
    ({}, "save", "broadcast_object_list", "harmony.save")])
def test_a_dead_peer_in_a_modules_collective_is_a_communication_error(kw, call, exits_in, op, tmp_path):
    res = _spawn(2, _module_call, kw, call, exits_in, str(tmp_path / "ckpt"), timeout=200, wait_for={0})
    got = res[0]
    assert got.startswith("CommunicationError") and op in got, got
    assert "RuntimeError" not in got.split("(")[0], got


def _dies_compiling(rank, world):
    """Rank 1 dies in the middle of its compile (its cost model): rank 0 meets nobody after planning."""
    import harmony.driver.compile as compile_
    if rank == 1:
        compile_.cost.annotate = lambda *a, **k: os._exit(0)
    model, data = _gpt()
    try:
        harmony.compile(model, example_batch=harmony.data.shard(data[0]), microbatches=2, comm_timeout=60,
                        memory_budget=int(training_state_bytes(model) * 0.5), **SGD)
        return "no error"
    except Exception as e:      # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def test_a_peer_dying_while_compiling_is_a_communication_error():
    got = _spawn(2, _dies_compiling, timeout=120, wait_for={0})[0]
    assert got.startswith("CommunicationError") and "harmony.compile's agreement after planning" in got, got

