"""Fine-tune a Hugging Face Llama with ``transformers.Trainer``, each step run by Harmony under a memory budget.

    python examples/trainer.py                       # a Llama (4 layers, width 256), 200 steps
    python examples/trainer.py --stop-at 100         # stop after the checkpoint at step 100 ...
    python examples/trainer.py --resume              # ... and carry on from the last checkpoint, to the bit
    torchrun --nproc_per_node 2 examples/trainer.py --tiny    # data parallel: each rank its share of the data
    python examples/trainer.py --tiny                # a few seconds: the size CI runs

``HarmonyTrainer`` is ``Trainer`` with Harmony's knobs in ``harmony_config``: what ``TrainingArguments`` says
(the AdamW Trainer builds, the cosine schedule with warm-up, ``max_grad_norm``, ``bf16``, ``gradient_accumulation_
steps`` as Harmony's microbatches, evaluation and checkpoint schedules) holds as in any Trainer run, and every
checkpoint-N folder also holds Harmony's training state, so ``resume_from_checkpoint`` continues as if the run had
not stopped. The logs carry Harmony's peak device bytes and its traffic per step beside ``loss``, ``grad_norm`` and
``learning_rate``.

The model is built from a config with random weights (nothing is downloaded); with a checkpoint of your own use
``AutoModelForCausalLM.from_pretrained(...)``. The data is synthetic: each sequence counts up from a random token
by a random stride, of random length, padded per batch as Hugging Face's collators pad (dynamic padding): the
example batch handed to ``HarmonyTrainer`` is one padded to the longest length, so every batch runs its plan.
(Needs ``pip install -e ".[trainer]"``: transformers and accelerate.)
"""
from __future__ import annotations

import argparse
import math

import harmony  # before torch: it sets the OpenMP and allocator variables torch reads when it loads
import torch
import transformers
from harmony.integrations.transformers import HarmonyTrainer
from transformers import TrainerCallback, TrainingArguments


def counting(size: int, seq: int, vocab: int, seed: int) -> list[dict]:
    """``size`` sequences of ``seq // 2`` to ``seq`` tokens, each ``start, start + stride, ...`` (mod the vocabulary,
    token 0 left for the padding)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab - 1, (size, 1), generator=g)
    stride = torch.randint(1, 4, (size, 1), generator=g)
    ids = (start + stride * torch.arange(seq)) % (vocab - 1) + 1
    lengths = torch.randint(seq // 2, seq + 1, (size,), generator=g).tolist()
    return [{"input_ids": row[:n]} for row, n in zip(ids, lengths)]


def pad_batch(samples: list[dict], to: int | None = None) -> dict:
    """Padded to the longest sample (or to ``to`` tokens), as ``DataCollatorForLanguageModeling`` pads: an attention
    mask, and labels of -100 on the padding (the model shifts the labels itself)."""
    width = to or max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, :len(s["input_ids"])], mask[row, :len(s["input_ids"])] = s["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class Print(TrainerCallback):
    """One line per log on rank 0; stops the run after the checkpoint of step ``stop_at``."""

    def __init__(self, stop_at: int | None):
        self.stop_at = stop_at

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step and state.is_world_process_zero:       # restored from the checkpoint's trainer state
            print(f"resumed from checkpoint-{state.global_step} at step {state.global_step}", flush=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero:
            return
        if "loss" in logs:
            print(f"step {state.global_step:4d}  loss {logs['loss']:.4f}  lr {logs['learning_rate']:.2e}  grad norm "
                  f"{logs['grad_norm']:.3f}  peak {logs['harmony_peak_bytes'] / 2**20:.2f} MiB of "
                  f"{logs['harmony_budget_bytes'] / 2**20:.2f}  to the device {logs['harmony_h2d_bytes'] / 2**20:.2f} "
                  f"MiB a step", flush=True)
        elif "eval_loss" in logs:
            print(f"step {state.global_step:4d}  validation loss {logs['eval_loss']:.4f}", flush=True)

    def on_save(self, args, state, control, **kwargs):
        if self.stop_at is not None and state.global_step >= self.stop_at:
            control.should_training_stop = True


def main(argv=None) -> dict:
    args = parse(argv)
    torch.manual_seed(args.seed)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.width, intermediate_size=args.width * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
        max_position_embeddings=args.seq, use_cache=False)
    model = transformers.LlamaForCausalLM(config)
    n = sum(p.numel() for p in model.parameters())
    budget = int(16 * n * args.budget)    # fp32 weights, gradients and AdamW's two moments: 16 bytes a parameter
    train_set = counting(args.samples, args.seq, args.vocab, args.seed)
    val_set = counting(2 * args.batch, args.seq, args.vocab, args.seed + 1)
    rows = args.batch * args.accumulation           # a step's rows: Harmony cuts them into microbatches
    training = TrainingArguments(
        args.out, max_steps=args.steps, per_device_train_batch_size=args.batch, per_device_eval_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulation, learning_rate=args.lr, weight_decay=0.01,
        lr_scheduler_type="cosine", warmup_steps=max(1, args.steps // 10), max_grad_norm=1.0, bf16=args.bf16,
        eval_strategy="steps", eval_steps=args.save_every, save_strategy="steps", save_steps=args.save_every,
        logging_steps=args.log_every, report_to=[], disable_tqdm=True, seed=args.seed,
        use_cpu=not torch.cuda.is_available(), remove_unused_columns=False)
    trainer = HarmonyTrainer(
        model=model, args=training, train_dataset=train_set, eval_dataset=val_set, data_collator=pad_batch,
        example_batch=pad_batch(train_set[:rows], to=args.seq),      # the largest batch: padded to the longest
        harmony_config=harmony.Config(memory_budget=budget), callbacks=[Print(args.stop_at)])
    trainer.remove_callback(transformers.PrinterCallback)    # Print says it in a line (disable_tqdm's printer)
    world = training.world_size
    if trainer.is_world_process_zero():
        print(f"Llama, {n / 1e6:.2f}M parameters, {world} rank(s) x {rows} rows a step in {args.accumulation} "
              f"microbatches, memory budget {budget / 2**20:.2f} MiB ({args.budget:.0%} of the training state)")
    result = trainer.train(resume_from_checkpoint=True if args.resume else None)
    sm = trainer.sm
    if trainer.is_world_process_zero():
        print(f"{len(sm.plan.packs)} packs; trained to step {result.global_step} (sm.steps {sm.steps})")
    metrics = trainer.evaluate()
    trainer.save_model(f"{args.out}/final")           # save_pretrained's layout: from_pretrained loads it
    if trainer.is_world_process_zero():
        transformers.utils.logging.disable_progress_bar()
        print(f"validation loss {metrics['eval_loss']:.4f} (perplexity {math.exp(metrics['eval_loss']):.2f}); "
              f"model saved to {args.out}/final")
        again = transformers.LlamaForCausalLM.from_pretrained(f"{args.out}/final")
        same = all(torch.equal(v, again.state_dict()[k]) for k, v in sm.state_dict().items())
        print(f"from_pretrained gives the trained weights: {same}")
    trainer.end()         # closes trainer.sm, then Trainer's end (trackers, the process group under torchrun)
    return metrics


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="2 layers, width 64, a few steps: what CI runs")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--width", type=int, default=256, help="hidden size (default 256)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4; half as many key/value heads)")
    p.add_argument("--vocab", type=int, default=1024, help="vocabulary size (default 1024)")
    p.add_argument("--seq", type=int, default=64, help="tokens of the longest sequence (default 64)")
    p.add_argument("--samples", type=int, default=2048, help="training sequences (default 2048)")
    p.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size (default 8)")
    p.add_argument("--accumulation", type=int, default=2,
                   help="gradient_accumulation_steps: Harmony's microbatches (default 2)")
    p.add_argument("--budget", type=float, default=0.5,
                   help="device memory budget as a share of the training state (default 0.5)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    p.add_argument("--steps", type=int, default=200, help="max_steps (default 200)")
    p.add_argument("--save-every", type=int, default=50, help="evaluate and save a checkpoint every N steps "
                                                              "(default 50)")
    p.add_argument("--log-every", type=int, default=10, help="log every N steps (default 10)")
    p.add_argument("--bf16", action="store_true", help="TrainingArguments(bf16=True): Harmony's precision='bf16'")
    p.add_argument("--stop-at", type=int, default=None, help="stop after the checkpoint at this step (default: "
                                                             "run to --steps)")
    p.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --out")
    p.add_argument("--out", default="trainer-out", help="Trainer's output_dir (default trainer-out/)")
    p.add_argument("--seed", type=int, default=0, help="(default 0)")
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.width, args.heads, args.vocab, args.seq = 2, 64, 4, 64, 16
        args.samples, args.batch, args.accumulation, args.budget = 64, 4, 2, 0.5
        args.steps, args.save_every, args.log_every, args.lr = 8, 4, 2, 3e-3
    return args


if __name__ == "__main__":
    main()
