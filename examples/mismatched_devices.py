"""Data parallel over mismatched devices: `balance="auto"` gives each rank the share of the work it can carry.

    torchrun --nproc_per_node 2 examples/mismatched_devices.py          # rank 1 emulated 3x slower, half the memory
    torchrun --nproc_per_node 2 examples/mismatched_devices.py --tiny   # a few seconds: the size CI runs

As Cephalo does it, the balance pass decouples each rank's share of the compute (rows of
the batch, in how many microbatches) from its share of the training state (optimizer state
it keeps and steps), and solves for the split with an integer program over each device's
speed and memory. The devices here are logical devices of this machine
(``Hardware.logical``): each has its own memory budget, and a speed factor above 1 makes
the runtime sleep that much longer after each compute op, an emulated slower GPU. On a real
mixed cluster describe the devices instead, e.g. ``Hardware.preset(["l4", "a6000"])``, one
per rank. Every rank passes the whole global batch; each trains on the rows the plan gives it.
"""
from __future__ import annotations

import argparse
import statistics
import time

import harmony  # before torch: it sets the OpenMP and allocator variables torch reads when it loads
import harmony.data
import torch

from harmony import Hardware
from harmony.models import GPT, GPTConfig, copy_task


def main(argv=None) -> list[float]:
    args = parse(argv)
    torch.manual_seed(args.seed)
    c = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, width=args.width, heads=args.heads)
    model = GPT(c)
    state = 16 * sum(p.numel() for p in model.parameters())      # fp32 weights, gradients, AdamW's two moments
    budgets = [int(state * f) for f in args.budgets]
    hw = Hardware.this_machine().logical(budgets, speed_factors=args.speed_factors)   # one device per rank
    data = list(copy_task(c, args.batch, args.steps, seed=args.seed))   # global batches, the same on every rank
    sm = harmony.compile(model, example_batch=data[0], hardware=hw, balance="auto", data_parallel=True,
                         optimizer=torch.optim.AdamW, optimizer_kwargs=dict(lr=args.lr))
    rank, world = harmony.data.rank_and_world()
    if len(budgets) != world:
        raise SystemExit(f"{len(budgets)} devices described for {world} ranks: give --budgets and --speed-factors "
                         f"one per rank")
    say = print if rank == 0 else (lambda *a, **k: None)
    say(hw.describe())
    say("\n== " + sm.program.reports[0].title + " ==")              # the balance pass's plan, one row per rank
    say(sm.report().split("\n== ")[1].split("\n", 1)[1].rstrip())
    losses, seconds = [], []
    for step, (x, y) in enumerate(data, 1):
        t0 = time.perf_counter()
        losses.append(sm(x, y).item())         # the whole global batch: the plan takes this rank's rows
        seconds.append(time.perf_counter() - t0)
        if step % args.log_every == 0:
            say(f"step {step:4d}  loss {losses[-1]:.4f} (rank 0's rows)")
    import torch.distributed as dist

    mine = dict(rank=rank, samples=sm.program.config.batch_size, microbatches=sm.plan.microbatches,
                step_s=statistics.median(seconds))
    every = [None] * world
    dist.all_gather_object(every, mine)
    for r in every:
        say(f"rank {r['rank']}: {r['samples']} samples in {r['microbatches']} microbatches, "
            f"median step {r['step_s'] * 1e3:.0f} ms")
    sm.close()
    dist.destroy_process_group()
    return losses


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="3 layers, width 64, 4 steps: what CI runs")
    p.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.5],
                   help="each rank's device memory, as a share of the training state (default 1.0 0.5)")
    p.add_argument("--speed-factors", type=float, nargs="+", default=[1.0, 3.0],
                   help="each rank's emulated slowdown, 1 = this machine (default 1 3)")
    p.add_argument("--layers", type=int, default=6, help="transformer blocks (default 6)")
    p.add_argument("--width", type=int, default=256, help="hidden size (default 256)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size (default 256)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--batch", type=int, default=24, help="global batch: sequences per step over all ranks (default 24)")
    p.add_argument("--steps", type=int, default=20, help="steps (default 20)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--log-every", type=int, default=5, help="print the loss every N steps (default 5)")
    p.add_argument("--seed", type=int, default=0, help="(default 0)")
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.width, args.heads, args.vocab, args.seq = 3, 64, 2, 64, 16
        args.batch, args.steps, args.log_every = 12, 4, 2
    return args


if __name__ == "__main__":
    main()
