"""Train in bf16 mixed precision: bf16 compute copies on the device, fp32 masters and AdamW on the host.

    python examples/bf16.py                 # the built-in GPT (8 layers, width 512), 200 steps
    python examples/bf16.py --tiny          # a few seconds: the size CI runs

``precision="bf16"`` is the one change from an fp32 run: the device holds bf16 copies of the
weights (2 bytes a parameter, not 4), activations and gradients are bf16, and the optimizer
steps the fp32 masters, so the same budget holds about twice the packs. Checkpoints save the
fp32 masters; a run resumed from one continues as if it had not stopped.

The model is Harmony's own GPT (``harmony.models.GPT``: ``forward(idx, targets)`` returns the
loss), batches are tuples, so compile with ``example_batch=(x, y)`` and call ``sm(x, y)``.
Hugging Face models train in bf16 the same way (``precision="bf16"`` with a dict batch, as in
examples/hf_finetune.py; tests/test_architectures.py checks nine architectures).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import harmony  # before torch: it sets the OpenMP and allocator variables torch reads when it loads
import torch
from torch.utils.data import DataLoader, TensorDataset

from harmony.models import GPT, GPTConfig


def counting(size: int, c: GPTConfig, seed: int):
    """Inputs and next-token targets of ``size`` sequences counting up from a random token by a random stride."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, c.vocab, (size, 1), generator=g)
    stride = torch.randint(1, 4, (size, 1), generator=g)
    tokens = (start + stride * torch.arange(c.seq + 1)) % c.vocab
    return tokens[:, :-1], tokens[:, 1:]


def main(argv=None) -> list[float]:
    args = parse(argv)
    torch.manual_seed(args.seed)
    c = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, width=args.width, heads=args.heads)
    x, y = counting(args.batch * args.steps, c, seed=args.seed)
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch, shuffle=True, drop_last=True)
    model = GPT(c)
    n = sum(p.numel() for p in model.parameters())
    budget = int(16 * n * args.budget)        # a share of the fp32 training state: 16 bytes a parameter
    example = tuple(next(iter(loader)))
    sm = harmony.compile(model, example_batch=example, memory_budget=budget, microbatches=args.microbatches,
                         optimizer=torch.optim.AdamW, optimizer_kwargs=dict(lr=args.lr), precision="bf16")
    print(f"GPT, {n / 1e6:.2f}M parameters, bf16, {len(sm.plan.packs)} packs under {budget / 2**20:.1f} MiB "
          f"({args.budget:.0%} of the fp32 training state)")
    header = sm.report().split("\n\n")[0].splitlines()     # the report's first block: model, budget, tiers
    print("\n".join(line for line in header if not line.startswith("Harmony report")))

    losses = []
    for step, (x, y) in enumerate(loader, 1):
        losses.append(sm(x, y).item())         # the loss comes back in fp32
        if step % args.log_every == 0:
            print(f"step {step:4d}  loss {losses[-1]:.4f}")
    k = max(1, len(losses) // 5)
    print(f"loss {sum(losses[:k]) / k:.4f} -> {sum(losses[-k:]) / k:.4f} (mean of the first and last {k} steps)")

    ckpt = Path(args.out) / "checkpoint"
    harmony.save(sm, ckpt)                     # fp32 masters and AdamW state
    sm.close()
    # a second process would do the same: compile the model again (any budget), then load
    again = harmony.compile(GPT(c), example_batch=example, memory_budget=budget, microbatches=args.microbatches,
                            optimizer=torch.optim.AdamW, optimizer_kwargs=dict(lr=args.lr), precision="bf16")
    info = harmony.load(again, ckpt)
    print(f"resumed from {ckpt} at step {info.step}: next loss {again(*example).item():.4f}")
    again.close()
    return losses


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="2 layers, width 64, 24 steps: what CI runs")
    p.add_argument("--layers", type=int, default=8, help="transformer blocks (default 8)")
    p.add_argument("--width", type=int, default=512, help="hidden size (default 512)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary size (default 512)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step (default 4)")
    p.add_argument("--steps", type=int, default=200, help="steps (default 200)")
    p.add_argument("--budget", type=float, default=0.3,
                   help="device memory budget as a share of the fp32 training state (default 0.3)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--log-every", type=int, default=20, help="print the loss every N steps (default 20)")
    p.add_argument("--out", default="bf16-run", help="where the checkpoint goes (default bf16-run/)")
    p.add_argument("--seed", type=int, default=0, help="(default 0)")
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.width, args.heads, args.vocab, args.seq = 2, 64, 2, 64, 32
        args.batch, args.microbatches, args.steps, args.budget, args.log_every = 8, 2, 24, 0.5, 6
        args.lr = 1e-2
    return args


if __name__ == "__main__":
    main()
