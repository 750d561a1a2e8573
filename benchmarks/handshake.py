"""What the ranks' handshake (driver/handshake.py) and the job-wide step outcome (runtime/comm/jobwide.py: the ranks'
words on each collective of a step) cost: gloo ranks, one small model.

    python benchmarks/handshake.py [mlp|gpt|gpt-wide] [dp|zero3|pipeline] [ranks (2)]

Prints the handshake's own time per call and a step's time four ways, interleaved step by step, each way taking
each place in turn (on a shared machine the place in the rotation moved a way's median by up to 10%):
as the module runs (the handshake, and the words riding on the step's collectives: at the end of a buffer, or on
shard_state="full"'s first swap of chunks), "before" (the words in a meet of their own before each
collective except on two ranks' buffers: how three ranks or more ran before the words rode), without the words (the
handshake only: the step before the job-wide outcome), and with neither; and the handshake only again, a fifth way
that runs the same code as the fourth (``noise``: how far two medians of one code fall apart in the run; a cost
within it is no measured cost). Each cost is also given paired: the median over rounds of a way's step minus the
handshake-only step of the same round (a round runs every way once, back to back, so a load that comes and goes
falls on both), with a 95% bootstrap interval; an interval that holds 0 is no measured cost. Not a test: a
measurement, run by hand.

    python benchmarks/handshake.py mlp dp 3 --steps 200
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
    rounds = min(len(v) for v in times.values())
    paired = {k: [v[i] - times["handshake"][i] for i in range(rounds)] for k, v in times.items() if k != "handshake"}
    return per_call, {k: statistics.median(v) for k, v in times.items()}, paired


def interval(diffs: list[float], draws: int = 2000) -> tuple[float, float, float]:
    """The median of ``diffs`` and a 95% bootstrap interval of it (seeded: the same figures give the same interval)."""
    import random
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(draws))
    return statistics.median(diffs), meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


def main(argv: list[str]) -> None:
    import argparse
    from test_collectives import _spawn
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", nargs="?", default="mlp", choices=("mlp", "gpt", "gpt-wide"))
    ap.add_argument("mode", nargs="?", default="dp", choices=tuple(MODES))
    ap.add_argument("world", nargs="?", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="rounds (each way once per round; default 40, gpt-wide 20)")
    a = ap.parse_args(argv)
    case, mode, world = a.case, a.mode, a.world
    steps = a.steps or (20 if case == "gpt-wide" else 40)
    res = _spawn(world, _measure, case, 500, steps, mode, timeout=900 + 2 * steps)
    for r, value in sorted(res.items()):
        if isinstance(value, str):
            print(f"rank {r}: {value}")
            continue
        per_call, t, paired = value
        print(f"{case} {mode}, {world} ranks, rank {r}: handshake {per_call * 1e6:.0f} us per call; step median "
              f"{t['both'] * 1e3:.2f} ms with the handshake and the words riding "
              f"({(t['both'] - t['handshake']) / t['handshake'] * 100:+.1f}% on the handshake only), "
              f"{t['before'] * 1e3:.2f} ms with meets of their own where not at the end of a buffer (before; "
              f"{(t['before'] - t['handshake']) / t['handshake'] * 100:+.1f}%), {t['handshake'] * 1e3:.2f} ms with the "
              f"handshake only, {t['neither'] * 1e3:.2f} ms with neither; noise: the handshake only again "
              f"{t['again'] * 1e3:.2f} ms ({(t['again'] - t['handshake']) / t['handshake'] * 100:+.1f}%)")
        pairs = "; ".join(f"{way} {m * 1e3:+.2f} ms [{lo * 1e3:+.2f}, {hi * 1e3:+.2f}]" for way, (m, lo, hi) in
                          ((w, interval(d)) for w, d in paired.items()))
        print(f"  paired, per round, minus the handshake only (median [95% interval]): {pairs}")


if __name__ == "__main__":
    main(sys.argv[1:])
