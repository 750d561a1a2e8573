"""A value crossing a pack boundary keeps the strides eager's would have, forward and backward, so the kernels
reading it (and their reductions' order) are eager's: ConvNeXt's channels-first LayerNorm and blocks run through
channels-last views (``permute``), and a pack boundary falls between a permute and its reader.

Two places changed a value's strides, and with them the bits: a stash (a value kept on the host between a
pack's forward and its recomputing backward) copied it contiguous (``TieredState.send``), and a pack's input,
made a leaf, got its gradient copied into its own strides by AccumulateGrad's layout contract where eager hands
the producer the gradient as computed (``runtime/pack_inputs.py``)."""
from __future__ import annotations

import copy

import pytest
import torch
from models import eager_accumulate, run_compiled, training_state_bytes

from harmony.runtime.pack_inputs import enter, grad_of


class ChannelsFirstNorm(torch.nn.LayerNorm):
    def forward(self, x):        # (N, C, H, W) normalised over C through a channels-last view, as ConvNeXt's
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class Block(torch.nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.dw = torch.nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.lin = torch.nn.Linear(c, c)
        self.scale = torch.nn.Parameter(torch.full((c,), 0.5))

    def forward(self, x):
        h = self.dw(x).permute(0, 2, 3, 1)
        return x + (self.scale * self.lin(h)).permute(0, 3, 1, 2)


class Net(torch.nn.Module):
    """A small ConvNeXt: stem, channels-first norm, two blocks of depthwise convolution, linear and layer scale."""

    def __init__(self, c: int = 8, export: bool = False):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, c, 2, stride=2)
        self.norm = ChannelsFirstNorm(c)
        self.blocks = torch.nn.Sequential(Block(c), Block(c))
        self.head = torch.nn.Linear(c, 4)
        self.export = export

    def forward(self, x, y):
        if self.export and x.shape[1] != 3:    # a branch on a shape: symbolic_trace cannot, torch.export can
            raise ValueError("3 channels")
        h = self.blocks(self.norm(self.stem(x)))
        return torch.nn.functional.cross_entropy(self.head(h.mean((2, 3))), y)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_permuted_values_crossing_packs_train_bitwise_as_eager(frontend):
    torch.manual_seed(0)
    model = Net(export=frontend == "export")
    data = [(torch.randn(8, 3, 8, 8), torch.randint(0, 4, (8,))) for _ in range(2)]
    ref, ref_losses = eager_accumulate(model, data, 4)
    ours = copy.deepcopy(model)
    budget = int(1.5 * training_state_bytes(model))
    sm, stats, losses = run_compiled(ours, data, 4, budget)
    assert sm.program.gm.meta["harmony.trace"].frontend == frontend
    stashes = [n for n in sm.graph.nodes if n.op == "call_function" and n.target.__name__ == "stash"]
    assert len(sm.plan.packs) > 3 and stashes
    assert any(s.inputs == ["permute"] for s in sm.plan.packs)      # a channels-last view crosses a boundary
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name


def test_a_pack_input_gets_its_gradient_as_autograd_computed_it():
    x = torch.ones(2, 3).t()               # a transposed value: strides (1, 3)
    y = enter(x, True)
    (y * 2).sum().backward()
    leaf = x.detach().requires_grad_()
    (leaf * 2).sum().backward()
    assert grad_of(y).stride() == (2, 1) and leaf.grad.stride() == x.stride()   # AccumulateGrad's contract
    assert torch.equal(grad_of(y), leaf.grad) and x.grad is None
    assert grad_of(enter(x, False)) is None and enter(3, True) == 3


def test_a_list_input_is_measured_off_the_graph_that_made_it():
    """A pack whose input is a list (mamba's ``chunk``, when the partition tries a cut between it and its
    ``getitem``): the list's tensors were left on their producer's graph, which an earlier measurement's backward
    had freed, so measuring this pack raised "backward through the graph a second time" (PassError in the
    partition; benchmarks/zoo.py's minimum for mamba, after earlier compiles in the process)."""
    from harmony.compiler.pack_cost import _profile_pack

    w = torch.ones(4, requires_grad=True)
    chunk = list((w * 2).chunk(2))
    chunk[0].sum().backward()               # the producer's graph, freed

    class First(torch.nn.Module):
        def forward(self, chunk):
            return (chunk[0] * 3,)

    out = _profile_pack(torch.fx.symbolic_trace(First()), [chunk], [True], loss_output=False)
    assert out["bwd_recompute_peak"] > 0 and w.grad.tolist() == [2.0, 2.0, 0.0, 0.0]
    entered = enter(tuple(chunk), True)
    assert type(entered) is tuple and all(t.grad_fn is None and not t.requires_grad for t in entered)
