"""Heterogeneous balance, simulated: Cephalo's example cluster, uniform vs Cephalo's choice vs Harmony's balance.

GPT 2.7B (32 layers, width 2560, 32 heads, sequence 1024), global batch 64, on 2 x L4 +
RTX A6000 + Tesla P40 (Cephalo, ICS'25). A SIMULATION on published figures, not a run:
each rank's step time is its microbatches' FLOPs (forward, backward and the recompute
of activation checkpointing: 8 x parameters x tokens, plus attention) over the device's
datasheet dense peak in the dtype it trains in (fp16 tensor cores on the L4 and A6000;
fp32 on the P40, whose fp16 rate is 1/64 of fp32) times a common sustained share
(``--efficiency``); memory holds the rank's shard of the 18 B/param mixed-precision state
(fp16 weights, fp32 master, Adam moments), the largest layer gathered twice in fp16,
and per sample the layer-boundary checkpoints plus one layer's activations
(34*s*h + 5*a*s^2 bytes, Korthikanti et al.). Throughput = global batch / slowest rank.
Cephalo's published choice: per-rank batches 13, 12, 34, 5 in 1, 2, 1, 1 microbatches,
equal state shares.
"""
from __future__ import annotations

import argparse
import time

import common
from harmony.compiler.balance import ModelCost, balance, evaluate, uniform
from harmony.compiler.hardware import Device

LAYERS, WIDTH, HEADS, SEQ, VOCAB = 32, 2560, 32, 1024, 50304


def gpt_cost() -> ModelCost:
    params = 12 * LAYERS * WIDTH ** 2 + VOCAB * WIDTH
    attention = 4 * LAYERS * SEQ ** 2 * WIDTH          # QK^T and AV, forward, per sample
    per_sample = 8 * params * SEQ + 4 * attention       # fwd + bwd (2x) + recompute fwd
    layer_acts = 34 * SEQ * WIDTH + 5 * HEADS * SEQ ** 2
    checkpoints = LAYERS * SEQ * WIDTH * 2
    return ModelCost(flops_const=0.0, flops_per_sample=per_sample, act_const=0.0,
                     act_per_sample=layer_acts + checkpoints, state_bytes=18 * params,
                     layer_bytes=2 * 2 * 12 * WIDTH ** 2)


def cluster(efficiency: float):
    out = []
    for name, dtype in (("l4", "fp16"), ("l4", "fp16"), ("a6000", "fp16"), ("p40", "fp32")):
        d = Device.preset(name)
        out.append(d.replace(dtype=dtype, efficiency=efficiency))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--efficiency", type=float, default=0.4, help="sustained share of peak FLOP/s, all devices")
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    cost, devices = gpt_cost(), cluster(args.efficiency)
    plans = {"uniform (16 each, 1 microbatch)": uniform(cost, devices, args.batch),
             "Cephalo's choice": evaluate(cost, devices, [(13, 1), (6, 2), (34, 1), (5, 1)], [0.25] * 4)}
    t0 = time.perf_counter()
    plans["Harmony balance (ILP)"] = balance(cost, devices, args.batch)
    solve = time.perf_counter() - t0
    rows = []
    base = plans["uniform (16 each, 1 microbatch)"].throughput
    for name, plan in plans.items():
        rows.append(dict(plan=name, status=plan.status,
                         batches=" ".join(f"{s.microbatch}x{s.microbatches}" for s in plan.shares),
                         state_shares=" ".join(f"{s.state_share:.2f}" for s in plan.shares),
                         step_s=plan.step_seconds, samples_per_s=plan.throughput, vs_uniform=plan.throughput / base))
    print(common.table(rows, f"SIMULATED: GPT 2.7B, batch {args.batch}, 2 x L4 + A6000 + P40 "
                             f"(efficiency {args.efficiency:g} of datasheet peak)"))
    h, c = plans["Harmony balance (ILP)"], plans["Cephalo's choice"]
    print(f"\nHarmony / Cephalo's choice: {h.throughput / c.throughput:.2f}x (target >= 1); "
          f"Harmony / uniform: {h.throughput / base:.2f}x (target >= 1.5); ILP solve {solve:.2f} s (target < 5 s)")
    print("devices: " + "; ".join(f"{d.name} {d.memory / 2**30:.0f} GiB {d.effective_flops / 1e12:.1f} TFLOP/s "
                                  f"sustained ({d.dtype})" for d in devices))


if __name__ == "__main__":
    main()
