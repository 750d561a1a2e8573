"""Issue 28 point 2: ``sm.evaluate(*batch)`` runs a forward-only schedule under the training budget.

Its loss is eager ``model.eval()`` + ``no_grad``'s on the same weights (bitwise in fp32, per microbatch as a step
averages them); it changes no training state, so a module that evaluated between steps trains on bitwise as one
that never did; the meter and the device's holds are as before it, also after an error inside it; ``sm(...)``
under ``torch.no_grad()`` or in eval mode evaluates.
"""
from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import harmony
from faults import fail_at
from harmony.errors import BudgetError, ConfigError, InputError
from harmony.models import GPT, GPTConfig, copy_task
from models import CASES, call, cnn_case, params, split, training_state_bytes


class Guarded(nn.Module):
    """Batch norm and both kinds of dropout behind a branch torch.fx cannot trace: the export front end's graph,
    with ``aten.batch_norm(..., training=True)``, ``aten.dropout(..., True)`` and ``num_batches_tracked += 1``."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.3)
        self.mid = nn.Sequential(*[m for i in range(4) for m in (nn.Linear(128 if i == 0 else 64, 64),
                                                                  nn.BatchNorm1d(64), nn.ReLU())])
        self.head = nn.Linear(64, 10)

    def forward(self, x, y):
        if x.shape[0] > 0:         # symbolic_trace cannot branch on a shape; torch.export can
            x = x * 1.0
        h = F.avg_pool2d(self.drop(F.relu(self.bn(self.conv(x)))), 2).flatten(1)
        h = F.dropout(self.mid(h), 0.2, self.training)
        return F.cross_entropy(self.head(h), y)


def guarded_case(batch=8, seed=0):
    torch.manual_seed(seed)
    return Guarded(), [(torch.randn(batch, 3, 8, 8), torch.randint(0, 10, (batch,))) for _ in range(3)]


def gpt_dropout_case(batch=8, seed=0):
    return CASES["gpt"](batch=batch, seed=seed, dropout=0.1)


def hf_gpt2_dropout_case(batch=4, seed=0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=128, n_layer=3, n_embd=64, n_head=2, n_positions=32, resid_pdrop=0.1,
                                  embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "eager"
    model = transformers.GPT2LMHeadModel(cfg)
    data = []
    for _ in range(3):
        ids = torch.randint(0, 128, (batch, 16))
        data.append({"input_ids": ids, "labels": ids.clone()})
    return model, data


EVAL_CASES = {"gpt-dropout": gpt_dropout_case, "cnn-batchnorm": cnn_case, "export-bn-dropout": guarded_case,
              "hf-gpt2-dropout": hf_gpt2_dropout_case}


def compiled(case, frac=0.4, microbatches=2, **kw):
    """The model (kept as it was), its batches, and a module compiled from a copy under ``frac`` of its training
    state (swapping)."""
    model, data = EVAL_CASES[case]() if isinstance(case, str) else case
    sm = harmony.compile(copy.deepcopy(model), example_batch=data[0], microbatches=microbatches,
                         memory_budget=int(training_state_bytes(model) * frac), **kw)
    return model, data, sm


def step(sm, batch, seed):
    torch.manual_seed(seed)        # dropout's masks: the same draws in both modules of a comparison
    return sm(**batch) if isinstance(batch, dict) else sm(*batch)


def evaluate(sm, batch):
    return sm.evaluate(**batch) if isinstance(batch, dict) else sm.evaluate(*batch)


def eager_eval(model, sm, batch, microbatches):
    """Eager ``model.eval()`` + ``no_grad`` on the module's current weights and buffers, the mean over microbatches as
    a step takes it."""
    eager = copy.deepcopy(model)
    eager.load_state_dict(sm.training_state_dict()["model"], strict=False)     # (a tied weight under one name)
    eager.eval()
    with torch.no_grad():
        return torch.stack([call(eager, mb).float() for mb in split(batch, microbatches)]).mean()


def holds(sm) -> tuple:
    rt = sm.runtime
    return rt.meter.live, {k: n for k, n in rt.state.refs.items() if n}


def buffers(sm) -> dict:
    names = dict(sm.program.gm.named_parameters())
    return {n: b.clone() for n, b in sm.training_state_dict()["model"].items() if n not in names}


@pytest.mark.parametrize("case", sorted(EVAL_CASES))
def test_evaluation_is_eager_eval_bitwise_and_changes_nothing(case):
    """After a step, the evaluation's loss is eager eval's bit for bit; batch norm's running statistics, the meter's
    live bytes and the device's holds are as before it; it swapped under the budget and within its prediction."""
    model, data, sm = compiled(case)
    step(sm, data[0], 0)
    before, stats = holds(sm), buffers(sm)
    assert sm.runtime.meter.peak <= sm.runtime.meter.budget
    loss = evaluate(sm, data[1])
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert torch.equal(loss, eager_eval(model, sm, data[1], 2)), (loss, eager_eval(model, sm, data[1], 2))
    assert holds(sm) == before
    after = buffers(sm)
    assert all(torch.equal(stats[n], after[n]) for n in stats)
    s = sm.eval_stats
    assert s["h2d_bytes"] > 0 and s["measured_peak"] <= s["budget"]
    assert s["measured_peak"] <= 1.1 * s["predicted_peak"]
    assert sm.steps == 1
    sm.close()


@pytest.mark.parametrize("case", ["gpt-dropout", "export-bn-dropout"])
def test_training_goes_on_bitwise_after_evaluations(case):
    """Two modules from copies of one model train the same steps; one evaluates before, between and after them: the
    weights are bitwise the same (RNG, buffers and optimizer state untouched), as are the losses."""
    model, data, a = compiled(case)
    _, _, b = compiled((model, data))
    evaluate(a, data[2])
    for i, batch in enumerate(data[:2]):
        la, lb = step(a, batch, i), step(b, batch, i)
        assert torch.equal(la, lb)
        evaluate(a, data[2])
    assert a.steps == b.steps == 2
    pa, pb = params(a), params(b)
    assert all(torch.equal(pa[n], pb[n]) for n in pb)
    assert a.eval_stats["evaluations"] == 3
    a.close()
    b.close()


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "sm.eval"])
def test_sm_under_no_grad_or_in_eval_mode_evaluates(mode):
    """``sm(...)`` under ``torch.no_grad()``, ``torch.inference_mode()`` or after ``sm.eval()`` evaluates: the same loss
    as ``sm.evaluate``, no step; ``sm.eval()`` leaves the user's model's modes alone, ``sm.train()`` trains again."""
    model, data, sm = compiled("gpt-dropout")
    step(sm, data[0], 0)
    weights = params(sm)
    user = sm.model
    if mode == "sm.eval":
        assert sm.eval() is sm and not sm.training and user.training
        loss = sm(*data[1])
        sm.train()
    else:
        with getattr(torch, mode)():
            loss = sm(*data[1])
    assert sm.steps == 1 and torch.equal(loss, sm.evaluate(*data[1]))
    assert all(torch.equal(weights[n], p) for n, p in params(sm).items())
    step(sm, data[1], 1)
    assert sm.steps == 2
    sm.close()


def test_the_users_eval_mode_does_not_reach_a_step():
    """The fx front end keeps ``nn.Dropout`` whole in the packs; a step runs it in training mode even when the user
    left the model in eval mode (for an eager evaluation of their own), and puts that mode back."""
    model, data, a = compiled("gpt-dropout")
    _, _, b = compiled((model, data))
    a.model.eval()
    for i, batch in enumerate(data[:2]):
        assert torch.equal(step(a, batch, i), step(b, batch, i))
    assert not any(m.training for m in a.model.modules())
    pa, pb = params(a), params(b)
    assert all(torch.equal(pa[n], pb[n]) for n in pb)
    a.close()
    b.close()


def test_an_error_inside_an_evaluation_is_rolled_back():
    """Targets out of range fail the last pack's forward, an injected error a swap midway: each time the meter and
    holds are back, the note says so, and the module trains on bitwise as one that never evaluated."""
    model, data, a = compiled("gpt-dropout")
    _, _, b = compiled((model, data))
    step(a, data[0], 0)
    step(b, data[0], 0)
    before = holds(a)
    x, y = data[1]
    with pytest.raises((IndexError, RuntimeError)) as err:
        a.evaluate(x, torch.full_like(y, 10_000))
    assert "evaluation was rolled back" in "\n".join(getattr(err.value, "__notes__", []))
    assert holds(a) == before
    with fail_at(3, RuntimeError("injected"), kinds=("forward",)), pytest.raises(RuntimeError, match="injected"):
        a.evaluate(*data[1])
    assert holds(a) == before
    with pytest.raises(InputError, match="larger than the compiled example batch"):
        a.evaluate(torch.cat([x, x]), torch.cat([y, y]))
    assert torch.equal(step(a, data[1], 1), step(b, data[1], 1))
    pa, pb = params(a), params(b)
    assert all(torch.equal(pa[n], pb[n]) for n in pb)
    a.close()
    b.close()


@pytest.fixture
def slow_disk_workers(monkeypatch):
    """A disk thread dawdles after each job, as one waiting for a core on a busy machine does: the buffers a read
    filled must not outlive its future (they are the CPU device's memory, on the meter)."""
    import concurrent.futures.thread as pool_thread
    run = pool_thread._WorkItem.run

    def dawdling(item):
        run(item)
        if threading.current_thread().name.startswith("harmony-disk"):
            time.sleep(0.01)
    monkeypatch.setattr(pool_thread._WorkItem, "run", dawdling)


def test_weights_on_disk_evaluate_and_stay_carried(tmp_path, slow_disk_workers):
    """Packs wholly on disk: the evaluation reads their files (the weights the last step carried on the device are
    used where they are and stay carried for the next step), equals eager eval, and the next steps are bitwise those
    of a module that never evaluated. The meter is as before it the moment it returns, also where the disk threads
    are slow to go on to their next job."""
    cfg = GPTConfig(layers=3, width=64, vocab=64, seq=16)
    torch.manual_seed(0)
    model, data = GPT(cfg), list(copy_task(cfg, 8, 3))
    kw = dict(frac=1 / 3, microbatches=4, weights_on="disk", optimizer_on="host", disk_group_bytes="24KiB",
              offload_dir=tmp_path)
    _, _, a = compiled((model, data), **kw)
    _, _, b = compiled((model, data), **kw)
    assert a.plan.packs_with("carried")
    step(a, data[0], 0)
    step(b, data[0], 0)
    before = holds(a)
    carried = set(a.runtime.state.params_disk.carried())      # (names only: a reference would keep them alive)
    assert carried
    loss = a.evaluate(*data[1])
    assert holds(a) == before and set(a.runtime.state.params_disk.carried()) == carried
    assert torch.allclose(loss, eager_eval(model, a, data[1], 4), rtol=0, atol=1e-6)   # tied weight: allclose
    assert a.eval_stats["h2d_bytes"] > 0
    for i, batch in enumerate(data[1:], 1):
        assert torch.equal(step(a, batch, i), step(b, batch, i))
    pa, pb = params(a), params(b)
    assert all(torch.equal(pa[n], pb[n]) for n in pb)
    a.close()
    b.close()


def test_bf16_evaluation_is_eager_eval_within_bf16_rounding():
    model, data, sm = compiled("gpt-dropout", precision="bf16")
    step(sm, data[0], 0)
    loss = sm.evaluate(*data[1])
    ref = eager_eval(model, sm, data[1], 2)
    assert loss.dtype == torch.float32
    assert torch.allclose(loss, ref, rtol=2e-2), (loss, ref)
    sm.close()


def test_evaluation_is_reported_and_compiled_once():
    model, data, sm = compiled("cnn-batchnorm")
    assert "evaluation schedule" not in sm.report()
    sm.evaluate(*data[0])
    first = sm._evaluation
    sm.evaluate(*data[1])
    assert sm._evaluation is first and sm.eval_stats["evaluations"] == 2
    text = sm.report()
    assert "evaluation schedule" in text and "forward" in text
    assert "BatchNorm2d modules run in eval mode" in text
    sm.close()


def test_what_cannot_evaluate_says_so():
    model, data = cnn_case()
    sm = harmony.compile(copy.deepcopy(model), example_batch=data[0], microbatches=2, policy="ondemand",
                         memory_budget=int(training_state_bytes(model) * 0.6))
    with pytest.raises(ConfigError, match="policy='ondemand'"):
        sm.evaluate(*data[0])
    sm.close()
    cut = harmony.compile(copy.deepcopy(model), example_batch=data[0], passes=["partition"])
    with pytest.raises(ConfigError, match="make no schedule"):
        cut.evaluate(*data[0])
    tight = harmony.compile(copy.deepcopy(model), example_batch=data[0], microbatches=2,
                            memory_budget=int(training_state_bytes(model) * 0.4))
    tight.program.config.headroom = 0.999      # the planner may fill nothing: no evaluation schedule fits
    with pytest.raises(BudgetError, match="evaluation schedule does not fit"):
        tight.evaluate(*data[0])
    tight.close()


def _data_parallel_rank(rank, world):
    import harmony.data
    from test_collectives import _digest
    model, data = gpt_dropout_case()
    sm = harmony.compile(copy.deepcopy(model), example_batch=harmony.data.shard(data[0]), microbatches=2,
                         memory_budget=int(training_state_bytes(model) * 0.5), shard_state=True)
    step(sm, harmony.data.shard(data[0]), rank)
    mine = harmony.data.shard(data[1])
    loss = sm.evaluate(*mine)
    same = torch.equal(loss, eager_eval(model, sm, mine, 2))
    step(sm, harmony.data.shard(data[2]), 10 + rank)
    out = dict(loss=loss.item(), same=same, steps=sm.steps, digest=_digest([p.detach() for p in sm.model.parameters()]))
    sm.close()
    return out


def test_data_parallel_ranks_evaluate_their_own_batch():
    """2 gloo ranks, optimizer state sharded: each rank's evaluation is eager eval of its own share of the batch
    (no all-reduce: the two losses differ), and the ranks train on in step with each other."""
    from test_collectives import _spawn
    out = _spawn(2, _data_parallel_rank, timeout=240)
    assert all(isinstance(out.get(r), dict) for r in range(2)), out
    assert out[0]["same"] and out[1]["same"] and out[0]["loss"] != out[1]["loss"]
    assert out[0]["steps"] == out[1]["steps"] == 2 and out[0]["digest"] == out[1]["digest"]
