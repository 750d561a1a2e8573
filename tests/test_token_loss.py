"""Whole-batch token losses (compiler/loss_weighting.py, driver/tokens.py): where the model or loss takes
``num_items_in_batch``, a step over microbatches with different numbers of label tokens (padding, labels of -100) is
the gradient of the whole batch's token mean: bitwise eager gradient accumulation where each microbatch's loss is
``model(**microbatch, num_items_in_batch=N)`` (Hugging Face's Trainer), allclose to eager on the whole batch."""
import copy
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import harmony
from harmony.compiler.loss_weighting import choose
from harmony.runtime.optim import optimizer_kwargs
from models import gpt_case, hf_bert_case, hf_small_llama_case, split, training_state_bytes


def padded(batches, key="labels"):
    """Rows cut short with labels of -100 (and an attention mask of 0 where the batch has one): the microbatches
    hold different numbers of counted tokens."""
    out = []
    for batch in batches:
        batch = {k: v.clone() for k, v in batch.items()} if isinstance(batch, dict) else [v.clone() for v in batch]
        labels = batch[key] if isinstance(batch, dict) else batch[-1]
        for row, start in ((1, 9), (2, 4), (5, 2)):
            if row < labels.shape[0]:
                labels[row, start:] = -100
                if isinstance(batch, dict) and "attention_mask" in batch:
                    batch["attention_mask"][row, start:] = 0
        out.append(batch if isinstance(batch, dict) else tuple(batch))
    return out


def eager(model, batches, microbatches, count=None):
    """Eager AdamW; ``count(batch)``: each microbatch's loss takes ``num_items_in_batch=count(batch)`` and counts
    whole (Hugging Face's Trainer); None: each counts ``1 / microbatches``. Returns the model and each step's loss."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), **optimizer_kwargs(torch.optim.AdamW, {}))
    losses = []
    for batch in batches:
        extra = {} if count is None else {"num_items_in_batch": count(batch)}
        total = 0.0
        for mb in split(batch, microbatches):
            out = model(**mb, **extra) if isinstance(mb, dict) else model(*mb, **extra)
            loss = out.loss if hasattr(out, "loss") else out
            (loss if count is not None else loss / microbatches).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total if count is not None else total / microbatches)
    return model, losses


def run(sm, batches):
    return [(sm(**b) if isinstance(b, dict) else sm(*b)).item() for b in batches]


def assert_bitwise(ours, ref):
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), f"{name}: max diff {(a - b).abs().max().item()}"


def assert_close(ours, ref, atol=2e-5):
    """Allclose: AdamW's normalised steps make a last-bit difference in a small gradient a difference of ~1e-5."""
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.allclose(a, b, rtol=1e-4, atol=atol), f"{name}: max diff {(a - b).abs().max().item()}"


def gpt_tokens(batch):
    return (batch[1] != -100).sum()


def test_gpt_trains_the_whole_batch_token_mean_bitwise_as_eager_accumulation():
    model, data = gpt_case(batch=8)
    data = padded(data)
    ours = copy.deepcopy(model)
    sm = harmony.compile(ours, data[0], memory_budget=int(training_state_bytes(model) * 0.5), microbatches=4)
    losses = run(sm, data)
    ref, ref_losses = eager(model, data, 4, gpt_tokens)
    assert_bitwise(ours, ref)
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    whole, whole_losses = eager(model, data, 1, gpt_tokens)     # the whole batch at once: its token mean
    assert_close(ours, whole)
    assert losses == pytest.approx(whole_losses, rel=1e-5)
    assert sm.stats["loss_tokens"] == int(gpt_tokens(data[-1]))
    report = sm.report()
    assert "== loss weighting: tokens" in report and "GPT takes num_items_in_batch" in report
    with torch.no_grad():         # evaluation: the whole batch's token mean too
        assert sm.evaluate(*data[0]).item() == pytest.approx(ref(*data[0]).item(), rel=1e-5)
    sm.close()


def test_rows_keeps_the_mean_of_the_microbatches_means():
    model, data = gpt_case(batch=8)
    data = padded(data)
    ours = copy.deepcopy(model)
    sm = harmony.compile(ours, data[0], memory_budget=int(training_state_bytes(model) * 0.5), microbatches=4,
                         loss_weighting="rows")
    losses = run(sm, data)
    ref, ref_losses = eager(model, data, 4)
    assert_bitwise(ours, ref)
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert "== loss weighting: rows" in sm.report() and "loss_tokens" not in sm.stats
    whole = model(*data[0]).item()        # the whole batch's token mean is not the mean of the microbatches' means
    assert losses[0] != pytest.approx(whole, rel=1e-4)
    sm.close()


def test_a_hugging_face_causal_lm_counts_its_shifted_labels():
    model, data = hf_small_llama_case(batch=4)
    for batch in data:
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    data = padded(data)

    def count(batch):          # what Hugging Face's Trainer counts for a causal LM
        return (batch["labels"][..., 1:] != -100).sum()
    ours = copy.deepcopy(model)
    sm = harmony.compile(ours, data[0], memory_budget="4MiB", microbatches=2)
    losses = run(sm, data)
    ref, ref_losses = eager(model, data, 2, count)
    assert_bitwise(ours, ref)
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    whole, whole_losses = eager(model, data, 1)
    assert_close(ours, whole)
    assert losses == pytest.approx(whole_losses, rel=1e-5)
    whole.eval()
    with torch.no_grad():
        assert sm.evaluate(**data[0]).item() == pytest.approx(whole(**data[0]).loss.item(), rel=1e-5)
    assert "labels[..., 1:] != -100" in sm.program.reports[0].notes[0]      # (the report wraps it)
    sm.close()


class TokenTagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.out = nn.Linear(16, 32)

    def forward(self, x):
        return self.out(torch.relu(self.emb(x)))


def token_loss(logits, target, num_items_in_batch=None):
    """A loss_fn that opts in: its summed cross-entropy over the count it is handed (the mean without one)."""
    flat = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    if num_items_in_batch is None:
        return F.cross_entropy(*flat)
    return F.cross_entropy(*flat, reduction="sum") / num_items_in_batch


def test_a_loss_fn_that_takes_the_count_opts_in():
    torch.manual_seed(0)
    model = TokenTagger()
    data = padded([(torch.randint(0, 32, (8, 12)), torch.randint(0, 32, (8, 12))) for _ in range(3)])
    ours = copy.deepcopy(model)
    sm = harmony.compile(ours, data[0], microbatches=4, loss_fn=token_loss)
    losses = run(sm, data)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), **optimizer_kwargs(torch.optim.AdamW, {}))
    for x, y in data:
        n = (y != -100).sum()
        for mx, my in zip(x.chunk(4), y.chunk(4)):
            token_loss(ref(mx), my, num_items_in_batch=n).backward()
        opt.step()
        opt.zero_grad()
    assert_bitwise(ours, ref)
    assert losses[0] == pytest.approx(token_loss(model(data[0][0]), data[0][1]).item(), rel=1e-5)
    assert "loss_fn takes num_items_in_batch" in sm.report()
    sm.close()


def test_what_cannot_weigh_by_tokens_says_so():
    with pytest.raises(harmony.errors.ConfigError, match="loss_weighting='tok'.*'auto', 'tokens', 'rows'"):
        harmony.Config(loss_weighting="tok")
    torch.manual_seed(0)
    data = (torch.randint(0, 32, (4, 6)), torch.randint(0, 32, (4, 6)))
    loss_fn = nn.CrossEntropyLoss()
    with pytest.raises(harmony.errors.ConfigError, match="loss_fn takes no num_items_in_batch"):
        harmony.compile(TokenTagger(), data, loss_fn=lambda o, t: loss_fn(o.flatten(0, 1), t.flatten()),
                        loss_weighting="tokens")
    sm = harmony.compile(TokenTagger(), data, loss_fn=lambda o, t: loss_fn(o.flatten(0, 1), t.flatten()))
    assert "loss weighting: rows" in sm.report() and "takes no num_items_in_batch" in sm.report()
    sm.close()
    model, batches = hf_bert_case(batch=4)        # its forward takes **kwargs but computes its own mean
    sm = harmony.compile(model, batches[0], memory_budget="8MiB", microbatches=2)
    assert "does not read num_items_in_batch" in sm.report()
    sm.close()
    with pytest.raises(harmony.errors.ConfigError, match="does not read num_items_in_batch"):
        harmony.compile(model, batches[0], memory_budget="8MiB", microbatches=2, loss_weighting="tokens")


@pytest.mark.parametrize("mode", [dict(parallel="pipeline"), dict(shard_state="full"), dict(balance="auto")])
def test_modes_that_weigh_by_rows_refuse_tokens_and_auto_falls_back(mode):
    model, _ = gpt_case(batch=8)
    key = next(iter(mode))
    cfg = types.SimpleNamespace(**{**dict(loss_fn=None, parallel=None, shard_state=False, balance=None,
                                          data_parallel=False, world_size=1, loss_weighting="auto"), **mode})
    weighting = choose(cfg, model, ["idx", "targets"])
    assert weighting.kind == "rows" and key in weighting.why
    cfg.loss_weighting = "tokens"
    with pytest.raises(harmony.errors.ConfigError, match=f"loss_weighting='tokens': {key}"):
        choose(cfg, model, ["idx", "targets"])


def _dp_rank(rank, world):
    """Each rank trains its half of the padded batches: its rows hold a different number of tokens."""
    import harmony.data
    model, data = gpt_case(batch=8)
    sm = harmony.compile(model, harmony.data.shard(padded(data)[0]), microbatches=2,
                         optimizer=torch.optim.SGD, optimizer_kwargs=dict(lr=0.1, momentum=0.9))
    losses = [sm(*harmony.data.shard(batch)).item() for batch in padded(data)]
    return dict(params=[p.detach().numpy().copy() for p in model.parameters()], losses=losses,
                tokens=sm.stats["loss_tokens"], report=sm.report())


def test_data_parallel_ranks_divide_by_the_global_batch_token_count():
    """Two gloo ranks: the count is summed over them and each seed is times the world size (the all-reduce
    averages): the parameters of eager SGD on the whole global batch's token mean; the ranks' losses average to it."""
    from test_collectives import _spawn
    res = _spawn(2, _dp_rank, timeout=300)
    assert sorted(res) == [0, 1] and all(isinstance(v, dict) for v in res.values()), res
    model, data = gpt_case(batch=8)
    data = padded(data)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_losses = []
    for x, y in data:
        loss = ref(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    assert res[0]["tokens"] == res[1]["tokens"] == int(gpt_tokens(data[-1]))
    assert "summed over the 2 data-parallel ranks" in res[0]["report"]
    for r in (0, 1):
        for a, b in zip(res[r]["params"], ref.parameters()):
            assert torch.allclose(torch.from_numpy(a), b.detach(), rtol=1e-5, atol=1e-6)
    mean = [(a + b) / 2 for a, b in zip(res[0]["losses"], res[1]["losses"])]
    assert mean == pytest.approx(ref_losses, rel=1e-5)
