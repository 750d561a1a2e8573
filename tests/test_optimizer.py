"""``sm.optimizer``: one optimizer over the packs' optimizers, for torch's lr schedulers, param groups and the user."""
import copy

import pytest
import torch

import harmony
from harmony.errors import ConfigError
from models import CASES, training_state_bytes


def groups_of(model):
    """No weight decay on biases and norms, as LLM recipes do."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    return [{"params": decay, "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def eager_steps(model, data, microbatches, make_scheduler, steps):
    """Eager gradient accumulation with AdamW in the same groups and a scheduler stepped after each update."""
    opt = torch.optim.AdamW(groups_of(model), lr=1e-2, foreach=False)
    sched = make_scheduler(opt)
    lrs = []
    for x, y in data[:steps]:
        opt.zero_grad()
        for mx, my in zip(x.chunk(microbatches), y.chunk(microbatches)):
            (model(mx, my) / microbatches).backward()
        opt.step()
        sched.step()
        lrs.append([g["lr"] for g in opt.param_groups])
    return lrs


SCHEDULERS = {
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)),
    "onecycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[2e-2, 1e-2], total_steps=6),
}


@pytest.mark.parametrize("optimizer_on", ["device", "host"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULERS))
def test_a_scheduler_on_sm_optimizer_drives_every_pack_as_eager(schedule, optimizer_on):
    """An AdamW instance in two param groups given to compile, a scheduler built on ``sm.optimizer``: the lr of
    each group follows the eager scheduler's exactly, and the weights are eager's bit for bit (device and host
    steps, the state swapped under a budget of 40% of it)."""
    model, data = CASES["gpt"](layers=4)
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(groups_of(model), lr=1e-2, foreach=False)
    sm = harmony.compile(model, example_batch=data[0], optimizer=opt, microbatches=2, optimizer_on=optimizer_on,
                         optimizer_kwargs={"fused": False}, memory_budget=int(training_state_bytes(model) * 0.4))
    assert [g["weight_decay"] for g in sm.optimizer.param_groups] == [0.1, 0.0]
    assert isinstance(sm.optimizer, torch.optim.Optimizer)
    sched = sm.add_scheduler(SCHEDULERS[schedule](sm.optimizer))
    lrs = []
    for x, y in data[:4]:
        sm(x, y)
        sched.step()
        lrs.append([g["lr"] for g in sm.optimizer.param_groups])
    assert lrs == eager_steps(reference, data, 2, SCHEDULERS[schedule], 4)
    weights = sm.training_state_dict()["model"]
    for name, p in reference.named_parameters():
        assert torch.equal(p, weights[name]), name
    sm.close()


def test_param_groups_by_name_and_a_hand_set_lr():
    """``param_groups=`` by name: the parameters no group names form a first group; setting a group's lr by hand
    reaches the packs' optimizers at the next step."""
    model, data = CASES["gpt"](layers=2)
    biases = [n for n, p in model.named_parameters() if p.dim() < 2]
    sm = harmony.compile(model, example_batch=data[0], microbatches=2,
                         param_groups=[{"params": biases, "weight_decay": 0.0}])
    assert [len(g["params"]) for g in sm.optimizer.param_groups] == \
        [sum(1 for p in model.parameters() if p.dim() >= 2), len(biases)]
    sm.optimizer.param_groups[1]["lr"] = 0.5
    sm(*data[0])
    assert {g["lr"] for opt in sm.optimizers for g in opt.param_groups if g["weight_decay"] == 0.0} == {0.5}
    sm.close()


def test_bad_optimizers_and_groups_are_refused(tmp_path):
    model, data = CASES["gpt"](layers=2)
    params = list(model.parameters())
    with pytest.raises(ConfigError, match="leaves out 1 trainable parameters"):
        harmony.compile(model, example_batch=data[0], optimizer=torch.optim.SGD(params[1:], lr=0.1))
    with pytest.raises(ConfigError, match="not a parameter of the model"):
        harmony.compile(model, example_batch=data[0], param_groups=[{"params": ["nope.weight"]}])
    with pytest.raises(ConfigError, match="already in an earlier group"):
        name = next(n for n, _ in model.named_parameters())
        harmony.compile(model, example_batch=data[0], param_groups=[{"params": [name]}, {"params": [name]}])
    with pytest.raises(ConfigError, match="param_groups="):
        harmony.compile(model, example_batch=data[0], param_groups=[{"params": [params[0]]}])
    sm = harmony.compile(model, example_batch=data[0])
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ConfigError, match="not built on this module's optimizer"):
        sm.add_scheduler(torch.optim.lr_scheduler.StepLR(other, 1))
    sm.close()


def test_harmony_save_and_load_keep_the_schedulers_and_the_groups_settings(tmp_path):
    """A run resumed from a checkpoint continues the schedule where it stopped: the lr of every group and the
    weights equal those of the run that never stopped, bit for bit."""
    model, data = CASES["gpt"](layers=2)

    def compiled():
        m = copy.deepcopy(model)
        sm = harmony.compile(m, example_batch=data[0], optimizer=torch.optim.AdamW(groups_of(m), lr=1e-2),
                             microbatches=2, optimizer_kwargs={"fused": False})
        return sm, sm.add_scheduler(SCHEDULERS["onecycle"](sm.optimizer))
    straight, sched = compiled()
    for i, (x, y) in enumerate(data):
        straight(x, y)
        sched.step()
        if i == 1:
            harmony.save(straight, tmp_path / "ckpt")
    resumed, sched2 = compiled()
    with pytest.raises(harmony.errors.CheckpointError, match="1 lr schedulers, and this module has 0"):
        m = copy.deepcopy(model)        # the same param groups, no scheduler
        bare = harmony.compile(m, example_batch=data[0], optimizer=torch.optim.AdamW(groups_of(m), lr=1e-2),
                               microbatches=2, optimizer_kwargs={"fused": False})
        harmony.load(bare, tmp_path / "ckpt")
    harmony.load(resumed, tmp_path / "ckpt")
    assert [g["lr"] for g in resumed.optimizer.param_groups] != [g["lr"] for g in straight.optimizer.param_groups]
    for x, y in data[2:]:
        resumed(x, y)
        sched2.step()
    assert [g["lr"] for g in resumed.optimizer.param_groups] == [g["lr"] for g in straight.optimizer.param_groups]
    assert sched2.state_dict()["last_epoch"] == sched.state_dict()["last_epoch"] == len(data) > 2
    a, b = straight.training_state_dict()["model"], resumed.training_state_dict()["model"]
    assert all(torch.equal(a[n], b[n]) for n in a)
    for sm in (straight, resumed, bare):
        sm.close()


@pytest.mark.parametrize("optimizer_on,precision", [("host", "fp32"), ("host", "bf16"), ("device", "fp32")])
def test_stats_time_the_host_threads_updates(optimizer_on, precision):
    """``sm.stats["host_step_seconds"]``: the host thread's time in optimizer updates (and, in bf16, in making fp32
    gradients), per step: what the simulator's host stream predicts. Host steps take some; device steps none."""
    model, data = CASES["gpt"](layers=2)
    sm = harmony.compile(model, example_batch=data[0], microbatches=2, optimizer_on=optimizer_on,
                         precision=precision, memory_budget=int(training_state_bytes(model) * 0.6))
    for x, y in data[:2]:
        sm(x, y)
        if optimizer_on == "host":
            assert sm.stats["host_step_seconds"] > 0
        else:
            assert sm.stats["host_step_seconds"] == 0
    sm.close()


def test_a_checkpoint_loads_only_into_the_param_groups_it_was_saved_with(tmp_path):
    """As torch.optim.Optimizer.load_state_dict: another number of groups, or a parameter in another group, is
    refused with nothing changed; the same groups take the saved settings (torch copies the saved groups' values)."""
    model, data = CASES["gpt"](layers=2)
    biases = [n for n, p in model.named_parameters() if p.dim() < 2]
    weights = [n for n, p in model.named_parameters() if p.dim() >= 2]

    def compiled(**kw):
        return harmony.compile(copy.deepcopy(model), example_batch=data[0], microbatches=2, **kw)
    one = compiled(optimizer_kwargs={"weight_decay": 0.01})
    one(*data[0])
    harmony.save(one, tmp_path / "one")
    two = compiled(optimizer_kwargs={"weight_decay": 0.1}, param_groups=[{"params": biases, "weight_decay": 0.0}])
    before = two.training_state_dict()["model"]["blocks.0.fc.weight"].clone()
    for load in (lambda: harmony.load(two, tmp_path / "one"),
                 lambda: two.load_training_state_dict(one.training_state_dict())):
        with pytest.raises(harmony.errors.CheckpointError, match="saved with 1 param group, and this module has 2 "
                                                                 "param groups.*Nothing was changed"):
            load()
    assert [g["weight_decay"] for g in two.optimizer.param_groups] == [0.1, 0.0] and two.steps == 0
    assert torch.equal(two.training_state_dict()["model"]["blocks.0.fc.weight"], before)
    two(*data[0])
    harmony.save(two, tmp_path / "two")
    with pytest.raises(harmony.errors.CheckpointError, match="saved with 2 param groups, and this module has 1 "):
        harmony.load(one, tmp_path / "two")
    moved = compiled(param_groups=[{"params": weights[:1] + biases, "weight_decay": 0.0}])
    with pytest.raises(harmony.errors.CheckpointError, match=f"in another param group than when saved \\({weights[0]} "
                                                             f"was in group 0, is in group 1 here"):
        harmony.load(moved, tmp_path / "two")
    other = compiled(optimizer_kwargs={"weight_decay": 0.2}, param_groups=[{"params": biases, "weight_decay": 0.05}])
    harmony.load(other, tmp_path / "two")
    assert [g["weight_decay"] for g in other.optimizer.param_groups] == [0.1, 0.0]
    assert {g["weight_decay"] for opt in other.optimizers for g in opt.param_groups} == {0.1, 0.0}
    for sm in (one, two, moved, other):
        sm.close()


@pytest.mark.parametrize("kwargs,groups,said", [
    ({"lrr": 1e-3}, None, r"optimizer_kwargs: AdamW refuses \{'lrr': 0.001\} \(.*unexpected keyword argument 'lrr'"),
    ({"lr": -1}, None, r"optimizer_kwargs: AdamW refuses \{'lr': -1\} \(Invalid learning rate: -1\)"),
    ({}, [{"params": ["head.weight"], "weight_decay": -0.1, "name": "head"}],
     r"param_groups\[0\]: AdamW refuses \{'weight_decay': -0.1\} \(Invalid weight_decay value: -0.1\)"),
])
def test_optimizer_arguments_are_checked_before_the_model_is_traced(kwargs, groups, said, monkeypatch):
    import harmony.driver.compile as driver

    def traced(*args, **kw):
        raise AssertionError("the model was traced before its optimizer's arguments were checked")
    monkeypatch.setattr(driver, "trace", traced)
    model, data = CASES["gpt"](layers=1)
    with pytest.raises(ConfigError, match=said):
        harmony.compile(model, example_batch=data[0], optimizer_kwargs=kwargs, param_groups=groups)
