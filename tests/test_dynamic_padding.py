"""Dynamic padding, as Hugging Face collators pad: every batch padded to its own longest sequence, one plan for all.

The module is compiled with the longest batch the loader gives; every batch after it, whatever its length and rows,
runs that plan (no batch is planned again) and trains bitwise as eager gradient accumulation over the same
microbatches, each weighted by the whole batch's label tokens; evaluation over a padded validation set gives eager
``model.eval()`` + ``no_grad`` on the same microbatches, and the whole batch's loss at once within rounding.
"""
import copy

import pytest
import torch

import harmony
from harmony.runtime.optim import optimizer_kwargs
from harmony.runtime.plan import even_rows
from models import hf_small_gpt2_case, hf_small_llama_case, training_state_bytes

CASES = {"llama": hf_small_llama_case, "gpt2": hf_small_gpt2_case}


def padded_batches(count, rows=4, longest=24, seed=1, last_rows=None):
    """``count`` batches of ``rows`` sequences of random lengths, each batch padded to its longest (pad id 0,
    attention mask 0, labels -100 there), the first the longest; the last of ``last_rows`` rows if given."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        n = last_rows if last_rows and i == count - 1 else rows
        lengths = torch.randint(3, longest + 1, (n,), generator=g)
        if i == 0:
            lengths[0] = longest
        width = int(lengths.max())
        ids = torch.randint(1, 128, (n, width), generator=g)
        mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        ids = ids * mask
        out.append(dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)))
    return out


def eager_accumulation(model, batches, microbatches, steps=True):
    """Eager AdamW over ``batches``, each cut into ``microbatches`` microbatches as the compiled plan cuts a smaller
    batch (``even_rows``), each microbatch's loss its summed loss over the batch's label tokens (Hugging Face's
    ``num_items_in_batch``: the whole batch's token mean, what ``loss_weighting="auto"`` trains); the losses
    (``steps=False``: eval mode, no_grad, no step)."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), **optimizer_kwargs(torch.optim.AdamW, {}))
    model.train(steps)
    losses = []
    for batch in batches:
        n = batch["input_ids"].shape[0]
        rows = even_rows(n, min(n, microbatches))
        tokens = (batch["labels"][..., 1:] != -100).sum()     # a causal LM's counted tokens (shifted labels)
        start, total = 0, 0.0
        with torch.set_grad_enabled(steps):
            for r in rows:
                loss = model(**{k: v[start:start + r] for k, v in batch.items()}, num_items_in_batch=tokens).loss
                if steps:
                    loss.backward()
                total += loss.item()
                start += r
        if steps:
            opt.step()
            opt.zero_grad()
        losses.append(total)
    return model, losses


@pytest.mark.parametrize("case", sorted(CASES))
def test_fifty_dynamically_padded_steps_run_one_plan_bitwise_as_eager(case):
    model, _ = CASES[case](batch=4)
    batches = padded_batches(50, last_rows=3)
    widths = {b["input_ids"].shape[1] for b in batches}
    assert len(widths) > 10
    ref, ref_losses = eager_accumulation(model, batches, 2)
    ours = copy.deepcopy(model)
    sm = harmony.compile(ours, batches[0], memory_budget=int(training_state_bytes(model) * 0.95), microbatches=2)
    losses = [sm(**b).item() for b in batches]
    assert sm.shapes.compiles == 0 and len(sm.shapes.plans) == 1
    shapes = {(b["input_ids"].shape) for b in batches[1:]} - {batches[0]["input_ids"].shape}
    assert sum(sm.shapes.served.values()) == sum(b["input_ids"].shape != batches[0]["input_ids"].shape
                                                 for b in batches) and len(sm.shapes.served) == len(shapes)
    assert sm.stats["measured_peak"] <= sm.stats["budget"]
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), f"{name}: max diff {(a - b).abs().max().item()}"
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    report = sm.report()
    assert "batch shapes" in report and "smaller ones seen" in report


def test_evaluation_over_a_padded_validation_set_is_eager_eval():
    """Every length, and a last batch of one row (fewer rows than the plan's microbatches): eager ``model.eval()``
    under ``no_grad`` on the same microbatches; no state changes."""
    model, _ = hf_small_llama_case(batch=4)
    train = padded_batches(2, seed=3)
    valid = padded_batches(6, seed=4, longest=20, last_rows=1)
    ours = copy.deepcopy(model)
    sm = harmony.compile(ours, train[0], memory_budget=int(training_state_bytes(model) * 0.95), microbatches=2)
    sm(**train[0])
    trained, _ = eager_accumulation(model, train[:1], 2)
    _, expected = eager_accumulation(trained, valid, 2, steps=False)
    before = [p.detach().clone() for p in ours.parameters()]
    got = [sm.evaluate(**b).item() for b in valid]
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-6)
    trained.eval()
    with torch.no_grad():          # the whole padded batch at once: its mean over every label token
        whole = [trained(**b).loss.item() for b in valid]
    assert got == pytest.approx(whole, rel=1e-5)
    assert sm.shapes.compiles == 0 and sm.steps == 1
    sm.sync_model()
    assert all(torch.equal(a, b) for a, b in zip(before, ours.parameters()))
    with pytest.raises(harmony.errors.InputError, match="larger than the compiled example batch"):
        sm.evaluate(**padded_batches(1, longest=30, seed=5)[0])
