"""Bytes moved between host and device per training iteration: harmony vs sequential vs ondemand.

The built-in GPT at 12 and 24 layers, budgets of 25% and 50% of its training state
(16 B/param: fp32 parameter, gradient, Adam m and v), 4, 16 and 64 microbatches of one
sequence each, planned for the Harmony paper's GPU (GTX 1080 Ti over PCIe; the budget is
the given share, not the GPU's memory) and run here. Every figure is measured by the
runtime on a real step (the second, once the optimizer state exists), not predicted.

Lower bound (per iteration, over every placement of the optimizer step), for a budget U (the
whole budget: Harmony's planner leaves 5% of it for its prediction error, but a schedule that
needs no such margin could fill it) and the parameters P (fp32 bytes), no room set aside for the
working set of the layer being computed:
  * a parameter byte whose optimizer steps on the host moves at least 3 bytes (its gradient
    out once, its weight in for the forward and again for the backward), less 1 if its
    weight stays on the device across the turn from forward to backward, which holds 1 byte
    there;
  * one whose optimizer steps on the device moves nothing only if it and its optimizer state
    (2 bytes per byte for Adam) stay on the device the whole time (3 bytes held, 3 saved);
    anything less moves more than a host step would (its optimizer state in and out: 4);
  * so every byte held saves at most one byte moved, and at the turn everything held is on
    the device at once: moved >= 3 P - U. (Each parameter arrives once per phase unless it
    stays, each gradient leaves once.)
  * plus the stash traffic the budget forces (``forced_stash``): Harmony runs every microbatch
    through a pack before the next, so at the turn every microbatch's input to every pack after
    the first waits for its backward, on the device (a byte of room, so a byte of state not
    held: 1 more moved) or stashed (out and back: 2). A partition into k packs has k - 1 cuts,
    each crossed by at least the narrowest gap's bytes for every one of the M microbatches. Fewer
    packs are bigger: a pack's weights are all on the device during its backward, beside its
    gradients, which it accumulates over the microbatches there or sends out for each (M - 1
    more per byte); its largest pack has at least P / k. So the stash term is
    min over k of (k - 1) M a + (M - 1) max(0, 2 P / k - U), a the narrowest gap's bytes.
    Without it (the issue's first two terms alone) the bound gave the whole budget to held state;
    on 12 layers at a quarter of the state and 64 microbatches it adds 1 MiB to 18.7.
The column ``device_bound`` is the same bound for schedules that step the optimizer on the
device (``optimizer_on="device"``; the column ``harmony_device_step``), without the stash term:
there parameters are kept first, Rp = min(P, U), then optimizer state O = 2 P,
Ro = min(O, U - Rp), and what is not resident moves 3 (P - Rp) - T + 2 (O - Ro),
T = min(P - Rp, U - Rp - Ro) the weights that can stay across the turn.
How close a schedule can come: at the turn it also holds the last pack's working set (its
weights, gradients and activations) and, under Harmony's grouping, each pack's stashed inputs
for every microbatch, of every cut the partition makes, not only the fewest the budget forces; the
bound gives that room to held weights. The partition picks packs for the least predicted time,
not the least traffic: where the copies hide behind compute, cuts that save time cost bytes
(12 layers, half the state, 64 microbatches: the fewest bytes any 2 or 3 block-boundary packs move
is 14.9 MiB, 4.99 ms simulated; the planner's 4 packs move 16.8 MiB in 4.16 ms). The swap pass holds
weights between a pack's visits, and steps parameters on the device with all their state
resident, parameter by parameter where a whole pack's do not fit, and fills the budget.
"""
from __future__ import annotations

import argparse
import time

import common  # noqa: F401  (puts the repository on sys.path)
import torch

import harmony
from harmony.models import GPT, GPTConfig, copy_task
from harmony.passes.partition import find_units


# Swap volume is a GPU-scale concern: plan as on the Harmony paper's GPU (GTX 1080 Ti over PCIe),
# where moving a byte costs as much as ~1000 FLOPs, rather than on this CPU, where memcpy is cheap.
HARDWARE = "gtx1080ti"


def param_bytes(model) -> int:
    """P: the model's parameters, fp32 bytes."""
    return sum(t.numel() * 4 for t in model.parameters())


def lower_bound(model, budget: int, stash: float = 0.0) -> int:
    """Bytes any schedule moves per iteration, whatever it keeps where (see the module's docstring)."""
    return int(max(0.0, 3 * param_bytes(model) - budget + stash))


def forced_stash(program, budget: float, p: int) -> float:
    """The least stash traffic the budget forces on a Harmony schedule (the module's docstring): the
    narrowest gap between two layers that both hold parameters, crossed by every microbatch, at each cut
    of the cheapest pack count."""
    units = find_units(program)
    owns = [i for i, u in enumerate(units) if u.params]
    gap = min(units[s].cross_in for s in range(owns[0] + 1, owns[-1] + 1))
    m = program.config.microbatches
    return min((k - 1) * m * gap + (m - 1) * max(0.0, 2 * p / k - budget) for k in range(1, len(owns) + 1))


def device_step_bound(model, budget: int) -> int:
    """The same for schedules whose optimizer steps on the device."""
    p = param_bytes(model)
    o = 2 * p
    rp = min(p, budget)
    ro = min(o, budget - rp)
    t = min(p - rp, budget - rp - ro)
    return int(3 * (p - rp) - t + 2 * (o - ro))


def measure(model, data, microbatches, budget, policy, optimizer_on="auto"):
    sm = harmony.compile(model, example_batch=data[0], memory_budget=budget, microbatches=microbatches,
                         policy=policy, optimizer_kwargs={"lr": 1e-4}, hardware=HARDWARE,
                         optimizer_on=optimizer_on)
    for x, y in data:
        sm(x, y)
    s = sm.stats
    sm.close()
    stash = forced_stash(sm.program, budget, param_bytes(model)) if policy == "harmony" else 0.0
    return dict(moved=s["h2d_bytes"] + s["d2h_bytes"], peak=s["measured_peak"], packs=len(sm.plan.packs),
                stash=stash)


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
                    r = measure(GPT(c), data, m, budget, policy)
                    assert r["peak"] <= budget or policy == "ondemand", (policy, r["peak"], budget)
                    moved[policy] = r["moved"]
                    row[f"{policy}_MiB"] = moved[policy] / 2**20
                    if policy == "harmony":
                        row["packs"] = r["packs"]
                        stash = r["stash"]
                device = measure(GPT(c), data, m, budget, "harmony", optimizer_on="device")["moved"]
                row["harmony_device_step_MiB"] = device / 2**20
                bound = lower_bound(model, budget, stash)
                row["stash_MiB"] = stash / 2**20
                row["bound_MiB"] = bound / 2**20
                row["harmony/bound"] = moved["harmony"] / bound if bound else float("nan")
                row["device_step/device_bound"] = device / device_step_bound(model, budget)
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
