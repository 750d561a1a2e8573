"""``len()`` of a tensor stays symbolic while torch.export traces (compiler/trace/sizes.py): a contrastive two-tower
loss over ``torch.arange(len(logits))`` (CLIP's) trains bitwise as eager at the plan's microbatch size and on a batch
of other rows than the example's."""
from __future__ import annotations

import builtins
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import assert_bitwise, split, training_state_bytes

import harmony
from harmony.compiler.trace import TRACE_INFO, trace
from harmony.runtime.optim import optimizer_kwargs

TOKENS, VOCAB, FEATURES = 6, 32, 10
PYTHONS_LEN = builtins.len


class TwoTower(nn.Module):
    """Text and image towers and CLIP's symmetric contrastive loss, with ``return_loss`` a non-tensor argument."""

    def __init__(self, width=16):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.text = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
        self.image = nn.Sequential(nn.Linear(FEATURES, width), nn.GELU(), nn.Linear(width, width))
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, input_ids, pixels, return_loss=False):
        text = F.normalize(self.text(self.embed(input_ids).mean(1)), dim=-1)
        image = F.normalize(self.image(pixels), dim=-1)
        logits = self.scale.exp() * text @ image.t()
        if not return_loss:
            return logits
        targets = torch.arange(len(logits), device=logits.device)     # len(): the microbatch's rows, a symbol
        return (F.cross_entropy(logits, targets) + F.cross_entropy(logits.t(), targets)) / 2


def pairs(rows, seed):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, VOCAB, (rows, TOKENS), generator=g),
            "pixels": torch.randn(rows, FEATURES, generator=g), "return_loss": True}


def eager(model, data, microbatches):
    """Eager gradient accumulation and AdamW, each microbatch copied into tensors of its own as the runtime loads it
    (models.eager_accumulate passes views: MKL can round a 3-row matmul over a view that starts mid-row of the batch
    otherwise than over a fresh copy). The model and the losses."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), **optimizer_kwargs(torch.optim.AdamW, {}))
    losses = []
    for batch in data:
        parts = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in mb.items()}
                 for mb in split(batch, microbatches)]
        step = []
        for mb in parts:
            loss = model(**mb)
            (loss / microbatches).backward()
            step.append(loss.item())
        opt.step()
        opt.zero_grad()
        losses.append(sum(step) / microbatches)
    return model, losses


def test_a_contrastive_loss_over_len_trains_bitwise_at_the_microbatch_and_at_other_rows():
    torch.manual_seed(0)
    model = TwoTower()
    data = [pairs(8, 0), pairs(6, 1), pairs(8, 2)]      # microbatches of 4 rows, then of 3
    sm = harmony.compile(copy.deepcopy(model), example_batch=data[0],
                         memory_budget=training_state_bytes(model) // 2, microbatches=2)
    assert len(sm.plan.packs) > 1
    losses = [sm(**batch).item() for batch in data]
    assert sm.shapes.compiles == 0                     # the compiled plan ran the 6 rows too
    ref, eager_losses = eager(model, data, 2)
    assert_bitwise(sm, {n: p.detach() for n, p in ref.named_parameters()})
    sm.close()
    assert losses == pytest.approx(eager_losses, rel=1e-6)


def test_the_rows_stay_free_in_the_trace_and_len_is_pythons_again_after():
    gm = trace(TwoTower(), pairs(8, 0))
    info = gm.meta[TRACE_INFO]
    assert info.frontend == "export"                   # torch.fx cannot take len() of a proxy
    assert [sizes[0] for sizes in info.sizes] == [None, None]
    assert builtins.len is PYTHONS_LEN
    three = pairs(3, 1)
    assert gm(three["input_ids"], three["pixels"]).dim() == 0          # the graph runs 3 rows
