"""The CPU as ``Hardware.profile`` measures it, when it is the device: the timings of ``machine`` put into
the description ``Hardware.detect`` made of this machine.
"""
from __future__ import annotations

import time

from harmony.compiler.hardware import machine


def profile_cpu(base, seconds: float, path, threads: int | None, block: tuple[int, ...]):
    """``base`` (the ``Hardware`` ``detect(path, device="cpu")`` describes) with its CPU device, host and disk
    measured in about ``seconds`` at ``threads`` intra-op threads (None: as many as torch uses now); ``block``: the
    transformer block's (width, tokens[, sequence length]). ``Hardware.profile`` says what each figure is."""
    if threads is None:
        import torch
        threads = torch.get_num_threads()
    flops = machine.matmul_flops(0.25 * seconds, threads)
    latency = machine.kernel_latency(0.05 * seconds, threads)
    call, op = machine.ondemand_latency(0.04 * seconds, threads)
    efficiency = machine.block_efficiency(0.2 * seconds, flops, latency, threads, *block)
    copy = machine.memcpy_bandwidth(0.12 * seconds)
    codec = machine.codec_rates(0.03 * seconds)
    read, write, how = machine.disk_bandwidth(0.35 * seconds, path)
    cpu = base.devices[0]
    dev = cpu.replace(peak_flops={"fp32": flops}, efficiency=efficiency, kernel_latency=latency,
                      ondemand_call_latency=call, ondemand_op_latency=op,
                      h2d_bandwidth=copy, d2h_bandwidth=copy, memory_bandwidth=2 * copy,
                      source=f"Hardware.profile {time.strftime('%Y-%m-%d %H:%M')}: measured")
    return base.replace(devices=(dev,), host_flops=flops, host_memory_bandwidth=2 * copy,
                        disk_read_bandwidth=read, disk_write_bandwidth=write, codec_rates=codec,
                        notes=(f"measured by Hardware.profile: fp32 matmul at {threads} threads, tensor-op "
                               f"latency, a transformer block of width {block[0]} on {block[1]} tokens, "
                               f"memcpy, the gradient codec, disk ({how}); nominal, not measured: network",))
