"""A value that many packs read (an encoder's output, read by every decoder layer's cross-attention) gets its
gradient summed as eager's backward sums it: bitwise, not just allclose (passes/schedule.py ``folds``).

Before, each reading pack summed its own contributions and the producer added the packs' sums in pack order, where
eager folds every contribution into one running sum, the last reader's first: 87 of this model's 102 parameters
differed from eager's in the last bit."""
from __future__ import annotations

import copy

import pytest
import torch
from models import eager_accumulate, run_compiled, training_state_bytes


class Decoder(torch.nn.Module):
    def __init__(self, width: int, enc: int):
        super().__init__()
        self.k, self.v = torch.nn.Linear(enc, width), torch.nn.Linear(enc, width)
        self.o, self.norm = torch.nn.Linear(width, width), torch.nn.LayerNorm(width)

    def forward(self, h, enc):     # reads the encoder's output twice
        return h + self.o(torch.tanh(self.norm(h) + self.k(enc) * self.v(enc)))


class EncoderDecoder(torch.nn.Module):
    """The encoder's output is narrower than the decoder's stream, so the narrowest gaps fall between decoder
    layers and the output crosses every one of them to the packs that read it."""

    def __init__(self, width: int = 64, enc: int = 16, layers: int = 12):
        super().__init__()
        self.e1, self.e2 = torch.nn.Linear(width, width), torch.nn.Linear(width, enc)
        self.dec = torch.nn.ModuleList(Decoder(width, enc) for _ in range(layers))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x, y):
        enc = self.e2(torch.relu(self.e1(x)))
        h = x
        for d in self.dec:
            h = d(h, enc)
        return torch.nn.functional.mse_loss(self.head(h).squeeze(-1), y)


def _case():
    torch.manual_seed(0)
    return EncoderDecoder(), [(torch.randn(8, 4, 64), torch.randn(8, 4)) for _ in range(2)]


@pytest.mark.parametrize("policy,recompute", [("harmony", "auto"), ("harmony", "always"), ("sequential", "auto")])
def test_a_value_many_packs_read_trains_bitwise_as_eager(policy, recompute):
    model, data = _case()
    ref, ref_losses = eager_accumulate(model, data, 4)
    ours = copy.deepcopy(model)
    budget = int(training_state_bytes(model) * 0.22)
    sm, stats, losses = run_compiled(ours, data, 4, budget, policy, recompute=recompute)
    readers = [n for n in sm.graph.nodes if n.op == "call_function" and n.kwargs.get("chain")]
    assert len(sm.plan.packs) > 3 and readers      # the encoder's output is read by several packs
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name
    assert all(s["measured_peak"] <= budget for s in stats)


def test_the_schedule_says_where_each_readers_sum_goes_on():
    """Each reading pack's backward names the later reader whose sum it continues (None for the last reader),
    and the producer's backward takes the first reader's sum whole."""
    import harmony
    model, data = _case()
    sm = harmony.compile(model, example_batch=data[0], microbatches=4,
                         memory_budget=int(training_state_bytes(model) * 0.22))
    back = {(n.args[0], n.args[1]): n for n in sm.graph.nodes
            if n.op == "call_function" and n.target.__name__ == "backward"}
    readers = sorted({p for (p, mb), n in back.items() if n.kwargs.get("chain")})
    for mb in range(4):
        chains = [dict(back[(p, mb)].kwargs["chain"]) for p in readers]
        assert len(chains) >= 3 and all(len(c) == 1 for c in chains)
        assert list(chains[-1].values()) == [None]           # the last reader starts the sum
        for after, c in zip(readers[1:], chains[:-1]):     # each continues the next reader's (or its stash's)
            (name, h), = c.items()
            while h.target.__name__ == "unstash":
                h = h.args[0].args[0]
            assert h.target.__name__ == "backward" and h.args[:2] == (after, mb)
        producers = [n for (p, m), n in back.items() if m == mb and n.kwargs.get("totals")]
        assert len(producers) == 1 and producers[0].args[0] < readers[0]
    sm.close()
