"""What the ranks' handshake (driver/handshake.py) and the job-wide step outcome (runtime/comm/jobwide.py: a meet
before each collective of a step) cost: 2 gloo ranks, one small model.

    python benchmarks/handshake.py [mlp|gpt|gpt-wide] [dp|zero3|pipeline]

Prints the handshake's own time per call and a step's time three ways, interleaved step by step, each way taking
each place in turn (on a shared machine the place in the rotation moved a way's median by up to 10%; median of each):
as the module runs (handshake and meets), without the meets (the handshake only: the step before the job-wide
outcome), and with neither. Not a test: a measurement, run by hand.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))   # the tests' models and spawn


MODES = {"dp": {}, "zero3": dict(shard_state="full"), "pipeline": dict(parallel="pipeline")}


def _measure(rank, world, case, calls, steps, mode="dp"):
    import torch

    import harmony
    import harmony.data
    from models import CASES, training_state_bytes
    model, data = CASES["gpt"](batch=16, width=256, layers=4, seq=64) if case == "gpt-wide" else CASES[case](batch=16)
    shard = (lambda b: b) if mode == "pipeline" else harmony.data.shard
    sm = harmony.compile(model, example_batch=shard(data[0]), microbatches=2,
                         memory_budget=int(training_state_bytes(model) * 0.5), optimizer=torch.optim.AdamW,
                         **MODES[mode])
    handshake, status = sm.handshake, sm.runtime.status
    t0 = time.perf_counter()
    for _ in range(calls):
        handshake.agree("sm(...) (a training step)", sm.steps)
    per_call = (time.perf_counter() - t0) / calls
    times: dict = {"both": [], "handshake": [], "neither": []}
    for i in range(3 * steps):
        way = list(times)[(i + i // 3) % 3]     # each way at each place of the triples alike: the place moves a step
        sm.handshake = handshake if way != "neither" else None
        sm.runtime.status = status if way == "both" else None
        t0 = time.perf_counter()
        sm(*shard(data[i % len(data)]))
        times[way].append(time.perf_counter() - t0)
    sm.close()
    return per_call, {k: statistics.median(v) for k, v in times.items()}


if __name__ == "__main__":
    from test_collectives import _spawn
    case = sys.argv[1] if len(sys.argv) > 1 else "mlp"
    mode = sys.argv[2] if len(sys.argv) > 2 else "dp"
    res = _spawn(2, _measure, case, 500, 20 if case == "gpt-wide" else 40, mode, timeout=900)
    for r, value in sorted(res.items()):
        if isinstance(value, str):
            print(f"rank {r}: {value}")
            continue
        per_call, t = value
        print(f"{case} {mode}, rank {r}: handshake {per_call * 1e6:.0f} us per call; step median "
              f"{t['both'] * 1e3:.2f} ms with the handshake and the meets, {t['handshake'] * 1e3:.2f} ms with the "
              f"handshake only ({(t['both'] - t['handshake']) / t['handshake'] * 100:+.1f}%), "
              f"{t['neither'] * 1e3:.2f} ms with neither")
