"""Small models for the tests, and the eager PyTorch references Harmony must match."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from harmony.models import GPT, GPTConfig, copy_task


class MLP(nn.Module):
    def __init__(self, sizes=(32,) + (128,) * 8 + (10,)):
        super().__init__()
        self.layers = nn.Sequential(*[m for a, b in zip(sizes, sizes[1:]) for m in (nn.Linear(a, b), nn.ReLU())][:-1])

    def forward(self, x, y):
        return F.cross_entropy(self.layers(x), y)


class CNN(nn.Module):
    """Eleven conv layers with BatchNorm: running statistics must advance once per microbatch."""

    def __init__(self, width=32, depth=10):
        super().__init__()
        layers = [nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
        for _ in range(depth):
            layers += [nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
        self.body = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(4 * width, 10))

    def forward(self, x, y):
        return F.cross_entropy(self.body(x), y)


def mlp_case(batch=16, seed=0):
    torch.manual_seed(seed)
    return MLP(), [(torch.randn(batch, 32), torch.randint(0, 10, (batch,))) for _ in range(3)]


def cnn_case(batch=8, seed=0):
    torch.manual_seed(seed)
    return CNN(), [(torch.randn(batch, 3, 8, 8), torch.randint(0, 10, (batch,))) for _ in range(3)]


def gpt_case(batch=8, seed=0, **cfg):
    torch.manual_seed(seed)
    c = GPTConfig(**{"layers": 3, "width": 64, "vocab": 64, "seq": 16, "tie": False, **cfg})
    return GPT(c), list(copy_task(c, batch, 3, seed=seed))


def _hf_case(model_class: str, config_class: str, batch: int, seed: int, **config):
    """A small Hugging Face model with random weights and eager attention, and 3 batches of 16 tokens out of 128
    (labels = inputs)."""
    transformers = __import__("pytest").importorskip("transformers")
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_class)(vocab_size=128, **config)
    cfg._attn_implementation = "eager"
    model = getattr(transformers, model_class)(cfg)
    data = []
    for _ in range(3):
        ids = torch.randint(0, 128, (batch, 16))
        data.append({"input_ids": ids, "labels": ids.clone()})
    return model, data


def hf_gpt2_case(batch=4, seed=0, tie=False):
    return _hf_case("GPT2LMHeadModel", "GPT2Config", batch, seed, n_layer=4, n_embd=64, n_head=2, n_positions=32,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tie)


def hf_bert_case(batch=4, seed=0, tie=False):
    return _hf_case("BertForMaskedLM", "BertConfig", batch, seed, num_hidden_layers=4, hidden_size=64,
                    num_attention_heads=2, intermediate_size=128, max_position_embeddings=32,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, tie_word_embeddings=tie)


def hf_llama_case(batch=4, seed=0, tie=False):
    """Llama's parts: rotary position embeddings, grouped-query attention, RMSNorm, a gated SiLU MLP."""
    return _hf_case("LlamaForCausalLM", "LlamaConfig", batch, seed, num_hidden_layers=4, hidden_size=64,
                    num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, max_position_embeddings=32,
                    attention_dropout=0.0, tie_word_embeddings=tie, use_cache=False)


CASES = {"mlp": mlp_case, "cnn": cnn_case, "gpt": gpt_case, "hf-gpt2": hf_gpt2_case, "hf-bert": hf_bert_case,
         "hf-llama": hf_llama_case}


def call(model, batch):
    """The model's loss on a batch given as a tuple or a dict."""
    if isinstance(batch, dict):
        out = model(**batch)
        return out.loss if hasattr(out, "loss") else out
    return model(*batch)


def split(batch, m):
    if isinstance(batch, dict):
        parts = {k: v.chunk(m) for k, v in batch.items()}
        return [{k: parts[k][i] for k in batch} for i in range(m)]
    return list(zip(*(t.chunk(m) for t in batch)))


def eager_accumulate(model, data, microbatches, optimizer=torch.optim.AdamW, **kw):
    """Eager PyTorch: each batch as ``microbatches`` gradient-accumulation steps, then one update.

    The optimizer gets the arguments Harmony would give it (``fused=True`` where torch has it,
    unless ``kw`` chose): the same update, so the same bits."""
    from harmony.optim import optimizer_kwargs
    model = copy.deepcopy(model)
    opt = optimizer(model.parameters(), **optimizer_kwargs(optimizer, kw))
    losses = []
    for batch in data:
        total = 0.0
        for mb in split(batch, microbatches):
            loss = call(model, mb)
            (loss / microbatches).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total / microbatches)
    return model, losses


def eager_full(model, data, optimizer=torch.optim.AdamW, **kw):
    """Eager PyTorch on the whole batch at once."""
    return eager_accumulate(model, data, 1, optimizer, **kw)


def training_state_bytes(model) -> int:
    return 16 * sum(p.numel() for p in model.parameters())


def run_compiled(model, data, microbatches, budget, policy="harmony", **kw):
    import harmony
    example = data[0]
    sm = harmony.compile(model, example_batch=example, memory_budget=budget, microbatches=microbatches,
                         policy=policy, **kw)
    stats, losses = [], []
    for batch in data:
        loss = sm(**batch) if isinstance(batch, dict) else sm(*batch)
        losses.append(loss.item())
        stats.append(dict(sm.stats))
    sm.close()
    return sm, stats, losses


def params(sm):
    """The compiled module's parameters, copied (by the names of its traced graph), read from disk where they are."""
    model = sm.state_dict()["model"]
    return {n: model[n].detach().clone() for n, _ in sm.program.gm.named_parameters()}


def assert_bitwise(sm, expected):
    got = params(sm)
    assert got.keys() == expected.keys()
    for n in expected:
        assert torch.equal(got[n], expected[n]), n
