"""Pipeline across devices (``parallel="pipeline"``, issue 31), part 1: a REAL run on this machine.

The built-in GPT trained (AdamW, fp32) by one rank, and by ``--ranks`` pipelined ranks (``torchrun
--nproc_per_node N``, gloo) with contiguous and round-robin placement, each rank a logical CPU device with the same
``memory_budget`` and the same EMULATED speed factor (``--speed-factor``, default 4: the runtime sleeps (factor - 1)
x the measured time of each compute op, so the ranks' compute does not fight over this machine's two cores and the
pipeline's overlap shows; Hardware.this_machine().logical(budgets, speed_factors), as benchmarks/hetero.py does).
Measured: the median step time after ``--warmup`` steps (the slowest rank's; every rank ends a step together, at
the loss broadcast), throughput in samples/s and its ratio to one rank; per rank the training state it holds
(``sm.stats`` state_weight_bytes + state_optim_bytes) and its peak RSS; whether the parameters after the run are
bitwise those of the one-rank run. Data parallel on the same ranks would hold the whole state on every rank: its
figure is the one-rank state times the ranks (not run).

    python benchmarks/pipeline.py                       # 4 ranks, 8 layers of width 256, speed factor 4
    python benchmarks/pipeline.py --ranks 2 --layers 4  # smaller

Not here yet: part 2 (the simulated paper servers) needs the simulator to model N devices and their links.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import common


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--speed-factor", type=float, default=4.0)
    ap.add_argument("--budget", type=float, default=0.5, help="each device's budget, a share of the training state")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--placement", default="contiguous", help=argparse.SUPPRESS)
    common.add_json_arg(ap)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    out = Path(tempfile.mkdtemp(prefix="harmony-pipeline-"))
    runs = {"1 rank": _launch(args, out, 1, "none")}
    for placement in ("contiguous", "round_robin"):
        runs[f"{args.ranks} ranks {placement}"] = _launch(args, out, args.ranks, placement)
    one = runs["1 rank"]
    rows = []
    for name, r in runs.items():
        rows.append(dict(run=name, packs=" ".join(str(p) for p in r["packs"]), step_s=r["step_s"],
                         samples_per_s=args.batch / r["step_s"], vs_one_rank=one["step_s"] / r["step_s"],
                         state_MiB=" ".join(f"{b / 2**20:.1f}" for b in r["state"]),
                         node_state_MiB=sum(r["state"]) / 2**20,
                         peak_rss_MiB=" ".join(f"{b / 2**20:.0f}" for b in r["rss"]),
                         within_budget=r["within"], bitwise_as_1_rank=r["digest"] == one["digest"]))
    print(common.table(rows, f"GPT {args.layers} layers x {args.width}, batch {args.batch} x {args.seq} tokens in "
                             f"{args.microbatches} microbatches, budget {args.budget:g} of the state per device, "
                             f"speed factor {args.speed_factor:g} (EMULATED)"))
    print(f"data parallel on {args.ranks} ranks would hold {args.ranks} x {sum(one['state']) / 2**20:.1f} MiB = "
          f"{args.ranks * sum(one['state']) / 2**20:.1f} MiB of training state on the node (not run)")
    common.save_json(args.json, {r["run"]: r["vs_one_rank"] for r in rows})


def _launch(args, out: Path, ranks: int, placement: str) -> dict:
    result = out / f"{ranks}-{placement}.json"
    base = [__file__, "--worker", str(result), "--placement", placement]
    for k in ("layers", "width", "seq", "batch", "microbatches", "speed_factor", "budget", "steps", "warmup"):
        base += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    if ranks == 1:
        cmd = [sys.executable] + base
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
               str(29500 + os.getpid() % 1000)] + base
    print(f"running {ranks} rank(s) {placement} ...", flush=True)
    subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1", HARMONY_COMM_TIMEOUT="120"))
    return json.loads(result.read_text())


def worker(args) -> None:
    import hashlib

    import torch
    import torch.distributed as dist

    import harmony
    from harmony.compiler.hardware import Hardware
    from harmony.models import GPT, GPTConfig, copy_task

    torch.set_num_threads(1)
    torch.manual_seed(0)
    c = GPTConfig(layers=args.layers, width=args.width, heads=max(1, args.width // 64), vocab=256, seq=args.seq,
                  tie=False)
    model = GPT(c)
    data = list(copy_task(c, args.batch, args.steps + args.warmup, seed=0))
    state = 16 * sum(p.numel() for p in model.parameters())
    budget = int(state * args.budget)
    hw = Hardware.this_machine().logical([budget], [args.speed_factor])
    kw = dict(parallel="pipeline", placement=args.placement) if args.placement != "none" else {}
    sm = harmony.compile(model, data[0], memory_budget=budget, microbatches=args.microbatches, hardware=hw, **kw)
    times, within = [], True
    for i, batch in enumerate(data):
        sm(*batch)
        within = within and sm.stats["measured_peak"] <= sm.stats["budget"]
        if i >= args.warmup:
            times.append(sm.stats["step_seconds"])
    mine = sm.state_dict()["model"]
    held = sm.stats.get("state_weight_bytes", 0) + sm.stats.get("state_optim_bytes", 0)
    if not kw:       # one rank: every weight and all optimizer state
        held = sum(t.nbytes for t in mine.values()) + sum(v.nbytes for o in sm.optimizers for s in o.state.values()
                                                          for v in s.values() if isinstance(v, torch.Tensor))
    mine = {n: t.detach().clone() for n, t in mine.items()}
    me = dict(step_s=statistics.median(times), state=held, rss=sm.stats["peak_rss_bytes"], within=within,
              packs=len(sm.plan.packs), params=mine)
    every = [me]
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, me)
    sm.close()
    if not dist.is_initialized() or dist.get_rank() == 0:
        params = {n: t for r in every for n, t in r["params"].items()}
        h = hashlib.sha256()
        for n in sorted(params):
            h.update(params[n].contiguous().view(torch.uint8).numpy().tobytes())
        Path(args.worker).write_text(json.dumps(dict(
            step_s=max(r["step_s"] for r in every), state=[r["state"] for r in every], rss=[r["rss"] for r in every],
            within=all(r["within"] for r in every), packs=[r["packs"] for r in every], digest=h.hexdigest())))


if __name__ == "__main__":
    main()
