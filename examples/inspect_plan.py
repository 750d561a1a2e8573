"""Look inside a compiled plan: the report, the schedule as Python, drawings, a timeline, a simulated GPU step.

    python examples/inspect_plan.py                 # the built-in GPT (8 layers, width 512) at 30% of its state
    python examples/inspect_plan.py --tiny          # a few seconds: the size CI runs
    python examples/inspect_plan.py --gpu h100-sxm  # simulate another preset (a100-40gb, l4, t4, rtx3090, ...)

What each piece answers:

* ``sm.report()``: what every pass decided and why, in numbers (packs, bytes moved, predicted
  and measured peak); its "terms" paragraph explains the report's words;
* ``sm.code``: the schedule, readable as Python, one op a line with the bytes it moves and the
  device's live and peak memory after it;
* ``harmony.viz.draw(sm, "plan", out_dir)``: the model graph coloured by pack and the schedule
  graph (SVG with Graphviz's ``dot``, else ``.dot`` files), and after a step a Chrome/Perfetto
  timeline of it (open the JSON in ui.perfetto.dev);
* ``sm.simulate("a100-40gb")``: the same schedule on a GPU described by its datasheet, a
  discrete-event simulation: step time, how busy each stream is, peak device memory.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import harmony  # before torch: it sets the OpenMP and allocator variables torch reads when it loads
import torch

from harmony.models import GPT, GPTConfig, copy_task
from harmony.viz import timeline


def main(argv=None):
    args = parse(argv)
    torch.manual_seed(args.seed)
    c = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, width=args.width, heads=args.heads)
    model = GPT(c)
    state = 16 * sum(p.numel() for p in model.parameters())
    data = list(copy_task(c, args.batch, 2, seed=args.seed))
    sm = harmony.compile(model, example_batch=data[0], memory_budget=int(state * args.budget),
                         microbatches=args.microbatches, optimizer=torch.optim.AdamW)
    for x, y in data:                          # a step fills the report's "last step" and the measured timeline
        sm(x, y)

    print(sm.report())
    code = sm.code.splitlines()
    shown = code if args.all_code else code[:args.code_lines]
    print(f"== the schedule as Python (sm.code): {len(code)} lines" + ("" if args.all_code else
                                                                         f", the first {len(shown)}") + " ==")
    print("\n".join(shown))

    out = Path(args.out)
    files = harmony.viz.draw(sm, "plan", out_dir=out)     # model, schedule, and the last step's timeline
    print("\ndrawings: " + ", ".join(str(f) for f in files))

    sim = sm.simulate(args.gpu)                # the schedule on a GPU preset's datasheet figures
    print(f"\n== simulated on {args.gpu} ==")
    print(repr(sim))                           # the short form; sim.summary() is the table below
    print(sim.summary())
    print(f"{len(sim.events)} simulated ops in sim.events")
    files = [timeline.chrome_trace(sim.events, out / f"simulated_{args.gpu}.json")]
    if sim.memory:
        files.append(timeline.memory_plot(sim, out / f"simulated_{args.gpu}_memory.svg",
                                          budget=sm.program.config.memory_budget))
    print("simulated timeline: " + ", ".join(str(f) for f in files))
    sm.close()


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="3 layers, width 64: what CI runs")
    p.add_argument("--layers", type=int, default=8, help="transformer blocks (default 8)")
    p.add_argument("--width", type=int, default=512, help="hidden size (default 512)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary size (default 512)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step (default 4)")
    p.add_argument("--budget", type=float, default=0.3,
                   help="device memory budget as a share of the training state (default 0.3)")
    p.add_argument("--gpu", default="a100-40gb", help="the GPU preset to simulate on (default a100-40gb)")
    p.add_argument("--code-lines", type=int, default=40, help="lines of sm.code to print (default 40)")
    p.add_argument("--all-code", action="store_true", help="print all of sm.code")
    p.add_argument("--out", default="inspect-plan", help="where the drawings go (default inspect-plan/)")
    p.add_argument("--seed", type=int, default=0, help="(default 0)")
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.width, args.heads, args.vocab, args.seq = 3, 64, 2, 64, 16
        args.batch, args.microbatches, args.budget = 8, 2, 0.5
    return args


if __name__ == "__main__":
    main()
