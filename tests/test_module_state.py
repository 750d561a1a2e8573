"""``ScheduledModule`` follows ``nn.Module``'s conventions: ``sm.state_dict()`` / ``sm.load_state_dict()`` are the
model's weights by the model's names, read from and written to wherever they live (host, device, disk), with the
optimizer state left as it is; the whole training state is ``sm.training_state_dict()`` /
``sm.load_training_state_dict()``, and the old form given to ``load_state_dict`` still loads with a FutureWarning.
``torch.compile(sm)`` and ``sm.compile()`` are refused, pointing to ``harmony.compile(torch.compile(model))``."""
import copy

import pytest
import torch

import harmony
from harmony.errors import CheckpointError, ConfigError
from harmony.models import GPT, GPTConfig, copy_task
from models import assert_bitwise, params

CFG = GPTConfig(layers=3, width=64, vocab=64, seq=16)      # tied embedding and head: one tensor, two names
DATA = list(copy_task(CFG, 8, 3))


def gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(CFG)


def compile_gpt(model, **kw):
    budget = 16 * sum(p.numel() for p in model.parameters()) // 3      # a third of the state: packs swap
    return harmony.compile(model, example_batch=DATA[0], memory_budget=budget, microbatches=4, **kw)


def train(sm, batches):
    return [sm(x, y).item() for x, y in batches]


def optim_state(sm) -> dict:
    return {n: {k: v.clone() for k, v in s.items()} for n, s in sm.training_state_dict()["optimizer"].items()}


@pytest.fixture(scope="module", params=["host", "disk"])
def trained(request, tmp_path_factory):
    """One step under a budget that swaps, weights between steps on the host or in files (weights_on="disk")."""
    kw = {} if request.param == "host" else dict(weights_on="disk", optimizer_on="host",
                                                  offload_dir=tmp_path_factory.mktemp("weights"))
    sm = compile_gpt(gpt(), **kw)
    train(sm, DATA[:1])
    yield sm
    sm.close()


def test_state_dict_is_the_models_by_its_names(trained):
    sm = trained
    sd = sm.state_dict()
    reference = gpt()
    assert list(sd) == list(reference.state_dict())       # the model's keys, in its order, tied names both
    assert sd["tok.weight"].data_ptr() == sd["head.weight"].data_ptr()
    expected = {n: t.clone() for n, t in sm.training_state_dict()["model"].items()}
    for n, t in sd.items():
        if n in expected:
            assert torch.equal(t, expected[n]), n
    reference.load_state_dict(sd)                         # an eager model takes it as is
    assert not any(torch.isnan(t).any() for t in reference.state_dict().values())
    assert list(sm.state_dict(prefix="m.")) == ["m." + k for k in sd]


def test_load_state_dict_sets_the_weights_where_they_live_and_keeps_the_optimizer_state(trained):
    sm = trained
    other = gpt(seed=1)
    before_optim, steps = optim_state(sm), sm.steps
    result = sm.load_state_dict(other.state_dict())
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    got = sm.state_dict()
    for n, t in other.state_dict().items():
        assert torch.equal(got[n], t), n
    after = optim_state(sm)
    assert sm.steps == steps and after.keys() == before_optim.keys()
    for n, s in before_optim.items():
        for k, v in s.items():
            assert torch.equal(after[n][k], v), (n, k)
    # the next step trains from the loaded weights (no stale copy on the device or in a file): one AdamW step
    # moves each weight by about lr at most
    train(sm, DATA[1:2])
    lr = sm.optimizer.param_groups[0]["lr"]
    for n, t in sm.state_dict().items():
        assert (t - other.state_dict()[n]).abs().max() <= 2 * lr, n


def test_a_mismatched_module_state_dict_is_refused_before_anything_changes(trained):
    sm = trained
    before = params(sm)
    sd = sm.state_dict()
    with pytest.raises(CheckpointError, match=r"missing keys \['blocks.0.ln1.weight'\].*Nothing was changed"):
        sm.load_state_dict({k: v for k, v in sd.items() if k != "blocks.0.ln1.weight"})
    with pytest.raises(CheckpointError, match=r"blocks.0.qkv.weight: given \(3, 3\), model \(192, 64\)"):
        sm.load_state_dict({**sd, "blocks.0.qkv.weight": torch.zeros(3, 3)})
    assert_bitwise(sm, before)
    result = sm.load_state_dict({"blocks.0.ln1.weight": sd["blocks.0.ln1.weight"], "extra": torch.zeros(1)},
                                strict=False)
    assert result.unexpected_keys == ["extra"] and "head.weight" in result.missing_keys
    assert_bitwise(sm, before)


def test_a_training_state_given_to_load_state_dict_still_loads_with_a_warning():
    sm = compile_gpt(gpt())
    train(sm, DATA[:1])
    saved = copy.deepcopy(sm.training_state_dict())
    assert sorted(saved) == ["format", "model", "model_groups", "optimizer", "param_groups", "rng", "schedulers",
                             "step"]
    at1 = params(sm)
    train(sm, DATA[1:2])
    with pytest.warns(FutureWarning, match="load_training_state_dict"):
        sm.load_state_dict(saved)
    assert sm.steps == 1
    assert_bitwise(sm, at1)
    sm.close()


def test_torch_compile_of_the_module_is_refused():
    sm = compile_gpt(gpt())
    x, y = DATA[0]
    with pytest.raises(ConfigError, match=r"harmony.compile\(torch.compile\(model\)"):
        torch.compile(sm)(x, y)
    with pytest.raises(ConfigError, match=r"sm.compile\(\).*harmony.compile\(torch.compile\(model\)"):
        sm.compile()
    assert sm.steps == 0
    train(sm, DATA[:1])            # called as it is, it trains
    assert sm.steps == 1
    sm.close()
