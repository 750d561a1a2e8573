"""Bad input: each gets a clear harmony.errors exception, and the model is left as it was."""
import copy
import threading

import pytest
import torch
import torch.nn as nn

import harmony
from harmony.errors import BudgetError, ConfigError, InputError, TraceError
from models import CASES, training_state_bytes


@pytest.fixture
def gpt():
    model, data = CASES["gpt"]()
    before = copy.deepcopy(model.state_dict())
    threads = threading.active_count()
    yield model, data
    for k, v in model.state_dict().items():      # nothing lost or changed by a failed compile
        assert torch.equal(v, before[k]), k
    assert threading.active_count() <= threads


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum().item() > 0:   # a number from a tensor, compared in Python: not traced (branches.py)
            return self.lin(x)
        return -self.lin(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = Branchy(), nn.Linear(8, 2)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.b(self.a(x)), y)


def test_untraceable_model_names_the_line_and_the_leaf_fix():
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    with pytest.raises(TraceError) as e:
        harmony.compile(Net(), example_batch=(x, y))
    assert "test_errors.py" in str(e.value) and "leaf_modules" in str(e.value)
    sm = harmony.compile(Net(), example_batch=(x, y), leaf_modules=[Branchy], memory_budget="1MiB")
    sm(x, y)


def test_budget_below_one_layer(gpt):
    model, data = gpt
    with pytest.raises(BudgetError, match="smallest budget that works is .* bytes") as e:
        harmony.compile(model, example_batch=data[0], memory_budget=1000, microbatches=4)
    assert e.value.min_budget > 1000


def test_microbatches_must_divide_the_batch(gpt):
    model, data = gpt
    with pytest.raises(ConfigError, match="divisor of the batch size 8"):
        harmony.compile(model, example_batch=data[0], microbatches=3)
    with pytest.raises(ConfigError):
        harmony.compile(model, example_batch=data[0], microbatches=0)


def test_example_batch_that_does_not_match_the_model(gpt):
    model, data = gpt
    x, y = data[0]
    with pytest.raises(InputError):
        harmony.compile(model, example_batch=(x,))
    with pytest.raises(InputError):
        harmony.compile(model, example_batch=(x[:, :3].float(), y))
    with pytest.raises(InputError, match="batch"):
        harmony.compile(model, example_batch=(x, y[:4]))


def test_a_batch_that_does_not_match_the_compiled_plan(gpt):
    model, data = gpt
    sm = harmony.compile(model, example_batch=data[0], memory_budget=int(training_state_bytes(model) * 0.5),
                         microbatches=4)
    x, y = data[0]
    with pytest.raises(InputError, match="same number of rows"):     # other shapes train (tests/test_shapes.py)
        sm(x[:4], y[:3])
    with pytest.raises(InputError, match=r"idx float32\[8, 16\].*cannot be planned"):
        sm(x.float(), y)
    with pytest.raises(InputError, match="expected 2 batch tensors"):
        sm(x)
    sm.close()


@pytest.mark.parametrize("bad", ["lots", "-1MiB", 0, "12XB"])
def test_bad_budget(gpt, bad):
    model, data = gpt
    with pytest.raises(ConfigError, match="memory_budget"):
        harmony.compile(model, example_batch=data[0], memory_budget=bad)


def test_bad_optimizer_and_policy_and_pass(gpt):
    model, data = gpt
    with pytest.raises(ConfigError, match="torch.optim.Optimizer class"):
        harmony.compile(model, example_batch=data[0], optimizer="adam")
    with pytest.raises(ConfigError, match="unknown policy"):
        harmony.compile(model, example_batch=data[0], policy="fifo")
    with pytest.raises(ConfigError, match="unknown pass"):
        harmony.compile(model, example_batch=data[0], passes=("partition", "nope"))
    with pytest.raises(ConfigError, match="unknown pass 'graph'"):       # a pass's parts live inside its package
        harmony.compile(model, example_batch=data[0], passes=("graph",))
    with pytest.raises(ConfigError, match="takes pass names"):
        harmony.compile(model, example_batch=data[0], passes=("swap.graph",))
    with pytest.raises(ConfigError, match="takes pass names"):
        harmony.compile(model, example_batch=data[0], passes=("partition", 3))
    # swap fits a memory curve that counts the all-reduce buffers compress places: it must come after compress
    with pytest.raises(ConfigError, match="'swap' must run after pass 'compress'"):
        harmony.compile(model, example_batch=data[0], passes=("partition", "schedule", "offload", "swap", "compress"))
    with pytest.raises(ConfigError, match="device='gpu' is not a device torch knows"):
        harmony.compile(model, example_batch=data[0], device="gpu")
