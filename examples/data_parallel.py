"""Data parallel training under torchrun, gradients all-reduced in 4 bits (CGX-style compression).

    torchrun --nproc_per_node 2 examples/data_parallel.py            # 2 ranks (gloo; on GPUs beside nccl)
    torchrun --nproc_per_node 2 examples/data_parallel.py --tiny     # a few seconds: the size CI runs

Every rank runs this same script: it builds the same model, takes its share of each global
batch (``harmony.data.shard``) and compiles with ``data_parallel=True``; ``harmony.compile``
joins the process group torchrun describes, broadcasts rank 0's weights, and plans an
all-reduce of each pack's gradients, quantized to 4 bits a value with error feedback
(``compression="4bit"``; ``"fp32"`` for exact averaging). Every rank ends each step with the
same parameters; rank 0 prints.
"""
from __future__ import annotations

import argparse
import hashlib

import harmony  # before torch: it sets the OpenMP and allocator variables torch reads when it loads
import harmony.data
import torch

from harmony.models import GPT, GPTConfig, copy_task


def digest(model) -> str:
    """A hash of every parameter's bytes: equal on every rank after each step."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:12]


def main(argv=None) -> list[float]:
    args = parse(argv)
    torch.manual_seed(args.seed)             # the same initial weights on every rank (compile broadcasts rank 0's)
    c = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, width=args.width, heads=args.heads)
    model = GPT(c)
    n = sum(p.numel() for p in model.parameters())
    data = list(copy_task(c, args.batch, args.steps, seed=args.seed))     # global batches, the same on every rank
    compression = None if args.compression == "none" else args.compression
    sm = harmony.compile(model, example_batch=harmony.data.shard(data[0]), optimizer=torch.optim.AdamW,
                         optimizer_kwargs=dict(lr=args.lr), memory_budget=int(16 * n * args.budget),
                         microbatches=args.microbatches, data_parallel=True, compression=compression)
    rank, world = harmony.data.rank_and_world()
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{world} ranks, GPT {n / 1e6:.2f}M parameters, {args.batch // world} of each batch of {args.batch} per "
        f"rank, gradients all-reduced as {args.compression}")
    losses = []
    for step, batch in enumerate(data, 1):
        losses.append(sm(*harmony.data.shard(batch)).item())   # this rank's loss on its share
        if step % args.log_every == 0:
            say(f"step {step:4d}  loss {losses[-1]:.4f} (rank 0's share)")
    # every rank ends with the same parameters: gather each rank's digest to check it
    import torch.distributed as dist

    digests = [None] * world
    dist.all_gather_object(digests, digest(model))
    say(f"parameters equal on every rank: {len(set(digests)) == 1} ({digests[0]})")
    compress = next(r for r in sm.program.reports if r.title.startswith("compress"))
    say("compress pass: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                     for k, v in compress.totals.items() if k != "seconds"))
    sm.close()
    dist.destroy_process_group()
    return losses


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="3 layers, width 64, 6 steps: what CI runs")
    p.add_argument("--layers", type=int, default=6, help="transformer blocks (default 6)")
    p.add_argument("--width", type=int, default=256, help="hidden size (default 256)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size (default 256)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--batch", type=int, default=16, help="global batch: sequences per step over all ranks (default 16)")
    p.add_argument("--microbatches", type=int, default=2, help="microbatches per step on each rank (default 2)")
    p.add_argument("--steps", type=int, default=50, help="steps (default 50)")
    p.add_argument("--budget", type=float, default=0.5,
                   help="device memory budget per rank, as a share of the training state (default 0.5)")
    p.add_argument("--compression", default="4bit", help="the gradient all-reduce: 1bit..8bit, fp16, bf16, adaptive, "
                                                     "or none: exact fp32 (default 4bit)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--log-every", type=int, default=10, help="print the loss every N steps (default 10)")
    p.add_argument("--seed", type=int, default=0, help="(default 0)")
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.width, args.heads, args.vocab, args.seq = 3, 64, 2, 64, 16
        args.batch, args.steps, args.log_every = 8, 6, 2
    return args


if __name__ == "__main__":
    main()
