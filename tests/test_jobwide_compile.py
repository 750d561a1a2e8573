"""Issue 61: a rank whose compile fails fails every rank's compile alike, at once (driver/agree.py).

Each case makes one rank's compile fail at another stage (its example batch, its budget, building its runtime)
in another mode, while the others go on towards the compile's collectives. Every rank must raise at once (the
failing rank its own error; the others the same class of error naming rank 1 and what it said), no rank is left
with a module, and the ranks compile and train together right after.
"""
from __future__ import annotations


import harmony
import harmony.data
from models import training_state_bytes
from test_collectives import _spawn
from test_jobwide import ADAMW, SGD, _gpt

TIMEOUT = 30      # a rank left waiting would raise CommunicationError after this: the cases want none


def _compile(rank, world, kw, batch, frac=0.5, shard=True):
    model, _ = _gpt()
    budget = int(training_state_bytes(model) * frac)
    where = dict(memory_budget=budget)
    if kw.get("balance") is not None:
        from harmony.compiler.hardware import Hardware
        where = dict(hardware=Hardware.this_machine().logical([budget] * world), data_parallel=True)
    return harmony.compile(model, example_batch=harmony.data.shard(batch) if shard else batch, microbatches=2,
                           comm_timeout=TIMEOUT, **where, **{**SGD, **kw})


def _float_ids(batch):
    return batch[0].float(), batch[1]      # an embedding's ids as floats: the trace fails


CASES = {"dp, a bad example batch": ({}, "batch", True),
         "zero3, a budget too small": (dict(shard_state="full", **ADAMW), "budget", True),
         "balance, a bad example batch": (dict(balance="uniform"), "batch", False),
         "pipeline, a budget too small": (dict(parallel="pipeline"), "budget", False),
         "zero1, its runtime fails": (dict(shard_state=True), "runtime", True),
         # after the runtime's process groups, the last of the compile's collectives (the end of compile meets)
         "dp, its step status fails": ({}, "status", True),
         "zero3, its shape cache fails": (dict(shard_state="full", **ADAMW), "shapes", True),
         "pipeline, its step status fails": (dict(parallel="pipeline"), "status", False)}
LATE = ["dp, its step status fails", "zero3, its shape cache fails", "pipeline, its step status fails"]


def _injected(*a, **k):
    raise OSError("injected: no room for the module's state")


def _cases(rank, world, names=tuple(n for n in CASES if n not in LATE)):
    import harmony.driver.assemble as assemble
    import harmony.driver.handshake as handshake
    _, data = _gpt()
    out = {}
    faults = {"runtime": (assemble, "build_optimizers"), "status": (handshake, "StepStatus"),
              "shapes": (assemble, "ShapeCache")}
    for name in names:
        kw, fault, shard = CASES[name]
        batch, frac = data[0], 0.5
        if rank == 1 and fault == "batch":
            batch = _float_ids(batch)
        if rank == 1 and fault == "budget":
            frac = 0.001
        where, attr = faults.get(fault, (None, None))
        real = getattr(where, attr) if where is not None else None
        if rank == 1 and where is not None:     # rank 1's compile fails there; rank 0's goes on
            setattr(where, attr, _injected)
        try:
            _compile(rank, world, kw, batch, frac, shard)
            got = "no error"
        except Exception as e:      # noqa: BLE001
            got = f"{type(e).__name__}: {e}"
        if where is not None:
            setattr(where, attr, real)
        sm = _compile(rank, world, kw, data[0], shard=shard)      # the ranks compile and train together after
        sm(*(harmony.data.shard(data[1]) if shard else data[1]))
        out[name] = (got, sm.steps)
        sm.close()
    return out


def test_a_rank_whose_compile_fails_fails_every_ranks_compile_alike():
    _check(_spawn(2, _cases, timeout=400))


def test_a_rank_whose_compile_fails_after_the_runtimes_groups_fails_every_ranks_compile():
    """A failure after the compile's last collective (the runtime's handshake, its shape cache) is met at the end
    of compile: rank 0 does not leave with a module while rank 1 has none."""
    _check(_spawn(2, _cases, LATE, timeout=400))


def _check(res):
    assert sorted(res) == [0, 1], res
    for r, v in res.items():
        assert isinstance(v, dict), f"rank {r}: {v}"
    for name, (got1, steps1) in res[1].items():
        got0, steps0 = res[0][name]
        kind = got1.split(":")[0]
        assert kind != "no error" and kind != "CommunicationError", (name, got1)
        assert got0.startswith(kind if kind in ("BudgetError", "InputError", "TraceError", "ConfigError")
                               else "HarmonyError"), (name, got0, got1)
        assert "rank 1 failed while" in got0 and got1.split(":", 1)[1].strip()[:40] in got0, (name, got0)
        assert steps0 == steps1 == 1, name
