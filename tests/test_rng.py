"""Dropout draws the same masks whatever the plan: each microbatch has a random stream of its own (runtime/rng.py).

Before, every forward drew from the one global generator in the schedule's order, which interleaves packs and
microbatches as the budget decides: the same seed trained another model at another budget."""
from __future__ import annotations

import copy

import pytest
import torch
from models import CASES, eager_accumulate, run_compiled, training_state_bytes

from harmony.runtime.rng import microbatch_states


def _train(frac: float, microbatches: int = 4, steps: int = 2, **kw):
    model, data = CASES["gpt"](dropout=0.1)
    torch.manual_seed(123)
    sm, _, losses = run_compiled(model, data[:steps], microbatches, int(training_state_bytes(model) * frac), **kw)
    return sm, model, losses, torch.get_rng_state()


def test_the_masks_do_not_depend_on_the_budget_or_on_recompute():
    """At a budget of many packs with recompute, and at one of everything resident, the same seed trains the same
    model, bit for bit, and leaves the generator in the same state."""
    small, small_model, small_losses, small_rng = _train(0.3, recompute="always")
    big, big_model, big_losses, big_rng = _train(4.0)
    assert len(small.plan.packs) > 2 and len(big.plan.packs) == 1
    assert any(n.kwargs.get("saved", 0) is None for n in small.graph.nodes if n.op == "call_function"
               and n.target.__name__ == "backward")          # some forwards are recomputed (their draws replayed)
    assert small_losses == big_losses
    for (name, a), b in zip(small_model.named_parameters(), big_model.parameters()):
        assert torch.equal(a, b), name
    assert torch.equal(small_rng, big_rng)


def test_a_step_draws_eager_accumulations_masks_from_the_microbatch_streams():
    model, data = CASES["gpt"](dropout=0.1)
    ours = copy.deepcopy(model)
    torch.manual_seed(7)
    ref, ref_losses = eager_accumulate(model, data[:2], 4, streams=True)
    ref_rng = torch.get_rng_state()
    torch.manual_seed(7)
    sm, _, losses = run_compiled(ours, data[:2], 4, int(training_state_bytes(model) * 0.4))
    assert len(sm.plan.packs) > 1 and any(p.random for p in sm.plan.packs)
    assert losses == pytest.approx(ref_losses, rel=1e-6)    # (eager sums the microbatches' losses as Python floats)
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name
    assert torch.equal(torch.get_rng_state(), ref_rng)
    # the streams matter: drawn from the one generator in order, eager's masks (and losses) are others
    torch.manual_seed(7)
    _, plain = eager_accumulate(model, data[:1], 4)
    assert plain[0] != ref_losses[0]


def test_one_microbatch_draws_from_the_global_generator_as_eager_does():
    torch.manual_seed(3)
    before = torch.get_rng_state()
    states = microbatch_states(1)
    assert len(states) == 1 and torch.equal(states[0][0], before) and states[0][1] is None
    assert torch.equal(torch.get_rng_state(), before)        # reading the states draws nothing


def test_microbatch_states_are_distinct_and_depend_only_on_the_start():
    torch.manual_seed(5)
    a = microbatch_states(4)
    b = microbatch_states(4)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a, b))
    assert len({bytes(s[0].numpy()) for s in a}) == 4
    torch.manual_seed(6)
    c = microbatch_states(4)
    assert not any(torch.equal(x[0], y[0]) for x, y in zip(a[1:], c[1:]))


def test_a_failed_step_leaves_the_generator_where_it_found_it():
    """A step that raises after its forwards drew their masks is undone, its draws too: the next step trains as if
    it had not run."""
    from faults import fail_at

    import harmony
    model, data = CASES["gpt"](dropout=0.1)
    ref_model = copy.deepcopy(model)
    budget = int(training_state_bytes(model) * 0.4)
    torch.manual_seed(11)
    sm = harmony.compile(model, example_batch=data[0], memory_budget=budget, microbatches=4)
    before = torch.get_rng_state()
    with fail_at(0, RuntimeError("injected"), kinds=("backward",)) as hit, pytest.raises(RuntimeError):
        sm(*data[0])
    assert hit["hit"]
    assert torch.equal(torch.get_rng_state(), before)
    loss = sm(*data[0]).item()
    sm.close()
    torch.manual_seed(11)
    ref = harmony.compile(ref_model, example_batch=data[0], memory_budget=budget, microbatches=4)
    assert ref(*data[0]).item() == loss
    ref.close()
