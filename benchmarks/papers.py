"""The Harmony paper's setups, simulated: harmony vs sequential vs ondemand on 4 x GTX 1080 Ti over PCIe.

SIMULATIONS on published hardware figures, not measurements: the GPU is the GTX 1080 Ti
preset (NVIDIA's specifications: 11.3 TFLOP/s fp32 peak, 11 GiB), its host link the swap
bandwidth msr-fiddle/harmony's scheduler assumes for these servers (3_scheduler/sched_args.py:
--bw_swap 11.5 GiB/s per direction), and the host's memory bandwidth a nominal 100 GB/s
(the optimizer steps there, as in the paper). Compute runs at the datasheet peak unless
``--efficiency`` says otherwise; a lower efficiency lengthens compute, which hides more of
the swapping and shrinks every speedup below.

Models, built by Hugging Face transformers on the meta device (no memory: harmony.compile
traces and costs them on fake tensors, and ``device="meta"`` gives a runtime that is never
run; a 1.5 B-parameter model compiles in about 0.3 GiB of RAM): BERT-Large (24 layers,
hidden 1024, sequences of 512), GPT-2 Large (36 x 1280, 774 M) and GPT-2 XL (1.5 B:
48 x 1600), both on sequences of 1024. ``--models`` also offers GPT-2 Medium and the
repository's BERT-96 (96 BERT-Large layers; its compile takes minutes). The Harmony
repository's Table 1 scripts train a minibatch of 64 on 4 GPUs; here each GPU holds 16
samples, run in 4 and in 16 microbatches, under the GPU's 11 GiB. AdamW, fp32: 16 B of
training state per parameter, so BERT-Large (5.4 GB of state) fits a GPU at 16
microbatches and every policy is the same there: nothing to swap.

One device's schedule is simulated. The four GPUs are data-parallel replicas, each with
the same schedule on its own samples, so the per-device swap volume does not depend on
the replica count; the 4-GPU throughput is 4 x batch / (step + gradient all-reduce), the
all-reduce a ring over PCIe peer-to-peer at msr-fiddle/harmony's --bw_p2p default of
8.2 GiB/s, not overlapped with anything (the same time for every policy, so it narrows
the speedups a little).

``ondemand`` (virtualized memory: CUDA unified memory, IBM LMS) has no copies in its
schedule; the simulator replays what its runtime does: fetch each pack's parameters,
gradients or optimizer state when an op touches them, evicting the least recently used
(writing back what changed) to fit beside the activations, and the op waits for those
copies. Swap bytes are the copies between host and device per iteration, both ways.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import common
import torch

import harmony
from harmony.compiler.hardware import Hardware
from harmony.errors import BudgetError
from harmony.base.units import parse_bytes

GiB = 2**30
from harmony.compiler.config import POLICIES  # noqa: E402
SWAP = 11.5 * GiB           # msr-fiddle/harmony 3_scheduler/sched_args.py --bw_swap
P2P = 8.2 * GiB             # msr-fiddle/harmony 3_scheduler/sched_args.py --bw_p2p
GPUS = 4
PAPER = "up to 7.6x throughput, up to two orders of magnitude less swap (VLDB'22 abstract)"


def bert_large(seq=512, layers=24):
    from transformers import BertConfig, BertForMaskedLM
    cfg = BertConfig(hidden_size=1024, num_hidden_layers=layers, num_attention_heads=16, intermediate_size=4096,
                     max_position_embeddings=seq)
    return BertForMaskedLM(cfg), seq


def gpt2(layers, width, heads, seq=1024):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=seq)
    return GPT2LMHeadModel(cfg), seq


MODELS = {
    "bert-large": lambda: bert_large(),
    "bert-96": lambda: bert_large(layers=96),
    "gpt2-medium": lambda: gpt2(24, 1024, 16),
    "gpt2-large": lambda: gpt2(36, 1280, 20),
    "gpt2-xl": lambda: gpt2(48, 1600, 25),
}


def compile_policies(name, batch, microbatches, hw, budget):
    """{policy: ScheduledModule or BudgetError} for one model and microbatch count, on the meta device.

    ``harmony.compile`` for the first policy; the others reuse its trace and cost analysis
    (both policy-free) and run only the passes. (A public way to do this would be a
    ``harmony.compile`` that takes several policies, or one that takes a traced program.)
    """
    from harmony.api import ScheduledModule
    from harmony.compiler.ir import Program
    from harmony.compiler.passmanager import DEFAULT_PIPELINE, run_passes

    out = {}
    with torch.device("meta"):
        model, seq = MODELS[name]()
        ids = torch.zeros(batch, seq, dtype=torch.long)
        first = None
        for policy in POLICIES:
            try:
                if first is None:
                    out[policy] = first = harmony.compile(
                        model, {"input_ids": ids, "labels": ids}, memory_budget=budget, microbatches=microbatches,
                        policy=policy, device="meta", hardware=hw)
                    continue
                base = first.program
                program = Program(model=model, gm=base.gm, example_batch=base.example_batch,
                                  config=dataclasses.replace(base.config, policy=policy))
                program.fake, program.optim_profile = base.fake, base.optim_profile
                out[policy] = ScheduledModule(run_passes(program, DEFAULT_PIPELINE), "meta")
            except BudgetError as e:
                out[policy] = e
    return sum(p.numel() for p in model.parameters()), out


def main():
    from transformers.utils import logging
    logging.set_verbosity_error()           # the config notes it picks GPT-2's default loss
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["bert-large", "gpt2-large", "gpt2-xl"], choices=list(MODELS))
    ap.add_argument("--batch", type=int, default=16, help="samples per GPU per iteration")
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--budget", default="11GiB", help="per GPU (default: the GTX 1080 Ti's 11 GiB)")
    ap.add_argument("--efficiency", type=float, nargs="+", default=[1.0, 0.5],
                    help="shares of peak FLOP/s to simulate at (the first is the headline)")
    ap.add_argument("--quick", action="store_true", help="GPT-2 Large at 16 microbatches only, about a minute")
    args = ap.parse_args()
    if args.quick:
        args.models, args.microbatches = ["gpt2-large"], [16]
    budget = parse_bytes(args.budget)
    hw = Hardware.preset("gtx1080ti", count=GPUS, link=SWAP)
    print("SIMULATED, not measured: " + hw.describe().splitlines()[0])
    print(f"{GPUS} such GPUs as data-parallel replicas; budget {budget / GiB:.1f} GiB per GPU; swap link "
          f"{SWAP / GiB:g} GiB/s, all-reduce {P2P / GiB:g} GiB/s (msr-fiddle/harmony scheduler defaults)\n",
          flush=True)
    t_start = time.perf_counter()
    rows, summary = [], []
    for name in args.models:
        for m in args.microbatches:
            result = {}
            t0 = time.perf_counter()
            params, compiled = compile_policies(name, args.batch, m, hw, budget)
            seconds = time.perf_counter() - t0
            for policy, sm in compiled.items():
                row = dict(model=name, params_M=params / 1e6, microbatches=m, policy=policy)
                if isinstance(sm, BudgetError):
                    row["note"] = f"does not fit: {sm}".split("\n")[0][:90]
                    rows.append(row)
                    continue
                sims = {eff: sm.simulate(hw.replace(devices=(hw.devices[0].replace(efficiency=eff),)))
                        for eff in args.efficiency}
                allreduce = 2 * (GPUS - 1) / GPUS * 4 * params / P2P
                sim = sims[args.efficiency[0]]
                swap = sum(sim.moved.values())
                result[policy] = {eff: GPUS * args.batch / (s.step_seconds + allreduce) for eff, s in sims.items()}
                result[policy]["swap"] = swap
                row.update(packs=len(sm.plan.packs), step_s=sim.step_seconds, allreduce_s=allreduce,
                           gpu_samples_s=args.batch / sim.step_seconds,
                           samples_s_4gpu=result[policy][args.efficiency[0]], swap_GiB=swap / GiB,
                           compute_util=sim.utilisation["compute"])
                rows.append(row)
                sm.close()
            print(common.table(rows[-len(compiled):], f"{name}, {m} microbatches (compiled in {seconds:.0f} s)"),
                  flush=True)
            if "harmony" not in result:
                continue
            h = result["harmony"]
            line = dict(model=name, microbatches=m)
            for base in ("sequential", "ondemand"):
                if base not in result:
                    line[f"vs_{base}"] = "baseline does not fit"
                    continue
                for eff in args.efficiency:
                    line[f"speedup_vs_{base}@{eff:g}"] = h[eff] / result[base][eff]
                line[f"swap_{base}/harmony"] = result[base]["swap"] / h["swap"] if h["swap"] else float("nan")
            line.update(paper_speedup="up to 7.6x", paper_swap="up to ~100x")
            summary.append(line)
    print()
    print(common.table(rows, f"per-GPU schedules, batch {args.batch} per GPU (SIMULATED on GTX 1080 Ti figures; "
                             f"efficiency {args.efficiency[0]:g} of peak)"))
    print()
    print(common.table(summary, "Harmony against the baselines: 4-GPU throughput ratio at each efficiency, "
                                "and swap volume ratio (SIMULATED)"))
    print(f"paper: {PAPER}")
    print(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
