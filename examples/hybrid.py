"""A pipeline inside each server, compressed data parallelism across servers: parallel=("pipeline", "data").

On each of two servers (here: two torchrun invocations on this machine, the two "nodes"):

    torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d --rdzv-endpoint localhost:29500 --rdzv-id demo \\
        examples/hybrid.py --tiny

Every rank runs this same script. The four ranks form two pipelines of two (a server's ranks: torchrun's
``LOCAL_WORLD_SIZE`` is the ``pipeline_size``); each pipeline places the model's packs across its server's ranks as
``parallel="pipeline"`` does, and trains on its half of each global batch (``harmony.data.shard(batch,
pipeline_size=2)``). Each pack's gradients are averaged over the two ranks that hold it, one per server, right after
the pack's last backward, in 4 bits a value (``--compression``; ``none`` averages exactly). Rank 0 prints the
report's grid section, the losses, and whether the ranks holding the same packs end with the same weights.
"""
from __future__ import annotations

import argparse
import hashlib

import harmony  # before torch: it sets the OpenMP and allocator variables torch reads when it loads
import harmony.data
import torch

from harmony.models import GPT, GPTConfig, copy_task


def digest(sm) -> str:
    """A hash of this rank's packs' weights: equal on the ranks that hold the same packs."""
    h = hashlib.sha256()
    for name, t in sorted(sm.training_state_dict()["model"].items()):
        h.update(name.encode() + t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:12]


def main(argv=None) -> list[float]:
    args = parse(argv)
    torch.manual_seed(args.seed)             # the same initial weights everywhere (compile broadcasts pipeline 0's)
    c = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, width=args.width, heads=args.heads, tie=False)
    model = GPT(c)
    n = sum(p.numel() for p in model.parameters())
    data = list(copy_task(c, args.batch, args.steps, seed=args.seed))     # global batches, the same on every rank
    compression = None if args.compression == "none" else args.compression
    sm = harmony.compile(model, example_batch=harmony.data.shard(data[0], pipeline_size=args.pipeline_size),
                         optimizer=torch.optim.AdamW, optimizer_kwargs=dict(lr=args.lr),
                         memory_budget=int(16 * n * args.budget), microbatches=args.microbatches,
                         parallel=("pipeline", "data"), pipeline_size=args.pipeline_size, compression=compression)
    rank, world = harmony.data.rank_and_world()
    say = print if rank == 0 else (lambda *a, **k: None)
    grid = sm.plan.stage.grid
    say(f"{world} ranks as {grid.pipeline} x {grid.replicas} (pipeline x data parallel), GPT {n / 1e6:.2f}M "
        f"parameters, gradients averaged across pipelines as {args.compression}")
    section = sm.report().split("== grid:", 1)[1].split("\n== ", 1)[0]
    say("== grid:" + section)
    losses = []
    for step, batch in enumerate(data, 1):
        losses.append(sm(*harmony.data.shard(batch, pipeline_size=args.pipeline_size)).item())   # the job's mean
        if step % args.log_every == 0:
            say(f"step {step:4d}  loss {losses[-1]:.4f}")
    import torch.distributed as dist

    digests = [None] * world
    dist.all_gather_object(digests, digest(sm))
    same = all(digests[r] == digests[r % grid.pipeline] for r in range(world))
    say(f"replicas equal (the ranks holding the same packs): {same}")
    if args.out:
        harmony.save(sm, args.out)       # every rank: each stage written once, by pipeline 0's ranks
        say(f"saved {args.out}")
    sm.close()
    dist.destroy_process_group()
    return losses


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="3 layers, width 64, 6 steps: what CI runs")
    p.add_argument("--pipeline-size", type=int, default=None,
                   help="ranks per pipeline (default: torchrun's --nproc_per_node, a server's devices)")
    p.add_argument("--layers", type=int, default=6, help="transformer blocks (default 6)")
    p.add_argument("--width", type=int, default=256, help="hidden size (default 256)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size (default 256)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--batch", type=int, default=16, help="global batch: sequences per step over all pipelines "
                                                         "(default 16)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step in each pipeline (default 4)")
    p.add_argument("--steps", type=int, default=50, help="steps (default 50)")
    p.add_argument("--budget", type=float, default=0.5,
                   help="device memory budget per rank, as a share of the training state (default 0.5)")
    p.add_argument("--compression", default="4bit", help="the replicas' all-reduce: 1bit..8bit, fp16, bf16, or "
                                                     "none: exact fp32 (default 4bit)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--log-every", type=int, default=10, help="print the loss every N steps (default 10)")
    p.add_argument("--out", default=None, help="save a checkpoint there at the end (default: none)")
    p.add_argument("--seed", type=int, default=0, help="(default 0)")
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.width, args.heads, args.vocab, args.seq = 3, 64, 2, 64, 16
        args.batch, args.steps, args.log_every, args.budget = 8, 6, 2, 2.0
    if args.pipeline_size is None:
        import os
        args.pipeline_size = int(os.environ.get("LOCAL_WORLD_SIZE", 2))
    return args


if __name__ == "__main__":
    main()
