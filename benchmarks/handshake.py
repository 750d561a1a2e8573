"""What the ranks' handshake (driver/handshake.py) and the job-wide step outcome (runtime/comm/jobwide.py: the ranks'
words on each collective of a step) cost: gloo ranks, one small model.

    python benchmarks/handshake.py [mlp|gpt|gpt-wide] [dp|zero3|pipeline] [ranks (2)]

Prints the handshake's own time per call and a step's time four ways, interleaved step by step, each way taking
each place in turn (on a shared machine the place in the rotation moved a way's median by up to 10%; median of each):
as the module runs (the handshake, and the words riding on the step's collectives: at the end of a buffer, or on
shard_state="full"'s first swap of chunks), "before" (the words in a meet of their own before each
collective except on two ranks' buffers: how three ranks or more ran before the words rode), without the words (the
handshake only: the step before the job-wide outcome), and with neither; and the handshake only again, a fifth way
that runs the same code as the fourth (``noise``: how far two medians of one code fall apart in the run; a cost
within it is no measured cost). Not a test: a measurement, run by hand.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))   # the tests' models and spawn


MODES = {"dp": {}, "zero3": dict(shard_state="full"), "pipeline": dict(parallel="pipeline")}


def _before(on: bool) -> None:
    """The words ride at the end of a two-rank buffer only, else meet first (``on``), or ride everywhere they can."""
    import harmony.runtime.partitioned as partitioned
    from harmony.runtime.comm.communicator import Communicator
    from harmony.runtime.partitioned import meet
    if not hasattr(_before, "saved"):
        _before.saved = Communicator.rides, meet.rides
    rides, shares_rides = _before.saved
    if on:
        Communicator.rides = lambda self: self.world == 2 and rides(self)
        partitioned.rides = meet.rides = \
            lambda shares, comm, plan=None: shares_rides(shares, comm, plan) and meet.swapped(shares)
    else:
        Communicator.rides, partitioned.rides, meet.rides = rides, shares_rides, shares_rides


def _measure(rank, world, case, calls, steps, mode="dp"):
    import torch

    import harmony
    import harmony.data
    from models import CASES, training_state_bytes
    model, data = CASES["gpt"](batch=24, width=256, layers=4, seq=64) if case == "gpt-wide" else CASES[case](batch=24)
    shard = (lambda b: b) if mode == "pipeline" else harmony.data.shard
    sm = harmony.compile(model, example_batch=shard(data[0]), microbatches=2,
                         memory_budget=int(training_state_bytes(model) * 0.5), optimizer=torch.optim.AdamW,
                         **MODES[mode])
    handshake, status = sm.handshake, sm.runtime.status
    t0 = time.perf_counter()
    for _ in range(calls):
        handshake.agree("sm(...) (a training step)", sm.steps)
    per_call = (time.perf_counter() - t0) / calls
    times: dict = {"both": [], "before": [], "handshake": [], "neither": [], "again": []}
    ways = len(times)
    for i in range(ways * steps):
        way = list(times)[(i + i // ways) % ways]     # each way at each place of the rounds alike: it moves a step
        sm.handshake = handshake if way != "neither" else None
        sm.runtime.status = status if way in ("both", "before") else None
        _before(way == "before")
        t0 = time.perf_counter()
        sm(*shard(data[i % len(data)]))
        times[way].append(time.perf_counter() - t0)
    sm.close()
    return per_call, {k: statistics.median(v) for k, v in times.items()}


if __name__ == "__main__":
    from test_collectives import _spawn
    case = sys.argv[1] if len(sys.argv) > 1 else "mlp"
    mode = sys.argv[2] if len(sys.argv) > 2 else "dp"
    world = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    res = _spawn(world, _measure, case, 500, 20 if case == "gpt-wide" else 40, mode, timeout=900)
    for r, value in sorted(res.items()):
        if isinstance(value, str):
            print(f"rank {r}: {value}")
            continue
        per_call, t = value
        print(f"{case} {mode}, {world} ranks, rank {r}: handshake {per_call * 1e6:.0f} us per call; step median "
              f"{t['both'] * 1e3:.2f} ms with the handshake and the words riding "
              f"({(t['both'] - t['handshake']) / t['handshake'] * 100:+.1f}% on the handshake only), "
              f"{t['before'] * 1e3:.2f} ms with meets of their own where not at the end of a buffer (before; "
              f"{(t['before'] - t['handshake']) / t['handshake'] * 100:+.1f}%), {t['handshake'] * 1e3:.2f} ms with the "
              f"handshake only, {t['neither'] * 1e3:.2f} ms with neither; noise: the handshake only again "
              f"{t['again'] * 1e3:.2f} ms ({(t['again'] - t['handshake']) / t['handshake'] * 100:+.1f}%)")
