"""How close the host's AdamW step comes to the host's memory bandwidth (issue 63's item 1: a host step that overlaps
the backward is bounded by the bytes it moves, so its rate against a memory-bandwidth probe says how much faster it
could go).

The simulator costs a host step as its traffic (``runtime.plan.step_traffic``: 4 x (2 P + O) bytes, P the fp32
parameters, O the optimizer state) at ``Hardware.host_memory_bandwidth`` (twice the measured memcpy rate: a copy
reads and writes). This measures torch's CPU AdamW, in each implementation torch offers here (the for-loop, foreach
and fused), stepping fp32 parameters of ``--mib`` MiB with their gradients and state, and prints its traffic per
second against that figure: the share of the bandwidth the step reaches, which the simulator takes as 100%.

    python benchmarks/host_step.py [--mib 256] [--seconds 2] [--threads N]

``benchmarks/gpu.py`` prints the same table for the GPU machine's host before its rows (in its JSON's ``card``).
"""
from __future__ import annotations

import argparse
import statistics
import time

GB = 1e9
IMPLS = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}


def adamw_rates(mib: int = 256, seconds: float = 2.0, tensors: int = 8) -> dict:
    """{implementation: step traffic bytes/s}, the median step of each over ``seconds`` / 3, and the memory probe
    (``memcpy`` x 2, as ``Hardware.profile`` measures ``host_memory_bandwidth``). An implementation torch lacks here
    is left out."""
    import torch

    from harmony.compiler.hardware.machine import memcpy_bandwidth
    from harmony.runtime.plan import step_traffic
    numel = mib * 2**20 // 4 // tensors
    out = {"memory_bandwidth": 2 * memcpy_bandwidth(seconds / 4)}
    for name, kw in IMPLS.items():
        params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.randn(numel)
        try:
            opt = torch.optim.AdamW(params, lr=1e-4, **kw)
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
        out[name] = step_traffic(4 * numel * tensors, state) / statistics.median(times)
        del opt, params
    return out


def describe(rates: dict) -> str:
    """One line: each implementation's traffic rate and its share of the memory probe."""
    bw = rates["memory_bandwidth"]
    each = ", ".join(f"{k} {v / GB:.1f} GB/s ({v / bw:.0%})" for k, v in rates.items() if k != "memory_bandwidth")
    return f"host AdamW step traffic: {each} of the memory-bandwidth probe's {bw / GB:.1f} GB/s (memcpy x 2)"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="fp32 parameters stepped (MiB)")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = ap.parse_args(argv)
    import torch
    if a.threads:
        torch.set_num_threads(a.threads)
    rates = adamw_rates(a.mib, a.seconds)
    print(f"{torch.get_num_threads()} threads, {a.mib} MiB of parameters: {describe(rates)}")
    return rates


if __name__ == "__main__":
    main()
