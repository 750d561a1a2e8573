"""The process group: made from the torchrun environment (and destroyed at exit), and its network measured as the
simulator costs it."""
from __future__ import annotations

import atexit
import math
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from harmony.runtime.comm.failures import guarded


def init_process_group(timeout: float = 60.0, backend: str | None = None, **kwargs) -> None:
    """``dist.init_process_group`` from the torchrun environment with a timeout in seconds.

    The backend defaults to gloo for host tensors beside nccl for CUDA ones when CUDA is available
    (``"cpu:gloo,cuda:nccl"``: the ranks' words on a step, a pipeline's messages and ZeRO-3's reduce-scatters are
    collectives on host tensors, which nccl alone does not take), else gloo. The timeout bounds every
    collective: a rank that dies or stalls makes the others fail instead of hanging.

    The group made here is destroyed at exit (``atexit``) unless the caller destroyed it first: a gloo
    group left for the interpreter's finalization can abort the process ("terminate called without an
    active exception", SIGABRT) after training ended well, when its workers free the tensors of their
    last work without the interpreter they need.
    """
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout), **kwargs)
    atexit.register(_destroy_at_exit, dist.group.WORLD)


def _destroy_at_exit(world) -> None:
    """The process group ``init_process_group`` made, destroyed while the interpreter is whole (if it still is
    the one in use: a caller may have destroyed it and made another)."""
    if dist.is_initialized() and dist.group.WORLD is world:
        dist.destroy_process_group()


def measure_network(nbytes: int = 16 << 20, repeats: int = 5, group=None) -> tuple[float, float]:
    """(bytes/s, seconds per message) of this group's fp32 all-reduce, as the simulator costs it.

    The simulator charges a ring all-reduce of ``n`` bytes ``2 (w - 1) / w * n / bandwidth +
    2 (w - 1) * latency``; this times ``repeats`` all-reduces of 4 KiB and of ``nbytes`` (medians)
    and solves for the two. A collective: every rank of ``group`` calls it, and gets the same
    figures (rank 0's, broadcast).
    """
    world = dist.get_world_size(group)
    if world == 1:
        return math.inf, 0.0

    small, big = (_timed(n, repeats, group, time.perf_counter, "network") for n in (4096, nbytes))
    hops = 2 * (world - 1)
    latency = max(small / hops, 1e-6)
    bandwidth = hops / world * nbytes / max(big - hops * latency, 1e-9)
    figures = torch.tensor([bandwidth, latency], dtype=torch.float64)
    guarded("the broadcast of rank 0's network figures", dist.broadcast, figures, src=0, group=group, peer=0)
    return float(figures[0]), float(figures[1])


def measure_socket_rate(nbytes: int = 16 << 20, repeats: int = 3, group=None) -> float:
    """Bytes/s of all-reduce traffic one core's gloo carries (``Hardware.socket_rate``, what the simulator costs a
    CPU device's all-reduce's socket work at): the bytes a rank sends and receives in an fp32 ring all-reduce of
    ``nbytes``, over the CPU seconds its process spends in it (every thread's: gloo's own do the socket work), the
    median of ``repeats`` on each rank, averaged over the ranks. CPU time, not wall time: a machine busy with other
    work does not make the figure lower. A collective: every rank of ``group`` calls it and gets the same figure."""
    world = dist.get_world_size(group)
    if world == 1:
        return math.inf
    seconds = _timed(nbytes, repeats, group, time.process_time, "socket")
    moved = 2 * 2 * (world - 1) / world * max(nbytes // 4, 1) * 4       # sent and as many received
    rate = torch.tensor([moved / max(seconds, 1e-9)], dtype=torch.float64)
    guarded("the socket measurement's average", dist.all_reduce, rate, group=group)
    return float(rate[0]) / world


def _timed(nbytes: int, repeats: int, group, clock, what: str) -> float:
    """The median over ``repeats`` of ``clock``'s seconds for an fp32 all-reduce of ``nbytes``, each after a
    barrier."""
    buf = torch.zeros(max(nbytes // 4, 1))
    times = []
    for _ in range(repeats):
        guarded(f"the {what} measurement's barrier", dist.barrier, group=group)
        t0 = clock()
        guarded(f"the {what} measurement's all-reduce", dist.all_reduce, buf, group=group)
        times.append(clock() - t0)
    return sorted(times)[len(times) // 2]
