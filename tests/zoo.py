"""A zoo of Hugging Face ``transformers`` architectures, each from a tiny config with random weights (nothing is
downloaded): decoder LMs of several families (mixture-of-experts and state-space ones among them), encoder-decoders,
encoders with a classification head, vision transformers and CNNs, speech, and a two-tower contrastive model.

``ZOO[name]`` is an ``Entry``: ``entry.case(seed)`` builds the model and ``STEPS`` batches of ``entry.rows`` rows
(a dict of the model's keyword arguments, the loss's labels among them). Configs are as small as each family
allows (hidden 16-32, 1-2 layers, vocabulary 128, 8 tokens), so the whole zoo trains in a few minutes on two cores
(tests/test_zoo.py); benchmarks/zoo.py measures more of each (bf16, the smallest budget).
"""
from __future__ import annotations

import dataclasses

import torch

VOCAB, TOKENS, ROWS, STEPS = 128, 8, 4, 2
IMAGE, CLASSES = 16, 4

# dropout off everywhere (issue 60 item 5 is about dropout); eager attention (the trace sees its ops)
_LM = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           intermediate_size=64, max_position_embeddings=32, use_cache=False, tie_word_embeddings=False)
_NO_KV = {k: v for k, v in _LM.items() if k != "num_key_value_heads"}
_ENC = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            num_labels=CLASSES)
_SEQ2SEQ = dict(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
                dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, use_cache=False, pad_token_id=1,
                bos_token_id=0, eos_token_id=2, decoder_start_token_id=0, forced_eos_token_id=None,
                tie_word_embeddings=False, scale_embedding=False)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One architecture: ``model``/``config`` are transformers class names, ``kind`` the batch it takes
    ("lm", "seq2seq", "classify", "image", "ctc", "whisper", "clip"), ``rows`` the batch's rows (a CNN's
    BatchNorm and a contrastive loss need more than one row a microbatch), ``family`` the table's group."""

    family: str
    model: str
    config: str
    kind: str
    options: dict
    rows: int = ROWS
    fraction: float = 0.4

    def build(self, seed: int = 0):
        transformers = __import__("pytest").importorskip("transformers")
        torch.manual_seed(seed)
        cfg = getattr(transformers, self.config)(**self.options)
        cfg._attn_implementation = "eager"
        return getattr(transformers, self.model)(cfg).train()

    def batches(self, seed: int = 0) -> list[dict]:
        g = torch.Generator().manual_seed(seed + 1)
        return [BATCHES[self.kind](self, g) for _ in range(STEPS)]

    def case(self, seed: int = 0):
        return self.build(seed), self.batches(seed)


def _ids(g, rows, n=TOKENS, low=3):
    return torch.randint(low, VOCAB, (rows, n), generator=g)


def _lm(e, g):
    ids = _ids(g, e.rows)
    return {"input_ids": ids, "labels": ids.clone()}


def _seq2seq(e, g):
    return {"input_ids": _ids(g, e.rows), "labels": _ids(g, e.rows)}


def _classify(e, g):
    return {"input_ids": _ids(g, e.rows), "labels": torch.randint(0, CLASSES, (e.rows,), generator=g)}


def _image(e, g):
    return {"pixel_values": torch.randn(e.rows, 3, IMAGE, IMAGE, generator=g),
            "labels": torch.randint(0, CLASSES, (e.rows,), generator=g)}


def _ctc(e, g):
    # a CTC label of 3 characters (1..VOCAB-1; 0 is the blank) over the 6 frames the convolution leaves
    return {"input_values": torch.randn(e.rows, 400, generator=g),
            "labels": torch.randint(1, 30, (e.rows, 3), generator=g)}


def _whisper(e, g):
    mels, frames = e.options["num_mel_bins"], 2 * e.options["max_source_positions"]
    return {"input_features": torch.randn(e.rows, mels, frames, generator=g), "labels": _ids(g, e.rows)}


def _clip(e, g):
    return {"input_ids": _ids(g, e.rows), "pixel_values": torch.randn(e.rows, 3, IMAGE, IMAGE, generator=g),
            "return_loss": True}


# The share of its fp32 training state each trains at: about 5% above the smallest budget that plans. A model this
# small spends most of a layer's memory on activations and its embedding and head, so that is 30-90%, not the
# issue's 25% (a larger share for the vision models, whose 16x16 images are many tokens a row).
FRACTIONS = {'llama': 0.38, 'mistral': 0.38, 'qwen2': 0.38, 'qwen3': 0.39, 'gemma': 0.36, 'gemma2': 0.38, 'phi': 0.31,
             'phi3': 0.38, 'gpt2': 0.31, 'gpt-neox': 0.31, 'gptj': 0.34, 'opt': 0.31, 'bloom': 0.31, 'falcon': 0.54,
             'stablelm': 0.31, 'olmo2': 0.39, 'granite': 0.38, 'starcoder2': 0.37, 'gpt-bigcode': 0.31,
             'mixtral': 0.38, 'qwen2-moe': 0.37, 'olmoe': 0.38, 'mamba': 0.53, 'bart': 0.31, 'pegasus': 0.31,
             'marian': 0.31, 'bert': 0.32, 'roberta': 0.32, 'distilbert': 0.32, 'albert': 0.68, 'electra': 0.43,
             'vit': 0.87, 'deit': 0.9, 'swin': 1.2, 'convnext': 0.53, 'resnet': 0.51, 'mobilenet-v2': 0.31,
             'whisper': 0.31, 'wav2vec2-ctc': 0.6, 'hubert-ctc': 0.6}

BATCHES = {"lm": _lm, "seq2seq": _seq2seq, "classify": _classify, "image": _image, "ctc": _ctc,
           "whisper": _whisper, "clip": _clip}


def _decoder(model, config, family="decoder", kv=True, **options):
    return Entry(family, model, config, "lm", {**(_LM if kv else _NO_KV), **options})


def _encoder(model, config, **options):
    return Entry("encoder", model, config, "classify", {**_ENC, **options})


def _vision(model, config, **options):
    return Entry("vision", model, config, "image", {"num_labels": CLASSES, **options}, rows=8)


_VIT = dict(image_size=IMAGE, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
_CONV = dict(conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 8), num_feat_extract_layers=2, hidden_size=32,
             num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=32,
             num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=4, hidden_dropout=0.0, attention_dropout=0.0,
             activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0,
             mask_time_prob=0.0, mask_feature_prob=0.0, ctc_loss_reduction="mean", pad_token_id=0)
_TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, attention_dropout=0.0)

ZOO: dict[str, Entry] = {
    # decoder-only language models
    "llama": _decoder("LlamaForCausalLM", "LlamaConfig"),
    "mistral": _decoder("MistralForCausalLM", "MistralConfig", sliding_window=4),
    "qwen2": _decoder("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": _decoder("Qwen3ForCausalLM", "Qwen3Config", head_dim=8),
    "gemma": _decoder("GemmaForCausalLM", "GemmaConfig", head_dim=8),
    "gemma2": _decoder("Gemma2ForCausalLM", "Gemma2Config", head_dim=8, sliding_window=4,
                       query_pre_attn_scalar=8),
    "phi": _decoder("PhiForCausalLM", "PhiConfig", resid_pdrop=0.0, embd_pdrop=0.0),
    "phi3": _decoder("Phi3ForCausalLM", "Phi3Config", resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=0, bos_token_id=1,
                     eos_token_id=2),
    "gpt2": Entry("decoder", "GPT2LMHeadModel", "GPT2Config", "lm", dict(
        vocab_size=VOCAB, n_layer=2, n_embd=32, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, tie_word_embeddings=False, use_cache=False, bos_token_id=0, eos_token_id=2)),
    "gpt-neox": _decoder("GPTNeoXForCausalLM", "GPTNeoXConfig", kv=False, hidden_dropout=0.0),
    "gptj": Entry("decoder", "GPTJForCausalLM", "GPTJConfig", "lm", dict(
        vocab_size=VOCAB, n_layer=2, n_embd=32, n_head=4, n_positions=32, rotary_dim=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False, use_cache=False)),
    "opt": Entry("decoder", "OPTForCausalLM", "OPTConfig", "lm", dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
        word_embed_proj_dim=32, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
        tie_word_embeddings=False, use_cache=False, pad_token_id=1)),
    "bloom": Entry("decoder", "BloomForCausalLM", "BloomConfig", "lm", dict(
        vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0,
        tie_word_embeddings=False, use_cache=False)),
    "falcon": _decoder("FalconForCausalLM", "FalconConfig", kv=False, hidden_dropout=0.0,
                       new_decoder_architecture=False, multi_query=True, bias=False),
    "stablelm": _decoder("StableLmForCausalLM", "StableLmConfig", hidden_dropout=0.0),
    "olmo2": _decoder("Olmo2ForCausalLM", "Olmo2Config", pad_token_id=1, eos_token_id=2),
    "granite": _decoder("GraniteForCausalLM", "GraniteConfig"),
    "starcoder2": _decoder("Starcoder2ForCausalLM", "Starcoder2Config", residual_dropout=0.0, embedding_dropout=0.0),
    "gpt-bigcode": Entry("decoder", "GPTBigCodeForCausalLM", "GPTBigCodeConfig", "lm", dict(
        vocab_size=VOCAB, n_layer=2, n_embd=32, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, tie_word_embeddings=False, use_cache=False)),
    # mixture of experts
    "mixtral": _decoder("MixtralForCausalLM", "MixtralConfig", "moe", num_local_experts=4, num_experts_per_tok=2),
    "qwen2-moe": _decoder("Qwen2MoeForCausalLM", "Qwen2MoeConfig", "moe", num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "olmoe": _decoder("OlmoeForCausalLM", "OlmoeConfig", "moe", num_experts=4, num_experts_per_tok=2, pad_token_id=1),
    # state-space
    "mamba": Entry("ssm", "MambaForCausalLM", "MambaConfig", "lm", dict(
        vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=2,
        use_cache=False, tie_word_embeddings=False)),
    # encoder-decoders
    "t5": Entry("seq2seq", "T5ForConditionalGeneration", "T5Config", "seq2seq", dict(
        vocab_size=VOCAB, num_layers=1, num_decoder_layers=1, d_model=32, d_kv=8, num_heads=4, d_ff=64,
        dropout_rate=0.0, use_cache=False, decoder_start_token_id=0, pad_token_id=0, tie_word_embeddings=False)),
    "bart": Entry("seq2seq", "BartForConditionalGeneration", "BartConfig", "seq2seq", _SEQ2SEQ),
    "pegasus": Entry("seq2seq", "PegasusForConditionalGeneration", "PegasusConfig", "seq2seq", _SEQ2SEQ),
    "marian": Entry("seq2seq", "MarianMTModel", "MarianConfig", "seq2seq", {**_SEQ2SEQ, "decoder_vocab_size": VOCAB}),
    # encoders with a classification head
    "bert": _encoder("BertForSequenceClassification", "BertConfig"),
    "roberta": _encoder("RobertaForSequenceClassification", "RobertaConfig", pad_token_id=1),
    "distilbert": Entry("encoder", "DistilBertForSequenceClassification", "DistilBertConfig", "classify", dict(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=32, dropout=0.0,
        attention_dropout=0.0, seq_classif_dropout=0.0, num_labels=CLASSES)),
    "albert": _encoder("AlbertForSequenceClassification", "AlbertConfig", embedding_size=16,
                       classifier_dropout_prob=0.0),
    "electra": _encoder("ElectraForSequenceClassification", "ElectraConfig", embedding_size=16),
    "deberta-v2": _encoder("DebertaV2ForSequenceClassification", "DebertaV2Config", pooler_dropout=0.0,
                           problem_type="single_label_classification",
                           relative_attention=True, position_buckets=8, max_relative_positions=16,
                           pos_att_type=["p2c", "c2p"]),
    # vision: transformers and CNNs
    "vit": _vision("ViTForImageClassification", "ViTConfig", **_VIT),
    "deit": _vision("DeiTForImageClassification", "DeiTConfig", **_VIT),
    "swin": _vision("SwinForImageClassification", "SwinConfig", image_size=IMAGE, patch_size=2, embed_dim=16,
                    depths=[1, 1], num_heads=[2, 4], window_size=4, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, drop_path_rate=0.0),
    "convnext": _vision("ConvNextForImageClassification", "ConvNextConfig", hidden_sizes=[8, 16], depths=[1, 1],
                        num_stages=2, drop_path_rate=0.0, image_size=IMAGE),
    "resnet": _vision("ResNetForImageClassification", "ResNetConfig", embedding_size=8, hidden_sizes=[8, 16],
                      depths=[1, 1], layer_type="basic"),
    "mobilenet-v2": _vision("MobileNetV2ForImageClassification", "MobileNetV2Config", image_size=IMAGE,
                            depth_multiplier=0.25, finegrained_output=False, classifier_dropout_prob=0.0),
    # speech
    "wav2vec2-ctc": Entry("speech", "Wav2Vec2ForCTC", "Wav2Vec2Config", "ctc", _CONV),
    "hubert-ctc": Entry("speech", "HubertForCTC", "HubertConfig", "ctc", _CONV),
    "whisper": Entry("speech", "WhisperForConditionalGeneration", "WhisperConfig", "whisper", dict(
        vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=8,
        max_target_positions=32, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, use_cache=False,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=0, tie_word_embeddings=False,
        begin_suppress_tokens=None, suppress_tokens=None)),
    # multimodal two-tower
    "clip": Entry("multimodal", "CLIPModel", "CLIPConfig", "clip", dict(
        text_config=dict(vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0, eos_token_id=2, **_TOWER),
        vision_config=dict(image_size=IMAGE, patch_size=4, **_TOWER), projection_dim=16), rows=8),
}
ZOO = {name: dataclasses.replace(e, fraction=FRACTIONS.get(name, e.fraction)) for name, e in ZOO.items()}


# ------------------------------------------------------------- training one architecture, compiled and eager

MICROBATCHES = 4


@dataclasses.dataclass
class Trained:
    """One architecture trained ``STEPS`` steps compiled at ``budget`` and eagerly: the parameters that differ
    from eager gradient accumulation's (fp32; ``shared``: those read by several layers, allclose by contract),
    both runs' losses, and the plan's predicted peak beside the measured one (the largest over the steps)."""

    name: str
    precision: str
    budget: int
    packs: int
    compile_seconds: float
    predicted_peak: int
    measured_peak: int
    losses: list
    eager_losses: list
    differ: list
    shared: list
    misses: int = 0

    @property
    def loss_gap(self) -> float:
        return max(abs(a - b) / abs(b) for a, b in zip(self.losses, self.eager_losses))

    @property
    def peak_ratio(self) -> float:
        return self.measured_peak / self.predicted_peak


def shared_parameters(model) -> set[str]:
    """Names of parameters registered under several names (T5's ``shared`` embedding, an encoder-decoder's)."""
    names: dict = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {n for group in names.values() if len(group) > 1 for n in group}


def train(name: str, precision: str = "fp32", fraction: float | None = None, budget: int | None = None) -> Trained:
    """``ZOO[name]`` compiled at ``budget`` (default: ``fraction`` of its fp32 training state, default its
    ``FRACTIONS``; where that is below what one layer needs, the smallest budget that plans, +2%), ``MICROBATCHES``
    microbatches, AdamW, trained ``STEPS`` steps beside eager PyTorch: gradient accumulation in fp32 (compared
    parameter by parameter), ``torch.autocast`` in bf16 (compared by loss)."""
    import copy
    import time

    import harmony
    from models import eager_accumulate, eager_autocast, params, training_state_bytes

    model, data = ZOO[name].case()
    budget = budget or int((fraction or ZOO[name].fraction) * training_state_bytes(model))
    start = time.perf_counter()
    try:
        sm = harmony.compile(copy.deepcopy(model), example_batch=data[0], memory_budget=budget,
                             microbatches=MICROBATCHES, precision=precision)
    except harmony.errors.BudgetError as e:     # one layer needs more: the smallest budget that plans, +2%
        budget = int(e.min_budget * 1.02)
        start = time.perf_counter()
        sm = harmony.compile(copy.deepcopy(model), example_batch=data[0], memory_budget=budget,
                             microbatches=MICROBATCHES, precision=precision)
    seconds = time.perf_counter() - start
    losses, stats = [], []
    for batch in data:
        losses.append(sm(**batch).item())
        stats.append(dict(sm.stats))
    got, shared = params(sm), shared_parameters(model)
    sm.close()
    differ = []
    if precision == "fp32":
        ref, eager_losses = eager_accumulate(model, data, MICROBATCHES)
        expected = {n: p.detach() for n, p in ref.named_parameters()}
        assert got.keys() == expected.keys(), sorted(set(got) ^ set(expected))
        differ = [n for n in expected if not torch.equal(got[n], expected[n]) and n not in shared]
        differ += [n for n in shared & expected.keys()
                   if not torch.allclose(got[n], expected[n], rtol=1e-5, atol=1e-6)]
    else:
        eager_losses = eager_autocast(model, data, MICROBATCHES, getattr(torch, {"bf16": "bfloat16"}[precision]))
    return Trained(name, precision, budget, len(sm.plan.packs), seconds, max(s["predicted_peak"] for s in stats),
                   max(s["measured_peak"] for s in stats), losses, eager_losses, differ, sorted(shared),
                   sum(s.get("plan_misses", 0) for s in stats))
