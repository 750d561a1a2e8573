"""Batches as libraries hand them (driver/constants.py, compiler/trace/batch.py).

A Hugging Face ``BatchEncoding`` (a ``Mapping``, not a ``dict``) is a batch like a dict: as ``example_batch``, in
``sm(batch)``, ``sm(**batch)`` and ``sm.evaluate(...)``, training bitwise as the same dict does. A batch's items
that are not tensors (``use_cache=False``, a float, a bool, None, a str) are constants of the trace: not inputs of
the plan, passed to the forward as they are; other values trace and plan the step again, once; evaluation refuses
them. Numerics are eager PyTorch's gradient accumulation over the same microbatches, bit for bit, in fp32.
"""
from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
import torch.nn as nn

import harmony
from harmony.errors import InputError
from harmony.runtime.optim import optimizer_kwargs
from models import hf_small_gpt2_case, params

transformers = pytest.importorskip("transformers")


class Scaled(nn.Module):
    """A forward that takes options beside its tensors, as Hugging Face models do."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x, y, scale: float = 1.0, relu: bool = False, note: str | None = None, dims=(0, 1)):
        h = self.a(x) * scale
        if relu:
            h = h.relu()
        if note is not None:
            h = h + len(note)
        return ((self.b(h) - y) ** 2).mean(dim=dims)


def scaled_case(rows=4, steps=3):
    torch.manual_seed(0)
    return Scaled(), [(torch.randn(rows, 8), torch.randn(rows, 8)) for _ in range(steps)]


def tensors_and_constants(batch: dict) -> tuple[dict, dict]:
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    return tensors, {k: v for k, v in batch.items() if k not in tensors}


def eager(model, batches, microbatches):
    """Eager AdamW, each batch (a dict: its tensors cut into ``microbatches``, its constants given to every one) as
    gradient accumulation, then one update. Returns the model and the losses."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), **optimizer_kwargs(torch.optim.AdamW, {}))
    losses = []
    for batch in batches:
        tensors, fixed = tensors_and_constants(dict(batch))
        total = 0.0
        for i in range(microbatches):
            out = model(**{k: v.chunk(microbatches)[i] for k, v in tensors.items()}, **fixed)
            loss = out.loss if hasattr(out, "loss") else out
            (loss / microbatches).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total / microbatches)
    return model, losses


def assert_params_equal(sm, ref):
    ours = params(sm)
    theirs = dict(ref.named_parameters())
    assert ours.keys() <= theirs.keys()
    for name, value in ours.items():
        assert torch.equal(value, theirs[name]), name


def tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    cfg._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(cfg)


def encodings(steps=3, rows=4, vocab=64, **constants):
    out = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (rows, 16))
        out.append(transformers.BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                               "labels": ids.clone(), **constants}))
    return out


# -- a BatchEncoding is a batch ----------------------------------------------------------------------------------
def test_a_batch_encoding_trains_bitwise_as_the_same_dict_and_as_eager():
    model, data = hf_small_gpt2_case(batch=4)
    batches = [transformers.BatchEncoding(b) for b in data]
    assert not isinstance(batches[0], dict)
    ref, ref_losses = eager(model, data, 2)
    by_dict = harmony.compile(copy.deepcopy(model), example_batch=data[0], microbatches=2)
    by_encoding = harmony.compile(copy.deepcopy(model), example_batch=batches[0], microbatches=2)
    assert by_encoding.plan.input_names == ["input_ids", "labels", "num_items_in_batch"]
    assert by_encoding.program.constants == {}
    dict_losses = [by_dict(**b).item() for b in data]
    # the three ways to hand a BatchEncoding over: as keywords, alone by position, and split
    encoding_losses = [by_encoding(**batches[0]).item(), by_encoding(batches[1]).item(),
                       by_encoding(batches[2]["input_ids"], labels=batches[2]["labels"]).item()]
    assert encoding_losses == dict_losses
    assert dict_losses == pytest.approx(ref_losses, rel=1e-6)
    assert_params_equal(by_encoding, ref)
    assert all(torch.equal(a, b) for a, b in zip(params(by_dict).values(), params(by_encoding).values()))
    loss = by_encoding.evaluate(batches[0])
    assert torch.equal(loss, by_dict.evaluate(**data[0]))
    by_dict.close()
    by_encoding.close()


# -- constants of the trace ------------------------------------------------------------------------------------
def test_options_of_the_forward_are_constants_of_the_trace_and_train_as_eager():
    model, data = scaled_case()
    fixed = dict(scale=2.0, relu=True, note="hi", dims=(0, 1))
    batches = [{"x": x, "scale": 2.0, "y": y, "relu": True, "note": "hi", "dims": (0, 1)} for x, y in data]
    ref, ref_losses = eager(model, batches, 2)
    sm = harmony.compile(copy.deepcopy(model), example_batch=batches[0], microbatches=2)
    assert sm.plan.input_names == ["x", "y"]
    assert [n.name for n in sm.program.gm.graph.nodes if n.op == "placeholder"] == ["x", "y"]
    assert sm.program.constants == fixed and list(sm.program.constants) == list(fixed)     # the batch's order
    losses = [sm(**batches[0]).item(), sm(batches[1]).item(),
              sm(batches[2]["x"], batches[2]["y"], **fixed).item()]
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert_params_equal(sm, ref)
    assert sm.shapes.compiles == 0                   # the same constants: the compiled plan every time
    assert "batch constants" in sm.report() and "scale=2.0" in sm.report()
    sm.close()


def test_a_tuple_batch_takes_its_constants_in_their_places():
    """``forward(x, scale)`` with ``loss_fn``: ``(x, 2.0, y)`` calls the model as ``model(x, 2.0)``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))

    class WithScale(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = model

        def forward(self, x, scale):
            return self.body(x) * scale

    net = WithScale()
    data = [(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(2)]
    sm = harmony.compile(copy.deepcopy(net), example_batch=(data[0][0], 2.0, data[0][1]),
                         loss_fn=nn.MSELoss(), microbatches=2)
    assert sm.plan.input_names == ["x", "target"] and sm.program.constants == {"scale": 2.0}
    ref = copy.deepcopy(net)
    opt = torch.optim.AdamW(ref.parameters(), **optimizer_kwargs(torch.optim.AdamW, {}))
    for x, y in data:
        assert sm(x, 2.0, y).item() > 0
        for xs, ys in zip(x.chunk(2), y.chunk(2)):
            (nn.functional.mse_loss(ref(xs, 2.0), ys) / 2).backward()
        opt.step()
        opt.zero_grad()
    assert_params_equal(sm, ref)
    with pytest.raises(InputError, match="missing 'scale'"):
        sm(data[0][0], target=data[0][1])
    sm.close()


def test_hugging_face_flags_in_a_batch_encoding_train_as_eager():
    """``use_cache=False``, ``output_hidden_states=False``, ``return_dict=True``, as a collator or a user adds them;
    the last step asks for the hidden states: traced and planned again, and still eager's step."""
    model = tiny_llama()
    batches = encodings(use_cache=False, output_hidden_states=False, return_dict=True)
    batches[-1]["output_hidden_states"] = True
    ref, ref_losses = eager(model, batches, 2)
    sm = harmony.compile(copy.deepcopy(model), example_batch=batches[0], microbatches=2)
    assert sm.plan.input_names == ["input_ids", "attention_mask", "labels", "num_items_in_batch"]
    assert sm.program.constants == dict(use_cache=False, output_hidden_states=False, return_dict=True)
    losses = [sm(b).item() for b in batches]
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert_params_equal(sm, ref)
    assert sm.shapes.compiles == 1
    sm.close()


def test_another_constant_traces_and_plans_once_and_trains_as_eager_with_it(caplog):
    model, data = scaled_case(steps=4)
    scales = [2.0, 3.0, 3.0, 2.0]
    batches = [{"x": x, "y": y, "scale": s} for (x, y), s in zip(data, scales)]
    ref, ref_losses = eager(model, batches, 2)
    sm = harmony.compile(copy.deepcopy(model), example_batch=batches[0], microbatches=2)
    with caplog.at_level(logging.INFO, logger="harmony"):
        losses = [sm(**b).item() for b in batches]
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert_params_equal(sm, ref)
    assert sm.shapes.compiles == 1 and len(sm.shapes.plans) == 2      # scale=3.0 planned once, then cached
    again = [r.getMessage() for r in caplog.records if "again" in r.getMessage()]
    assert again == ["harmony: scale=3.0 (compiled with 2.0): tracing and planning the step again with these "
                     "constants"]
    other = [p for p in sm.shapes.plans.values() if p is not sm.shapes.example][0]
    assert other.steps == 2 and other.program.constants == {"scale": 3.0}
    assert sm.shapes.example.steps == 2
    rows = sm.shapes.summary()
    assert sorted(r["shape"].split("; ")[1] for r in rows) == ["scale=2.0", "scale=3.0"]
    sm.close()


def test_a_constant_that_equals_the_forwards_default_may_be_left_out_or_added():
    model, data = scaled_case(steps=2)
    (x, y), (x2, y2) = data
    ref, _ = eager(model, [{"x": x, "y": y, "relu": False}, {"x": x2, "y": y2, "note": None}], 1)
    sm = harmony.compile(copy.deepcopy(model), example_batch={"x": x, "y": y, "relu": False})
    sm(x=x, y=y)                     # relu=False is the forward's default: the same call
    sm(x=x2, y=y2, note=None)        # so is note=None, which the example did not have
    assert sm.shapes.compiles == 0
    assert_params_equal(sm, ref)
    sm.close()


def test_evaluation_with_other_constants_is_refused_and_changes_nothing():
    model, data = scaled_case(steps=2)
    (x, y), (x2, y2) = data
    sm = harmony.compile(copy.deepcopy(model), example_batch={"x": x, "y": y, "scale": 2.0}, microbatches=2)
    sm(x=x, y=y, scale=2.0)
    before = params(sm)
    with pytest.raises(InputError) as raised:
        sm.evaluate(x=x2, y=y2, scale=3.0)
    message = str(raised.value)
    assert "sm.evaluate(...) got scale=3.0 (compiled with 2.0)" in message
    assert "compile with an example_batch that has these ones" in message
    after = params(sm)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert sm.steps == 1 and sm.shapes.compiles == 0 and sm._evaluation is None
    loss = sm.evaluate({"x": x2, "y": y2, "scale": 2.0})
    reference = copy.deepcopy(model)
    reference.load_state_dict(sm.training_state_dict()["model"])
    with torch.no_grad():
        expected = torch.stack([reference(a, b, scale=2.0) for a, b in zip(x2.chunk(2), y2.chunk(2))]).mean()
    assert torch.equal(loss, expected)
    sm.close()


# -- what is refused, and how it says so ------------------------------------------------------------------------
def test_bad_batches_are_input_errors_that_say_what_and_what_to_do():
    model, data = scaled_case(steps=1)
    x, y = data[0]
    with pytest.raises(InputError, match=r"example_batch holds scale=list.*bool, int, float, str, None"):
        harmony.compile(copy.deepcopy(model), example_batch={"x": x, "y": y, "scale": [2.0]})
    with pytest.raises(InputError, match=r"any Mapping, such as a Hugging Face BatchEncoding.*got set"):
        harmony.compile(copy.deepcopy(model), example_batch={x, y})
    with pytest.raises(InputError, match=r"last item is loss_fn's target and must be a tensor, got float"):
        harmony.compile(nn.Linear(8, 8), example_batch=(x, 2.0), loss_fn=nn.MSELoss())

    sm = harmony.compile(copy.deepcopy(model), example_batch={"x": x, "y": y, "scale": 2.0})
    cases = [
        (dict(x=x, y=y), r"missing 'scale', which example_batch gave as 2\.0 .*pass scale=2\.0"),
        (dict(x=x, y=y, scale=2.0, relu=True), r"got relu=True, which example_batch did not have.*Leave it out"),
        (dict(x=x, y=None, scale=2.0), r"got y=None where example_batch had a tensor"),
        (dict(x=x, y=y, scale=[2.0]), r"got scale=list, which example_batch gave as 2\.0"),
        (dict(x=x, y=y, scale=2.0, bogus=y), r"unknown keyword argument 'bogus'"),
    ]
    for call, match in cases:
        with pytest.raises(InputError, match=match):
            sm(**call)
    with pytest.raises(InputError, match="'x' both in the batch and by keyword"):
        sm({"x": x, "y": y, "scale": 2.0}, x=x)
    assert sm.steps == 0 and sm.shapes.compiles == 0
    sm.close()


def test_a_checkpoint_records_the_constants_it_was_traced_with(tmp_path):
    model, data = scaled_case(steps=1)
    x, y = data[0]
    sm = harmony.compile(copy.deepcopy(model), example_batch={"x": x, "y": y, "scale": 2.0, "dims": (0, 1)})
    sm(x=x, y=y, scale=2.0, dims=(0, 1))
    harmony.save(sm, tmp_path / "ck")
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert manifest["constants"] == {"scale": 2.0, "dims": [0, 1]}
    sm.close()
