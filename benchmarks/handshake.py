"""What the ranks' handshake (driver/handshake.py) costs: 2 gloo ranks, one small model, replicated data parallel.

    python benchmarks/handshake.py [mlp|gpt|gpt-wide]

Prints the handshake's own time per call and a step's time with and without it (interleaved, median of each).
Not a test: a measurement, run by hand.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))   # the tests' models and spawn


def _measure(rank, world, case, calls, steps):
    import torch

    import harmony
    import harmony.data
    from models import CASES, training_state_bytes
    model, data = CASES["gpt"](batch=16, width=256, layers=4, seq=64) if case == "gpt-wide" else CASES[case](batch=16)
    sm = harmony.compile(model, example_batch=harmony.data.shard(data[0]), microbatches=2,
                         memory_budget=int(training_state_bytes(model) * 0.5), optimizer=torch.optim.AdamW)
    handshake = sm.handshake
    t0 = time.perf_counter()
    for _ in range(calls):
        handshake.agree("sm(...) (a training step)", sm.steps)
    per_call = (time.perf_counter() - t0) / calls
    with_it, without = [], []
    for i in range(2 * steps):
        sm.handshake = handshake if i % 2 else None
        t0 = time.perf_counter()
        sm(*harmony.data.shard(data[i % len(data)]))
        (with_it if i % 2 else without).append(time.perf_counter() - t0)
    sm.close()
    return per_call, statistics.median(with_it), statistics.median(without)


if __name__ == "__main__":
    from test_collectives import _spawn
    case = sys.argv[1] if len(sys.argv) > 1 else "mlp"
    res = _spawn(2, _measure, case, 500, 20 if case == "gpt-wide" else 40, timeout=600)
    for r, (per_call, w, wo) in sorted(res.items()):
        print(f"{case}, rank {r}: handshake {per_call * 1e6:.0f} us per call; step median {w * 1e3:.2f} ms with it, "
              f"{wo * 1e3:.2f} ms without ({(w - wo) / wo * 100:+.1f}%)")
