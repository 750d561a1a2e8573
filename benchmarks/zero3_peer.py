"""DeepSpeed ZeRO-3 with parameters and optimizer state on NVMe, as one torchrun rank of benchmarks/partition.py.

The same GPT, batch and optimizer settings as partition.py's Harmony ranks, set up as benchmarks/offload.py sets up
its DeepSpeed column (``setup_deepspeed``: built inside ``deepspeed.zero.Init`` so it is never whole in RAM, CPU
accelerator, gloo, ``max_in_cpu`` 0 so parameters really live on NVMe, pin_memory false; its docstring says what
else differs from DeepSpeed's defaults and why), launched with the world size torchrun gives. Per rank: the median
step time after the first, the peak RSS over the steps (VmHWM after a reset once setup is done), and the bytes the
rank's process read from and wrote to the block device per step (/proc/self/io).

Needs ``pip install -e ".[bench]"`` and ``apt-get install -y libaio-dev``; without them ``missing()`` says what
to install and partition.py's DeepSpeed row says so instead of a number.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))   # offload.py imports its siblings by name

import offload  # noqa: E402


def missing() -> str | None:
    """Why DeepSpeed cannot run here, or None."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return offload.deepspeed_missing()


def rank(c, x, y, microbatches: int, steps: int) -> dict:
    """Train ``steps`` batches (x, y: this rank's share) on this torchrun rank; its figures. (DeepSpeed's AdamW
    takes offload.py's lr; step time does not depend on it.)"""
    a = SimpleNamespace(batch=x.shape[0], microbatches=microbatches, ds_sub_group=5e7, ds_max_in_cpu=0,
                        ds_zero="", ds_no_dedupe=False)
    with tempfile.TemporaryDirectory(prefix="harmony-bench-ds-", dir=os.environ.get("HARMONY_BENCH_DIR")) as work:
        step, info, close = offload.setup_deepspeed(a, c, x, y, work)
        hwm = offload.reset_peak_rss()
        times, reads, writes = [], [], []
        for _ in range(steps):
            io0, t0 = offload.proc_io(), time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
            io1 = offload.proc_io()
            reads.append(io1.get("read_bytes", 0) - io0.get("read_bytes", 0))
            writes.append(io1.get("write_bytes", 0) - io0.get("write_bytes", 0))
        close()
    after = slice(1, None) if steps > 1 else slice(None)
    return dict(step_s=statistics.median(times[after]), peak_rss_MiB=offload.vm_hwm_bytes() / 2**20 if hwm else None,
                read_MiB_per_step=statistics.median(reads[after]) / 2**20,
                write_MiB_per_step=statistics.median(writes[after]) / 2**20, deepspeed=info["deepspeed"])
