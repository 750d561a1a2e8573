"""The host's AdamW step, measured and as the simulator prices it (issue 63's item 1: a host step that overlaps the
backward is bounded by the bytes it moves, so its price decides where each pack steps).

The simulator prices a step as its traffic under the optimizer's kernel (``runtime.plan.step_traffic``: the fused
kernel's one pass, 3 P + 2 O bytes, P the fp32 parameters, O the optimizer state; the for-loop and foreach forms'
temporaries, 4 x (2 P + O)) at the rate ``Hardware.profile`` measured for that kernel (``host_step_rates``: AdamW
steps of 32 MiB of parameters, ``compiler.hardware.machine.step_rates``), else at ``host_memory_bandwidth`` (the
memcpy probe x 2: a copy reads and writes). Before it priced every kernel as the for-loop at the probe.

This measures torch's CPU AdamW, in each implementation torch offers here (the for-loop, foreach and fused),
stepping fp32 parameters of ``--mib`` MiB with their gradients and state, and prints per kernel: the step measured,
its price now (the profile's rates measured here first, at the profile's size) and as priced before, with each
error; and each kernel's traffic per second against the memory probe.

    python benchmarks/host_step.py [--mib 256] [--seconds 2] [--threads N]

``benchmarks/gpu.py`` prints the share table for the GPU machine's host before its rows (in its JSON's ``card``).
"""
from __future__ import annotations

import argparse
import statistics
import time

GB = 1e9
IMPLS = ("for-loop", "foreach", "fused")


def adamw_steps(mib: int = 256, seconds: float = 2.0, tensors: int = 8) -> dict:
    """{implementation: (median seconds of a step, parameter bytes, optimizer state bytes)} over ``seconds`` /
    3 each. An implementation torch lacks here is left out."""
    import torch

    from harmony.runtime.plan import KERNEL_KWARGS
    numel, out = mib * 2**20 // 4 // tensors, {}
    for name in IMPLS:
        params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.randn(numel)
        try:
            opt = torch.optim.AdamW(params, lr=1e-4, **KERNEL_KWARGS[name])
            opt.step()                       # the state made and touched: the timed steps take no page faults
        except (RuntimeError, TypeError, ValueError):
            continue
        times, stop = [], time.perf_counter() + seconds / len(IMPLS)
        while len(times) < 3 or time.perf_counter() < stop:
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        state = sum(v.nbytes for s in opt.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor) and v.numel() > 1)
        out[name] = (statistics.median(times), 4 * numel * tensors, state)
        del opt, params
    return out


def adamw_rates(mib: int = 256, seconds: float = 2.0, tensors: int = 8) -> dict:
    """{implementation: its ``step_traffic`` bytes/s}, and the memory probe (``memcpy`` x 2, as ``Hardware.profile``
    measures ``host_memory_bandwidth``)."""
    from harmony.compiler.hardware.machine import memcpy_bandwidth
    from harmony.runtime.plan import step_traffic
    out = {"memory_bandwidth": 2 * memcpy_bandwidth(seconds / 4)}
    for name, (t, p, o) in adamw_steps(mib, seconds, tensors).items():
        out[name] = step_traffic(p, o, name) / t
    return out


def describe(rates: dict) -> str:
    """One line: each implementation's traffic rate and its share of the memory probe."""
    bw = rates["memory_bandwidth"]
    each = ", ".join(f"{k} {v / GB:.1f} GB/s ({v / bw:.0%})" for k, v in rates.items() if k != "memory_bandwidth")
    return f"host AdamW step traffic: {each} of the memory-bandwidth probe's {bw / GB:.1f} GB/s (memcpy x 2)"


def predicted_vs_measured(mib: int = 256, seconds: float = 2.0, threads: int | None = None) -> dict:
    """{implementation: {measured, predicted, predicted_before (seconds), error, error_before (predicted / measured
    - 1), traffic (bytes)}} of a step of ``mib`` MiB, priced on what ``Hardware.profile`` measures here now (the
    memory probe and the step rates at its own size), and ``memory_bandwidth``, ``host_step_rates``."""
    import types

    import torch

    from harmony.compiler.hardware import machine
    from harmony.runtime.plan import step_rate, step_traffic
    bw = 2 * machine.memcpy_bandwidth(seconds / 4)
    rates = machine.step_rates(seconds / 4, threads or torch.get_num_threads())
    hw = types.SimpleNamespace(host_memory_bandwidth=bw, memory_bandwidth=bw, host_step_rates=rates)
    out = {"memory_bandwidth": bw, "host_step_rates": dict(rates)}
    for name, (t, p, o) in adamw_steps(mib, seconds).items():
        now = step_traffic(p, o, name) / step_rate(hw, name, host=True)
        before = step_traffic(p, o, "for-loop") / bw        # every kernel as the for-loop, at the probe
        out[name] = dict(measured=t, predicted=now, predicted_before=before, error=now / t - 1,
                         error_before=before / t - 1, traffic=step_traffic(p, o, name))
    return out


def table(rows: dict) -> str:
    lines = [f"{'kernel':9} {'measured':>9} {'predicted':>10} {'error':>7} {'before':>9} {'error':>7}"]
    for name in IMPLS:
        if name in rows:
            r = rows[name]
            lines.append(f"{name:9} {r['measured'] * 1e3:7.1f}ms {r['predicted'] * 1e3:8.1f}ms {r['error']:+7.0%} "
                         f"{r['predicted_before'] * 1e3:7.1f}ms {r['error_before']:+7.0%}")
    rates = ", ".join(f"{k} {v / GB:.1f}" for k, v in rows["host_step_rates"].items())
    lines.append(f"priced on: memory probe {rows['memory_bandwidth'] / GB:.1f} GB/s (memcpy x 2); step rates "
                 f"(GB/s of step traffic, the profile's 32 MiB): {rates}; before: 4 x (2 P + O) at the probe")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="fp32 parameters stepped (MiB)")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = ap.parse_args(argv)
    import torch
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = predicted_vs_measured(a.mib, a.seconds)
    print(f"{torch.get_num_threads()} threads, {a.mib} MiB of parameters: a host AdamW step, measured and priced")
    print(table(rows))
    print(describe(dict(memory_bandwidth=rows["memory_bandwidth"],
                        **{k: rows[k]["traffic"] / rows[k]["measured"] for k in IMPLS if k in rows})))
    return rows


if __name__ == "__main__":
    main()
