"""Bytes moved between host and device per training iteration: harmony vs sequential vs ondemand.

The built-in GPT at 12 and 24 layers, budgets of 25% and 50% of its training state
(16 B/param: fp32 parameter, gradient, Adam m and v), 4, 16 and 64 microbatches of one
sequence each, planned for the Harmony paper's GPU (GTX 1080 Ti over PCIe; the budget is
the given share, not the GPU's memory) and run here. Every figure is measured by the
runtime on a real step (the second, once the optimizer state exists), not predicted.

Lower bound (per iteration, over every placement of the optimizer step), for a budget B
(less the planner's headroom, U = 0.95 B) and the parameters P (fp32 bytes), stash traffic
not counted and no room set aside for the working set of the layer being computed:
  * a parameter byte whose optimizer steps on the host moves at least 3 bytes (its gradient
    out once, its weight in for the forward and again for the backward), less 1 if its
    weight stays on the device across the turn from forward to backward, which holds 1 byte
    there;
  * one whose optimizer steps on the device moves nothing only if it and its optimizer state
    (2 bytes per byte for Adam) stay on the device the whole time (3 bytes held, 3 saved);
    anything less moves more than a host step would (its optimizer state in and out: 4);
  * so every byte held saves at most one byte moved, and at the turn everything held is on
    the device at once: moved >= 3 P - U. (This is the issue's bound: each parameter arrives
    once per phase unless it stays, each gradient leaves once.)
The column ``device_bound`` is the same bound for schedules that step the optimizer on the
device (``optimizer_on="device"``; the column ``harmony_device_step``): there parameters
are kept first, Rp = min(P, U), then optimizer state O = 2 P, Ro = min(O, U - Rp), and what
is not resident moves 3 (P - Rp) - T + 2 (O - Ro), T = min(P - Rp, U - Rp - Ro) the weights
that can stay across the turn.
How close a schedule can come: at the turn it also holds the last pack's working set (its
weights, gradients and activations) and, under Harmony's grouping, each pack's stashed inputs
for every microbatch; the bound gives that room to held weights. The partition picks packs
for the least predicted time, not the least traffic: on a small model a pack's fixed cost
favours few, large packs, whose working sets leave less room at the turn. The swap pass holds
weights between a pack's visits, and steps parameters on the device with all their state
resident, parameter by parameter where a whole pack's do not fit (at 12 layers, 16 microbatches,
25%: 28 of pack 2's 30 weights held beside pack 3's whole; 50%: every pack's weights held and 11
of pack 0's 38 parameters stepped on the device), and fills the budget. What the bound gives
to held state then goes to the working set at the turn and to the pack boundaries' activations
for every microbatch (1 MiB per boundary at 64 microbatches), kept or stashed.
"""
from __future__ import annotations

import argparse
import time

import common  # noqa: F401  (puts the repository on sys.path)
import torch

import harmony
from harmony.models import GPT, GPTConfig, copy_task


# Swap volume is a GPU-scale concern: plan as on the Harmony paper's GPU (GTX 1080 Ti over PCIe),
# where moving a byte costs as much as ~1000 FLOPs, rather than on this CPU, where memcpy is cheap.
HARDWARE = "gtx1080ti"


def lower_bound(model, budget: int, headroom: float) -> int:
    """Bytes any schedule moves per iteration, whatever it keeps where (see the module's docstring)."""
    p = sum(t.numel() * 4 for t in model.parameters())
    return int(max(0.0, 3 * p - budget * (1 - headroom)))


def device_step_bound(model, budget: int, headroom: float) -> int:
    """The same for schedules whose optimizer steps on the device."""
    p = sum(t.numel() * 4 for t in model.parameters())
    o = 2 * p
    usable = budget * (1 - headroom)
    rp = min(p, usable)
    ro = min(o, usable - rp)
    t = min(p - rp, usable - rp - ro)
    return int(3 * (p - rp) - t + 2 * (o - ro))


def measure(model, data, microbatches, budget, policy, optimizer_on="auto"):
    sm = harmony.compile(model, example_batch=data[0], memory_budget=budget, microbatches=microbatches,
                         policy=policy, optimizer_kwargs={"lr": 1e-4}, hardware=HARDWARE,
                         optimizer_on=optimizer_on)
    for x, y in data:
        sm(x, y)
    s = sm.stats
    sm.close()
    return s["h2d_bytes"] + s["d2h_bytes"], s["measured_peak"], len(sm.plan.packs), sm.program.config.headroom


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[12, 24])
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.5])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--seq", type=int, default=32)
    args = ap.parse_args()
    rows = []
    for layers in args.layers:
        c = GPTConfig(vocab=256, seq=args.seq, layers=layers, width=args.width, heads=4, tie=False)
        for frac in args.budgets:
            for m in args.microbatches:
                torch.manual_seed(0)
                model = GPT(c)
                state = 16 * sum(p.numel() for p in model.parameters())
                budget = int(state * frac)
                data = list(copy_task(c, m, 2))
                row = dict(layers=layers, budget=f"{frac:.0%}", microbatches=m)
                moved = {}
                t0 = time.perf_counter()
                for policy in ("harmony", "sequential", "ondemand"):    # each where it steps by default
                    moved[policy], peak, packs, headroom = measure(GPT(c), data, m, budget, policy)
                    assert peak <= budget or policy == "ondemand", (policy, peak, budget)
                    row[f"{policy}_MiB"] = moved[policy] / 2**20
                    if policy == "harmony":
                        row["packs"] = packs
                device, _, _, _ = measure(GPT(c), data, m, budget, "harmony", optimizer_on="device")
                row["harmony_device_step_MiB"] = device / 2**20
                bound = lower_bound(model, budget, headroom)
                row["bound_MiB"] = bound / 2**20
                row["harmony/bound"] = moved["harmony"] / bound if bound else float("nan")
                row["device_step/device_bound"] = device / device_step_bound(model, budget, headroom)
                row["sequential/harmony"] = moved["sequential"] / moved["harmony"]
                row["ondemand/harmony"] = moved["ondemand"] / moved["harmony"]
                row["target_ondemand"] = f">= {m / 2:g}"
                row["s"] = time.perf_counter() - t0
                rows.append(row)
                print(common.table(rows[-1:]), flush=True)
    print()
    print(common.table(rows, "bytes moved per iteration (measured on the second step)"))
    print("targets: harmony/bound <= 1.15 in every row; ondemand/harmony >= microbatches / 2")


if __name__ == "__main__":
    main()
