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


class Bypass(nn.Module):
    """A wide block between two narrow layers, and a narrow side path from the first layer to the head past it: at
    the block's backward, every microbatch's input gradients of the head wait for the first layer's (the side path's
    share) as well as the block's."""

    def __init__(self, width: int = 32, hidden: int = 128, side: int = 8):
        super().__init__()
        self.inp, self.side = nn.Linear(width, width), nn.Linear(width, side)
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)
        self.head = nn.Linear(width + side, width)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        s = self.side(h)
        h = self.down(torch.tanh(self.up(h)))
        return F.mse_loss(self.head(torch.cat([h, s], -1)), y)


def bypass_case(batch=256, seed=0):
    torch.manual_seed(seed)
    return Bypass(), [(torch.randn(batch, 32), torch.randn(batch, 32)) for _ in range(2)]


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
    """``m`` microbatches of ``batch``; a dict's non-tensor values (``return_loss=True``) go to each whole."""
    if isinstance(batch, dict):
        parts = {k: v.chunk(m) if isinstance(v, torch.Tensor) else [v] * m for k, v in batch.items()}
        return [{k: parts[k][i] for k in batch} for i in range(m)]
    return list(zip(*(t.chunk(m) for t in batch)))


def eager_accumulate(model, data, microbatches, optimizer=torch.optim.AdamW, clip=None, norm_type=2.0,
                     streams=False, **kw):
    """Eager PyTorch: each batch as ``microbatches`` gradient-accumulation steps, then one update
    (``clip``: after ``clip_grad_norm_(model.parameters(), clip, norm_type)``; the norms are in ``model.norms``).
    ``streams``: each microbatch draws its random numbers from its own stream, as a compiled step's do
    (runtime/rng.py), so dropout's masks are the step's.

    The optimizer gets the arguments Harmony would give it (``fused=True`` where torch has it,
    unless ``kw`` chose): the same update, so the same bits."""
    from harmony.runtime.optim import optimizer_kwargs
    from harmony.runtime.rng import microbatch_states, rng_state, set_rng_state
    model = copy.deepcopy(model)
    opt = optimizer(model.parameters(), **optimizer_kwargs(optimizer, kw))
    losses, model.norms = [], []
    for batch in data:
        total = 0.0
        states = microbatch_states(microbatches) if streams else None
        for m, mb in enumerate(split(batch, microbatches)):
            if states is not None:
                set_rng_state(torch.device("cpu"), states[m])
            loss = call(model, mb)
            if states is not None:
                states[m] = rng_state(torch.device("cpu"))
            (loss / microbatches).backward()
            total += loss.item()
        if states is not None:
            set_rng_state(torch.device("cpu"), states[0])
        if clip is not None:
            model.norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip, norm_type).item())
        opt.step()
        opt.zero_grad()
        losses.append(total / microbatches)
    return model, losses


def eager_autocast(model, data, microbatches, dtype):
    """Eager PyTorch under ``torch.autocast`` (fp32 weights), gradient accumulation over ``microbatches``; fp16
    with ``GradScaler``'s default loss scaling, as Harmony's (a step whose gradients overflow is skipped in both).
    The losses."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    losses = []
    for batch in data:
        total = 0.0
        for mb in split(batch, microbatches):
            with torch.autocast("cpu", dtype=dtype):
                loss = call(model, mb)
            scaler.scale(loss.float() / microbatches).backward()
            total += loss.item()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(total / microbatches)
    return losses


def eager_full(model, data, optimizer=torch.optim.AdamW, **kw):
    """Eager PyTorch on the whole batch at once."""
    return eager_accumulate(model, data, 1, optimizer, **kw)


def withheld(model) -> list[str]:
    """The parameters of ``model`` whose values cannot be read here (reading one raises OffloadError: their
    weights live on disk, in other ranks' shares, or on other pipeline ranks; runtime/placeholders.py)."""
    from harmony.errors import OffloadError
    out = []
    for n, p in model.named_parameters():
        try:
            p.sum()
        except OffloadError:
            out.append(n)
    return out


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
    model = sm.training_state_dict()["model"]
    return {n: model[n].detach().clone() for n, _ in sm.program.gm.named_parameters()}


def assert_bitwise(sm, expected):
    got = params(sm)
    assert got.keys() == expected.keys()
    for n in expected:
        assert torch.equal(got[n], expected[n]), n


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock, as torchvision writes it: in-place ReLU and ``out += identity``."""

    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class ResNet18(nn.Module):
    """torchvision's resnet18 layout (stem, four stages of two BasicBlocks, average pool, fc) at a chosen width,
    returning the cross-entropy loss; torchvision's CPU wheel does not load here, so it is written out."""

    def __init__(self, width=64, classes=10):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(width, 2)
        self.layer2 = self._make_layer(2 * width, 2, stride=2)
        self.layer3 = self._make_layer(4 * width, 2, stride=2)
        self.layer4 = self._make_layer(8 * width, 2, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8 * width, classes)

    def _make_layer(self, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes, 1, stride=stride, bias=False),
                                       nn.BatchNorm2d(planes))
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [BasicBlock(planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x, y):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return F.cross_entropy(self.fc(torch.flatten(self.avgpool(x), 1)), y)


def resnet18_case(batch=4, seed=0, width=8):
    """64x64 images: the last stage is 2x2, so each BatchNorm there normalises over more than two values."""
    torch.manual_seed(seed)
    return ResNet18(width), [(torch.randn(batch, 3, 64, 64), torch.randint(0, 10, (batch,))) for _ in range(3)]


# Tiny decoder-only configs (2 layers) for the architecture tests: the parts each family adds over Llama.
_DECODER = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                max_position_embeddings=32, attention_dropout=0.0, use_cache=False, tie_word_embeddings=False)


def hf_mistral_case(batch=4, seed=0):
    return _hf_case("MistralForCausalLM", "MistralConfig", batch, seed, sliding_window=8, **_DECODER)


def hf_qwen2_case(batch=4, seed=0):
    return _hf_case("Qwen2ForCausalLM", "Qwen2Config", batch, seed, **_DECODER)


def hf_mixtral_case(batch=4, seed=0):
    """Top-2 routing over 4 experts; the router normalises its top values in place (``/=``)."""
    return _hf_case("MixtralForCausalLM", "MixtralConfig", batch, seed, num_local_experts=4, num_experts_per_tok=2,
                    **_DECODER)


def hf_qwen2_moe_case(batch=4, seed=0):
    return _hf_case("Qwen2MoeForCausalLM", "Qwen2MoeConfig", batch, seed, num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=32, shared_expert_intermediate_size=32, **_DECODER)


def hf_neox_case(batch=4, seed=0):
    return _hf_case("GPTNeoXForCausalLM", "GPTNeoXConfig", batch, seed, num_hidden_layers=2, hidden_size=32,
                    num_attention_heads=4, intermediate_size=64, max_position_embeddings=32, use_cache=False,
                    hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False)


def hf_t5_case(batch=4, seed=0):
    """Encoder-decoder; labels shift right into the decoder's inputs (decoder_start_token_id)."""
    return _hf_case("T5ForConditionalGeneration", "T5Config", batch, seed, num_layers=2, num_decoder_layers=2,
                    d_model=32, d_kv=8, num_heads=4, d_ff=64, dropout_rate=0.0, use_cache=False,
                    decoder_start_token_id=0, pad_token_id=0, tie_word_embeddings=False)


def hf_small_llama_case(batch=4, seed=0):
    return _hf_case("LlamaForCausalLM", "LlamaConfig", batch, seed, **_DECODER)


def hf_small_gpt2_case(batch=4, seed=0):
    return _hf_case("GPT2LMHeadModel", "GPT2Config", batch, seed, n_layer=2, n_embd=32, n_head=4, n_positions=32,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False)


ARCHITECTURES = {"llama": hf_small_llama_case, "mistral": hf_mistral_case, "qwen2": hf_qwen2_case,
                 "mixtral": hf_mixtral_case, "qwen2-moe": hf_qwen2_moe_case, "gpt-neox": hf_neox_case,
                 "t5": hf_t5_case, "gpt2": hf_small_gpt2_case, "resnet18": resnet18_case}


def assert_graph_is_eager(gm, model, batch) -> None:
    """The traced ``gm`` computes ``model``'s loss on ``batch`` and every parameter's gradient bitwise as eager does
    (on a copy of the model: ``model`` is left as it was)."""
    eager = copy.deepcopy(model)
    ref = eager(*batch)
    ref.backward()
    loss = gm(*batch)
    loss.backward()
    assert torch.equal(loss, ref)
    grads = dict(gm.named_parameters())
    for name, p in eager.named_parameters():
        assert torch.equal(grads[name].grad, p.grad), name
