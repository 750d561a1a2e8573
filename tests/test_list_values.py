"""A list of tensors (a ``chunk``'s, a ``split``'s) between layers: no pack starts where one crosses to its
readers, since a pack's inputs send gradients back as tensors only (a later pack reading the list would leave the
earlier pack's parameters with part of their gradients, silently)."""
import copy

import pytest
import torch
import torch.nn as nn

import harmony
from harmony.compiler.passmanager import DEFAULT_PIPELINE
from harmony.errors import ConfigError
from harmony.passes.partition import first_nodes
from models import assert_bitwise, eager_accumulate, training_state_bytes


class Split(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.l = nn.Linear(d, 2 * d)

    def forward(self, x):
        return list(self.l(x).chunk(2, -1))


class Join(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.l = nn.Linear(d, d)

    def forward(self, xs):
        return self.l(xs[0]) * torch.sigmoid(xs[1])


class Gated(nn.Module):
    def __init__(self, d=32, n=4):
        super().__init__()
        self.blocks = nn.ModuleList([m for _ in range(n) for m in (Split(d), Join(d))])
        self.head = nn.Linear(d, 1)

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        return ((self.head(x).squeeze(-1) - y) ** 2).mean()


def _setup():
    torch.manual_seed(0)
    model = Gated()
    data = [(torch.randn(8, 32), torch.randn(8)) for _ in range(2)]
    return model, data, eager_accumulate(model, data, 2)[0]


def test_no_pack_starts_between_a_chunk_and_its_readers():
    model, data, expected = _setup()
    sm = harmony.compile(copy.deepcopy(model), example_batch=data[0], microbatches=2,
                         memory_budget=int(training_state_bytes(model) * 0.16))
    assert len(sm.plan.packs) > 4, "a budget tight enough to cut inside the blocks"
    firsts = first_nodes(sm.program)
    assert "chunk" in firsts and "linear_1" in firsts and not any(n.startswith("getitem") for n in firsts), firsts
    for spec in sm.plan.packs:
        assert not any(n.startswith("chunk") for n in spec.inputs), (spec.name, spec.inputs)
    for batch in data:
        sm(*batch)
    assert_bitwise(sm, {n: p.detach() for n, p in expected.named_parameters()})
    sm.close()


def test_a_partition_cutting_a_list_from_its_readers_is_refused():
    """Handed a partition that starts packs at the chunk's getitems, compile refuses it by name (it used to train,
    with the first block of each pair never receiving the gradient through the list)."""
    model, data, expected = _setup()
    kw = dict(example_batch=data[0], microbatches=2, memory_budget=int(training_state_bytes(model) * 2))
    with pytest.raises(ConfigError, match=r"\['getitem', 'getitem_2'\], which are not cut points"):
        harmony.compile(copy.deepcopy(model), **kw,
                        passes=(("partition", ["getitem", "getitem_2"]),) + tuple(DEFAULT_PIPELINE[1:]))
    sm = harmony.compile(copy.deepcopy(model), **kw,          # the cut points beside them train exactly
                         passes=(("partition", ["chunk", "linear_1", "chunk_1"]),) + tuple(DEFAULT_PIPELINE[1:]))
    assert len(sm.plan.packs) == 4
    for batch in data:
        sm(*batch)
    assert_bitwise(sm, {n: p.detach() for n, p in expected.named_parameters()})
    sm.close()
