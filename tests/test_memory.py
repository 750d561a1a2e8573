"""Memory contract: the measured device peak never exceeds the budget; verify's prediction is within 10%."""
import copy

import pytest
import torch

import harmony
from harmony.errors import BudgetError
from models import CASES, run_compiled, training_state_bytes


@pytest.mark.parametrize("policy", ["harmony", "sequential"])
@pytest.mark.parametrize("frac", [0.25, 0.5, 1.0])
@pytest.mark.parametrize("case", ["gpt", "mlp", "cnn"])
def test_measured_peak_within_budget_and_prediction(case, frac, policy):
    model, data = CASES[case](layers=6) if case == "gpt" else CASES[case]()
    budget = int(training_state_bytes(model) * frac)
    sm, stats, _ = run_compiled(copy.deepcopy(model), data, 4, budget, policy)
    for s in stats:
        assert s["measured_peak"] <= budget
    steady = stats[-1]   # the first step also creates the optimizer state
    assert abs(steady["predicted_peak"] - steady["measured_peak"]) <= 0.10 * steady["measured_peak"], steady
    if frac < 1.0:
        assert len(sm.plan.packs) > 1
    assert steady["h2d_bytes"] == pytest.approx(steady["predicted_h2d"], rel=0.02)


def test_ondemand_stays_within_budget_once_it_has_seen_a_step():
    """The on-demand baseline makes room for what each op allocated in the previous step."""
    model, data = CASES["gpt"]()
    budget = int(training_state_bytes(model) * 0.5)
    _, stats, _ = run_compiled(copy.deepcopy(model), data, 4, budget, "ondemand")
    assert stats[-1]["measured_peak"] <= budget
    assert stats[-1]["h2d_bytes"] > 0


def test_the_runtime_enforces_the_budget():
    """A plan that under-predicts is stopped by the runtime's meter, not silently exceeded."""
    model, data = CASES["gpt"]()
    sm = harmony.compile(model, example_batch=data[0], memory_budget=int(training_state_bytes(model) * 0.5),
                         microbatches=4)
    sm.runtime.meter.budget = sm.stats.get("measured_peak", 0) or int(sm.predicted.peak * 0.5)
    with pytest.raises(harmony.errors.DeviceOutOfMemory, match="over its budget"):
        sm(*data[0])


def test_budget_error_names_a_budget_that_compiles():
    model, data = CASES["gpt"]()
    with pytest.raises(BudgetError) as e:
        harmony.compile(model, example_batch=data[0], memory_budget=int(training_state_bytes(model) * 0.05),
                        microbatches=4)
    assert e.value.min_budget and "smallest budget" in str(e.value)
    sm = harmony.compile(model, example_batch=data[0], memory_budget=e.value.min_budget, microbatches=4)
    sm(*data[0])
    assert sm.stats["measured_peak"] <= e.value.min_budget
