"""The largest model one machine trains: the built-in GPT grown until its plan no longer fits the machine's tiers.

The search plans (on the meta device: nothing is allocated, no file written) the GPT of ``--width`` at growing
depth under three limits: the device budget (``--device-memory``), the host budget (``--host-memory``, Harmony's
``host_memory_budget``) and the disk's room (``--disk``, default the free space under ``--offload-dir``). A depth
fits where ``harmony.compile`` accepts the budgets and the plan puts no more on disk than the disk holds (with the
disk tier's own headroom). The deepest fitting plan's step is simulated on ``--hardware``, and with ``--run`` that
model is built and trained on ``--device`` for ``--steps``: measured step, model TFLOP/s, device peak against the
budget, the process's peak RSS against the host budget and the disk traffic, beside the predicted figures.
The peer is eager PyTorch's ceiling: the model whose fp32 + AdamW state alone fills the device.

    python benchmarks/largest.py --hardware h100-sxm --device-memory 72GiB --host-memory 100GiB --disk 56GiB
    python benchmarks/largest.py --run --device cuda --width 4096 --steps 3 --offload-dir /scratch   # on a GPU machine
    python benchmarks/largest.py --quick --run                                                       # a minute, here

The fp32 + AdamW state is 16 bytes a parameter (weights, gradients, two moments); the host's share of it is what
``host_memory_budget`` bounds. ``--run`` builds the model under ``harmony.empty_weights()``, so compile makes its
weights as it places them and the host never holds them all (``--eager-build``: built with its weights, which the
host then holds whole until compile has written the disk packs); the run's peak RSS is printed beside the budget.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import tempfile
import time

import common

from harmony.base.units import parse_bytes

GiB = 2**30


def gpt_config(a, layers: int):
    from harmony.models import GPTConfig
    return GPTConfig(vocab=a.vocab, seq=a.seq, layers=layers, width=a.width, heads=max(1, a.width // a.head_dim),
                     tie=False)


def card_hardware(path: str):
    """The card a ``benchmarks/gpu.py`` run measured (its JSON's ``card``) over the datasheet preset of its kind: plans
    for that machine simulated off it. Figures the record lacks stay the datasheet's (or nominal, for the host)."""
    from harmony.compiler.hardware import Hardware
    with open(path) as f:
        card = json.load(f)["card"]
    kind = next((k for k in ("h200", "h100", "a100") if k in card["name"].lower()), "a100")
    hw = Hardware.preset(f"{kind}-sxm" if kind != "a100" else "a100-80gb")
    dev = hw.devices[0]
    flops = dict(dev.peak_flops, **{k: card[f"{k}_flops"] for k in ("fp32", "bf16") if card.get(f"{k}_flops")})
    dev = dev.replace(name=card["name"] + " (measured by benchmarks/gpu.py)", peak_flops=flops, queued=True,
                      **{f: card[k] for f, k in (("h2d_bandwidth", "h2d"), ("d2h_bandwidth", "d2h"),
                                                 ("kernel_latency", "kernel_latency"), ("efficiency", "efficiency"),
                                                 ("plain_kernel_latency", "plain_kernel_latency"),
                                                 ("memory_bandwidth", "memory_bandwidth")) if card.get(k)})
    host = {f: card[f] for f in ("host_memory_bandwidth", "host_flops") if card.get(f)}
    return hw.replace(devices=(dev,), **host)


def hardware(a):
    from harmony.compiler.hardware import Hardware
    if a.hardware.endswith(".json"):
        hw = card_hardware(a.hardware)
    else:
        hw = Hardware.this_machine() if a.hardware == "this" else Hardware.preset(a.hardware)
    if a.host_ram:      # the machine's host memory, where the hardware description does not know it
        hw = hw.replace(host_memory=parse_bytes(a.host_ram, "--host-ram"))
    return hw.computing_in(a.precision)


def compile_options(a, hw) -> dict:
    import torch
    return dict(optimizer=torch.optim.AdamW, optimizer_kwargs=dict(lr=3e-4, weight_decay=0.1),
                memory_budget=a.device_memory, host_memory_budget=a.host_memory, microbatches=a.microbatches,
                precision=a.precision, hardware=hw, offload_dir=a.offload_dir)


def plan(a, hw, layers: int) -> dict:
    """The plan of ``layers`` layers on the meta device: its tiers' bytes and simulated step, or why it does not fit."""
    import torch
    import harmony
    from harmony.errors import BudgetError
    from harmony.models import GPT
    from harmony.runtime.tiers.dirs import room_needed
    from harmony.viz.report import tiers_of
    c = gpt_config(a, layers)
    with torch.device("meta"):
        model = GPT(c)
    x = torch.zeros(a.batch, a.seq, dtype=torch.long, device="meta")
    row = dict(layers=layers, width=c.width, params=c.n_params(), state_GiB=round(16 * c.n_params() / GiB, 3))
    t0 = time.perf_counter()
    try:
        sm = harmony.compile(model, (x, x), device="meta", **compile_options(a, hw))
    except BudgetError as e:
        return dict(row, fits=False, why=str(e).split(":")[0][:120])
    tiers = tiers_of(sm.program)
    sim = sm.simulate(hw.logical([a.device_memory]))
    disk_need = room_needed(tiers["disk_bytes"])     # as compile checks the disk it runs on
    row.update(fits=disk_need <= a.disk, packs=len(sm.plan.packs),
               device_GiB=round(tiers["device_bytes"] / GiB, 3), host_GiB=round(tiers["host_bytes"] / GiB, 3),
               disk_GiB=round(tiers["disk_bytes"] / GiB, 3), predicted_peak_GiB=round(sm.predicted.peak / GiB, 2),
               predicted_step_s=round(sim.step_seconds, 3),
               predicted_tflops=round(6 * c.n_params() * a.batch * a.seq / sim.step_seconds / 1e12, 2),
               plan_s=round(time.perf_counter() - t0, 1))
    if not row["fits"]:
        row["why"] = f"the disk holds {a.disk / GiB:.1f} GiB, the plan needs {disk_need / GiB:.1f}"
    return row


def search(a, hw) -> tuple[dict | None, list[dict]]:
    """The deepest GPT of ``a.width`` whose plan fits: depths doubled until one does not, then bisected."""
    tried: dict[int, dict] = {}

    def fits(layers: int) -> bool:
        if layers not in tried:
            tried[layers] = plan(a, hw, layers)
            print(json.dumps(tried[layers]), flush=True)
        return tried[layers]["fits"]
    if not fits(1):
        return None, list(tried.values())
    lo, hi = 1, 2
    while hi <= a.max_layers and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, a.max_layers + 1)
    while hi - lo > 1:       # lo fits, hi does not (or is past the largest depth asked for)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return tried[lo], [tried[k] for k in sorted(tried)]


def run(a, hw, layers: int) -> dict:
    """Build the model of ``layers`` layers, compile it on ``a.device`` and train ``a.steps`` steps."""
    import torch
    import harmony
    from harmony.models import GPT
    torch.manual_seed(0)
    c = gpt_config(a, layers)
    t0 = time.perf_counter()
    # without its weights: compile makes them as it places them, so the host never holds the whole model
    with contextlib.nullcontext() if a.eager_build else harmony.empty_weights():
        model = GPT(c)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, c.vocab, (a.batch, c.seq), generator=g) for _ in range(a.steps)]
    sm = harmony.compile(model, (data[0], data[0]), device=a.device, **compile_options(a, hw))
    del model      # compile holds what it needs; the module the user passed keeps placeholders for disk packs
    setup = time.perf_counter() - t0
    sim = sm.simulate(hw.logical([a.device_memory]))
    times, stats = [], []
    try:
        for x in data:
            t = time.perf_counter()
            loss = float(sm(x, torch.roll(x, -1, dims=1)))
            times.append(time.perf_counter() - t)
            stats.append(dict(sm.stats, loss=loss))
            print(f"step {len(times)}: {times[-1]:.2f} s, loss {loss:.4f}", flush=True)
    finally:
        sm.close()
    step = statistics.median(times[1:] or times)
    last = stats[-1]
    out = dict(layers=layers, width=c.width, params=c.n_params(), device=a.device, setup_s=round(setup, 1),
               step_s=round(step, 3), tflops=round(6 * c.n_params() * a.batch * a.seq / step / 1e12, 3),
               predicted_step_s=round(sim.step_seconds, 3), measured_peak_GiB=round(last["measured_peak"] / GiB, 3),
               budget_GiB=round(a.device_memory / GiB, 3), predicted_peak_GiB=round(last["predicted_peak"] / GiB, 3),
               peak_rss_GiB=round(max(s["peak_rss_bytes"] for s in stats) / GiB, 2),
               host_budget_GiB=round(a.host_memory / GiB, 2), build="eager" if a.eager_build else "empty_weights",
               losses=[round(s["loss"], 4) for s in stats])
    for k in ("disk_read_bytes", "disk_write_bytes"):
        if k in last:
            out[k.replace("_bytes", "_GB")] = round(last[k] / 1e9, 2)
    if "cuda_allocated_peak" in last:
        out["cuda_allocated_GiB"] = round(last["cuda_allocated_peak"] / GiB, 3)
        out["cuda_reserved_GiB"] = round(last["cuda_reserved_peak"] / GiB, 3)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--hardware", default="this", help="a GPU preset (h100-sxm, ...), a benchmarks/gpu.py JSON "
                   "(the card it measured), or 'this': this machine's profile")
    p.add_argument("--host-ram", default=None, help="the host's memory, for --host-memory's default (60%% of it)")
    p.add_argument("--device-memory", default=None, help="the device budget (default 90%% of the device's memory)")
    p.add_argument("--host-memory", default=None, help="the host budget (default 60%% of the host's memory)")
    p.add_argument("--disk", default=None, help="room on disk (default: the free space under --offload-dir)")
    p.add_argument("--offload-dir", default=None, help="where --run's disk tier writes (default: the temp directory)")
    p.add_argument("--max-layers", type=int, default=512)
    p.add_argument("--layers", type=int, default=None, help="skip the search: plan (and --run) this depth")
    p.add_argument("--run", action="store_true", help="then build and train the model found")
    p.add_argument("--eager-build", action="store_true", help="--run builds the model with its weights (the "
                   "default builds it under harmony.empty_weights and compile makes them a pack at a time)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="a small search and run on this machine (a minute)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.quick:
        a.width, a.head_dim, a.seq, a.vocab, a.batch, a.microbatches, a.max_layers = 128, 64, 64, 512, 2, 2, 64
        # (the disk tier keeps 64 MiB of headroom on any disk: about 40 MiB of state here)
        a.device_memory, a.host_memory, a.disk = a.device_memory or "4MiB", a.host_memory or "8MiB", a.disk or "104MiB"
    hw = hardware(a)
    a.device_memory = parse_bytes(a.device_memory or int(0.9 * hw.devices[0].memory), "--device-memory")
    a.host_memory = parse_bytes(a.host_memory or int(0.6 * hw.host_memory), "--host-memory")
    a.disk = parse_bytes(a.disk or shutil.disk_usage(a.offload_dir or tempfile.gettempdir()).free, "--disk")
    print(f"hardware: {hw.describe()}\nlimits: device {a.device_memory / GiB:.2f} GiB, host {a.host_memory / GiB:.2f} "
          f"GiB, disk {a.disk / GiB:.2f} GiB; GPT width {a.width}, batch {a.batch} x {a.seq} in {a.microbatches} "
          f"microbatches, {a.precision}", flush=True)
    if a.layers is not None:
        best, tried = plan(a, hw, a.layers), []
    else:
        best, tried = search(a, hw)
    if tried:
        print(common.table([{k: v for k, v in r.items() if k != "why"} for r in tried], "plans tried"))
    result = dict(limits=dict(device=a.device_memory, host=a.host_memory, disk=a.disk), hardware=hw.describe(),
                  tried=tried, largest=best)
    if best is None or not best["fits"]:
        what = f"{a.layers} layers do not fit" if a.layers is not None else "no depth fits"
        print(f"{what} these limits" + (f": {best['why']}" if best else ""))
    else:
        print(f"largest: {best['params'] / 1e9:.3f}B parameters ({best['layers']} layers of width {best['width']}), "
              f"training state {best['state_GiB']} GiB: device {best['device_GiB']}, host {best['host_GiB']}, "
              f"disk {best['disk_GiB']} GiB between steps; predicted step {best['predicted_step_s']} s, "
              f"{best['predicted_tflops']} model TFLOP/s (simulated on {hw.devices[0].name})")
        # the peer: eager PyTorch holds the whole state on the device, so no model above this trains there
        eager = a.device_memory // 16
        result["eager_params_at_most"] = eager
        print(f"eager PyTorch: at most {eager / 1e9:.3f}B parameters (16 bytes each in the device's "
              f"{a.device_memory / GiB:.2f} GiB, activations aside); Harmony {best['params'] / eager:.1f}x that")
        if a.run:
            result["run"] = run(a, hw, best["layers"])
            print(common.table([{k: v for k, v in result["run"].items() if k != "losses"}], "measured"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
