"""What evaluation adds to training on the demo GPT: the eval schedule's one-time build, then each ``sm.evaluate``
beside a training step (``sm(...)``) and beside eager ``model.eval()`` + ``no_grad`` on the whole model (no budget).

    python benchmarks/evaluate.py                     # the demo's GPT: 6 layers, width 256, 40% of its state
    python benchmarks/evaluate.py --layers 2 --width 64 --steps 3

Steps and evaluations take turns (step, evaluate, eager evaluate, ...), and the figures are medians, since
this machine's speed moves from one minute to the next.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import common
import harmony  # before torch: it sets the OpenMP and allocator variables torch reads when it loads
import torch
from harmony.models import GPT, GPTConfig, copy_task


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--budget", type=float, default=0.4, help="share of the training state (default 0.4)")
    p.add_argument("--steps", type=int, default=8, help="rounds of step + evaluation measured (default 8)")
    p.add_argument("--device", default="cpu")
    common.add_json_arg(p)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    c = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, width=args.width, heads=args.heads)
    model = GPT(c)
    eager = copy.deepcopy(model).to(args.device)
    state = 16 * sum(q.numel() for q in model.parameters())
    data = list(copy_task(c, args.batch, args.steps + 2))
    sm = harmony.compile(model, example_batch=data[0], memory_budget=int(state * args.budget),
                         microbatches=args.microbatches, device=args.device)
    sm(*data[0])                       # warm-up step
    t0 = time.perf_counter()
    sm.evaluate(*data[1])              # builds the eval schedule, then runs it
    first = time.perf_counter() - t0
    build = sm.eval_stats["compile_seconds"]
    steps, evals, eagers = [], [], []
    for x, y in data[2:]:
        steps.append(_timed(lambda: sm(x, y)))
        evals.append(_timed(lambda: sm.evaluate(x, y)))
        eager.load_state_dict(sm.training_state_dict()["model"], strict=False)    # the trained weights (not timed)
        eagers.append(_timed(lambda: _eager(eager, x, y, args.microbatches)))
    step, ev, eg = (statistics.median(v) for v in (steps, evals, eagers))
    s = sm.eval_stats
    print(f"demo GPT {args.layers} layers, width {args.width}, {state / 16 / 1e6:.2f}M parameters, batch {args.batch} "
          f"in {args.microbatches} microbatches, budget {args.budget:.0%} of the training state, "
          f"{len(sm.plan.packs)} packs, device {args.device}")
    rows = [("training step sm(x, y)", step, 1.0),
            ("sm.evaluate(x, y)", ev, ev / step),
            ("eager model.eval() + no_grad, whole model resident", eg, eg / step),
            ("first sm.evaluate (builds the schedule)", first, first / step),
            ("  of which the schedule's build", build, build / step)]
    for name, sec, ratio in rows:
        print(f"{name:<52} {sec * 1e3:9.1f} ms   {ratio:5.2f} x step")
    print(f"evaluation: peak {s['measured_peak'] / 2**20:.2f} MiB measured vs {s['predicted_peak'] / 2**20:.2f} "
          f"predicted (budget {s['budget'] / 2**20:.2f}), h2d {s['h2d_bytes'] / 2**20:.2f} MiB; training step: peak "
          f"{sm.stats['measured_peak'] / 2**20:.2f} MiB, h2d {sm.stats['h2d_bytes'] / 2**20:.2f} MiB")
    common.save_json(args.json, {"evaluate/step": ev / step, "evaluate/eager": ev / eg, "step_s": step,
                                 "evaluate_s": ev, "eager_s": eg, "first_evaluate/step": first / step,
                                 "eval_peak/budget": s["measured_peak"] / s["budget"]})
    sm.close()


def _timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    float(out)
    return time.perf_counter() - t0


def _eager(model, x, y, microbatches):
    model.eval()
    with torch.no_grad():
        dev = next(model.parameters()).device
        return torch.stack([model(a.to(dev), b.to(dev)) for a, b in zip(x.chunk(microbatches),
                                                                         y.chunk(microbatches))]).mean()


if __name__ == "__main__":
    main()
