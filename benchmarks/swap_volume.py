"""Bytes moved between host and device per training iteration: harmony vs sequential vs ondemand, and a lower bound.

The built-in GPT at 12 and 24 layers, budgets of 25% and 50% of its training state
(16 B/param: fp32 parameter, gradient, Adam m and v), 4, 16 and 64 microbatches of one
sequence each, run here; every figure is measured by the runtime on a real step (the second,
once the optimizer state exists), not predicted.

Where it is planned. Harmony's planner minimises the step's time. Swap volume is what this benchmark
measures, so the rows plan where moving bytes is what the step waits for: the Harmony paper's GPU
(GTX 1080 Ti) with its host link slowed 100x, 157 MB/s each way (``HARDWARE``; the budget is the
given share, not the GPU's memory). There the least time is the least traffic. On the GPU's own
PCIe 3.0 x16 the copies hide behind compute and the optimizer's host steps, and the planner rightly
spends bytes to save time (more cuts, less recompute): columns ``harmony_full_link_MiB`` and
``full_link/bound`` are that plan's traffic, shown beside the target's, not held to it.

Lower bound (``bound_MiB``): the least any schedule of Harmony's kind could move under the whole budget
``U`` (not the planner's 95% of it: a schedule that needs no margin for prediction error could fill it),
over every partition of the model into contiguous packs at the layer boundaries the planner cuts at
(``find_units``). Such a schedule runs every microbatch through a pack's forward before the next pack,
and its backward, recomputing from the pack's input, pack by pack in reverse; each gradient accumulates
on the device and leaves once. Per parameter byte, under host steps (the state does not fit):

  * its gradient leaves once and its weight comes in for the forward and again for the backward (3),
    less 1 if the weight stays on the device from its pack's forward to its backward, which holds it
    there meanwhile; the last pack's weights stay by construction (its forward hands over to its backward);
  * stepped on the device with its optimizer state instead (Adam: 3 bytes held for the whole step), it
    moves nothing;
  * every microbatch's activations crossing a cut, and later their gradients, wait on the device (a
    byte of room each) or go to the host and back (2 moved per byte);
  * during each pack j's backward the device holds its working set ``W_j`` (its weights and gradients,
    and one microbatch's activations saved for backward: the least any backward needs), the state
    stepped on the device, the weights held for the packs before j, and the activations crossing the
    cuts up to j and the gradients coming back through its output, for every microbatch: all within U.

This is a linear program per partition. Its constraint at one pack j gives the bound (derived in
``harmony.passes.partition.search.least_traffic``, which also minimises it over all partitions with a
DP): moved >= 3 P - U + W_j - P_j - P_after_j + 2 A_j - min(A_j, U - W_j), where ``P`` is the
parameters' bytes, ``P_j`` pack j's, ``P_after_j`` those of the packs after it (whose weights are gone
by then) and ``A_j`` the crossing bytes above. Each parameter arrives at least once per phase unless it
stays resident, each gradient leaves once, and the stash traffic the budget forces is what crosses the
cuts and cannot wait on the device. Column ``any_schedule_MiB`` is the bound without the working set or
the cuts, ``3 P - U`` (every byte of the budget holding state that saves a byte moved), which any
schedule of any kind respects; no schedule reaches it, since a backward needs its weights, gradients and
activations on the device.

The column ``device_bound`` is the same kind of bound for schedules that step the optimizer on the
device (``optimizer_on="device"``; the column ``harmony_device_step``), without the working set:
there parameters are kept first, Rp = min(P, U), then optimizer state O = 2 P, Ro = min(O, U - Rp),
and what is not resident moves 3 (P - Rp) - T + 2 (O - Ro), T = min(P - Rp, U - Rp - Ro) the weights
that can stay across the turn.
"""
from __future__ import annotations

import argparse
import time

import common  # noqa: F401  (puts the repository on sys.path)
import torch

import harmony
from harmony.compiler.hardware import Device
from harmony.models import GPT, GPTConfig, copy_task
from harmony.passes.partition import find_units
from harmony.passes.partition.cost import device_sizes
from harmony.passes.partition.search import least_traffic


# Plan where the host link is what the step waits for: the Harmony paper's GPU with its link slowed 100x.
HARDWARE = Device.preset("gtx1080ti", link=Device.preset("gtx1080ti").h2d_bandwidth / 100)
FULL_LINK = Device.preset("gtx1080ti")


def param_bytes(model) -> int:
    """P: the model's parameters, fp32 bytes."""
    return sum(t.numel() * 4 for t in model.parameters())


def any_schedule_bound(model, budget: int) -> int:
    """3 P - U: every byte of the budget holding state that saves one byte moved (see the module's docstring)."""
    return int(max(0, 3 * param_bytes(model) - budget))


def lower_bound(program, budget: int) -> int:
    """The least a schedule of Harmony's kind moves under ``budget`` over every partition of ``program``'s layers (the
    module's docstring): a pack's working set is its weights, its gradients and one microbatch's saved activations."""
    units = find_units(program)
    sizes = device_sizes(program)

    def work(s: int, e: int) -> float:
        params = frozenset().union(*(u.params for u in units[s:e]))
        return 2 * sum(sizes[n] for n in params) + sum(u.kept for u in units[s:e])
    found = least_traffic(units, sizes, program.config.microbatches, work, budget, budget)
    return 0 if found is None else int(found[0])


def device_step_bound(model, budget: int) -> int:
    """The same for schedules whose optimizer steps on the device."""
    p = param_bytes(model)
    o = 2 * p
    rp = min(p, budget)
    ro = min(o, budget - rp)
    t = min(p - rp, budget - rp - ro)
    return int(3 * (p - rp) - t + 2 * (o - ro))


def measure(model, data, microbatches, budget, policy, optimizer_on="auto", hardware=HARDWARE):
    sm = harmony.compile(model, example_batch=data[0], memory_budget=budget, microbatches=microbatches,
                         policy=policy, optimizer_kwargs={"lr": 1e-4}, hardware=hardware,
                         optimizer_on=optimizer_on)
    for x, y in data:
        sm(x, y)
    s = sm.stats
    sm.close()
    bound = lower_bound(sm.program, budget) if policy == "harmony" else None
    return dict(moved=s["h2d_bytes"] + s["d2h_bytes"], peak=s["measured_peak"], packs=len(sm.plan.packs),
                bound=bound)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[12, 24])
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.5])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--seq", type=int, default=32)
    common.add_json_arg(ap)
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
                        bound = r["bound"]
                full = measure(GPT(c), data, m, budget, "harmony", hardware=FULL_LINK)["moved"]
                row["harmony_full_link_MiB"] = full / 2**20
                device = measure(GPT(c), data, m, budget, "harmony", optimizer_on="device")["moved"]
                row["harmony_device_step_MiB"] = device / 2**20
                row["bound_MiB"] = bound / 2**20
                row["any_schedule_MiB"] = any_schedule_bound(model, budget) / 2**20
                row["harmony/bound"] = moved["harmony"] / bound if bound else float("nan")
                row["full_link/bound"] = full / bound if bound else float("nan")
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
    common.save_json(args.json, {"harmony/bound worst row": max(r["harmony/bound"] for r in rows),
                                 "harmony/bound mean": sum(r["harmony/bound"] for r in rows) / len(rows),
                                 "ondemand/harmony vs target worst": min(r["ondemand/harmony"] / (r["microbatches"] / 2)
                                                                         for r in rows),
                                 "rows": rows})


if __name__ == "__main__":
    main()
