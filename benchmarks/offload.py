"""Training state several times the memory budget: Harmony's offload tiers vs DeepSpeed ZeRO-Infinity vs FSDP2.

The built-in GPT (random weights, untied head) trains the same batch for the same number of
steps under each system, each in its own subprocess so that peak RSS is per system:

  harmony    harmony.compile(..., memory_budget=--budget, host_memory_budget=--host-budget (640 MiB:
             the target's 1 GiB of RSS over the budget, less what Python and torch hold; Harmony
             fills what its pipeline leaves of it with files kept in memory),
             offload_dir=<dir>) with torch.optim.AdamW stepping on the host; whatever the
             offload pass puts on disk (here every pack wholly: weights and optimizer state,
             which the host budget cannot hold) lives in a private directory under --dir: each
             pack's weights are read for the forward and the backward, and its step, on the host
             thread while the next pack's backward runs, takes the backward's weights and reads
             and writes back the optimizer state. If Harmony refuses the host budget
             (BudgetError naming the smallest it accepts), the runner retries once with that
             minimum and says so in the table.
  deepspeed  DeepSpeed ZeRO-3 with ZeRO-Infinity offload of parameters AND optimizer state to
             NVMe (``nvme_path`` a directory under --dir), CPU accelerator, gloo, world size 1,
             pin_memory false, the model built inside ``deepspeed.zero.Init`` so it is never
             whole in RAM, ``max_in_cpu`` 0 so parameters really live on NVMe (ds_config says
             what else differs from DeepSpeed's defaults, and why). The optimizer is DeepSpeed's own CPU Adam in AdamW
             mode
             (DeepSpeedCPUAdam, adamw_mode=True: what ZeRO-Offload/Infinity uses), same lr
             and weight decay as torch's AdamW elsewhere.
  fsdp2      torch.distributed.fsdp.fully_shard per block and at the root with
             CPUOffloadPolicy(pin_memory=False) on a CPU gloo mesh of world size 1; torch AdamW
             (fused, as below).
             Everything stays in RAM (run it where the model fits).
  eager      plain PyTorch in memory (forward, backward, torch AdamW step): the compute reference.
             Harmony, FSDP2 and eager step torch's AdamW with the same arguments: fused=True, which
             Harmony adds where torch has the kernel (runtime/optim.py; torch's CPU default is a
             Python loop, 3.7x slower here on this model's 600M parameters: 1.45 vs 0.39 s).

Every child runs with torch's huge-page CPU allocations (THP_MEM_ALLOC_ENABLE=1, which importing
harmony sets; a value in the caller's environment wins), so the systems share one allocator
setting; each row's notes say whether it was in effect (huge_pages). The Harmony child imports
harmony before torch, as a user's script would, so its idle OpenMP threads sleep at once
(OMP_WAIT_POLICY=PASSIVE, harmony/process.py: 17.0 s a step instead of 18.3 here); the others
keep libgomp's default, a spin of ~8 ms between parallel regions (eager PyTorch, the bound's
compute, was no faster sleeping: 13.6 s against 12.9); each row's notes say which
(idle_threads_sleep).

Rounds: the systems run one after another, and again (--rounds, default 2; DeepSpeed, whose setup
takes 5-6 minutes, only in the first: --once): this machine's speed drifts by more than the
targets' margins from one run to the next (the same Harmony setup took 14.0-14.5, 15.1-17.3 and
17.2-18.2 s a step in three runs an hour apart, eager 13.8-14.1, 14.1-14.3 and 13.0-13.2, and
run back to back in one minute 13.8-15.1 against eager's 14.0-15.6), so each system is measured
at more than one moment, interleaved with the others. Every figure pools a system's runs (the
steps after each run's first); the compute bound takes eager's fastest step of them all.

Columns: median step time of the steps after the first (every step's time in the notes), and
the CPU seconds (user + system, all threads) the child spent in it: on a shared machine wall
time moves with the load and CPU time much less; the shares of the machine's cores idle and
stolen by the hypervisor during the steps (/proc/stat: idle + iowait, steal; this VM has had
1-15% stolen from one minute to the next), which lengthen a step without being its work. Disk
I/O is one cause here: an O_DIRECT read/write loop at 0.7-0.8 GB/s beside a 2-thread sgemm had
29-30% of the cores stolen and cut the sgemm's rate by 38% (10.4 -> 6.4 matmuls of 2048^2 a
second; 3% system time in the guest), so a system that overlaps disk traffic with compute on
busy cores, as Harmony does, pays for its I/O in compute time the bound below does not count
(measured again at the end of every run by io_interference; bound_io_s adds it, see below);
peak RSS over the whole child (getrusage ru_maxrss, taken before and after the reset below,
since clear_refs resets what getrusage reads too) and over the training steps only (VmHWM
after resetting it with /proc/self/clear_refs once setup is done); bytes the child really read
from and wrote to the block device per step (/proc/self/io read_bytes/write_bytes, median over
the steps after the first), and for Harmony also its own disk-tier counters (sm.stats); the
disk GB/s these imply over the step; and the bound max(compute, read/raw_read + write/raw_write),
where compute is the eager run's fastest step after the first (else FSDP2's, noted; the load
of a shared machine only slows a step, so the fastest is the truest) and the raw bandwidths are
measured in this run by an O_DIRECT sequential write, overwrite and read of --raw-bytes in --dir
(compiler/hardware/machine.py's disk_bandwidth, the helper Hardware.profile uses; the write rate is the
overwrite's, into allocated blocks, as the disk tier writes: the first, allocating write is in
the notes), just before and just after each system that uses the disk: a shared cloud disk's
rates move several-fold from one minute to the next (this machine's read 0.72 to 3.6 GB/s,
overwrite 0.51 to 1.27, between back-to-back runs), so each system's bound takes the mean of
the two probes around its own run. bound_io_s (and vs_bound_io) is that bound for a system that
overlaps its disk traffic with compute: max(compute + the compute the row's bytes cost when moved
beside it, disk_bound_s), the cost per GB read and written measured at the end of the run by
io_interference (a whole-machine sgemm alone and beside read and write loops); it explains a gap,
it is not the issue's target, which stays vs_bound.

Install for the DeepSpeed column (not in CI):
    apt-get install -y libaio-dev          # DeepSpeed's async_io op builds against it
    pip install -e ".[bench]"              # deepspeed; keep torch as it is (pin torch==<yours>)
The first DeepSpeed run JIT-builds async_io and cpu_adam (a few minutes each, cached under
~/.cache/torch_extensions). Without deepspeed or libaio the DeepSpeed row says what is
missing and the other columns still run.

    python benchmarks/offload.py                                   # ~600M params (~10 GB of state), 2 GiB budget
    python benchmarks/offload.py --layers 4 --width 256 --systems harmony,eager   # a quick look
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import common  # noqa: F401  (puts the repository on sys.path)

# the caller's OpenMP settings: importing harmony here (the disk probes) sets OMP_WAIT_POLICY in this process's
# environment, which must not reach the other systems' children
CALLER_OMP = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}

GiB = 2**30
SYSTEMS = ("harmony", "deepspeed", "fsdp2", "eager")
LR, WD = 1e-4, 0.01
MARK = "OFFLOAD-BENCH-RESULT "


# ----------------------------------------------------------------------------------------------
# the child: one system, its own process
# ----------------------------------------------------------------------------------------------

def proc_io() -> dict:
    """This process's block I/O so far: bytes really read from / written to storage (/proc/self/io)."""
    out = {}
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            k, v = line.split(":")
            out[k.strip()] = int(v)
    except OSError:
        pass
    return out


def machine_cpu() -> list[int]:
    """The whole machine's CPU time so far, in clock ticks: /proc/stat's first line (user nice system idle iowait
    irq softirq steal ...); [] where there is none."""
    try:
        return [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return []


def idle_steal(before: list[int], after: list[int]) -> tuple[float, float] | tuple[None, None]:
    """Shares of the machine's cores idle (idle + iowait) and stolen by the hypervisor (steal) between two
    ``machine_cpu`` readings: a step's wall time grows with both, neither is work the system did."""
    if len(before) < 8 or len(after) < 8:
        return None, None
    d = [b - a for a, b in zip(before, after)]
    total = sum(d) or 1
    return (d[3] + d[4]) / total, d[7] / total


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux clear_refs 5); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def vm_hwm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def model_config(a):
    from harmony.models import GPTConfig
    heads = a.heads or next(h for h in (16, 12, 8, 4, 2, 1) if a.width % h == 0)
    return GPTConfig(vocab=a.vocab, seq=a.seq, layers=a.layers, width=a.width, heads=heads, tie=False)


def example_batch(c, batch):
    from harmony.models import copy_task
    return next(iter(copy_task(c, batch, 1, seed=0)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo():
    if "TORCHELASTIC_RUN_ID" in os.environ:    # a torchrun rank (benchmarks/zero3_peer.py): its world as given
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def plain_step(model, opt, x, y):
    """One training step of an in-memory model: forward, backward, optimizer step; returns the loss."""
    def step():
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


def adamw_kwargs() -> dict:
    """torch AdamW's arguments for every system that steps with it: the implementation Harmony picks
    (fused where torch has it, runtime/optim.py), so the compute reference steps as fast as Harmony can."""
    import torch
    from harmony.runtime.optim import optimizer_kwargs
    return optimizer_kwargs(torch.optim.AdamW, dict(lr=LR, weight_decay=WD))


def setup_eager(a, c, x, y, workdir):
    import torch
    from harmony.models import GPT
    torch.manual_seed(0)
    model = GPT(c)
    kw = adamw_kwargs()
    opt = torch.optim.AdamW(model.parameters(), **kw)
    return plain_step(model, opt, x, y), {"optimizer": f"torch.optim.AdamW {kw}"}, lambda: None


def setup_fsdp2(a, c, x, y, workdir):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from harmony.models import GPT
    init_gloo()
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    model = GPT(c)
    policy = CPUOffloadPolicy(pin_memory=False)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    kw = adamw_kwargs()
    opt = torch.optim.AdamW(model.parameters(), **kw)
    info = {"optimizer": f"torch.optim.AdamW {kw} on DTensors"}
    return plain_step(model, opt, x, y), info, dist.destroy_process_group


def setup_harmony(a, c, x, y, workdir):
    import torch
    import harmony
    from harmony.errors import BudgetError
    from harmony.models import GPT
    torch.manual_seed(0)
    model = GPT(c)          # built once; compile plans over these tensors (the host's master copies)
    info = {"optimizer": "torch.optim.AdamW (plan.residency says where each pack steps)", "host_budget": a.host_budget}
    kw = dict(optimizer=torch.optim.AdamW, optimizer_kwargs=dict(lr=LR, weight_decay=WD),
              memory_budget=a.budget, microbatches=a.microbatches, offload_dir=workdir)
    try:
        sm = harmony.compile(model, (x, y), host_memory_budget=a.host_budget, **kw)
    except BudgetError as e:
        minimum = getattr(e, "min_budget", None)
        if not minimum:
            raise
        info["host_budget"] = f"{minimum / GiB:.2f}GiB (raised from {a.host_budget}: {str(e).split('. ')[0]})"
        sm = harmony.compile(model, (x, y), host_memory_budget=minimum, **kw)
    info["optimizer"] = f"torch.optim.AdamW {sm.optimizer_kwargs} (plan.residency says where each pack steps)"
    info["compile_s"] = round(sm.compile_seconds["total"], 2)
    info["packs"] = len(sm.plan.packs)
    for attr in ("step_on", "optim_on", "master_on"):   # the placements of the packs' residency records
        counts: dict = {}
        for record in sm.plan.residency.values():
            counts[getattr(record, attr)] = counts.get(getattr(record, attr), 0) + 1
        info[f"plan.{attr}"] = counts
    steps_stats = info.setdefault("stats", [])

    def step():
        loss = sm(x, y)
        s = {k: v for k, v in sm.stats.items() if isinstance(v, (int, float, str, bool))}
        steps_stats.append(s)
        return float(loss)
    return step, info, sm.close


PERSIST = 10**5       # stage3_param_persistence_threshold (DeepSpeed's default): smaller parameters stay in RAM


def ds_config(a, nvme: str, block_params: list[int], other_params: list[int]) -> dict:
    """ZeRO-3, parameters and optimizer state on NVMe. Beyond DeepSpeed's defaults:

    * ``max_in_cpu`` 0: its default, 1e9 elements, keeps every parameter of these models in CPU
      memory (swapped in from NVMe once, permanently), which is not parameter offload;
    * the parameter swap buffers: one holds one parameter, so each is just over the largest
      parameter (default 1e8 elements: 5 of them would be 2 GB of RSS), and there are enough for
      three blocks' swapped parameters plus the embeddings and head (with 5, DeepSpeed fails with
      "Not enough buffers 0 for swapping 1" as soon as it prefetches); the prefetch bucket is one
      block, at most two blocks' parameters are live and a parameter is kept for reuse only within
      one block (the default reuse distance, 1e9 elements, keeps every parameter of this model
      swapped in once fetched, and the buffers run out at once: the same error);
    * ``sub_group_size`` --ds-sub-group: the optimizer state swapped in at once (the default, 1e9
      elements, is the whole model here, 3x its size in RAM).
    """
    swapped = [n for n in block_params if n > PERSIST]
    others = [n for n in other_params if n > PERSIST]
    largest = max(swapped + others + [2**20])
    buffer = -(-largest // 2**20) * 2**20
    block = max(sum(swapped), 1)
    return {
        "train_batch_size": a.batch * int(os.environ.get("WORLD_SIZE", "1")),   # a.batch: each rank's
        "train_micro_batch_size_per_gpu": a.batch // a.microbatches,
        "gradient_accumulation_steps": a.microbatches,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme, "pin_memory": False, "buffer_size": buffer,
                              "buffer_count": 3 * len(swapped) + len(others) + 2, "max_in_cpu": int(a.ds_max_in_cpu)},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": False},
            "sub_group_size": int(a.ds_sub_group),
            "stage3_param_persistence_threshold": PERSIST,
            "stage3_prefetch_bucket_size": block,
            "stage3_max_live_parameters": 2 * block,
            "stage3_max_reuse_distance": block,
        },
        "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                "overlap_events": True},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class Missing(RuntimeError):
    """A peer that cannot run here (not installed): its row says what to install, without a traceback."""


def deepspeed_missing() -> str | None:
    """Why the DeepSpeed column cannot run here, or None."""
    try:
        import deepspeed  # noqa: F401
    except ImportError as e:
        return f"deepspeed is not installed ({e}): pip install -e '.[bench]' (or pip install deepspeed)"
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        if not AsyncIOBuilder().is_compatible(verbose=False):
            return ("DeepSpeed's async_io op cannot build: libaio is missing; "
                    "run `apt-get install -y libaio-dev` (Debian/Ubuntu)")
    except Exception as e:                     # noqa: BLE001
        return f"DeepSpeed's async_io op is unavailable: {type(e).__name__}: {e}"
    return None


def dedupe_nvme_prefetch() -> None:
    """Work around a DeepSpeed bug (0.19.8) that stops ZeRO-3 with parameters on NVMe at its second step.

    The coordinator's NVMe prefetch (``__prefetch_nvme_param_partitions``) walks the trace's
    parameter queue, where a parameter used at the end of the forward and again at the start of
    the backward (the last block's) appears twice; it passes both to ``swap_in``, which fails with
    "AssertionError: param N already assigned swap buffer id M". The coordinator's all-gather
    prefetch right above it skips such duplicates ("Avoid duplicates"); this does the same for the
    NVMe one. Without it the only working setting is no prefetch at all (stage3_prefetch_bucket_size
    0). --ds-no-dedupe runs DeepSpeed unpatched.
    """
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import AsyncPartitionedParameterSwapper as S
    if getattr(S.swap_in, "_deduped", False):
        return
    original = S.swap_in

    def swap_in(self, params, async_op=True, swap_in_buffers=None):
        if swap_in_buffers is None:
            params = list({p.ds_id: p for p in params}.values())
        return original(self, params, async_op=async_op, swap_in_buffers=swap_in_buffers)
    swap_in._deduped = True
    S.swap_in = swap_in


def setup_deepspeed(a, c, x, y, workdir):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    missing = deepspeed_missing()
    if missing:
        raise Missing(missing)
    import torch
    import deepspeed
    from harmony.models import GPT, GPTConfig
    if not a.ds_no_dedupe:
        dedupe_nvme_prefetch()
    init_gloo()
    deepspeed.init_distributed(dist_backend="gloo")
    nvme = os.path.join(workdir, "nvme")
    os.makedirs(nvme, exist_ok=True)
    one = GPT(GPTConfig(**{**vars(c), "layers": 1}))
    block_params = [p.numel() for p in one.blocks[0].parameters()]
    other_params = [p.numel() for n, p in one.named_parameters() if not n.startswith("blocks.")]
    del one
    cfg = ds_config(a, nvme, block_params, other_params)
    cfg["zero_optimization"].update(json.loads(a.ds_zero or "{}"))
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg, remote_device="nvme", pin_memory=False):
        model = GPT(c)          # partitioned and sent to NVMe module by module
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    inner = type(opt.optimizer).__name__ if hasattr(opt, "optimizer") else type(opt).__name__
    info = {"optimizer": f"{inner} (AdamW mode)",
            "ds_zero": {k: ({kk: vv for kk, vv in v.items() if kk != "nvme_path"} if isinstance(v, dict) else v)
                        for k, v in cfg["zero_optimization"].items()},
            "deepspeed": deepspeed.__version__,
            "nvme_prefetch_dedupe_patch": not a.ds_no_dedupe}
    mb = a.batch // a.microbatches

    def step():
        total = 0.0
        for i in range(a.microbatches):
            loss = engine(x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb])
            engine.backward(loss)
            engine.step()
            total += float(loss)
        return total / a.microbatches

    def close():
        engine.destroy() if hasattr(engine, "destroy") else None
    return step, info, close


SETUP = dict(eager=setup_eager, fsdp2=setup_fsdp2, harmony=setup_harmony, deepspeed=setup_deepspeed)


def child(a) -> None:
    import resource
    if a.child == "harmony":
        import harmony  # noqa: F401  (first, as a user's script would: it sets the process up before torch loads)
    import torch
    from harmony.base.process import huge_pages, idle_threads_sleep, rss_bytes
    workdir = a.workdir
    result = {"system": a.child}
    t0 = time.perf_counter()
    try:
        c = model_config(a)
        x, y = example_batch(c, a.batch)
        step, info, close = SETUP[a.child](a, c, x, y, workdir)
        result.update(info)
        result["setup_s"] = time.perf_counter() - t0
        result["huge_pages"] = huge_pages()
        result["idle_threads_sleep"] = idle_threads_sleep()
        result["rss_after_setup"] = rss_bytes()
        # clear_refs resets the high-water mark getrusage reads too: keep the setup's peak first
        result["peak_rss_setup"] = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, vm_hwm_bytes())
        result["hwm_reset"] = reset_peak_rss()
        times, cpus, reads, writes, losses, idles, steals = [], [], [], [], [], [], []
        for _ in range(a.steps):
            io0, m0 = proc_io(), machine_cpu()
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            s0 = time.perf_counter()
            losses.append(step())
            times.append(time.perf_counter() - s0)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            cpus.append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
            io1 = proc_io()
            idle, steal = idle_steal(m0, machine_cpu())
            idles.append(idle)
            steals.append(steal)
            reads.append(io1.get("read_bytes", 0) - io0.get("read_bytes", 0))
            writes.append(io1.get("write_bytes", 0) - io0.get("write_bytes", 0))
        result.update(step_s=times, cpu_s=cpus, idle=idles, steal=steals, threads=torch.get_num_threads(),
                      read_bytes=reads, write_bytes=writes, loss=losses,
                      peak_rss_steps=vm_hwm_bytes() if result["hwm_reset"] else None)
        close()
    except BaseException as e:                # noqa: BLE001  (the parent reports it as the row)
        result["error"] = f"{type(e).__name__}: {e}"
        if not isinstance(e, Missing):
            result["traceback"] = traceback.format_exc()
    result["peak_rss"] = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, vm_hwm_bytes(),
                             result.get("peak_rss_setup", 0), result.get("peak_rss_steps") or 0)
    result["torch"] = torch.__version__
    print(MARK + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------------------------
# the parent: raw disk bandwidth, one child per system, the table
# ----------------------------------------------------------------------------------------------

def raw_disk(path: str, nbytes: int) -> tuple[float, float, str]:
    """(read, write) bytes/s of a sequential O_DIRECT write then read of ``nbytes`` under ``path``."""
    from harmony.compiler.hardware.machine import disk_bandwidth
    # the helper writes until its cap or half its time budget: give it time enough to reach the cap
    return disk_bandwidth(max(60.0, nbytes / 2e7), path=path, cap=nbytes)


def io_interference(root: str, seconds: float, nbytes: int) -> dict:
    """Compute lost to disk traffic beside it: seconds of a whole-machine sgemm lost per byte read and written.

    A square sgemm on every core (compiler/hardware/machine.py's matmul_flops: the median run) runs alone, beside
    a loop of sequential 16 MiB reads of a file under ``root`` (O_DIRECT where the filesystem takes it),
    beside a loop of writes, and alone again, each for ``seconds``; lost = (1 - rate beside / rate alone)
    x seconds, per byte the loop moved. On this
    VM the hypervisor steals the vCPUs' time while the disk works, so a byte moved during compute
    costs compute; the bound max(compute, disk) counts none of it.
    """
    import mmap
    import threading

    import torch
    from harmony.compiler.hardware.machine import matmul_flops, takes_direct_io
    path, chunk = os.path.join(root, "interference.bin"), 16 << 20
    size = max(chunk, nbytes // chunk * chunk)
    buf = mmap.mmap(-1, chunk)                 # page aligned, as O_DIRECT wants
    buf.write(os.urandom(1 << 20) * 16)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        for at in range(0, size, chunk):
            os.pwrite(fd, view, at)
        os.fsync(fd)
    finally:
        os.close(fd)
    direct = os.O_DIRECT if takes_direct_io(path, buf) else 0   # else buffered, as the disk tier falls back to

    def rate(io=None) -> tuple[float, int, float]:
        """(sgemm FLOP/s on every core, bytes the ``io`` loop beside it moved, seconds it ran)."""
        stop, moved = threading.Event(), [0]

        def loop():
            fd = os.open(path, os.O_RDWR | direct)
            try:
                at = 0
                while not stop.is_set():
                    moved[0] += os.pwrite(fd, view, at) if io == "write" else os.preadv(fd, [view], at)
                    at = (at + chunk) % size
            finally:
                os.close(fd)
        t = threading.Thread(target=loop) if io else None
        if t:
            t.start()
        t0 = time.perf_counter()
        flops = matmul_flops(seconds, torch.get_num_threads(), n=1024)
        took = time.perf_counter() - t0
        stop.set()
        if t:
            t.join()
        return flops, moved[0], took
    try:
        first, (r, rb, rt), (w, wb, wt), last = rate()[0], rate("read"), rate("write"), rate()[0]
    finally:
        view.release()
        buf.close()
        os.remove(path)
    alone = (first + last) / 2
    lost = {k: max(0.0, 1 - x / alone) * took / moved if moved else 0.0
            for k, x, moved, took in (("read", r, rb, rt), ("write", w, wb, wt))}
    return dict(read_s_per_GB=1e9 * lost["read"], write_s_per_GB=1e9 * lost["write"], sgemm_GFLOPs_alone=alone / 1e9,
                sgemm_GFLOPs_reading=r / 1e9, sgemm_GFLOPs_writing=w / 1e9, read_GBps=rb / rt / 1e9,
                write_GBps=wb / wt / 1e9)


def run_child(system: str, a, workdir: str) -> dict:
    argv = [sys.executable, os.path.abspath(__file__), "--child", system, "--workdir", workdir]
    if a.ds_no_dedupe:
        argv.append("--ds-no-dedupe")
    for k in ("layers", "width", "heads", "vocab", "seq", "batch", "microbatches", "steps", "budget",
              "host_budget", "ds_sub_group", "ds_max_in_cpu", "ds_zero"):
        argv += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("THP_MEM_ALLOC_ENABLE", "1")   # the same allocator for every system (importing harmony sets it)
    for k, v in CALLER_OMP.items():               # and the caller's OpenMP waits (the harmony child sets its own)
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    t0 = time.perf_counter()
    p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    wall = time.perf_counter() - t0
    res = None
    for line in p.stdout.splitlines():
        if line.startswith(MARK):
            res = json.loads(line[len(MARK):])
    if a.verbose:
        shown = [line for line in p.stdout.splitlines() if not line.startswith(MARK)]
        print(f"--- {system} output ---\n" + "\n".join(shown))
    if res is None:     # killed (OOM?) or crashed before reporting
        tail = [line for line in p.stdout.splitlines() if line.strip()][-5:]
        why = f"exit code {p.returncode}" + (" (SIGKILL: out of memory?)" if p.returncode == -9 else "")
        res = {"system": system, "error": f"{why}; last output: {' | '.join(tail)}"}
    res["wall_s"] = wall
    if "error" in res and "traceback" in res:
        print(f"--- {system} failed ---\n{res['traceback']}", file=sys.stderr)
    return res


def gib(n):
    return None if n is None else n / GiB


def around(probes: list[tuple[str, tuple[float, float, str]]], system: str) -> tuple[float, float]:
    """(read, write) bytes/s for ``system``'s bound: the mean of the probes just before and after each of its runs."""
    after = [i for i, (n, _) in enumerate(probes) if n == f"after {system}" or n.startswith(f"after {system},")]
    if not after:            # it used no disk: its disk term is zero whatever the rate; the first probe will do
        return probes[0][1][:2]
    pairs = [probes[i][1] for a in after for i in (a - 1, a)]
    return sum(p[0] for p in pairs) / len(pairs), sum(p[1] for p in pairs) / len(pairs)


def steady(runs: list[dict], key: str) -> list:
    """``key``'s values over the steps after each run's first (a first step warms up), pooled over the runs."""
    return [v for r in runs for v in (r.get(key) or [])[1:]]


def median_of(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(results: dict, a, probes: list, interference: dict | None = None) -> tuple[list[dict], list[str]]:
    how = probes[0][1][2]
    notes = [f"raw disk under {a.dir or tempfile.gettempdir()} ({how}, {a.raw_bytes / GiB:.3g} GiB sequential), "
             "write/read GB/s: " + "; ".join(f"{name} {w / 1e9:.3g}/{r / 1e9:.3g}" for name, (r, w, _) in probes)]
    compute, compute_from = None, None
    for ref in ("eager", "fsdp2"):
        runs = results.get(ref)
        if runs and not any("error" in r for r in runs):   # the fastest step after the first: load only adds
            compute, compute_from = min(steady(runs, "step_s") or runs[0]["step_s"]), ref
            break
    if compute is not None:
        notes.append(f"compute time = the {compute_from} runs' fastest step after the first ({compute:.3g} s)"
                     + ("" if compute_from == "eager" else ": eager did not run"))
    if interference:
        i = interference
        notes.append(f"disk traffic beside compute (io_interference, at the end): a whole-machine sgemm ran at "
                     f"{i['sgemm_GFLOPs_alone']:.3g} GFLOP/s alone, {i['sgemm_GFLOPs_reading']:.3g} beside reads at "
                     f"{i['read_GBps']:.3g} GB/s, {i['sgemm_GFLOPs_writing']:.3g} beside writes at "
                     f"{i['write_GBps']:.3g} GB/s: {i['read_s_per_GB']:.3g} s of compute lost per GB read, "
                     f"{i['write_s_per_GB']:.3g} per GB written; bound_io_s = max(compute + that for the row's "
                     f"bytes, disk_bound_s), the bound for a system that overlaps its disk traffic with compute")
    rows = []
    for sysname in a.systems:
        runs = results[sysname]
        row = {"system": sysname}
        failed = next((r for r in runs if "error" in r), None)
        if failed is not None:
            row.update(step_s="failed", peak_rss_GiB=gib(failed.get("peak_rss")))
            notes.append(f"{sysname} FAILED: {failed['error']}")
            rows.append(row)
            continue
        t = median_of(steady(runs, "step_s"))
        rd, wr = median_of(steady(runs, "read_bytes")), median_of(steady(runs, "write_bytes"))
        idle, steal = median_of(steady(runs, "idle")), median_of(steady(runs, "steal"))
        steps = [r.get("peak_rss_steps") for r in runs]
        row.update(step_s=t, cpu_s=median_of(steady(runs, "cpu_s")),
                   idle_pct=None if idle is None else 100 * idle, steal_pct=None if steal is None else 100 * steal,
                   peak_rss_GiB=gib(max(r["peak_rss"] for r in runs)),
                   rss_steps_GiB=gib(max(steps)) if all(steps) else None,
                   read_GB_step=rd / 1e9, write_GB_step=wr / 1e9, disk_GBps=(rd + wr) / t / 1e9 if t else 0.0)
        if sysname == "harmony":
            st = steady(runs, "stats")
            hr = median_of([s.get("disk_read_bytes", 0) for s in st]) or 0
            hw = median_of([s.get("disk_write_bytes", 0) for s in st]) or 0
            row.update(h_read_GB=hr / 1e9, h_write_GB=hw / 1e9,
                       h_io_GBps="%.3g/%.3g" % (median_of([s.get("disk_read_GBps", 0) for s in st]) or 0,
                                                median_of([s.get("disk_write_GBps", 0) for s in st]) or 0))
        read_bw, write_bw = around(probes, sysname)
        disk_s = rd / read_bw + wr / write_bw
        bound = max(compute or 0.0, disk_s)
        row.update(raw_w_r=f"{write_bw / 1e9:.3g}/{read_bw / 1e9:.3g}" if rd + wr else "", disk_bound_s=disk_s,
                   bound_s=bound, vs_bound=t / bound if bound else None)
        if interference and compute is not None:    # compute slowed by the disk traffic beside it, if overlapped
            both = max(compute + (rd * interference["read_s_per_GB"] + wr * interference["write_s_per_GB"]) / 1e9,
                       disk_s)
            row.update(bound_io_s=both, vs_bound_io=t / both if both else None)
        rows.append(row)
        for rnd, r in enumerate(runs):
            extra = {k: v for k, v in r.items() if k not in ("system", "step_s", "cpu_s", "read_bytes", "write_bytes",
                                                             "loss", "idle", "steal",
                                                             "stats", "peak_rss", "peak_rss_steps", "traceback")}
            notes.append(f"{sysname}{f' (round {rnd + 1})' if len(runs) > 1 else ''}: steps "
                         + ", ".join(f"{s:.3g}" for s in r["step_s"]) + " s; losses "
                         + ", ".join(f"{x:.4g}" for x in r["loss"]) + "; read/write GB per step "
                         + ", ".join(f"{x / 1e9:.3g}/{w / 1e9:.3g}" for x, w in zip(r["read_bytes"], r["write_bytes"]))
                         + "; machine idle/steal % per step " + ", ".join(
                             "n/a" if i is None else f"{100 * i:.0f}/{100 * s:.0f}"
                             for i, s in zip(r.get("idle") or [], r.get("steal") or []))
                         + "; " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                             for k, v in extra.items()))
        r = runs[-1]
        if sysname == "harmony" and r.get("stats"):
            last = r["stats"][-1]
            keys = {k: v for k, v in last.items() if "disk" in k or "rss" in k or "param" in k}
            notes.append("harmony last-step sm.stats: " + ", ".join(f"{k}={v}" for k, v in keys.items()))
    cols = ["system", "step_s", "cpu_s", "idle_pct", "steal_pct", "peak_rss_GiB", "rss_steps_GiB", "read_GB_step",
            "write_GB_step", "disk_GBps", "h_read_GB", "h_write_GB", "h_io_GBps", "raw_w_r", "disk_bound_s", "bound_s",
            "vs_bound",
            "bound_io_s", "vs_bound_io"]
    cols = [k for k in cols if any(k in r for r in rows)]
    return [{k: r.get(k, "") for k in cols} for r in rows], notes


def ratios(rows: list[dict], a) -> list[str]:
    from harmony.base.units import parse_bytes
    by = {r["system"]: r for r in rows if isinstance(r.get("step_s"), float)}
    out = []
    h = by.get("harmony")
    if h:
        if h.get("vs_bound"):
            out.append(f"Harmony / bound     = {h['vs_bound']:.3g}   (target <= 1.25)")
        if h.get("vs_bound_io"):
            out.append(f"Harmony / bound_io  = {h['vs_bound_io']:.3g}   (the bound with the compute its disk traffic "
                       f"costs on this machine; not the issue's target)")
        d = by.get("deepspeed")
        if d:
            out.append(f"Harmony / DeepSpeed = {h['step_s'] / d['step_s']:.3g}   step time (target <= 0.67); "
                       f"peak RSS {h['peak_rss_GiB']:.3g} vs {d['peak_rss_GiB']:.3g} GiB (target: not higher)")
    e = by.get("eager")
    if e and e.get("cpu_s"):
        out.append("CPU seconds per step / eager's (work done, less sensitive to a shared machine's load): "
                   + ", ".join(f"{n} {r['cpu_s'] / e['cpu_s']:.3g}" for n, r in by.items() if r.get("cpu_s")))
    cap = parse_bytes(a.budget) + GiB
    for name, r in by.items():
        out.append(f"{name}: peak RSS / (budget + 1 GiB) = {r['peak_rss_GiB'] * GiB / cap:.3g} overall, "
                   + (f"{r['rss_steps_GiB'] * GiB / cap:.3g} over the steps" if r.get("rss_steps_GiB")
                      else "n/a over steps")
                   + "   (target <= 1)")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=1440)
    ap.add_argument("--heads", type=int, default=0, help="attention heads (0: 16, 12, 8... whichever divides width)")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget", default="2GiB", help="Harmony's memory_budget (the device's)")
    ap.add_argument("--host-budget", default="640MiB",
                    help="Harmony's host_memory_budget (raised to Harmony's stated minimum if it refuses); the "
                         "default is the 1 GiB over --budget that the peak-RSS target allows, less the ~330 MiB "
                         "the process holds itself (Python, torch, the graphs: 2GiB budget only)")
    ap.add_argument("--systems", default="harmony,deepspeed,fsdp2,eager",
                    help="comma-separated, from " + ",".join(SYSTEMS))
    ap.add_argument("--rounds", type=int, default=2,
                    help="run the systems this many times, one after another each round (a drifting machine is "
                         "measured at several moments); every figure pools a system's rounds")
    ap.add_argument("--once", default="deepspeed", help="comma-separated systems run in the first round only")
    ap.add_argument("--dir", default=None, help="where offload files and the raw-disk probe go (default: temp dir)")
    ap.add_argument("--raw-bytes", type=float, default=2 * GiB, help="bytes for the raw disk bandwidth probe")
    ap.add_argument("--interference-seconds", type=float, default=8.0,
                    help="seconds of each phase of the disk-beside-compute probe run at the end (0: skip it)")
    ap.add_argument("--ds-sub-group", type=float, default=5e7,
                    help="DeepSpeed sub_group_size: parameters whose optimizer state is swapped in at once")
    ap.add_argument("--ds-max-in-cpu", type=float, default=0,
                    help="DeepSpeed offload_param.max_in_cpu: parameter elements kept in CPU memory, not NVMe")
    ap.add_argument("--ds-no-dedupe", action="store_true",
                    help="run DeepSpeed without the NVMe-prefetch duplicate fix (fails at step 2 in 0.19.8)")
    ap.add_argument("--ds-zero", default="", help="JSON merged into DeepSpeed's zero_optimization config")
    ap.add_argument("--verbose", action="store_true", help="print each child's output")
    ap.add_argument("--json", help="also write the raw per-system results, rows and notes to this file")
    ap.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    a.systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    bad = [s for s in a.systems if s not in SYSTEMS]
    if bad:
        ap.error(f"unknown systems {bad}; choose from {','.join(SYSTEMS)}")
    if a.batch % a.microbatches:
        ap.error("--microbatches must divide --batch")
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    once = {s.strip() for s in a.once.split(",") if s.strip()}
    c = model_config(a)
    n = c.n_params()
    print(f"GPT {a.layers} layers x width {a.width} ({c.heads} heads), seq {a.seq}, batch {a.batch}: "
          f"{n / 1e6:.1f}M parameters, {16 * n / GiB:.2f} GiB of fp32 training state with AdamW; "
          f"budget {a.budget}, host budget {a.host_budget}; {a.steps} steps", flush=True)
    if a.dir:
        os.makedirs(a.dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="harmony-offload-bench-", dir=a.dir)
    try:
        probes = []

        def probe(name):
            raw = raw_disk(root, int(a.raw_bytes))
            probes.append((name, raw))
            print(f"raw disk {name}: write {raw[1] / 1e9:.3g} GB/s, read {raw[0] / 1e9:.3g} GB/s ({raw[2]})",
                  flush=True)
        probe("at the start")
        results: dict[str, list[dict]] = {}     # system -> one result per run
        for k in range(a.rounds):
            for s in a.systems:
                if k and (s in once or any("error" in r for r in results[s])):
                    continue
                workdir = os.path.join(root, s)
                os.makedirs(workdir)
                r = run_child(s, a, workdir)
                results.setdefault(s, []).append(r)
                shutil.rmtree(workdir, ignore_errors=True)
                name = s if a.rounds == 1 else f"{s}, round {k + 1}"
                print(f"{name}: " + (f"FAILED {r['error']}" if "error" in r else
                                     "steps " + ", ".join(f"{t:.3g}" for t in r["step_s"]) + " s, peak RSS "
                                     f"{r['peak_rss'] / GiB:.3g} GiB") + f" ({r['wall_s']:.0f} s wall)", flush=True)
                if "error" not in r and sum(r["read_bytes"]) + sum(r["write_bytes"]) > 2**20 * len(r["read_bytes"]):
                    probe(f"after {name}")
        interference = None
        if a.interference_seconds > 0:
            interference = io_interference(root, a.interference_seconds, min(int(a.raw_bytes), GiB))
            print("disk beside compute: " + ", ".join(f"{k} {v:.3g}" for k, v in interference.items()), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows, notes = summarize(results, a, probes, interference)
    notes.append("load average at the end (1, 5, 15 min; this machine has %d cores, shared): %s"
                 % (os.cpu_count(), ", ".join(f"{x:.2f}" for x in os.getloadavg())))
    print()
    print(common.table(rows, f"offload: GPT {n / 1e6:.0f}M params, {16 * n / GiB:.1f} GiB training state, "
                             f"budget {a.budget}; median of steps 2..{a.steps}"
                             + (f" of every run (rounds: {a.rounds})" if a.rounds > 1 else "")))
    print()
    for line in ratios(rows, a):
        print(line)
    print()
    for line in notes:
        print("- " + line)
    if a.json:
        raw = [dict(when=n, read=r, write=w, how=h) for n, (r, w, h) in probes]
        by = {r["system"]: r for r in rows if isinstance(r.get("step_s"), float)}
        headline = {f"harmony/{peer} step": by["harmony"]["step_s"] / by[peer]["step_s"]
                    for peer in ("eager", "deepspeed", "fsdp2") if "harmony" in by and peer in by}
        if "harmony" in by and by["harmony"].get("vs_bound"):
            headline["harmony/bound"] = by["harmony"]["vs_bound"]
        Path(a.json).write_text(json.dumps(dict(headline, raw_disk=raw, interference=interference, rows=rows,
                                                notes=notes, results=results), indent=1, default=str))


if __name__ == "__main__":
    main()
