"""Pipeline across devices (``parallel="pipeline"``, issue 31), part 1: a REAL run on this machine.

The built-in GPT trained (AdamW, fp32) by one rank, and by ``--ranks`` pipelined ranks (``torchrun
--nproc_per_node N``, gloo) with contiguous and round-robin placement (and contiguous, "layers" and round-robin
with each ``--groups`` value as ``pipeline_group``), each rank a logical CPU device with the same
``memory_budget`` and the same EMULATED speed factor (``--speed-factor``, default 4: the runtime sleeps each compute
op out to factor x its time alone on a core, runtime/executor.emulation_pause, so the ranks' compute does not fight
over this machine's two cores and the pipeline's overlap shows; Hardware.this_machine().logical(budgets,
speed_factors), as benchmarks/hetero.py does).
Measured: the median step time after ``--warmup`` steps (the slowest rank's; every rank ends a step together, at
the loss broadcast), throughput in samples/s and its ratio to one rank; per rank the training state it holds
(``sm.stats`` state_weight_bytes + state_optim_bytes), its peak RSS and its host memory apart from its logical
device (``HostSampler``), summed over the node against the state once plus 1 GiB per rank; whether the parameters
after the run are bitwise those of the one-rank run. Data parallel on the same ranks would hold the whole state on
every rank: its figure is the one-rank state times the ranks (not run).

    python benchmarks/pipeline.py                       # 4 ranks, 8 layers of width 256, speed factor 4
    python benchmarks/pipeline.py --ranks 2 --layers 4  # smaller

Part 2, SIMULATED (``--simulated`` runs it alone; by default it follows part 1): the Harmony paper's server (4 and
8 GTX 1080 Ti, 11 GB each, PCIe 3.0 behind one switch) and one of today (8 x A100 40 GB SXM4 on NVSwitch, two GPUs
per PCIe 4 switch), ``Hardware.node`` presets (compiler/hardware/nodes.py says where each figure comes from). GPT-2 1.5B
(48 x 1600) and a GPT of 6.7B (32 x 4096), both untied, sequences of 1024, built on the meta device (nothing is
allocated) and planned without ranks (driver/node.py), each device's budget its memory. A global batch
of ``--sim-batch`` samples in microbatches of ``--sim-microbatch``; three systems side by side:

- vPP: ``parallel="pipeline"``, contiguous placement (vPP; vPP-g1: ``placement="layers", pipeline_group=1``,
  one microbatch at a time through a rank's packs) and round-robin (vPP-rr, the paper's vPP), every rank's
  schedule simulated together (runtime/simulate/node.py: messages over P2P, swaps sharing the switch's uplink);
- vDP: data-parallel Harmony, each device one plan at its share of the batch, the N copies simulated together (so
  their swaps share the switch too), plus a ring all-reduce of the fp32 gradients over P2P not overlapped;
- ondemand: the same data-parallel replicas with ``policy="ondemand"`` (virtualized memory's fetch on touch).

Throughput is the global batch over the node's simulated step; per-device peak is the predicted device memory;
host memory of the node is the fp32 weights and optimizer state on the host (one copy under vPP, N under vDP).
The Harmony paper's reported figures stand beside ours where we found them (its abstract: "up to 7.6x" over
virtualized-memory baselines, "up to two orders of magnitude" less swap); a per-setting vPP or vDP speed-up from
its evaluation was not found in what we could search, and is marked so rather than guessed.

    python benchmarks/pipeline.py --simulated            # part 2 only, about 30 minutes on 2 cores (planning)
    python benchmarks/pipeline.py --quick --json out.json    # both parts at a small size, under 2 minutes
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import common


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--speed-factor", type=float, default=4.0)
    ap.add_argument("--budget", type=float, default=0.5, help="each device's budget, a share of the training state")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--placement", default="contiguous", help=argparse.SUPPRESS)
    ap.add_argument("--group", type=_group, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--groups", type=_group, nargs="*", default=[1],
                    help="pipeline_group values (a number or auto) run as extra rows, contiguous, layers and "
                         "round-robin placement (default: 1)")
    ap.add_argument("--simulated", action="store_true", help="part 2 only (the simulated servers)")
    ap.add_argument("--real", action="store_true", help="part 1 only (the real ranks on this machine)")
    ap.add_argument("--quick", action="store_true", help="both parts at a small size (under 2 minutes)")
    ap.add_argument("--servers", nargs="+", default=list(SERVERS), choices=list(SERVERS))
    ap.add_argument("--models", nargs="+", default=["gpt2-1.5b", "gpt-6.7b"], choices=list(SIM_MODELS))
    ap.add_argument("--sim-batch", type=int, default=64)
    ap.add_argument("--sim-microbatch", type=int, default=4)
    ap.add_argument("--sim-budget", type=float, default=None, help="GiB per device (default: its memory)")
    common.add_json_arg(ap)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.ranks, args.layers, args.width, args.steps, args.microbatches = 2, 4, 128, 2, 4
        args.servers, args.models, args.sim_batch, args.sim_budget = ["4x1080ti"], ["gpt-0.4b"], 16, 3.0
        args.sim_microbatch = 1
    figures = {} if args.simulated else real_part(args)
    if not args.real:
        figures.update(simulated_part(args))
    common.save_json(args.json, figures)


def _group(value: str):
    return value if value == "auto" else int(value)


def real_part(args) -> dict:
    """Part 1: real ranks on this machine; returns {run: throughput ratio to one rank}."""
    print("== part 1: REAL ranks on this machine ==", flush=True)
    out = Path(tempfile.mkdtemp(prefix="harmony-pipeline-"))
    runs = {"1 rank": _launch(args, out, 1, "none")}
    for placement in ("contiguous", "round_robin"):
        runs[f"{args.ranks} ranks {placement}"] = _launch(args, out, args.ranks, placement)
    for placement in ("contiguous", "layers", "round_robin"):
        for group in args.groups:
            runs[f"{args.ranks} ranks {placement} group {group}"] = _launch(args, out, args.ranks, placement, group)
    one = runs["1 rank"]
    rows = []
    for name, r in runs.items():
        rows.append(dict(run=name, packs=" ".join(str(p) for p in r["packs"]), group=r.get("group", ""),
                         step_s=r["step_s"],
                         samples_per_s=args.batch / r["step_s"], vs_one_rank=one["step_s"] / r["step_s"],
                         state_MiB=" ".join(f"{b / 2**20:.1f}" for b in r["state"]),
                         node_state_MiB=sum(r["state"]) / 2**20,
                         peak_rss_MiB=" ".join(f"{b / 2**20:.0f}" for b in r["rss"]),
                         host_MiB=" ".join(f"{b / 2**20:.0f}" for b in r["host"]),
                         node_host_MiB=sum(r["host"]) / 2**20,
                         within_budget=r["within"], bitwise_as_1_rank=r["digest"] == one["digest"]))
    print(common.table(rows, f"GPT {args.layers} layers x {args.width}, batch {args.batch} x {args.seq} tokens in "
                             f"{args.microbatches} microbatches, budget {args.budget:g} of the state per device, "
                             f"speed factor {args.speed_factor:g} (EMULATED)"))
    node = sum(one["state"]) + args.ranks * 2**30
    print(f"host_MiB: each rank's peak resident memory less its logical device's live bytes, sampled every 20 ms "
          f"(on a GPU node the device's bytes are not host memory); target for {args.ranks} ranks: the state once plus "
          f"1 GiB per rank = {node / 2**20:.0f} MiB; " + "; ".join(
              f"{r['run']}: {r['node_host_MiB']:.0f} MiB ({'within' if r['node_host_MiB'] * 2**20 <= node else 'OVER'})"
              for r in rows if not r["run"].startswith("1 ")))
    print(f"data parallel on {args.ranks} ranks would hold {args.ranks} x {sum(one['state']) / 2**20:.1f} MiB = "
          f"{args.ranks * sum(one['state']) / 2**20:.1f} MiB of training state on the node (not run)\n", flush=True)
    return {r["run"]: r["vs_one_rank"] for r in rows}


# -- part 2: simulated servers ------------------------------------------------------------------------
SERVERS = ("4x1080ti", "8x1080ti", "8xa100-40gb")
SIM_MODELS = {"gpt2-1.5b": dict(layers=48, width=1600, heads=25), "gpt-6.7b": dict(layers=32, width=4096, heads=32),
              "gpt-0.4b": dict(layers=12, width=1600, heads=25)}     # the last: --quick's
# (name, placement, pipeline_group): vPP-g1, stages balanced over the layers, hands each microbatch on once the
# rank's packs ran it
SYSTEMS = (("vPP", "contiguous", None), ("vPP-g1", "layers", 1), ("vPP-rr", "round_robin", None))
PAIRS = (("vPP", "vDP"), ("vPP-g1", "vDP"), ("vPP-rr", "vDP"), ("vPP-rr", "ondemand"),
         ("vDP", "ondemand"))
PAPER = {"vPP/vDP": "not found", "vPP-g1/vDP": "not found", "vPP-rr/vDP": "not found",
         "vPP-rr/ondemand": "up to 7.6x (abstract, any mode)",
         "vDP/ondemand": "up to 7.6x (abstract, any mode)"}
PAPER_CITE = ("Li et al., Harmony, VLDB 2022 (arXiv 2202.01306), abstract: throughput \"up to 7.6x over highly "
              "optimized baselines with virtualized memory\", swap \"reduced by up to two orders of magnitude\"; "
              "no per-model vPP or vDP figure was found by our search of the paper's text")


def _sim_model(name):
    from harmony.models import GPT, GPTConfig
    return GPT(GPTConfig(vocab=50257, seq=1024, tie=False, **SIM_MODELS[name]))


def _host_bytes(programs, copies=1) -> int:
    """fp32 weights and optimizer state on the host: each program's packs, ``copies`` times."""
    return copies * sum(s.master_bytes + s.optim_bytes for p in programs for s in p.plan.packs)


def _replica_programs(model, batch, hw, microbatches, budget) -> dict:
    """{policy: Program or BudgetError} for one data-parallel replica, harmony and ondemand (papers.py's way:
    ondemand reuses the harmony compile's trace and cost analysis)."""
    import dataclasses

    import harmony
    from harmony.compiler.ir import Program
    from harmony.compiler.passmanager import DEFAULT_PIPELINE, run_passes
    from harmony.errors import BudgetError
    out = {}
    try:
        sm = harmony.compile(model, batch, memory_budget=budget, microbatches=microbatches, device="meta",
                             hardware=hw, data_parallel=False)
    except BudgetError as e:
        return {"harmony": e, "ondemand": e}
    out["harmony"] = base = sm.program
    program = Program(model=model, gm=base.gm, example_batch=base.example_batch,
                      config=dataclasses.replace(base.config, policy="ondemand"))
    program.fake, program.optim_profile = base.fake, base.optim_profile
    try:
        out["ondemand"] = run_passes(program, DEFAULT_PIPELINE)
    except BudgetError as e:
        out["ondemand"] = e
    return out


def simulated_part(args) -> dict:
    """Part 2 (see the module's docstring); returns its ratios for --json."""
    import time

    import torch

    from harmony.compiler.hardware import Hardware
    from harmony.errors import BudgetError
    from harmony.driver.node import plan_node, simulate_programs
    GiB, rows, summary = 2**30, [], []
    print(f"== part 2: SIMULATED, not measured: {', '.join(args.servers)}; global batch {args.sim_batch} in "
          f"microbatches of {args.sim_microbatch} ==", flush=True)
    for server in args.servers:
        hw = Hardware.node(server)
        n, dev = len(hw.devices), hw.devices[0]
        budget = int(args.sim_budget * GiB) if args.sim_budget else dev.memory
        if args.sim_budget:     # the budget is the device: ondemand's replay fills the device's memory
            hw = hw.replace(devices=tuple(d.replace(memory=budget) for d in hw.devices))
        print(hw.describe().splitlines()[0] + f" (x{n}); " + hw.describe().splitlines()[n], flush=True)
        for name in args.models:
            t0, got = time.perf_counter(), {}
            with torch.device("meta"):
                model = _sim_model(name)
                params = sum(p.numel() for p in model.parameters())
                ids = torch.zeros(args.sim_batch, 1024, dtype=torch.long)
                for system, placement, group in SYSTEMS:
                    try:
                        programs = plan_node(model, (ids, ids), hw, memory_budget=budget, placement=placement,
                                             microbatches=args.sim_batch // args.sim_microbatch,
                                             pipeline_group=group)
                        got[system] = (simulate_programs(programs, hw), _host_bytes(programs), 0.0)
                    except BudgetError as e:
                        got[system] = e
                share = ids[:args.sim_batch // n]
                replicas = _replica_programs(model, (share, share), hw,
                                             max(1, args.sim_batch // n // args.sim_microbatch), budget)
            allreduce = 2 * (n - 1) / n * 4 * params / dev.p2p_bandwidth
            for system, policy in (("vDP", "harmony"), ("ondemand", "ondemand")):
                p = replicas[policy]
                got[system] = p if isinstance(p, BudgetError) else \
                    (simulate_programs([p], hw, replicas=n), _host_bytes([p], n), allreduce)
            for system, r in got.items():
                row = dict(server=server, model=name, params_B=params / 1e9, system=system)
                if isinstance(r, BudgetError):
                    rows.append(dict(row, note="does not fit: " + str(r).splitlines()[0][:80]))
                    continue
                node, host, comm = r
                step = node.step_seconds + comm
                util = sum(d.busy.get("compute", 0.0) for d in node.devices) / (n * step)
                rows.append(dict(row, step_s=step, allreduce_s=comm, samples_per_s=args.sim_batch / step,
                                 compute_util=util, swap_GiB=sum(node.moved.values()) / GiB,
                                 sent_GiB=sum(node.sent) / GiB, peak_GiB=node.peak_bytes / GiB,
                                 host_GiB=host / GiB))
            speed = {r["system"]: r["samples_per_s"] for r in rows[-len(got):] if "samples_per_s" in r}
            line = dict(server=server, model=name)
            for a, b in PAIRS:
                line[f"{a}/{b}"] = speed[a] / speed[b] if a in speed and b in speed else "n/a"
                line[f"paper {a}/{b}"] = PAPER[f"{a}/{b}"].split(" (")[0]
            summary.append(line)
            print(common.table(rows[-len(got):], f"{server}, {name} (planned and simulated in "
                                                 f"{time.perf_counter() - t0:.0f} s)"), flush=True)
    print()
    print(common.table(rows, "SIMULATED: throughput, per-device peak and node host memory of each system"))
    print()
    print(common.table(summary, "SIMULATED: throughput ratios, ours beside the Harmony paper's"))
    print(f"paper: {PAPER_CITE}")
    return {f"simulated {r['server']} {r['model']} {k}": v for r in summary for k, v in r.items()
            if "/" in k and not k.startswith("paper") and isinstance(v, float)}


def _launch(args, out: Path, ranks: int, placement: str, group: int | None = None) -> dict:
    result = out / f"{ranks}-{placement}-{group}.json"
    base = [__file__, "--worker", str(result), "--placement", placement] + (["--group", str(group)] if group else [])
    for k in ("layers", "width", "seq", "batch", "microbatches", "speed_factor", "budget", "steps", "warmup"):
        base += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    if ranks == 1:
        cmd = [sys.executable] + base
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
               str(29500 + os.getpid() % 1000)] + base
    print(f"running {ranks} rank(s) {placement}{f' group {group}' if group else ''} ...", flush=True)
    subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1", HARMONY_COMM_TIMEOUT="120"))
    return json.loads(result.read_text())


class HostSampler:
    """The most host memory the process held apart from its logical device, sampled every ``every`` seconds on a
    thread: resident memory (``base.process.rss_bytes``) less the device bytes its meter counts live at that
    moment. On a GPU node the device's bytes are not host memory; on this machine the logical device sits in the
    process's RAM. Bytes the allocator keeps after the device frees them count as host: an upper bound."""

    def __init__(self, meter, every: float = 0.02):
        import threading
        self.meter, self.every, self.peak = meter, every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        from harmony.base.process import rss_bytes
        self.peak = max(self.peak, rss_bytes() - self.meter.live)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def __enter__(self):
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()


def worker(args) -> None:
    import hashlib

    import torch
    import torch.distributed as dist

    import harmony
    from harmony.compiler.hardware import Hardware
    from harmony.models import GPT, GPTConfig, copy_task

    torch.set_num_threads(1)
    torch.manual_seed(0)
    c = GPTConfig(layers=args.layers, width=args.width, heads=max(1, args.width // 64), vocab=256, seq=args.seq,
                  tie=False)
    model = GPT(c)
    data = list(copy_task(c, args.batch, args.steps + args.warmup, seed=0))
    state = 16 * sum(p.numel() for p in model.parameters())
    budget = int(state * args.budget)
    hw = Hardware.this_machine().logical([budget], [args.speed_factor])
    kw = dict(parallel="pipeline", placement=args.placement, pipeline_group=args.group) \
        if args.placement != "none" else {}
    sm = harmony.compile(model, data[0], memory_budget=budget, microbatches=args.microbatches, hardware=hw, **kw)
    times, within = [], True
    with HostSampler(sm.runtime.meter) as host:
        for i, batch in enumerate(data):
            sm(*batch)
            within = within and sm.stats["measured_peak"] <= sm.stats["budget"]
            if i >= args.warmup:
                times.append(sm.stats["step_seconds"])
    mine = sm.training_state_dict()["model"]
    held = sm.stats.get("state_weight_bytes", 0) + sm.stats.get("state_optim_bytes", 0)
    if not kw:       # one rank: every weight and all optimizer state
        held = sum(t.nbytes for t in mine.values()) + sum(v.nbytes for o in sm.optimizers for s in o.state.values()
                                                          for v in s.values() if isinstance(v, torch.Tensor))
    # each parameter's digest, not the tensors: gathering every rank's weights on each would hold the model N times
    mine = {n: hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for n, t in mine.items()}
    me = dict(step_s=statistics.median(times), state=held, rss=sm.stats["peak_rss_bytes"], host=host.peak,
              within=within,
              packs=len(sm.plan.packs), params=mine,
              group=next((r.totals["group"] for r in sm.program.reports if r.title.startswith("stage")), ""))
    every = [me]
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, me)
    sm.close()
    if not dist.is_initialized() or dist.get_rank() == 0:
        params = {n: d for r in every for n, d in r["params"].items()}
        h = hashlib.sha256()
        for n in sorted(params):
            h.update(f"{n}:{params[n]};".encode())
        Path(args.worker).write_text(json.dumps(dict(
            step_s=max(r["step_s"] for r in every), state=[r["state"] for r in every], rss=[r["rss"] for r in every],
            host=[r["host"] for r in every],
            within=all(r["within"] for r in every), packs=[r["packs"] for r in every], digest=h.hexdigest(),
            group=every[0]["group"])))


if __name__ == "__main__":
    main()
