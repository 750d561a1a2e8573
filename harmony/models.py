"""Built-in models for the demo, tests and benchmarks: a GPT-style transformer and a synthetic task."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab: int = 256
    seq: int = 64
    layers: int = 4
    width: int = 128
    heads: int = 4
    dropout: float = 0.0
    tie: bool = True

    def n_params(self) -> int:
        per_layer = 12 * self.width ** 2 + 13 * self.width
        head = 0 if self.tie else self.vocab * self.width
        return self.vocab * self.width + self.seq * self.width + self.layers * per_layer + 2 * self.width + head


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.width)
        self.qkv = nn.Linear(c.width, 3 * c.width)
        self.proj = nn.Linear(c.width, c.width)
        self.ln2 = nn.LayerNorm(c.width)
        self.fc = nn.Linear(c.width, 4 * c.width)
        self.out = nn.Linear(4 * c.width, c.width)
        self.drop = nn.Dropout(c.dropout)
        self.heads = c.heads

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(w, dim=2)
        q, k, v = (z.view(b, t, self.heads, w // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, w)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """A GPT-2-style decoder; ``forward(idx, targets)`` returns the mean cross-entropy loss (targets of -100 left
    out); ``forward(idx, targets, num_items_in_batch=n)`` their sum over ``n``."""

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.tok = nn.Embedding(c.vocab, c.width)
        self.pos = nn.Embedding(c.seq, c.width)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln = nn.LayerNorm(c.width)
        self.head = nn.Linear(c.width, c.vocab, bias=False)
        if c.tie:
            self.head.weight = self.tok.weight
        for m in self.modules():
            self._init_weights(m)

    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2's initialisation of one module's own parameters: small weights, so the first loss is about
        ln(vocab). (Named as Hugging Face's: ``harmony.compile`` fills a GPT built under ``empty_weights`` with it.)"""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    def forward(self, idx, targets, num_items_in_batch=None):
        """The mean cross-entropy over the targets that are not -100; with ``num_items_in_batch`` (a count of such
        targets over a whole batch this one is part of), their summed loss divided by it, as Hugging Face's LM
        losses do: gradient accumulation over the parts then gives the whole batch's token mean."""
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        if num_items_in_batch is None:
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               reduction="sum") / num_items_in_batch


def copy_task(c: GPTConfig, batch: int, steps: int, seed: int = 0):
    """A learnable synthetic task: each sequence repeats a random pattern; predict the next token."""
    g = torch.Generator().manual_seed(seed)
    period = 8
    for _ in range(steps):
        pattern = torch.randint(0, c.vocab, (batch, period), generator=g)
        seq = pattern.repeat(1, (c.seq + 1) // period + 1)[:, : c.seq + 1]
        yield seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
