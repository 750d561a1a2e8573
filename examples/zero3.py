"""ZeRO-3 under torchrun: a Hugging Face Llama whose weights, gradients and optimizer state are partitioned over the
ranks, each rank's share of them in a file on its own disk.

    torchrun --nproc_per_node 2 examples/zero3.py                  # Llama (4 layers, width 256) on 2 ranks
    torchrun --nproc_per_node 2 examples/zero3.py --replicated     # the same run as plain data parallelism
    torchrun --nproc_per_node 2 examples/zero3.py --tiny           # a few seconds: the size CI runs

``shard_state="full"``: each rank keeps one chunk (1/N) of every pack's fp32 weights and their AdamW state, here
in a file of its own ``offload_dir`` (``weights_on="disk"``); a pack's weights come to the device by an all-gather
of every rank's chunk (each rank reading only its chunk from its disk: N disks read at once), its gradients go to
their owners by a reduce-scatter, and each rank steps its chunk. It trains bitwise like ``--replicated`` (every rank
holding and reading all of it). The model is built from a config with random weights (nothing is downloaded); the
data is the synthetic counting task of examples/hf_finetune.py. At the end rank 0 prints each rank's host and disk
bytes, a validation loss, and the checkpoint it saved (each rank its own chunks).
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import harmony  # before torch: it sets the OpenMP and allocator variables torch reads when it loads
import harmony.data
import torch
import torch.distributed as dist
from data_parallel import digest              # (this script's directory is on sys.path)
from hf_finetune import CountingDataset         # the same synthetic data
from torch.utils.data import DataLoader

MiB = 2**20


def build_model(args):
    import transformers

    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.width, intermediate_size=2 * args.width,
                                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                      num_key_value_heads=args.heads, max_position_embeddings=args.seq,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    config._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(config)


def main(argv=None) -> dict:
    args = parse(argv)
    torch.manual_seed(args.seed)              # the same initial weights on every rank (compile broadcasts rank 0's)
    model = build_model(args)
    n = sum(p.numel() for p in model.parameters())
    train = DataLoader(CountingDataset(args.batch * args.steps, args.seq, args.vocab, args.seed, varied=False),
                       batch_size=args.batch, drop_last=True)            # global batches, the same on every rank
    val = next(iter(DataLoader(CountingDataset(args.batch, args.seq, args.vocab, args.seed + 1, varied=False),
                               batch_size=args.batch)))
    rank, world = harmony.data.rank_and_world()
    out = Path(args.out or tempfile.mkdtemp(prefix="harmony-zero3-"))
    mode = False if args.replicated else "full"
    sm = harmony.compile(model, example_batch=harmony.data.shard(next(iter(train))), optimizer=torch.optim.AdamW,
                         optimizer_kwargs=dict(lr=args.lr), memory_budget=int(16 * n * args.budget),
                         microbatches=args.microbatches, data_parallel=True, shard_state=mode,
                         weights_on="disk", offload_dir=out / f"offload-rank{rank}",
                         loss_weighting="rows")     # as shard_state="full" weighs: --replicated compares bitwise

    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{world} ranks, Llama {n / 1e6:.2f}M parameters ({16 * n / MiB:.1f} MiB of fp32 weights, gradients and "
        f"AdamW state), shard_state={mode!r}, {args.batch // world} of each batch of {args.batch} per rank")
    losses = []
    for step, batch in enumerate(train, 1):
        losses.append(float(sm(**harmony.data.shard(batch))))     # this rank's loss on its share
        if step % args.log_every == 0 or step == 1:
            say(f"step {step:4d}  loss {losses[-1]:.4f} (rank 0's share)")
    stats = dict(sm.stats)
    loss = sm.evaluate(**harmony.data.shard(val)).reshape(1)
    dist.all_reduce(loss)
    say(f"validation loss {float(loss) / world:.4f} (mean over the ranks' shares)")
    harmony.save(sm, out / "checkpoint")
    say(f"checkpoint in {out / 'checkpoint'}: each rank's " + ("chunks and their optimizer state" if mode else
                                                               "whole state (rank 0 writes it)"))
    shard = next((r.totals for r in sm.program.reports if r.title.startswith("shard") and "rank" in r.totals), None)
    kept = 12 * n if shard is None else shard["master_bytes_this_rank"] + shard["optim_bytes_this_rank"]
    mine = dict(kept=kept, read=stats.get("disk_read_bytes", 0),
                written=stats.get("disk_write_bytes", 0), sent=stats.get("gather_wire_bytes", 0)
                + stats.get("reduce_scatter_wire_bytes", stats.get("comm_wire_bytes", 0)))
    every = [None] * world
    dist.all_gather_object(every, mine)
    for r, m in enumerate(every):
        say(f"rank {r}: keeps {m['kept'] / MiB:.2f} MiB of fp32 weights and AdamW state (of {12 * n / MiB:.2f}), "
            f"read {m['read'] / MiB:.2f} MiB from its disk and wrote {m['written'] / MiB:.2f} MiB in the last step, "
            f"sent {m['sent'] / MiB:.2f} MiB to the other ranks")
    sm.sync_model()            # partitioned: every rank's chunks gathered into the model's parameters
    digests = [None] * world
    dist.all_gather_object(digests, digest(model))
    say(f"parameters equal on every rank: {len(set(digests)) == 1} ({digests[0]})")
    sm.close()
    dist.destroy_process_group()
    return dict(losses=losses, digest=digests[0])


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="2 layers, width 64, 6 steps: what CI runs")
    p.add_argument("--replicated", action="store_true", help="plain data parallelism: every rank holds all the state")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--width", type=int, default=256, help="hidden size (default 256)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary size (default 512)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--batch", type=int, default=16, help="global batch: sequences per step over all ranks (default 16)")
    p.add_argument("--microbatches", type=int, default=2, help="microbatches per step on each rank (default 2)")
    p.add_argument("--steps", type=int, default=40, help="steps (default 40)")
    p.add_argument("--budget", type=float, default=0.25,
                   help="device memory budget per rank, as a share of the training state (default 0.25)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--log-every", type=int, default=10, help="print the loss every N steps (default 10)")
    p.add_argument("--out", default=None, help="where the offload directories and the checkpoint go (default: a new "
                                               "temporary directory)")
    p.add_argument("--seed", type=int, default=0, help="(default 0)")
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.width, args.heads, args.vocab, args.seq = 2, 64, 2, 64, 16
        args.batch, args.steps, args.log_every, args.budget = 8, 6, 2, 0.75   # a tiny model: activations weigh more
    return args


if __name__ == "__main__":
    main()
