"""Partitioned training state (shard_state="full", ZeRO-3) vs ZeRO-1 vs replicated data parallelism, per rank.

The built-in GPT (harmony/models.py, untied head), compiled under a device budget of half its training state with
the optimizer on the host, trained by 2 and 3 gloo ranks started with ``torchrun`` on this machine, one launch per
(world, mode) so each rank's peak RSS is its mode's. Per rank: the host bytes of its training state between steps
(fp32 weights and optimizer state, each storage once: ``runtime.partitioned.host_state_bytes``), what it stores in
memory and in its files together (``stored_MiB_per_rank``; ``stored_vs_one_rank``: against one replicated rank's,
``--worlds 1``: the 1/N target), its peak RSS, the
bytes it sent per step (all-reduce, or gather + reduce-scatter) and the median step time after a warm-up step.
The ranks share this machine's 2 cores, so step times compare the modes, not a cluster. The ``+clip`` modes clip by
the global norm (0.05, below the norm: every step clips), the ``+4bit`` ones send 4-bit gradients (CGX's codec):
the partitioned run's reduce-scatter is the quantized all-reduce's first half. ``deepspeed`` runs DeepSpeed ZeRO-3
on the same ranks, GPT and per-rank batch, with parameters and optimizer state on NVMe (benchmarks/zero3_peer.py;
where ``pip install -e ".[bench]"`` and libaio are there, else its row says what is missing); its state is on disk,
so its host column is empty and its disk columns (bytes each rank's process read from and wrote to the block
device per step, /proc/self/io) are where its state moves. Harmony's ``full`` keeps its share in host memory;
``full+disk`` keeps it on disk as DeepSpeed does (runtime/partitioned/disk.py), beside ``replicated+disk``, whose
ranks each keep and read whole files.

    python benchmarks/partition.py                      # 2 and 3 ranks, every mode
    python benchmarks/partition.py --modes full full+clip full+4bit replicated+4bit
    python benchmarks/partition.py --worlds 2 --modes replicated+disk full+disk deepspeed
    python benchmarks/partition.py --worlds 2 --layers 4 --width 256
    python benchmarks/partition.py --worlds 1 2 --modes replicated full deepspeed --layers 12 --width 512 --heads 8 \
        --device-budget 0.125 --disk-group-mib 8 --host-budget 0.25    # a state 4x each rank's host budget

With ``--host-budget`` each Harmony rank plans under that host memory budget (a fraction of the whole state, per
rank), the offload pass putting on disk what does not fit: a replicated rank its whole state's, a partitioned rank
its share's, which leaves it room to keep more of its share in memory. ``--worlds 1`` runs one rank (the replicated
modes only) for the 1/N comparison.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import shutil
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import add_json_arg, save_json, table  # noqa: E402

MODES = {"replicated": dict(shard_state=False), "zero1": dict(shard_state=True), "full": dict(shard_state="full"),
         # clipping by the global norm, and 4-bit gradients: each partitioned beside its replicated reference
         "replicated+clip": dict(shard_state=False, clip_grad_norm=0.05),
         "full+clip": dict(shard_state="full", clip_grad_norm=0.05),
         "replicated+4bit": dict(shard_state=False, compression="4bit"),
         "full+4bit": dict(shard_state="full", compression="4bit"),
         # weights and optimizer state on disk: each replicated rank its whole files, each partitioned rank its share
         "replicated+disk": dict(shard_state=False, weights_on="disk"),
         "full+disk": dict(shard_state="full", weights_on="disk")}


PEER = "deepspeed"       # DeepSpeed ZeRO-3, parameters and optimizer state on NVMe (benchmarks/zero3_peer.py)


def rank_run(args) -> None:
    """One rank of one launch: compile, train, report this rank's figures to rank 0, which writes them."""
    import torch
    import torch.distributed as dist

    from benchmarks import zero3_peer
    if args.mode == PEER:
        return _peer_rank(args, zero3_peer)
    proc_io = zero3_peer.offload.proc_io

    import harmony
    import harmony.data
    from harmony.models import GPT, GPTConfig, copy_task
    from harmony.runtime.partitioned import host_state_bytes
    torch.manual_seed(0)
    c = GPTConfig(layers=args.layers, width=args.width, heads=args.heads, vocab=args.vocab, seq=args.seq, tie=False)
    model = GPT(c)
    world = int(os.environ["WORLD_SIZE"])
    data = list(copy_task(c, args.batch * world, args.steps + 1))
    state = sum(p.numel() * 4 * 4 for p in model.parameters())      # weights, grads, AdamW's two moments
    host = dict(host_memory_budget=int(state * args.host_budget)) if args.host_budget else {}
    if args.disk_group_mib:
        host["disk_group_bytes"] = int(args.disk_group_mib * 2**20)
    budget = int(state * args.device_budget)
    files = tempfile.mkdtemp(prefix="harmony-partition-")        # this rank's own: its files are counted below
    sm = harmony.compile(model, example_batch=harmony.data.shard(data[0]), memory_budget=budget,
                         microbatches=args.microbatches, optimizer=torch.optim.AdamW, optimizer_kwargs=dict(lr=1e-3),
                         optimizer_on="host", offload_dir=files, **host, **MODES[args.mode])
    times, sent, io = [], [], []
    for batch in data:
        before = proc_io()
        sm(*harmony.data.shard(batch))
        after = proc_io()
        io.append([after.get(k, 0) - before.get(k, 0) for k in ("read_bytes", "write_bytes")])
        times.append(sm.stats["step_seconds"])
        sent.append(sum(sm.stats.get(k, 0) for k in ("comm_wire_bytes", "gather_wire_bytes",
                                                     "reduce_scatter_wire_bytes")))
    on_disk = sum(f.stat().st_size for f in Path(files).rglob("*") if f.is_file())
    mine = dict(rank=dist.get_rank() if dist.is_initialized() else 0,
                host_state_MiB=host_state_bytes(sm.runtime.state) / 2**20, disk_state_MiB=on_disk / 2**20,
                peak_rss_MiB=sm.stats["peak_rss_bytes"] / 2**20, sent_MiB_per_step=sent[-1] / 2**20,
                step_s=statistics.median(times[1:]), params=sum(p.numel() for p in model.parameters()),
                read_MiB_per_step=statistics.median(r for r, _ in io[1:]) / 2**20,
                write_MiB_per_step=statistics.median(w for _, w in io[1:]) / 2**20)
    sm.close()
    shutil.rmtree(files, ignore_errors=True)
    _report(args, mine)


def _report(args, mine: dict) -> None:
    import torch.distributed as dist
    if not dist.is_initialized():        # one rank: no process group to gather over
        Path(args.out).write_text(json.dumps([mine]))
        return
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(every))


def _peer_rank(args, zero3_peer) -> None:
    """A DeepSpeed rank: the same GPT and per-rank batch, its state on NVMe (no host state to count)."""
    from harmony.models import GPTConfig, copy_task
    c = GPTConfig(layers=args.layers, width=args.width, heads=args.heads, vocab=args.vocab, seq=args.seq, tie=False)
    world = int(os.environ["WORLD_SIZE"])
    x, y = next(copy_task(c, args.batch * world, 1))
    r = int(os.environ["RANK"])
    mine = zero3_peer.rank(c, x.chunk(world)[r], y.chunk(world)[r], args.microbatches, args.steps + 1)
    _report(args, dict(mine, rank=r, host_state_MiB=None, disk_state_MiB=None, sent_MiB_per_step=None, params=None))
    import torch.distributed as dist
    dist.destroy_process_group()    # DeepSpeed's group: left to the interpreter's exit, gloo may abort the rank
    # and so may a thread of DeepSpeed's (its NVMe I/O) the interpreter's exit destroys unjoined ("terminate called
    # without an active exception"), which failed a whole run after every figure was in: the rank has reported
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(world: int, mode: str, args) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "ranks.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world), __file__,
               "--rank-run", mode, "--out", str(out)] + [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
                                                          ("layers", "width", "heads", "vocab", "seq", "batch",
                                                           "microbatches", "steps", "host_budget", "device_budget",
                                                           "disk_group_mib")]
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=1200)
        if done.returncode:
            raise SystemExit(f"{mode} on {world} ranks failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="samples per rank")
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    ap.add_argument("--device-budget", type=float, default=0.5,
                    help="each rank's memory_budget as a fraction of the GPT's training state")
    ap.add_argument("--disk-group-mib", type=float, default=0.0, help="disk_group_bytes in MiB (0: the default)")
    ap.add_argument("--host-budget", type=float, default=0.0,
                    help="each Harmony rank's host_memory_budget as a fraction of the GPT's training state (0: none); "
                         "the offload pass then puts what does not fit on disk, a replicated rank its whole state's, a "
                         "partitioned rank its share's. --worlds 1 runs one rank (replicated modes only)")
    ap.add_argument("--modes", nargs="+", default=list(MODES) + [PEER], choices=list(MODES) + [PEER],
                    help=f"{PEER}: DeepSpeed ZeRO-3 with NVMe offload on the same ranks, where it is installed")
    ap.add_argument("--rank-run", default=None, choices=list(MODES) + [PEER], help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    add_json_arg(ap)
    args = ap.parse_args()
    if args.rank_run:
        args.mode = args.rank_run
        return rank_run(args)
    from benchmarks import zero3_peer
    missing = zero3_peer.missing() if PEER in args.modes else None
    if missing:
        print(f"{PEER}: not run, {missing}")
    rows, figures, one = [], {}, None
    for world in args.worlds:
        runs = {mode: launch(world, mode, args) for mode in args.modes if not (mode == PEER and missing)
                and (world > 1 or mode.startswith("replicated"))}
        ref = next((m for m in runs if m.startswith("replicated")), args.modes[0])   # host bytes against it
        base = max(r["host_state_MiB"] for r in runs[ref])
        for mode, ranks in runs.items():
            host = [r["host_state_MiB"] for r in ranks]
            peer = mode == PEER
            # the training state a rank stores between steps, in its memory and its files; one rank's the 1/N target's
            stored = None if peer else max(r["host_state_MiB"] + r["disk_state_MiB"] for r in ranks)
            if world == 1 and mode == "replicated":
                one = stored
            row = dict(world=world, mode=mode, params=runs[ref][0]["params"],
                       host_state_MiB_per_rank="(on NVMe)" if peer else " ".join(f"{h:.1f}" for h in host),
                       host_vs_replicated=None if peer else max(host) / base,
                       stored_MiB_per_rank=stored, stored_vs_one_rank=stored / one if stored and one else None,
                       peak_rss_MiB_max=max(r["peak_rss_MiB"] or 0 for r in ranks),
                       disk_read_MiB_step=max(r["read_MiB_per_step"] for r in ranks),
                       disk_write_MiB_step=max(r["write_MiB_per_step"] for r in ranks),
                       sent_MiB_per_step=ranks[0]["sent_MiB_per_step"],
                       step_s_slowest=max(r["step_s"] for r in ranks))
            rows.append(row)
            if not peer:
                figures[f"w{world}_{mode}_host_MiB"] = max(host)
                if one:
                    figures[f"w{world}_{mode} stored/one rank"] = stored / one
            figures[f"w{world}_{mode}_step_s"] = row["step_s_slowest"]
        if "full" in runs and "replicated" in runs:     # the headline ratios python -m benchmarks reads
            figures[f"w{world}_full/replicated host"] = (figures[f"w{world}_full_host_MiB"] /
                                                         figures[f"w{world}_replicated_host_MiB"])
            figures[f"w{world}_full/replicated step"] = (figures[f"w{world}_full_step_s"] /
                                                         figures[f"w{world}_replicated_step_s"])
        if "full+disk" in runs and "replicated+disk" in runs:
            figures[f"w{world}_full+disk/replicated+disk write"] = (
                max(r["write_MiB_per_step"] for r in runs["full+disk"]) /
                max(max(r["write_MiB_per_step"] for r in runs["replicated+disk"]), 1e-9))
        for a, b in (("full+disk", "replicated+disk"), ("full", "replicated")):
            if a in runs and b in runs:
                figures[f"w{world}_{a}/{b} read"] = (max(r["read_MiB_per_step"] for r in runs[a]) /
                                                     max(max(r["read_MiB_per_step"] for r in runs[b]), 1e-9))
        if PEER in runs and "full+disk" in runs:
            figures[f"w{world}_full+disk/{PEER} step"] = (figures[f"w{world}_full+disk_step_s"] /
                                                          figures[f"w{world}_{PEER}_step_s"])
            rows.append(dict(world=world, mode=f"full+disk / {PEER}",
                             step_s_slowest=figures[f"w{world}_full+disk/{PEER} step"]))
        if PEER in runs and "full" in runs:
            figures[f"w{world}_full/{PEER} step"] = (figures[f"w{world}_full_step_s"] /
                                                     figures[f"w{world}_{PEER}_step_s"])
            rows.append(dict(world=world, mode=f"full / {PEER}", step_s_slowest=figures[f"w{world}_full/{PEER} step"]))
    print(table(rows, "partitioned state vs ZeRO-1 vs replicated, per rank (measured on this machine)"))
    save_json(args.json, figures)


if __name__ == "__main__":
    main()
