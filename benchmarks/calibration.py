"""The simulator against reality: predicted versus measured step time on this machine.

What: the built-in GPT (default 6 layers, width 384, sequences of 128, batch 16 in 4
microbatches) under a budget of half its training state (16 B/param: fp32 weight,
gradient, Adam m and v), compiled for the ``harmony``, ``sequential`` and ``ondemand``
policies and run here; target: the prediction within 15% of the measured step for each.

How:
  * predicted: ``sm.simulate(hw)`` with ``hw = Hardware.profile(...).logical([budget])``,
    this CPU as a logical device holding the compile budget. The profile runs first, in
    this process, so it sees the machine as the steps will (the machine is shared):
    matmul peak, the cost of one tensor op under the runtime's accounting, the share of
    peak a transformer block of the model's width sustains on the model's tokens per
    microbatch, memcpy bandwidth. ``--cached`` uses ``Hardware.this_machine()`` instead.
    Nothing of the measured steps feeds the prediction.
  * measured: the median of ``--steps`` steps after ``--warmup`` warm-up steps (the first
    creates the optimizer state). The policies take turns step by step, so a change in
    the machine's load falls on all three alike.
  * one intra-op thread (``--threads``), for the profile and the steps alike. On this
    2-core machine shared with other busy processes, two threads stall at every op's
    barrier whenever another process holds a core: a transformer block ran in 0.05 s or
    0.53 s at random, and the profile and the steps need not draw the same luck (measured:
    a profile at 2 threads found 19% of peak sustained while the steps ran at full speed,
    so every prediction came out 4.7x too long). One thread ran the block in 0.08 s every
    time, and the steps no slower than with two.
  * what the model leaves out: the runtime's own per-op Python (the executor loop, the
    pack's fx module, autograd's start per backward), which weighs more as ops get
    smaller. At 256 tokens per microbatch and width 256 (``--quick``) predictions ran 2
    to 8% short of the measured steps; at the default 512 tokens, and at 12 layers or a
    25% budget, within 7% either way. (A profile of a single block, its weights hot in
    the cache, ran 15% short at ``--quick``; the profile now runs distinct layers.)
  * ``ondemand`` has no copies in its schedule: the runtime fetches state when an op
    touches it and evicts the least recently used. The simulator replays that at the
    granularity of a pack's parameters, gradients or optimizer state (an LRU over
    (pack, kind) in the room the activations leave), and charges the fetches and
    write-backs to the compute stream, since the op that touches the state waits for
    them. Its traffic is the simulator's, not a copy of another policy's. Its runtime also
    checks every tensor op for state to fetch, in Python (a function-level and a
    dispatch-level mode in forward and the step, the dispatch level in backward), which
    the profile measures per op (``ondemand_call_latency``, ``ondemand_op_latency``) and
    the simulator charges per op; without that charge it predicted 0.77 of the measured
    step at ``--quick``.

Files (``--out``, default ``$TMPDIR/harmony-calibration/``): ``<policy>_timeline.json``, predicted and
measured timelines of one policy in one Chrome/Perfetto trace (two processes: the
simulated device and the measured one), and ``<policy>_memory_predicted.svg`` /
``<policy>_memory_measured.svg``, device bytes over time against the budget.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import common
import torch

import harmony
from harmony.compiler.hardware import Hardware
from harmony.models import GPT, GPTConfig, copy_task
from harmony.viz import timeline

from harmony.compiler.config import POLICIES  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--budget", type=float, default=0.5, help="share of the training state (16 B/param)")
    ap.add_argument("--steps", type=int, default=7, help="measured steps per policy (median)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--trace", default="harmony", choices=POLICIES, help="policy whose timelines are written")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads for the steps and the profile")
    ap.add_argument("--profile-seconds", type=float, default=8.0)
    ap.add_argument("--cached", action="store_true", help="use the cached profile (Hardware.this_machine())")
    ap.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "harmony-calibration"))
    ap.add_argument("--quick", action="store_true", help="width 256, batch 8: about 30 s")
    common.add_json_arg(ap)
    args = ap.parse_args()
    if args.quick:
        args.width, args.batch, args.profile_seconds = 256, 8, 4.0
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    c = GPTConfig(vocab=512, seq=args.seq, layers=args.layers, width=args.width, heads=8, tie=False)
    tokens = args.batch // args.microbatches * args.seq
    hw = Hardware.this_machine() if args.cached else \
        Hardware.profile(seconds=args.profile_seconds, threads=args.threads,
                         block=(args.width, tokens, args.seq), save=False)
    print(hw.describe(), flush=True)

    torch.manual_seed(0)
    data = list(copy_task(c, args.batch, args.warmup + args.steps))
    state = 16 * c.n_params()
    budget = int(state * args.budget)
    compiled = {}
    for policy in args.policies:
        torch.manual_seed(0)
        compiled[policy] = harmony.compile(GPT(c), data[0], memory_budget=budget, microbatches=args.microbatches,
                                           policy=policy)
    times = {p: [] for p in args.policies}
    for i, (x, y) in enumerate(data):                 # the policies take turns, step by step
        for policy, sm in compiled.items():
            t0 = time.perf_counter()
            sm(x, y)
            if i >= args.warmup:
                times[policy].append(time.perf_counter() - t0)
    device = hw.logical([budget])
    rows, sims = [], {}
    for policy, sm in compiled.items():
        sims[policy] = sim = sm.simulate(device)
        measured = statistics.median(times[policy])
        ratio = sim.step_seconds / measured
        rows.append(dict(policy=policy, packs=len(sm.plan.packs), predicted_s=sim.step_seconds,
                         measured_s=measured, ratio=ratio, within_15pct="yes" if abs(ratio - 1) <= 0.15 else "NO",
                         steps_s=" ".join(f"{t:.2f}" for t in times[policy]),
                         predicted_MiB=sum(sim.moved.values()) / 2**20,
                         measured_MiB=(sm.stats["h2d_bytes"] + sm.stats["d2h_bytes"]) / 2**20))
    print()
    print(common.table(rows, f"GPT {args.layers}x{args.width}, seq {args.seq}, batch {args.batch} in "
                             f"{args.microbatches} microbatches, budget {args.budget:.0%} of "
                             f"{state / 2**20:.0f} MiB state: predicted vs measured step "
                             f"(median of {args.steps} after {args.warmup} warm-up)"))

    breakdown = []
    for policy, sm in compiled.items():
        op = {n.name: n.target.__name__ for n in sm.graph.nodes if n.op == "call_function"}
        for who, events in (("predicted", sims[policy].events), ("measured", sm.runtime.events)):
            row = dict(policy=policy, timeline=who)
            for e in events:
                kind = "host steps" if getattr(e, "stream", None) == "host" else op.get(e.name, "ondemand copies")
                row[kind] = row.get(kind, 0.0) + (e.end - e.start)
            if who == "measured":    # the host thread's optimizer updates (the step op only hands them over)
                row["host steps"] = sm.stats["host_step_seconds"]
            breakdown.append(row)
    print()
    print(common.table(breakdown, "seconds per op kind (measured: the last step; copies on their own streams "
                                  "overlap compute; host steps: the host thread's optimizer updates)"))

    out = Path(args.out)
    if args.trace in compiled:
        sm, sim = compiled[args.trace], sims[args.trace]
        measured = [dict(vars(e), device="measured (this CPU, runtime trace)") for e in sm.runtime.events]
        files = [timeline.chrome_trace(list(sim.events) + measured, out / f"{args.trace}_timeline.json"),
                 timeline.memory_plot(sim, out / f"{args.trace}_memory_predicted.svg", budget=budget,
                                      title=f"{args.trace}: predicted device bytes"),
                 timeline.memory_plot(sm.runtime.events, out / f"{args.trace}_memory_measured.svg", budget=budget,
                                      title=f"{args.trace}: measured device bytes (last step)")]
        print("\nwrote " + ", ".join(str(f) for f in files))
    for sm in compiled.values():
        sm.close()
    print(f"total {time.perf_counter() - t_start:.0f} s")
    common.save_json(args.json, {"simulator error worst policy": max(abs(r["ratio"] - 1) for r in rows),
                                 **{f"simulated/measured {r['policy']}": r["ratio"] for r in rows}})


if __name__ == "__main__":
    main()
