"""What the training loop's extras cost a step on the demo GPT: clipping by the global norm.

The demo's model and budget (``python -m harmony demo``: 6 blocks of width 256, 40% of the training state, 4
microbatches). Harmony trains two compiled copies, without and with ``clip_grad_norm=1.0``, and eager PyTorch
trains two copies (the peer: the whole model resident, ``clip_grad_norm_`` before ``opt.step()`` or not), all
four alternating step by step so that each sees the same machine. The table gives median step seconds and what
clipping adds, in seconds and as a ratio, for both. Under Harmony clipping moves every pack's step after the
last backward (the norm needs every gradient), so it costs the overlap of the host steps with backward.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import common
import torch

import harmony
from harmony.models import GPT, GPTConfig, copy_task


def _eager(model, clip):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(x, y, m):
        for xs, ys in zip(x.chunk(m), y.chunk(m)):
            (model(xs, ys) / m).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return step


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--budget", type=float, default=0.4, help="device budget as a share of the training state")
    ap.add_argument("--steps", type=int, default=12, help="timed steps of each (after 2 warm-up steps)")
    ap.add_argument("--clip", type=float, default=1.0)
    common.add_json_arg(ap)
    args = ap.parse_args()
    torch.manual_seed(0)
    c = GPTConfig(vocab=128, seq=args.seq, layers=args.layers, width=args.width, heads=4)
    model = GPT(c)
    x, y = next(copy_task(c, args.batch, 1))
    budget = int(16 * sum(p.numel() for p in model.parameters()) * args.budget)
    runs = {}
    for name, clip in (("plain", None), ("clip", args.clip)):
        sm = harmony.compile(copy.deepcopy(model), example_batch=(x, y), memory_budget=budget,
                             microbatches=args.microbatches, clip_grad_norm=clip)
        runs[f"harmony_{name}"] = lambda sm=sm: sm(x, y)
        runs[f"eager_{name}"] = (lambda step=_eager(copy.deepcopy(model), clip): step(x, y, args.microbatches))
    times: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(args.steps + 2):
        for k, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            if i >= 2:
                times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [dict(run=who, step_s=med[f"{who}_plain"], clipped_step_s=med[f"{who}_clip"],
                 clip_adds_s=med[f"{who}_clip"] - med[f"{who}_plain"], ratio=med[f"{who}_clip"] / med[f"{who}_plain"])
            for who in ("eager", "harmony")]
    load = os.getloadavg()[0]
    print(common.table(rows, f"clip_grad_norm={args.clip:g} on the demo GPT ({args.layers}x{args.width}, budget "
                             f"{args.budget:.0%} of the state, {args.microbatches} microbatches; medians of "
                             f"{args.steps} interleaved steps; load average {load:.2f})"))
    common.save_json(args.json, dict(harmony_clip_ratio=rows[1]["ratio"], eager_clip_ratio=rows[0]["ratio"],
                                     harmony_clip_adds_s=rows[1]["clip_adds_s"], load=load))


if __name__ == "__main__":
    main()
