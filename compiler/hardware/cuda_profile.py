"""A CUDA GPU as ``Hardware.profile`` measures it: the timings of ``machine`` put into the description
``Hardware.detect`` made of this machine and its card.
"""
from __future__ import annotations

import time

from harmony.compiler.hardware import machine


def profile_cuda(base, seconds: float, path, device, block: tuple[int, ...]):
    """``base`` (the ``Hardware`` ``detect(path, device)`` describes) with its GPU measured in about ``seconds``:
    matmul FLOP/s per dtype, pinned copies both ways, device memory, launches, a transformer block at ``block``
    (width, tokens) run as a recomputing backward runs it; the host's memcpy and disk as for the CPU."""
    import torch
    flops = {dt: machine.cuda_matmul_flops(0.06 * seconds, device, dt) for dt in ("fp32", "tf32", "bf16", "fp16")}
    h2d, d2h, d2d = machine.cuda_copy_bandwidth(0.12 * seconds, device)
    launch = machine.cuda_launch_latency(0.03 * seconds, device)
    latency = machine.kernel_latency(0.05 * seconds, torch.get_num_threads(), device=device)
    plain = machine.kernel_latency(0.03 * seconds, torch.get_num_threads(), device=device, metered=False)
    call, op = machine.ondemand_latency(0.04 * seconds, torch.get_num_threads(), device=device)
    efficiency = machine.block_efficiency(0.16 * seconds, flops["fp32"], latency, torch.get_num_threads(),
                                          *block, device=device)
    copy = machine.memcpy_bandwidth(0.08 * seconds)
    read, write, how = machine.disk_bandwidth(0.25 * seconds, path)
    dev = base.devices[0].replace(
        peak_flops=flops, efficiency=efficiency, kernel_latency=latency, plain_kernel_latency=plain,
        h2d_bandwidth=h2d, d2h_bandwidth=d2h,
        ondemand_call_latency=call, ondemand_op_latency=op,
        memory_bandwidth=d2d, link="pinned copies", queued=True,
        source=f"Hardware.profile {time.strftime('%Y-%m-%d %H:%M')}: measured on {base.devices[0].name}")
    return base.replace(devices=(dev,), host_memory_bandwidth=2 * copy, disk_read_bandwidth=read,
                        disk_write_bandwidth=write,
                        notes=(f"measured by Hardware.profile: matmul {8192}^3 per dtype, pinned copies, "
                               f"device copies, {launch * 1e6:.3g} us per bare launch, tensor-op latency under "
                               f"the runtime's accounting, a transformer block of width {block[0]} on "
                               f"{block[1]} tokens, host memcpy, disk ({how}); nominal, not measured: network",))
