"""LoRA fine-tuning of a Hugging Face causal LM under a device budget far below its weights (PEFT + Harmony).

    python examples/lora.py                 # a Llama (8 layers, width 512), bf16, 10% of its weights on the device
    python examples/lora.py --tiny          # a few seconds: the size CI runs

``peft.get_peft_model`` freezes the base model (``requires_grad=False``) and adds small trainable adapters;
``harmony.compile`` takes the result as any other model. The frozen base weights get no gradient, no optimizer
state and no fp32 master, and are never written back: in ``precision="bf16"`` they stay in bf16 on the host and
are streamed through the device pack by pack, while only the adapters' gradients come back and AdamW steps only
the adapters' fp32 masters. The report's "frozen" line says how many bytes that is and where they live.

The model is built from a config with random weights (nothing is downloaded); with a checkpoint of your own, use
``AutoModelForCausalLM.from_pretrained(...)`` instead (``torch_dtype=torch.bfloat16`` keeps the base in bf16 from
the start). The data is synthetic: each sequence counts up from a random token by a random stride, which the
adapters learn, so the loss falls. At the end the adapters are saved with PEFT's own ``save_pretrained``.
(Needs ``pip install -e ".[lora]"``: transformers and peft.)
"""
from __future__ import annotations

import argparse

import harmony  # before torch: it sets the OpenMP and allocator variables torch reads when it loads
import torch
import transformers
from peft import LoraConfig, get_peft_model


def counting(size: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (size, 1), generator=g)
    stride = torch.randint(1, 4, (size, 1), generator=g)
    return (start + stride * torch.arange(seq)) % vocab


def main(argv=None) -> list[float]:
    args = parse(argv)
    torch.manual_seed(args.seed)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.width, intermediate_size=args.width * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
        max_position_embeddings=args.seq, use_cache=False, tie_word_embeddings=False)
    base = transformers.LlamaForCausalLM(config)
    model = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    weights = 2 * frozen + 4 * adapters     # bytes: the base in bf16, the adapters' fp32 masters
    budget = int(weights * args.budget)

    ids = counting(args.batch * args.steps, args.seq, args.vocab, args.seed)
    batches = [{"input_ids": b, "labels": b} for b in ids.split(args.batch)]
    sm = harmony.compile(model, example_batch=batches[0], memory_budget=budget, microbatches=args.microbatches,
                         optimizer_kwargs=dict(lr=args.lr), precision="bf16")
    print(f"Llama, {frozen / 1e6:.2f}M frozen parameters, {adapters / 1e3:.1f}K in LoRA adapters (r={args.rank}); "
          f"{len(sm.plan.packs)} packs under {budget / 2**20:.2f} MiB ({args.budget:.0%} of the weights)")
    header = sm.report().split("\n\n")[0].splitlines()     # the report's first block: model, budget, tiers
    print("\n".join(line for line in header if not line.startswith("Harmony report")))

    losses = []
    for step, batch in enumerate(batches, 1):
        losses.append(sm(**batch).item())
        if step % args.log_every == 0:
            print(f"step {step:4d}  loss {losses[-1]:.4f}")
    k = max(1, len(losses) // 5)
    print(f"loss {sum(losses[:k]) / k:.4f} -> {sum(losses[-k:]) / k:.4f} (mean of the first and last {k} steps)")
    print(f"per step: {sm.stats['h2d_bytes'] / 2**20:.2f} MiB to the device, {sm.stats['d2h_bytes'] / 2**20:.2f} MiB "
          f"back (the adapters' gradients and stashed activations; full fine-tuning sends back every weight's "
          f"gradient, {4 * (frozen + adapters) / 2**20:.2f} MiB in fp32)")
    trained = sm.state_dict()          # the model's weights by its names, as nn.Module.state_dict() gives them
    print(f"adapter tensors trained: {sum('lora_' in k for k in trained)}")
    if args.out:
        sm.model.save_pretrained(args.out)          # PEFT writes the adapters only
        print(f"adapters saved to {args.out}")
    sm.close()
    return losses


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="2 layers, width 128, a few steps: what CI runs")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    p.add_argument("--width", type=int, default=512, help="hidden size (default 512)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (default 8; half as many key/value heads)")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary size (default 4096)")
    p.add_argument("--seq", type=int, default=128, help="tokens a sequence (default 128)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank r (default 8)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step (default 4)")
    p.add_argument("--budget", type=float, default=0.1,
                   help="device memory budget as a share of the model's weights (default 0.1)")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate of the adapters (default 2e-3)")
    p.add_argument("--steps", type=int, default=100, help="training steps (default 100)")
    p.add_argument("--log-every", type=int, default=10, help="print the loss every N steps (default 10)")
    p.add_argument("--out", default=None, help="a directory to save the adapters to (default: not saved)")
    p.add_argument("--seed", type=int, default=0, help="(default 0)")
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.width, args.heads, args.vocab, args.seq, args.rank = 2, 128, 4, 256, 16, 4
        args.batch, args.microbatches, args.budget, args.steps, args.log_every = 4, 2, 0.6, 12, 3
        args.lr = 1e-2
    return args


if __name__ == "__main__":
    main()
