"""A Python ``if`` on a tensor's value (compiler/trace/branches.py): taken as on the example batch, checked on every
batch by a node in the graph; a batch taking the other side is an InputError and the step rolls back."""
from __future__ import annotations

import copy

import pytest
import torch
from models import assert_bitwise, eager_accumulate, params

import harmony
from harmony.compiler.trace import TRACE_INFO, trace
from harmony.errors import InputError


class Checked(torch.nn.Module):
    """A check that raises on one side (CTC's labels check) and a branch that computes on both (a scale)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 16), torch.nn.Linear(16, 5)

    def forward(self, x, labels):
        if labels.max() >= 5:
            raise ValueError("labels out of range")
        h = torch.relu(self.a(x))
        if bool(x.abs().amax() > 100):
            h = h / 100
        return torch.nn.functional.cross_entropy(self.b(h), labels)


def _data(steps=2, rows=8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 4, generator=g), torch.randint(0, 5, (rows,), generator=g)) for _ in range(steps)]


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_each_branch_becomes_a_check_in_the_graph(frontend):
    torch.manual_seed(0)
    x, y = _data(1)[0]
    gm = trace(Checked(), (x, y), frontend=frontend)
    checks = [n for n in gm.graph.nodes if n.target is torch.ops.harmony.branch_check.default]
    assert [n.args[1] for n in checks] == [False, False]
    assert any("labels.max() >= 5" in note for note in gm.meta[TRACE_INFO].notes)
    with pytest.raises(InputError, match=r"(?s)labels\.max\(\) >= 5.*is True for this batch"):
        gm(x, torch.full_like(y, 7))
    with pytest.raises(InputError, match=r"amax\(\) > 100"):
        gm(x * 1000, y)               # the side that computes otherwise: refused, not computed by the traced side


def test_trains_bitwise_as_eager_and_a_batch_on_the_other_side_changes_nothing():
    torch.manual_seed(0)
    model, data = Checked(), _data()
    sm = harmony.compile(copy.deepcopy(model), example_batch=data[0], memory_budget=10**8, microbatches=2)
    sm(*data[0])
    before = params(sm)
    x, y = data[1]
    bad = y.clone()
    bad[-1] = 9                       # only the last microbatch takes the other side
    with pytest.raises(InputError, match="other side of a branch"):
        sm(x, bad)
    assert_bitwise(sm, before)
    assert sm.steps == 1
    sm(*data[1])
    ref, _ = eager_accumulate(model, data, 2)
    assert_bitwise(sm, {n: p.detach() for n, p in ref.named_parameters()})
    sm.close()
