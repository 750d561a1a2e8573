"""Ops whose output shapes depend on values, traced with shapes bounded by their inputs' (compiler/trace/bounded.py):
CTC loss with tensor lengths, as wav2vec2's and HuBERT's heads call it, trains bitwise as eager in several packs."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import assert_bitwise, eager_accumulate, training_state_bytes

import harmony
from harmony.compiler.trace import trace
from harmony.compiler.trace.bounded import BOUNDED

BLANK, CLASSES, SAMPLES = 0, 12, 64


class SpeechCTC(nn.Module):
    """A strided-convolution encoder and a CTC head whose loss is computed as Hugging Face's ``ForCTCLoss`` does:
    the targets are the labels' non-padding entries (``masked_select``) and every length is a tensor. It builds a
    shape with ``*``, as wav2vec2's attention does, which torch.fx cannot follow: torch.export traces it."""

    def __init__(self, width=16, layers=3):
        super().__init__()
        self.conv = nn.Conv1d(1, width, kernel_size=4, stride=4)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
                                    for _ in range(layers))
        self.head = nn.Linear(width, CLASSES)

    def forward(self, audio, mask, labels):
        h = self.conv(audio.view(*audio.shape[:1], 1, -1)).transpose(1, 2)
        for layer in self.layers:
            h = h + layer(h)
        log_probs = F.log_softmax(self.head(h), dim=-1, dtype=torch.float32).transpose(0, 1)
        frames = torch.div(mask.sum(-1), 4, rounding_mode="floor")         # each row's frames, a tensor
        keep = labels != BLANK
        return F.ctc_loss(log_probs, labels.masked_select(keep), frames, keep.sum(-1), blank=BLANK)


def ctc_batch(rows, seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(rows, SAMPLES, dtype=torch.long)
    mask[::2, SAMPLES // 2:] = 0                       # every other row has half the frames
    labels = torch.randint(1, CLASSES, (rows, 4), generator=g)
    labels[1::2, 2:] = BLANK                           # and another row's target is 2 long, padded
    return {"audio": torch.randn(rows, SAMPLES, generator=g), "mask": mask, "labels": labels}


def test_ctc_loss_with_tensor_lengths_trains_bitwise_as_eager_in_several_packs():
    """At three quarters of its training state (a few packs), on the example batch and then on one of fewer rows,
    which the same plan serves."""
    torch.manual_seed(0)
    model = SpeechCTC()
    data = [ctc_batch(8, 0), ctc_batch(4, 1)]
    budget = int(0.75 * training_state_bytes(model))
    sm = harmony.compile(copy.deepcopy(model), example_batch=data[0], memory_budget=budget, microbatches=4)
    plan = sm.plan
    assert len(plan.packs) > 1
    losses = [sm(**batch).item() for batch in data]
    assert sm.plan is plan
    ref, eager_losses = eager_accumulate(model, data, 4)
    assert_bitwise(sm, {n: p.detach() for n, p in ref.named_parameters()})
    sm.close()
    assert losses == pytest.approx(eager_losses, rel=1e-6)


def test_the_bounded_kernels_hold_only_while_harmony_traces():
    """A user's own torch.export (or torch.compile) of CTC after a compile meets torch's kernel, not the bound."""
    model, batch = SpeechCTC(layers=1), ctc_batch(4, 0)
    trace(model, batch, frontend="export")
    registered = torch._library.simple_registry.singleton
    assert all(registered.find(name).fake_impl.kernel is None for name in BOUNDED)
    with pytest.raises(Exception, match="_ctc_loss"):
        torch.export.export(model, (), batch, strict=False)
