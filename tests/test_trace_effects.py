"""A forward's Python side effects run once, when compile traces it, not at every step: compile says so
(compiler/trace/effects.py) instead of letting a counter or a print go quiet."""
from __future__ import annotations

import warnings

import pytest
import torch
from models import CASES

import harmony


class Counting(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.calls, self.mode = torch.nn.Linear(8, 8), 0, "first"

    def forward(self, x, y):
        self.calls += 1
        self.mode = "later"
        print("forward called")
        return torch.nn.functional.mse_loss(self.lin(x), y)


def _effects(model, batch) -> tuple[list[str], str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        sm = harmony.compile(model, batch, memory_budget="16MiB", microbatches=1)
    found = [str(w.message) for w in seen if str(w.message).startswith("harmony.compile: the forward")]
    report = sm.report()
    sm.close()
    return found, report


def test_a_counter_and_a_print_in_forward_are_said_once_at_compile(capsys):
    found, report = _effects(Counting(), (torch.randn(4, 8), torch.randn(4, 8)))
    assert "forward called" in capsys.readouterr().out         # the user still sees the print
    assert len(found) == 2
    assert "printed while it was traced ('forward called')" in found[0] and "runs once, at compile" in found[0]
    assert "calls 0 -> 1" in found[1] and "mode 'first' -> 'later'" in found[1] and "in a buffer" in found[1]
    assert report.count("\ntrace ") == 2


@pytest.mark.parametrize("case", ["gpt", "hf-gpt2"])
def test_models_without_side_effects_are_not_warned_about(case):
    model, data = CASES[case]()
    batch = data[0]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        sm = harmony.compile(model, example_batch=batch, memory_budget=10 * 16 * sum(p.numel() for p in
                                                                                      model.parameters()),
                             microbatches=1)
    sm.close()
    assert not [w for w in seen if str(w.message).startswith("harmony.compile: the forward")]
