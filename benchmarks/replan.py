"""Plan a measured GPU run again with today's compiler, on the card's recorded figures, and simulate it.

    python benchmarks/replan.py benchmarks/results/h200-fp32.json
    python benchmarks/replan.py benchmarks/results/h200-bf16.json --fracs 0.25 --options recompute=device,recompute=auto

A results file of benchmarks/gpu.py records the card it ran on (matmul FLOP/s per dtype, pinned copy rates, the
per-op host cost) and the model, batch and precision of its rows. This builds the same GPT on the meta device (no
weights), compiles it at each budget with each option set (``key=value``, ``;`` between keys of one set), with the
card as the plan's hardware, and prints each plan's simulated step beside the step the card measured for that budget:
what a planner change would move on that card, before a card is lent to measure it. Figures here are predictions
only (the host's figures are the preset's: the card's record has none).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import table  # noqa: E402


def card_hardware(card: dict, precision: str):
    """The recorded card as a ``Hardware``: a preset of its class with the measured figures in place."""
    from harmony.compiler.hardware import Hardware
    base = Hardware.preset("h200-sxm" if "H200" in card["name"] else "h100-sxm")
    flops = {"fp32": card["fp32_flops"], "bf16": card["bf16_flops"]}
    dev = base.devices[0].replace(name=card["name"], peak_flops=flops, h2d_bandwidth=card["h2d"],
                                  d2h_bandwidth=card["d2h"], kernel_latency=card["kernel_latency"],
                                  memory_bandwidth=card["memory_bandwidth"], queued=True, efficiency=1.0)
    return base.replace(devices=(dev,)).computing_in(precision)


def options(text: str) -> dict:
    out = {}
    for pair in filter(None, text.split(";")):
        key, _, value = pair.partition("=")
        out[key.strip()] = value.strip()
    return out


def replan(record: dict, fracs, option_sets, device: str = "meta") -> list[dict]:
    import torch

    import harmony
    from harmony.models import GPT, GPTConfig
    a = record["args"]
    c = GPTConfig(vocab=a["vocab"], seq=a["seq"], layers=a["layers"], width=a["width"],
                  heads=a["width"] // 128 or 1, tie=False)
    with torch.device(device):
        model = GPT(c)
    x = torch.zeros(a["batch"], c.seq, dtype=torch.long, device=device)
    hw = card_hardware(record["card"], a["precision"])
    measured = {r["system"]: r.get("step_s") for r in record["rows"]}
    rows = []
    for frac in fracs:
        for opts in option_sets:
            sm = harmony.compile(model, (x, x), memory_budget=int(16 * c.n_params() * frac),
                                 microbatches=a["microbatches"], device=device, hardware=hw,
                                 precision=a["precision"], **opts)
            choice = sm.program.swap_choice
            rows.append(dict(budget=f"{frac:.0%}", options=";".join(f"{k}={v}" for k, v in opts.items()) or "-",
                             packs=len(sm.plan.packs), graphs=len(choice.kept) if choice else 0,
                             on_host=len(choice.offloaded) if choice else 0,
                             predicted_s=round(sm.simulate(hw).step_seconds, 3),
                             measured_s=measured.get(f"harmony-{round(frac * 100)}"),
                             peak_GiB=round(sm.predicted.peak / 2**30, 2)))
            sm.close()
    eager = measured.get("eager")
    for r in rows:
        r["vs_eager"] = round(eager / r["predicted_s"], 2) if eager else None
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", help="a benchmarks/gpu.py results JSON (benchmarks/results/*.json)")
    ap.add_argument("--fracs", default="0.5,0.25", help="budgets, as fractions of the fp32 + AdamW state")
    ap.add_argument("--options", default="recompute=device,recompute=auto",
                    help="option sets to compare, comma between sets, ';' between keys of one set")
    ap.add_argument("--device", default="meta", help="meta (no weights) or cpu")
    a = ap.parse_args(argv)
    with open(a.results) as f:
        record = json.load(f)
    rows = replan(record, [float(x) for x in a.fracs.split(",")], [options(o) for o in a.options.split(",")],
                  a.device)
    card = record["card"]
    print(table(rows, f"{card['name']}, {record['args']['precision']} (recorded {card.get('date', '?')}), "
                      f"eager measured {next((r['step_s'] for r in record['rows'] if r['system'] == 'eager'), '-')} s"))


if __name__ == "__main__":
    main()
