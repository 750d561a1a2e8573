"""Property: random models, budgets and microbatch counts either train within the contracts or raise a
BudgetError naming a budget that then compiles and trains."""
import copy

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import harmony
from harmony.errors import BudgetError
from harmony.models import GPT, GPTConfig, copy_task
from models import MLP, eager_accumulate, training_state_bytes


@st.composite
def cases(draw):
    microbatches = draw(st.sampled_from([1, 2, 4]))
    batch = microbatches * draw(st.sampled_from([1, 2]))
    seed = draw(st.integers(0, 1000))
    torch.manual_seed(seed)
    if draw(st.booleans()):
        widths = draw(st.lists(st.sampled_from([16, 32, 64]), min_size=2, max_size=6))
        model = MLP((12,) + tuple(widths) + (5,))
        data = [(torch.randn(batch, 12), torch.randint(0, 5, (batch,))) for _ in range(2)]
    else:
        c = GPTConfig(vocab=32, seq=8, layers=draw(st.integers(1, 4)), width=draw(st.sampled_from([16, 32])),
                      heads=2, tie=False)
        model = GPT(c)
        data = list(copy_task(c, batch, 2, seed=seed))
    frac = draw(st.floats(0.02, 1.5))
    policy = draw(st.sampled_from(["harmony", "sequential"]))
    return model, data, microbatches, int(training_state_bytes(model) * frac), policy


def _train(model, data, microbatches, budget, policy):
    sm = harmony.compile(model, example_batch=data[0], memory_budget=budget, microbatches=microbatches,
                         policy=policy)
    peaks = []
    for x, y in data:
        sm(x, y)
        peaks.append(sm.stats["measured_peak"])
    sm.close()
    return sm, peaks


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_compiles_within_contracts_or_names_a_budget_that_does(case):
    model, data, microbatches, budget, policy = case
    ours = copy.deepcopy(model)
    try:
        sm, peaks = _train(ours, data, microbatches, budget, policy)
    except BudgetError as e:
        assert e.min_budget and e.min_budget > budget
        budget = e.min_budget
        ours = copy.deepcopy(model)
        sm, peaks = _train(ours, data, microbatches, budget, policy)
    assert max(peaks) <= budget
    ref, _ = eager_accumulate(model, data, microbatches)
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name
