"""``python -m harmony demo``: compile and train the built-in GPT under a memory budget smaller than its training
state."""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from pathlib import Path

import torch

import harmony
from harmony.base.errors import BudgetError
from harmony.base.units import fmt_bytes
from harmony.models import GPT, GPTConfig, copy_task


def _compile(model, batch, budget, args):
    return harmony.compile(model, example_batch=batch, optimizer=torch.optim.AdamW,
                           optimizer_kwargs={"lr": args.lr}, memory_budget=budget,
                           microbatches=args.microbatches, policy=args.policy, precision=args.precision)


@contextlib.contextmanager
def _progress():
    """The compile's phases as they finish (the ``"harmony"`` logger at INFO: trace, cost, each pass and its
    choice, the runtime), on stderr: a long compile shows where it is."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("  %(message)s"))
    log = logging.getLogger("harmony")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def demo(args) -> int:
    torch.manual_seed(args.seed)
    c = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, width=args.width, heads=args.heads)
    model = GPT(c)
    n = sum(p.numel() for p in model.parameters())
    state = 16 * n   # fp32 parameter, gradient and two Adam moments
    share = 0.4 if args.budget is None else args.budget
    budget = int(state * share)
    print(f"model: GPT, {args.layers} layers, width {args.width}, {n / 1e6:.2f}M parameters; "
          f"training state {fmt_bytes(state)} (16 B/param with AdamW)")
    data = copy_task(c, args.batch, args.steps, seed=args.seed)
    x, y = next(copy_task(c, args.batch, 1, seed=args.seed))
    t0 = time.perf_counter()
    for _ in range(4):       # each pass that finds the budget short says what would work: at most a few raises
        try:
            with _progress():
                sm = _compile(model, (x, y), budget, args)
            break
        except BudgetError as e:
            if args.budget is not None or e.min_budget is None or e.min_budget <= budget:
                print(f"error: {e}", file=sys.stderr)     # the user's own budget: say why, change nothing
                return 2
            # A small model's activations outweigh 40% of its state: the default is a share, not a promise
            print(f"a budget of {fmt_bytes(budget)} is below what this model needs: "
                  f"using the smallest budget that works, {fmt_bytes(e.min_budget)}")
            budget, share = e.min_budget, e.min_budget / state
    else:
        print(f"error: still no plan under {fmt_bytes(budget)} after 4 tries: pass --budget", file=sys.stderr)
        return 2
    print(f"device budget: {fmt_bytes(budget)} = {share:.0%} of the training state; "
          f"batch {args.batch} in {args.microbatches} microbatches; policy {args.policy}; precision {args.precision}")
    print(f"compiled in {time.perf_counter() - t0:.1f} s: {len(sm.plan.packs)} packs")
    from tqdm import tqdm
    bar = tqdm(data, total=args.steps, desc="training", unit="step", file=sys.stdout, mininterval=0.5)
    first = last = None
    for x, y in bar:
        loss = sm(x, y).item()
        first = loss if first is None else first
        last = loss
        bar.set_postfix(loss=f"{loss:.3f}", peak=fmt_bytes(sm.stats["measured_peak"]))
    bar.close()
    print(f"loss {first:.3f} -> {last:.3f} over {args.steps} steps")
    val = sm.evaluate(*next(copy_task(c, args.batch, 1, seed=args.seed + 1))).item()   # forward only, same budget
    print(f"validation loss {val:.3f} (sm.evaluate: {sm.eval_stats['eval_seconds']:.2f} s, its schedule built in "
          f"{sm.eval_stats['compile_seconds']:.2f} s; a training step {sm.stats['step_seconds']:.2f} s)\n")
    print(sm.report())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = harmony.viz.draw(sm, "plan", out_dir=out)
    print("drawings: " + ", ".join(str(f) for f in files))
    sm.close()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m harmony", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="train the built-in GPT under a memory budget (the main job)",
                       description="Compile the built-in GPT under a device budget smaller than its training state, "
                                   "train it on a synthetic copy task, print the report and write drawings.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d.add_argument("--layers", type=int, default=6, help="transformer blocks")
    d.add_argument("--width", type=int, default=256, help="hidden size")
    d.add_argument("--heads", type=int, default=4, help="attention heads")
    d.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    d.add_argument("--vocab", type=int, default=128, help="vocabulary size")
    d.add_argument("--batch", type=int, default=16, help="sequences per step")
    d.add_argument("--microbatches", type=int, default=4, help="microbatches the batch is cut into")
    d.add_argument("--steps", type=int, default=60, help="training steps")
    d.add_argument("--budget", type=float, default=None,
                   help="device budget as a share of the training state (default 0.4, raised to the smallest "
                        "budget that works where one layer needs more)")
    d.add_argument("--policy", default="harmony", choices=["harmony", "sequential", "ondemand"],
                   help="the schedule: harmony, or a baseline (sequential: gradient accumulation under swapping; "
                        "ondemand: fetch on use, evict the least recently used)")
    d.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    d.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="bf16/fp16: compute copies on the device, fp32 masters and optimizer on the host")
    d.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    d.add_argument("--out", default="harmony-demo", help="where the drawings go")
    args = p.parse_args(argv)
    return demo(args)


if __name__ == "__main__":
    raise SystemExit(main())
