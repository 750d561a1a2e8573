"""Train a model whose training state exceeds the host's memory budget: weights and optimizer state go to disk.

    python examples/disk_offload.py                       # ~50M-parameter GPT, host budget 1/4 of its state
    python examples/disk_offload.py --offload-dir /nvme   # put the files on a fast disk
    python examples/disk_offload.py --tiny                # a few seconds: the size CI runs

Three tiers, as ZeRO-Infinity has them: ``memory_budget`` bounds the device, ``host_memory_budget``
bounds the host, and what neither holds lives in files under ``offload_dir`` (a private
directory, mode 0700, removed when the run ends). Where the host cannot hold the optimizer
state, packs' optimizer state goes to disk and is stepped there in the background; where it
cannot hold the fp32 weights either, whole packs go to disk and are read for the forward and
the backward. ``sm.report()`` says which: its "between steps" line gives the bytes per tier,
and the offload pass's table where each pack's weights and optimizer state live.

The model is built under ``harmony.empty_weights()``: its parameters are shapes only until
compile has planned where they live, then each is made (the model's own initialisation,
seeded by the module's name) where it goes; the weights of packs on disk are written a
group at a time, so the host's peak stays near its budget rather than the model's size.
"""
from __future__ import annotations

import argparse
import itertools
import tempfile

import harmony  # before torch: it sets the OpenMP and allocator variables torch reads when it loads
import torch

from harmony.models import GPT, GPTConfig, copy_task


def main(argv=None) -> list[float]:
    args = parse(argv)
    torch.manual_seed(args.seed)
    c = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, width=args.width, heads=args.heads)
    # built without its weights: compile makes them as it places them, the disk packs' a file at a time, so the
    # host never holds the whole model (build it as usual and the host holds its fp32 weights until compile)
    with harmony.empty_weights():
        model = GPT(c)
    n = sum(p.numel() for p in model.parameters())
    state = 16 * n                     # fp32 weights, gradients and AdamW's two moments
    data = list(copy_task(c, args.batch, args.steps, seed=args.seed))
    offload_dir = args.offload_dir or tempfile.gettempdir()
    sm = harmony.compile(model, example_batch=data[0], optimizer=torch.optim.AdamW, optimizer_kwargs=dict(lr=args.lr),
                         memory_budget=int(state * args.budget), microbatches=args.microbatches,
                         host_memory_budget=int(state * args.host_budget), offload_dir=offload_dir,
                         **({"disk_group_bytes": args.file_bytes} if args.file_bytes else {}))
    print(f"GPT, {n / 1e6:.2f}M parameters, training state {state / 2**20:.1f} MiB; device budget "
          f"{args.budget:.0%} of it, host budget {args.host_budget:.0%}; offload files under {offload_dir}")
    losses = []
    for step, (x, y) in enumerate(data, 1):
        losses.append(sm(x, y).item())
        if step % args.log_every == 0:
            print(f"step {step:4d}  loss {losses[-1]:.4f}")
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}\n")
    report = sm.report()
    sections = {s.split(" ", 1)[0]: s for s in report.split("\n== ")}   # the report's parts, by first word
    header = sections["Harmony"].splitlines()
    for key in ("between steps", "weights "):      # bytes per tier; the weights compile made
        at = next(i for i, line in enumerate(header) if line.startswith(key))
        print("\n".join([header[at]] + list(itertools.takewhile(lambda line: line.startswith(" "), header[at + 1:]))))
    print("== " + sections["offload:"].strip())     # per pack: where it steps, where weights and state live
    print("disk I/O of the last step:")
    for line in sections["last"].splitlines():
        if line.startswith(("disk_read_bytes", "disk_write_bytes", "disk_io", "disk_read_GBps", "disk_write_GBps")):
            print("  " + line)
    if args.full_report:
        print("\n" + report)
    sm.close()                         # removes the offload files
    return losses


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="3 layers, width 64, 8 steps: what CI runs")
    p.add_argument("--layers", type=int, default=8, help="transformer blocks (default 8)")
    p.add_argument("--width", type=int, default=704, help="hidden size (default 704)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary size (default 4096)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step (default 4)")
    p.add_argument("--steps", type=int, default=20, help="steps (default 20)")
    p.add_argument("--budget", type=float, default=0.25,
                   help="device memory budget as a share of the training state (default 0.25)")
    p.add_argument("--host-budget", type=float, default=0.25,
                   help="host memory budget as a share of the training state (default 0.25)")
    p.add_argument("--offload-dir", default=None, help="where the offload files go (default: the temp directory)")
    p.add_argument("--file-bytes", default=None,
                   help="bytes of state per offload file, e.g. 64MiB: the unit the disk tier reads and steps "
                        "(default: Harmony's, DiskConfig.disk_group_bytes)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--log-every", type=int, default=5, help="print the loss every N steps (default 5)")
    p.add_argument("--full-report", action="store_true", help="print the whole report too")
    p.add_argument("--seed", type=int, default=0, help="(default 0)")
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.width, args.heads, args.vocab, args.seq = 3, 64, 2, 64, 16
        args.batch, args.steps, args.log_every, args.budget, args.file_bytes = 8, 8, 2, 0.34, "16KiB"
        args.host_budget, args.lr = 0.3, 3e-3
    return args


if __name__ == "__main__":
    main()
