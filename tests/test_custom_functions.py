"""A user's ``torch.autograd.Function`` runs its own backward in the compiled step (compiler/trace/functions.py):
torch.export traces through ``apply``, and autograd would differentiate the forward's ops instead."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import eager_accumulate, params, run_compiled

from harmony.compiler.trace import trace


class StraightThrough(torch.autograd.Function):
    """Rounds forward; passes the gradient through unchanged (a quantiser's straight-through estimator): the
    forward's derivative is zero almost everywhere, so a traced-through backward trains nothing before it."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


class ScaledGrad(torch.autograd.Function):
    """Identity forward, gradient times ``scale`` (a gradient reversal layer's form), a non-tensor argument."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


class Quantised(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x, y):
        h = StraightThrough.apply(self.a(x) * 4)
        h = ScaledGrad.apply(F.relu(self.b(h)), -0.5)
        return F.cross_entropy(self.head(h), y)


def _case():
    torch.manual_seed(0)
    return Quantised(), [(torch.randn(8, 8), torch.randint(0, 4, (8,))) for _ in range(2)]


def test_the_graph_calls_the_function_and_its_backward_as_eager():
    model, data = _case()
    gm = trace(model, data[0], frontend="export")
    assert not any("round" in str(n.target) for n in gm.graph.nodes)    # one node calls StraightThrough.apply
    eager = copy.deepcopy(model)
    ref = eager(*data[0])
    ref.backward()
    loss = gm(*data[0])
    loss.backward()
    assert torch.equal(loss, ref)
    grads = dict(gm.named_parameters())
    for name, p in eager.named_parameters():
        assert torch.equal(grads[name].grad, p.grad), name
    assert eager.a.weight.grad.abs().sum() > 0     # the straight-through gradient reached the first layer


def test_a_model_with_functions_trains_bitwise_as_eager_in_several_packs():
    model, data = _case()
    ref, _ = eager_accumulate(model, data, 2)
    sm, _, _ = run_compiled(copy.deepcopy(model), data, 2, 6000)
    assert len(sm.plan.packs) > 1
    got = params(sm)
    for name, p in ref.named_parameters():
        assert torch.equal(got[name], p.detach()), name


def test_a_function_defined_in_a_function_is_traced_through():
    """The graph's node imports the Function by name at run time: one it cannot find is traced through (its
    forward's ops, differentiated by autograd) as before."""
    class Local(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return Local.apply(self.lin(x)).sum()

    torch.manual_seed(0)
    gm = trace(M(), (torch.randn(2, 4),), frontend="export")
    assert any(n.target is torch.ops.aten.mul.Tensor for n in gm.graph.nodes)


@pytest.mark.parametrize("name", ["bloom"])
def test_bloom_gelu_trains_bitwise(name):
    """BLOOM's GELU is a Function whose backward evaluates the derivative in its own ops."""
    from zoo import train
    assert train(name).differ == []
