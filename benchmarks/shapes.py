"""What a batch of a new shape costs: its first step (which plans it) against a step at a cached shape.

The demo GPT (``python -m harmony demo``'s defaults: 6 layers, width 256, 64 tokens, batch 16 in 4
microbatches, 40% of its training state as the budget; its position table twice as long, for the longer
sequence) is compiled for full batches; then an epoch's smaller last batch, a shorter sequence and a longer
one (where the compiled choice does not fit it: every pack recomputing and stashing, fewer rows per
microbatch if need be) each take a first step, which traces and plans the shape (driver/shapes.py), and
more steps from the cache. The table gives each shape's first step, its median cached step, and the seconds
its plan took (the example's: compile's).
"""
from __future__ import annotations

import argparse
import statistics
import time

import common
import torch

import harmony
from harmony.models import GPT, GPTConfig, copy_task


def timed(sm, x, y) -> float:
    t0 = time.perf_counter()
    sm(x, y)
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--budget", type=float, default=0.4, help="device budget as a share of the training state")
    ap.add_argument("--steps", type=int, default=5, help="cached steps per shape (the median is shown)")
    common.add_json_arg(ap)
    args = ap.parse_args()
    torch.manual_seed(0)
    c = GPTConfig(vocab=128, seq=2 * args.seq, layers=args.layers, width=args.width, heads=4)   # room for 1.5x seq
    model = GPT(c)
    x, y = next(copy_task(c, args.batch, 1))
    full = (x[:, :args.seq], y[:, :args.seq])
    budget = int(16 * sum(p.numel() for p in model.parameters()) * args.budget)
    t0 = time.perf_counter()
    sm = harmony.compile(model, full, memory_budget=budget, microbatches=args.microbatches)
    compile_s = time.perf_counter() - t0
    shapes = {"example": full, "last batch": (full[0][:args.batch - 3], full[1][:args.batch - 3]),
              "shorter sequence": (x[:, :args.seq // 2], y[:, :args.seq // 2]),
              "longer sequence": (x[:, :args.seq * 3 // 2], y[:, :args.seq * 3 // 2])}
    rows = []
    for name, (bx, by) in shapes.items():
        first = timed(sm, bx, by)
        cached = statistics.median(timed(sm, bx, by) for _ in range(args.steps))
        plan = sm.shapes.plans[harmony.driver.shapes.shape_key((bx, by))]
        split = plan.program.plan.rows or (plan.program.plan.microbatch_size,) * plan.program.plan.microbatches
        rows.append(dict(shape=f"{name} {list(bx.shape)}", microbatches="+".join(map(str, split)),
                         first_step_s=first, step_s=cached, first_over_step=first / cached,
                         plan_s=plan.seconds if name != "example" else compile_s,
                         peak_MiB=sm.stats["measured_peak"] / 2**20, budget_MiB=budget / 2**20))
    print(common.table(rows, f"GPT {args.layers}x{args.width}, batch {args.batch} in {args.microbatches} "
                             f"microbatches, budget {args.budget:.0%} of the training state "
                             f"(example row: plan_s is compile's)"))
    others = rows[1:]        # each other shape against the example's cached step: what a new shape costs
    common.save_json(args.json, {**{r["shape"]: {k: v for k, v in r.items() if k != "shape"} for r in rows},
                                 "new shape first/cached step worst": max(r["first_over_step"] for r in others),
                                 "peak/budget worst": max(r["peak_MiB"] / r["budget_MiB"] for r in rows)})


if __name__ == "__main__":
    main()
