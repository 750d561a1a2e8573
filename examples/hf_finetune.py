"""Fine-tune a Hugging Face causal LM under a memory budget: a DataLoader with dynamic padding, AdamW, clipping,
validation every epoch, checkpoint and resume.

    python examples/hf_finetune.py                 # GPT-2 (6 layers, width 256) for 3 epochs
    python examples/hf_finetune.py --resume        # carry on from the last epoch's checkpoint
    python examples/hf_finetune.py --tiny          # a few seconds: the size CI runs

The model is built from a config with random weights (nothing is downloaded); with a
checkpoint of your own, use ``AutoModelForCausalLM.from_pretrained(...)`` instead. The data
is synthetic: each sequence counts up from a random token by a random stride (mod the
vocabulary), which a language model learns within a few hundred steps, so the loss visibly
falls; sequences have random lengths. Replace ``CountingDataset`` with your tokenized text.

Batches are padded as Hugging Face's collators pad them (``pad_batch``, as
``DataCollatorForLanguageModeling`` does): each to its own longest sequence, with an attention
mask and -100 labels on the padding, so nearly every batch has another shape. The module is
compiled with the longest batch (every sequence padded to ``--seq``), and every batch up to it,
training and validation alike, runs the plan compiled for it: no batch shape is planned again.
Hugging Face models take their batch as keywords: call ``sm(**batch)``; ``labels`` in the batch
make the model return its loss, which Harmony trains on.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import harmony  # before torch: it sets the OpenMP and allocator variables torch reads when it loads
import torch
from torch.utils.data import DataLoader, Dataset


class CountingDataset(Dataset):
    """``size`` sequences of ``seq // 4`` to ``seq`` tokens (all ``seq`` where not ``varied``), each ``start, start +
    stride, ...`` mod ``vocab`` (token 0 is the padding: the counts run over 1 .. vocab - 1)."""

    def __init__(self, size: int, seq: int, vocab: int, seed: int, varied: bool = True):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab - 1, (size, 1), generator=g)
        stride = torch.randint(1, 4, (size, 1), generator=g)
        ids = (start + stride * torch.arange(seq)) % (vocab - 1) + 1
        lengths = torch.randint(max(2, seq // 4), seq + 1, (size,), generator=g) if varied else torch.full((size,), seq)
        self.seqs = [row[:n] for row, n in zip(ids, lengths.tolist())]

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return {"input_ids": self.seqs[i], "labels": self.seqs[i].clone()}   # the model shifts labels itself


def pad_batch(samples: list[dict], to: int | None = None) -> dict:
    """Samples padded to the longest (or to ``to`` tokens): ``input_ids`` (0 on the padding), ``attention_mask``
    and ``labels`` (-100 on the padding, which the loss skips; the model shifts labels by one itself)."""
    width = to or max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[row, :n], mask[row, :n] = s["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def build_model(args):
    import transformers

    config = transformers.GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_layer=args.layers,
                                     n_embd=args.width, n_head=args.heads, bos_token_id=0, eos_token_id=0,
                                     resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=args.dropout)
    config._attn_implementation = "eager"
    return transformers.GPT2LMHeadModel(config)


def validation_loss(sm, loader) -> float:
    """The mean loss over ``loader``, evaluated by the compiled module under the same memory budget.

    ``sm.evaluate`` runs the model as ``model.eval()`` under ``torch.no_grad()`` would (dropout off), forward
    only, on the trained weights where they are; it changes nothing training reads, so the run trains on as if
    it had not evaluated. Its batches are padded to their own lengths and the last one is smaller: every batch
    up to the compiled one runs the compiled plan.
    """
    losses = [sm.evaluate(**batch).item() for batch in loader]
    return sum(losses) / len(losses)


def train(args) -> list[float]:
    torch.manual_seed(args.seed)
    model = build_model(args)
    train_set = CountingDataset(args.samples, args.seq, args.vocab, seed=args.seed)
    val_set = CountingDataset(2 * args.batch + args.batch // 2, args.seq, args.vocab, seed=args.seed + 1)
    order = torch.Generator()
    loader = DataLoader(train_set, batch_size=args.batch, shuffle=True, generator=order, collate_fn=pad_batch)
    val_loader = DataLoader(val_set, batch_size=args.batch, collate_fn=pad_batch)    # its last batch smaller

    n = sum(p.numel() for p in model.parameters())
    budget = int(16 * n * args.budget)       # fp32 weights, gradients and AdamW's two moments: 16 bytes a parameter
    # the largest batch the loader gives: a full batch padded to the longest sequence it can hold
    example = pad_batch([train_set[i] for i in range(args.batch)], to=args.seq)
    # AdamW in two param groups, as LLM recipes have it: no weight decay on biases and norms
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr)
    # clip_grad_norm: the recipe's max_grad_norm, by the global norm as clip_grad_norm_ computes it (the gradients
    # never reach model.parameters()' .grad, so clipping them by hand after sm(...) would clip nothing)
    sm = harmony.compile(model, example_batch=example, memory_budget=budget, microbatches=args.microbatches,
                         optimizer=opt, clip_grad_norm=1.0)
    # linear warm-up, then cosine decay, on sm.optimizer: it drives every pack's optimizer; registered, the
    # scheduler is saved and restored with the checkpoint
    total, warmup = args.epochs * len(loader), max(1, args.epochs * len(loader) // 10)
    sched = sm.add_scheduler(torch.optim.lr_scheduler.LambdaLR(
        sm.optimizer, lambda s: (s + 1) / warmup if s < warmup else
        0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, total - warmup)))))
    print(f"GPT-2, {n / 1e6:.2f}M parameters, {len(sm.plan.packs)} packs under {budget / 2**20:.1f} MiB "
          f"({args.budget:.0%} of the training state), {args.microbatches} microbatches of "
          f"{args.batch // args.microbatches}")

    ckpt = Path(args.out) / "checkpoint"
    first_epoch = 0
    if args.resume and ckpt.exists():
        info = harmony.load(sm, ckpt)          # weights, optimizer state, scheduler, step count and RNG
        first_epoch = math.ceil(info.step / len(loader))
        print(f"resumed from {ckpt} at step {info.step} (epoch {first_epoch})")

    losses = []
    for epoch in range(first_epoch, args.epochs):
        order.manual_seed(args.seed + epoch)   # the same order per epoch after a resume
        for batch in loader:
            loss = sm(**batch).item()          # forward, backward and AdamW update of the whole batch
            sched.step()
            losses.append(loss)
            step = sm.steps
            if step % args.log_every == 0:
                print(f"epoch {epoch} step {step:4d}  loss {loss:.4f}  lr {sm.optimizer.param_groups[0]['lr']:.2e}  "
                      f"grad norm {sm.stats['grad_norm']:.3f}")
        harmony.save(sm, ckpt)                 # atomic: a crash leaves the last complete checkpoint
        print(f"epoch {epoch} done: validation loss {validation_loss(sm, val_loader):.4f}, checkpoint {ckpt} at "
              f"step {sm.steps}")
    shapes = len(sm.shapes.served) + (sm.shapes.example.steps > sum(sm.shapes.served.values()))
    print(f"{shapes} batch shapes trained, {sm.shapes.compiles} planned after compile (the "
          f"compiled plan ran every batch up to its shape)")
    if losses:
        k = max(1, len(losses) // 5)
        print(f"loss {sum(losses[:k]) / k:.4f} -> {sum(losses[-k:]) / k:.4f} (mean of the first and last {k} "
              f"steps), validation {validation_loss(sm, val_loader):.4f}")
    sm.close()
    return losses


def parse(argv=None, **defaults):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="2 layers, width 64, a few steps: what CI runs")
    p.add_argument("--layers", type=int, default=6, help="transformer blocks (default 6)")
    p.add_argument("--width", type=int, default=256, help="hidden size (default 256)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--vocab", type=int, default=1024, help="vocabulary size (default 1024)")
    p.add_argument("--seq", type=int, default=64, help="tokens of the longest sequence (default 64)")
    p.add_argument("--samples", type=int, default=2048, help="training sequences per epoch (default 2048)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step (default 4)")
    p.add_argument("--budget", type=float, default=0.5,
                   help="device memory budget as a share of the training state (default 0.5)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--dropout", type=float, default=0.1, help="GPT-2's dropouts; off in validation (default 0.1)")
    p.add_argument("--epochs", type=int, default=3, help="epochs to train up to (default 3)")
    p.add_argument("--log-every", type=int, default=20, help="print the loss every N steps (default 20)")
    p.add_argument("--out", default="hf-finetune", help="where the checkpoint goes (default hf-finetune/)")
    p.add_argument("--resume", action="store_true", help="load OUT/checkpoint first, if there is one")
    p.add_argument("--seed", type=int, default=0, help="(default 0)")
    p.set_defaults(**defaults)
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.width, args.heads, args.vocab, args.seq = 2, 64, 2, 64, 16
        args.samples, args.batch, args.microbatches, args.budget = 64, 8, 2, 0.6
        args.log_every, args.lr = 4, 3e-3
    return args


if __name__ == "__main__":
    train(parse())
