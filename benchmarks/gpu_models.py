"""The models benchmarks/gpu.py trains: the built-in GPT, or Hugging Face's ``LlamaForCausalLM`` at a Llama-3-8B
shape (``--model llama``: 32 layers, hidden 4096, intermediate 14336, 32 heads with 8 key/value heads, untied head),
each from random weights. One interface for every row: how to build the model (its weights, or none, under
``harmony.empty_weights()``), its loss on a batch, the batch as ``harmony.compile`` and ``sm`` take it, and the
blocks FSDP2 shards one by one."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

LLAMA_8B = dict(width=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=32000, seq=2048)
LLAMA_QUICK = dict(width=256, layers=2, heads=4, kv_heads=2, intermediate=688, vocab=512, seq=64)


@dataclass
class Shape:
    kind: str                  # "gpt" or "llama"
    width: int
    layers: int
    heads: int
    vocab: int
    seq: int
    kv_heads: int = 0
    intermediate: int = 0
    params: int = 0            # counted once, on the meta device

    def build(self, empty: bool = False):
        """The model in fp32 on the CPU: with random weights, or (``empty``) under ``harmony.empty_weights()``, for
        compile to make each weight as it places it (the host never holds the whole model)."""
        import torch
        import harmony
        torch.manual_seed(0)
        with harmony.empty_weights() if empty else contextlib.nullcontext():
            return self._build()

    def _build(self):
        if self.kind == "gpt":
            from harmony.models import GPT, GPTConfig
            return GPT(GPTConfig(vocab=self.vocab, seq=self.seq, layers=self.layers, width=self.width,
                                 heads=self.heads, tie=False))
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(vocab_size=self.vocab, hidden_size=self.width, intermediate_size=self.intermediate,
                          num_hidden_layers=self.layers, num_attention_heads=self.heads,
                          num_key_value_heads=self.kv_heads, max_position_embeddings=self.seq,
                          tie_word_embeddings=False, use_cache=False)
        cfg._attn_implementation = "sdpa"
        return LlamaForCausalLM(cfg)

    def n_params(self) -> int:
        if not self.params:
            import torch
            with torch.device("meta"):
                self.params = sum(p.numel() for p in self._build().parameters())
        return self.params

    def state_bytes(self) -> int:
        return 16 * self.n_params()    # fp32 weights, gradients and AdamW's two moments

    def batch(self, x, y):
        """The batch as ``harmony.compile`` and ``sm`` take it: (x, y) for the GPT, keywords for Hugging Face
        (whose loss shifts the labels itself: the labels are the inputs)."""
        return (x, y) if self.kind == "gpt" else dict(input_ids=x, labels=x)

    def loss(self, model, x, y):
        return model(x, y) if self.kind == "gpt" else model(input_ids=x, labels=x).loss

    def call(self, sm, x, y):
        b = self.batch(x, y)
        return sm(*b) if isinstance(b, tuple) else sm(**b)

    def blocks(self, model) -> list:
        return list(model.blocks) if self.kind == "gpt" else list(model.model.layers)

    def describe(self) -> str:
        if self.kind == "gpt":
            return f"GPT width {self.width} x {self.layers} layers"
        return (f"LlamaForCausalLM hidden {self.width} x {self.layers} layers, intermediate {self.intermediate}, "
                f"{self.heads} heads ({self.kv_heads} key/value)")


def shape_of(a) -> Shape:
    """The model ``gpu.py``'s arguments name (``--model``, ``--width``, ...)."""
    if a.model == "gpt":
        return Shape("gpt", a.width, a.layers, a.width // 128 or 1, a.vocab, a.seq)
    return Shape("llama", a.width, a.layers, a.heads, a.vocab, a.seq, kv_heads=a.kv_heads,
                 intermediate=a.intermediate)
