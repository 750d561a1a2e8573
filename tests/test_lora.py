"""PEFT's LoRA on a Hugging Face Llama, under a budget well below the base model's weights.

The base weights are frozen (``requires_grad=False``): they get no gradient, no optimizer state and no master, and
are never written back; in bf16 they are kept in bf16 on the host. Only the adapters' gradients leave the device.
fp32 training is bitwise eager gradient accumulation over the same microbatches; bf16 is bitwise the eager
mixed-precision reference (a bf16 compute copy, fp32 masters of the adapters stepped by AdamW).
"""
import copy
import re

import pytest
import torch

import harmony
from models import _hf_case
from test_precision import eager_mixed
from test_shapes import eager_steps

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.slow

TARGETS = ["q_proj", "v_proj"]


def lora_llama():
    """A 4-layer Llama (width 128) from its config, LoRA r=4 on the attention's q and v projections."""
    model, data = _hf_case("LlamaForCausalLM", "LlamaConfig", 4, 0, num_hidden_layers=4, hidden_size=128,
                           num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                           max_position_embeddings=32, attention_dropout=0.0, use_cache=False,
                           tie_word_embeddings=False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=TARGETS, lora_dropout=0.0))
    return model, data


def split(model) -> tuple[dict, dict]:
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    return trainable, frozen


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.fixture(scope="module")
def fp32_run():
    model, data = lora_llama()
    ref, ref_losses = eager_steps(model, data, 2)
    weights = nbytes(dict(model.named_parameters()))
    sm = harmony.compile(copy.deepcopy(model), data[0], memory_budget=weights // 3, microbatches=2)
    losses = [sm(**b).item() for b in data]
    yield dict(sm=sm, model=model, ref=ref, losses=losses, ref_losses=ref_losses, weights=weights)
    sm.close()


def test_lora_trains_bitwise_as_eager_accumulation(fp32_run):
    sm, ref = fp32_run["sm"], fp32_run["ref"]
    assert sm.program.config.memory_budget < fp32_run["weights"] / 2     # well below the base weights
    assert len(sm.plan.packs) > 1
    for (name, a), b in zip(sm.model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), f"{name}: max diff {(a - b).abs().max().item()}"
    assert fp32_run["losses"] == pytest.approx(fp32_run["ref_losses"], abs=1e-6)
    assert fp32_run["losses"][-1] < fp32_run["losses"][0]


def test_only_the_adapters_have_gradients_optimizer_state_and_traffic_back(fp32_run):
    sm = fp32_run["sm"]
    trainable, frozen = split(sm.model)
    assert trainable and all("lora_" in n for n in trainable)
    assert {n for spec in sm.plan.packs for n in spec.params} == set(trainable)      # the packs' gradients
    assert set(sm.training_state_dict()["optimizer"]) == set(trainable)             # AdamW's state
    original = dict(split(fp32_run["model"])[1])
    for n, p in frozen.items():                                                    # never written back
        assert p.dtype == torch.float32 and torch.equal(p, original[n]), n
    # full fine-tuning sends every weight's gradient to the host each step: more than the frozen weights' bytes;
    # here what goes back is the adapters' gradients and the stashed activations
    assert sm.stats["d2h_bytes"] < nbytes(frozen) / 2
    assert sm.stats["d2h_bytes"] == sm.stats["predicted_d2h"]
    report = " ".join(sm.report().split())       # (its lines wrapped)
    assert re.search(r"frozen [\d.]+ MiB of weights in float32 on the host[^:]*: no gradient, optimizer state or "
                     r"master; never written back", report), report[:2000]


@pytest.fixture(scope="module")
def bf16_run():
    model, data = lora_llama()
    ref, ref_losses = eager_mixed(model, data, 2, torch.bfloat16)
    weights = nbytes(dict(model.named_parameters()))
    sm = harmony.compile(copy.deepcopy(model), data[0], memory_budget=weights // 4, microbatches=2,
                         precision="bf16")
    losses = [sm(**b).item() for b in data]
    yield dict(sm=sm, ref=ref, data=data, losses=losses, ref_losses=[loss.item() for loss in ref_losses])
    sm.close()


def test_lora_in_bf16_keeps_frozen_weights_in_bf16_and_trains_as_eager_mixed_precision(bf16_run):
    sm, ref = bf16_run["sm"], bf16_run["ref"]
    trainable, frozen = split(sm.model)
    assert {p.dtype for p in frozen.values()} == {torch.bfloat16}      # no fp32 master of a frozen weight
    assert {p.dtype for p in trainable.values()} == {torch.float32}    # the adapters' masters
    for (name, a), b in zip(sm.model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b.to(a.dtype)), f"{name}: max diff {(a.float() - b.float()).abs().max().item()}"
    assert bf16_run["losses"] == bf16_run["ref_losses"]
    assert bf16_run["losses"][-1] < bf16_run["losses"][0]
    assert re.search(r"frozen [\d.]+ MiB of weights in bfloat16 on the host", " ".join(sm.report().split()))


def test_a_lora_checkpoint_and_state_dict_keep_the_frozen_weights_in_their_dtype(bf16_run, tmp_path):
    sm = bf16_run["sm"]
    sd = sm.state_dict()
    assert list(sd) == list(sm.model.state_dict())          # PEFT's names
    assert sd["base_model.model.lm_head.weight"].dtype == torch.bfloat16
    saved = {n: t.clone() for n, t in sd.items()}
    harmony.save(sm, tmp_path / "ckpt")
    sm(**bf16_run["data"][0])
    harmony.load(sm, tmp_path / "ckpt")
    for n, t in sm.state_dict().items():
        assert torch.equal(t, saved[n]), n
