"""Mixed precision on the demo GPT: device peak, prediction and step time for fp32, bf16 and fp16.

Each run compiles the same GPT and trains the same copy-task batches. Rows: fp32 and bf16
under the same budget (bf16's 2-byte copies let the planner pick fewer, larger packs), then
bf16 (and, with --fp16, fp16) under half the budget, which gives the planner the same packs
as fp32 at the full budget, so the peaks compare at the same plan. Columns: packs, measured
device peak, verify's prediction and their ratio (target: within 10%), bytes moved per step,
median step time, and the peak relative to fp32's. fp16 matrix products are slow on most
CPUs (no native kernels), which is why it is opt-in here.
"""
from __future__ import annotations

import argparse
import statistics

import common
import torch

import harmony
from harmony.models import GPT, GPTConfig, copy_task


def run(c, data, budget, microbatches, precision):
    torch.manual_seed(0)
    model = GPT(c)
    sm = harmony.compile(model, example_batch=data[0], memory_budget=budget, microbatches=microbatches,
                         precision=precision)
    times = []
    for x, y in data:
        sm(x, y)
        times.append(sm.stats["step_seconds"])
    s = sm.stats
    sm.close()
    return dict(packs=len(sm.plan.packs), peak_MiB=s["measured_peak"] / 2**20,
                predicted_MiB=s["predicted_peak"] / 2**20, ratio=s["measured_peak"] / s["predicted_peak"],
                moved_MiB=(s["h2d_bytes"] + s["d2h_bytes"]) / 2**20,
                step_s=statistics.median(times[1:]) if len(times) > 1 else times[0])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--budget", type=float, default=0.4, help="share of the fp32 training state (16 B/param)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--fp16", action="store_true", help="also run fp16 (slow on a CPU)")
    args = ap.parse_args()
    c = GPTConfig(vocab=128, seq=64, layers=args.layers, width=args.width, heads=4)
    data = list(copy_task(c, args.batch, args.steps))
    torch.manual_seed(0)
    state = 16 * sum(p.numel() for p in GPT(c).parameters())
    budget = int(state * args.budget)
    cases = [("fp32", 1.0), ("bf16", 1.0), ("bf16", 0.5)] + ([("fp16", 0.5)] if args.fp16 else [])
    rows = []
    for precision, share in cases:
        r = run(c, data, int(budget * share), args.microbatches, precision)
        rows.append(dict(precision=precision, budget_MiB=budget * share / 2**20, **r))
    for r in rows:
        r["peak_vs_fp32"] = r["peak_MiB"] / rows[0]["peak_MiB"]
    print(common.table(rows, f"GPT {args.layers}x{args.width}, batch {args.batch} in {args.microbatches} "
                             f"microbatches, {args.steps} steps (median step after the first)"))


if __name__ == "__main__":
    main()
