"""The budget a BudgetError names is the smallest that plans: compile succeeds at it and trains within it, and
refuses 3% less (driver/min_budget.py finds it by planning again from the same trace)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import bypass_case, gpt_case, hf_gpt2_case, hf_small_llama_case, mlp_case

import harmony
from harmony.base.errors import BudgetError


def frozen_gpt_case():
    """Every parameter frozen but the last layer's (the head): no gradients or optimizer state for the rest."""
    model, data = gpt_case()
    model.requires_grad_(False)
    list(model.children())[-1].requires_grad_(True)
    return model, data


class LoRALinear(nn.Module):
    def __init__(self, a: int, b: int, rank: int = 4):
        super().__init__()
        self.base = nn.Linear(a, b).requires_grad_(False)
        self.down, self.up = nn.Linear(a, rank, bias=False), nn.Linear(rank, b, bias=False)
        nn.init.zeros_(self.up.weight)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


class LoRAMLP(nn.Module):
    def __init__(self, width: int = 128, depth: int = 6):
        super().__init__()
        self.layers = nn.ModuleList(LoRALinear(32 if i == 0 else width, width) for i in range(depth))
        self.head = LoRALinear(width, 10)

    def forward(self, x, y):
        for layer in self.layers:
            x = F.relu(layer(x))
        return F.cross_entropy(self.head(x), y)


def lora_case():
    torch.manual_seed(0)
    return LoRAMLP(), [(torch.randn(16, 32), torch.randint(0, 10, (16,)))]


def mamba_case():
    """A state-space model (Hugging Face's Mamba, its sequential scan): one layer, 8 tokens."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=1, expand=2,
                                      conv_kernel=2, use_cache=False)
    ids = torch.randint(0, 64, (4, 8))
    return transformers.MambaForCausalLM(config), [{"input_ids": ids, "labels": ids.clone()}]


CASES = {"mlp": mlp_case, "gpt": gpt_case, "frozen-gpt": frozen_gpt_case, "lora": lora_case, "bypass": bypass_case,
         "hf-gpt2": hf_gpt2_case, "hf-small-llama": hf_small_llama_case,
         "mamba": pytest.param(mamba_case, marks=pytest.mark.slow)}


def _compile(model, batch, budget: int):
    return harmony.compile(copy.deepcopy(model), example_batch=batch, memory_budget=budget, microbatches=4)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_budget_an_error_names_plans_and_three_percent_less_does_not(case):
    model, data = case()
    batch = data[0]
    with pytest.raises(BudgetError) as refused:
        _compile(model, batch, 1000)
    smallest = refused.value.min_budget
    assert refused.value.option == "memory_budget" and "is the smallest that plans" in str(refused.value)
    sm = _compile(model, batch, smallest)
    sm(**batch) if isinstance(batch, dict) else sm(*batch)
    assert sm.stats["measured_peak"] <= sm.stats["budget"] == smallest
    with pytest.raises(BudgetError) as again:
        _compile(model, batch, int(0.97 * smallest))
    assert again.value.min_budget == pytest.approx(smallest, rel=0.011)   # found again, to its 1%


def test_the_host_budget_an_error_names_plans_and_three_percent_less_does_not(tmp_path):
    model, data = gpt_case()
    options = dict(memory_budget="1MiB", microbatches=4, offload_dir=str(tmp_path), disk_group_bytes="64KiB")
    with pytest.raises(BudgetError) as refused:
        harmony.compile(copy.deepcopy(model), example_batch=data[0], host_memory_budget=1000, **options)
    smallest = refused.value.min_budget
    assert refused.value.option == "host_memory_budget" and "host_memory_budget=" in str(refused.value)
    sm = harmony.compile(copy.deepcopy(model), example_batch=data[0], host_memory_budget=smallest, **options)
    sm(*data[0])
    sm.close()
    with pytest.raises(BudgetError, match="host_memory_budget"):
        harmony.compile(copy.deepcopy(model), example_batch=data[0], host_memory_budget=int(0.97 * smallest),
                        **options)


@pytest.mark.slow
def test_every_budget_above_the_named_minimum_plans():
    """A larger budget plans wherever a smaller one does (the named minimum's search assumes it). The partition checks
    each pack alone, and BERT's embeddings take gradients from several later packs at once: at some budgets above the
    minimum it picks packs whose whole schedule does not fit, and compile plans every layer alone instead."""
    pytest.importorskip("transformers")
    from zoo import ZOO
    model, data = ZOO["bert"].case()
    with pytest.raises(BudgetError) as refused:
        _compile(model, data[0], 1000)
    smallest = refused.value.min_budget
    for above in (0.03, 0.06, 0.09, 0.12, 0.15):
        _compile(model, data[0], int(smallest * (1 + above))).close()
