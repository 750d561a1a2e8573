"""A pipeline inside each server, data parallelism across servers (parallel=("pipeline", "data"), issue 64).

SIMULATED, not measured: servers of 8 x A100 SXM4 40 GB (``Hardware.node("8xa100-40gb")``: NVLink between a server's
GPUs, PCIe 4 to the host; the host as the DGX A100's, 1 TiB at 409.6 GB/s), 2 and 4 of them joined by 10 or 100 Gbit/s
Ethernet (one link per server), GPT models of 13B and 30B parameters (sequence 1024, vocabulary 50257, untied), a
global batch of 64 sequences in microbatches of one sequence, AdamW. Three ways to use the servers, each planned by
Harmony and simulated:

- **hybrid**: one pipeline of 8 per server (``plan_node(..., replicas=S)``: the stage pass's placement, each rank's
  schedule with its packs' all-reduces over the S servers right after their last backward), the 8 pipeline ranks
  simulated together (runtime/simulate/node.py); the 8 stages pool the server's link (``Hardware.server_link``, as
  ``Grid.simulate`` does): an all-reduce alone there has the whole link, all-reduces that meet take turns. fp32 and
  4-bit gradients.
- **data parallel**: every GPU runs the whole model's plan under its 40 GB on its share of the batch (8 copies per
  server simulated together, sharing the PCIe switches), and the gradient all-reduce costs a hierarchical
  all-reduce's inter-server traffic, ``2 (S - 1) / S`` of the gradient bytes through each server's link, taken as
  fully overlapped with compute (step = max of the two): the most favourable case for data parallelism. fp32 and
  4-bit (CGX's bytes: 4 bits a value plus a bucket's two fp32 per 512 values).
- **pipeline alone**: one server's pipeline of 8 on the whole batch; the other servers idle.

A step is the longest of the simulated step, the all-reduce (data parallelism) and a bound the simulator does not
apply itself: the server's host memory bandwidth carrying every rank's host optimizer steps (``host_step_bound_s``;
data parallelism's 8 copies make it bind). Host memory is each server's fp32 weights and optimizer state (data
parallelism: 8 copies), against the server description's ``host_memory`` (``fits_host``). Throughput is the global
batch over the step; the ratios are hybrid's (4-bit) over the better of the others (the same codec for data
parallelism), and over the better of those that fit the host. Results: benchmarks/results/hybrid-simulated.json.

    python benchmarks/hybrid.py                 # both models (about half an hour of planning on 2 cores)
    python benchmarks/hybrid.py --quick         # a 1.3B GPT only, a few minutes
    python benchmarks/hybrid.py --emulated      # as root: two namespaces, links as an A100 server's (hybrid_emulated)
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import common

GPUS = 8
SERVERS = (2, 4)
LINKS = {"10Gb/s": 10e9 / 8, "100Gb/s": 100e9 / 8}       # bytes/s, one link per server
MODELS = {"gpt-13b": dict(layers=40, width=5120, heads=40), "gpt-30b": dict(layers=48, width=7168, heads=56),
          "gpt-1.3b": dict(layers=24, width=2048, heads=16)}      # the last: --quick's
LATENCY = 50e-6
# The server's host as NVIDIA's DGX A100 datasheet gives it: 1 TB of system memory, two AMD EPYC 7742 (8 channels of
# DDR4-3200 each: 2 x 204.8 GB/s peak); the node preset's host figures are nominal placeholders.
DGX_HOST_MEMORY = 1024 * 2**30
DGX_HOST_BANDWIDTH = 2 * 204.8e9
GiB = 2**30
RESULTS = Path(__file__).resolve().parent / "results" / "hybrid-simulated.json"


def per_value(codec) -> float:
    """Wire bytes per fp32 gradient byte: 1 (fp32), or 4 bits and a bucket's two fp32 per 512 values."""
    return 1.0 if codec is None else 4 / 32 + 2 * 4 / 512 / 4


def dp_allreduce(params: int, servers: int, link: float, codec) -> float:
    """Seconds of a hierarchical all-reduce's inter-server part: ``2 (S - 1) / S`` of the gradient bytes through
    each server's link (the servers' GPUs reduce inside first, over NVLink, not counted)."""
    return 2 * (servers - 1) / servers * 4 * params * per_value(codec) / link + 2 * (servers - 1) * LATENCY


def host_bytes(programs, copies=1) -> int:
    return copies * sum(s.master_bytes + s.optim_bytes for p in programs for s in p.plan.packs)


def host_seconds(programs, hw, copies=1) -> float:
    """A bound the simulator does not apply itself: the server's host memory carries every rank's host optimizer
    steps (``step_traffic`` of each host-stepped pack), ``copies`` times, at its ``host_memory_bandwidth``."""
    from harmony.base.tiers import Tier
    from harmony.runtime.plan import step_traffic
    traffic = sum(step_traffic(s.master_bytes, s.optim_bytes) for p in programs for s in p.plan.packs
                  if p.plan.at(s.index).step_on == Tier.HOST)
    return copies * traffic / hw.host_memory_bandwidth


def plan_model(name: str, args) -> dict:
    """Every plan of one model: the pipeline alone, the grid's per server count and codec, the data-parallel
    replica per server count (each planned once, simulated per link)."""
    import torch

    import harmony
    from harmony.compiler.hardware import Hardware
    from harmony.driver.node import plan_node
    from harmony.models import GPT, GPTConfig
    hw = Hardware.node("8xa100-40gb").replace(host_memory=DGX_HOST_MEMORY, host_memory_bandwidth=DGX_HOST_BANDWIDTH)
    opt = dict(optimizer=torch.optim.AdamW, optimizer_kwargs=dict(lr=1e-4), precision=args.precision)
    plans, t0 = {}, time.perf_counter()
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=50257, seq=1024, tie=False, **MODELS[name]))
        params = sum(p.numel() for p in model.parameters())

        def ids(rows):
            return torch.zeros(rows, 1024, dtype=torch.long)
        b = args.batch
        plans["pipeline"] = plan_node(model, (ids(b), ids(b)), hw, microbatches=b, **opt)
        print(f"  {name}: pipeline planned ({time.perf_counter() - t0:.0f} s)", flush=True)
        for s in args.servers:
            for codec in (None, "4bit"):
                rows = b // s
                plans[("hybrid", s, codec)] = plan_node(model, (ids(rows), ids(rows)), hw, microbatches=rows,
                                                        replicas=s, compression=codec, **opt)
                print(f"  {name}: hybrid x{s} {codec or 'fp32'} planned ({time.perf_counter() - t0:.0f} s)",
                      flush=True)
            rows = b // (s * GPUS)
            sm = harmony.compile(model, (ids(rows), ids(rows)), memory_budget=hw.devices[0].memory, microbatches=rows,
                                 device="meta", hardware=hw, data_parallel=False, **opt)
            plans[("data", s)] = sm.program
            print(f"  {name}: data parallel x{s} planned ({time.perf_counter() - t0:.0f} s)", flush=True)
    return dict(plans=plans, params=params, hw=hw, seconds=time.perf_counter() - t0)


def rows_of(name: str, got: dict, args) -> tuple[list[dict], list[dict]]:
    """The table's rows (system by system) and the ratios, per server count and link."""
    from harmony.driver.node import simulate_programs
    plans, params, hw = got["plans"], got["params"], got["hw"]
    pipe = simulate_programs(plans["pipeline"], hw)
    rows, ratios = [], []
    for s in args.servers:
        dp_node = simulate_programs([plans[("data", s)]], hw, replicas=GPUS)
        for link_name, link in LINKS.items():
            speed = {}
            head = dict(model=name, params_B=params / 1e9, servers=s, link=link_name)

            def row(system, node, comm, programs, copies=1):
                host, host_s = host_bytes(programs, copies), host_seconds(programs, hw, copies)
                step = max(node.step_seconds, comm, host_s)
                speed[system] = args.batch / step
                if host > hw.host_memory:
                    unfit.add(system)
                util = sum(d.busy.get("compute", 0.0) for d in node.devices) / (len(node.devices) * step)
                rows.append(dict(head, system=system, step_s=step, simulated_s=node.step_seconds, allreduce_s=comm,
                                 host_step_bound_s=host_s, samples_per_s=speed[system], compute_util=util,
                                 peak_GiB=node.peak_bytes / GiB, host_GiB_per_server=host / GiB,
                                 fits_host="yes" if host <= hw.host_memory else "no"))
            unfit: set = set()
            row("pipeline alone", pipe, 0.0, plans["pipeline"])
            for codec in (None, "4bit"):
                progs = plans[("hybrid", s, codec)]
                # the server's 8 stages pool its one link (Grid.simulate's sharing: Hardware.server_link)
                node = simulate_programs(progs, hw.replace(network_latency=LATENCY).server_link(link, GPUS))
                comm = max(sum(e.end - e.start for e in d.events if e.name.startswith("ar")) for d in node.devices)
                row(f"hybrid {codec or 'fp32'}", node, 0.0, progs)        # its all-reduces are in the simulation
                row(f"data parallel {codec or 'fp32'}", dp_node, dp_allreduce(params, s, link, codec),
                    [plans[("data", s)]], GPUS)
                rows[-2]["allreduce_s"] = comm
            best = max(speed["data parallel 4bit"], speed["pipeline alone"])
            fit = [v for k, v in speed.items() if k in ("data parallel 4bit", "pipeline alone") and k not in unfit]
            ratios.append(dict(head, **{"hybrid 4bit / best other": speed["hybrid 4bit"] / best,
                                        "hybrid 4bit / best other fitting the host":
                                            speed["hybrid 4bit"] / max(fit) if fit else "none fits",
                                        "hybrid 4bit / data parallel 4bit": speed["hybrid 4bit"]
                                        / speed["data parallel 4bit"],
                                        "hybrid 4bit / pipeline alone": speed["hybrid 4bit"] / speed["pipeline alone"],
                                        "hybrid fp32 / data parallel fp32": speed["hybrid fp32"]
                                        / speed["data parallel fp32"]}))
    return rows, ratios


def emulated(args) -> dict:
    """The EMULATED part (benchmarks/hybrid_emulated.py): measured throughput of each system, its predicted step
    beside its measured one, ratios; ``{link setting: figures}``."""
    import hybrid_emulated
    if args.worker:
        hybrid_emulated.worker(args)
        return {}
    if args.emulated_inner:
        return hybrid_emulated.inner(args)
    return {link: _setting_figures(args, got) for link, got in hybrid_emulated.outer(args).items()}


def _links_table(setting: dict) -> str:
    """What each link is against compute: in the emulation and in the named server (bytes per FLOP, and the
    seconds a byte takes over the seconds a FLOP takes, the same thing)."""
    rows = [dict(link=k, emulated_bytes_per_s=setting[k] if k == "network" else setting["host_link"] or "memcpy",
                 emulated_bytes_per_FLOP=setting["bytes_per_flop"][k],
                 named_server_bytes_per_FLOP=setting["named_bytes_per_flop"][k],
                 emulated_over_named=setting["bytes_per_flop"][k] / setting["named_bytes_per_flop"][k])
            for k in ("host_link", "network")]
    return common.table(rows, f"EMULATED links, --link {setting['link']}: compute {setting['compute_flops'] / 1e9:.3g} "
                              f"GFLOP/s a rank (the profile's sustained FLOP/s over the speed factor); named server: "
                              f"{setting['named']}")


def _setting_figures(args, got: dict) -> dict:
    """One link setting's tables and figures."""
    systems, setting = got["systems"], got["setting"]
    speed = {k: v["samples_per_s"] for k, v in systems.items() if v}
    rows = [dict(system=k, **{f: x for f, x in v.items() if isinstance(x, (int, float, str)) and f not in (
        "SIMULATED_sharing", "server_cores")}, load_1min=v["load"]["before"][0]) for k, v in systems.items() if v]
    cores = next((v["server_cores"] for v in systems.values() if v), "")
    print(_links_table(setting))
    print(common.table(rows, f"EMULATED: two servers of 2 ranks on this machine, {setting['tc_rate']} between them, "
                             f"host link {setting['host_link'] / 1e6:.4g} MB/s" if setting["host_link"] else
                             f"EMULATED: two servers of 2 ranks on this machine, {setting['tc_rate']} between them, "
                             f"host link a memcpy" + f", speed factor {args.speed_factor:g}, budget "
                             f"{args.budget_per_param:g} B/parameter, servers' cores {cores or 'all'}"))
    print(common.table([dict(system=k, **v["rank0"]) for k, v in systems.items() if v], "EMULATED: rank 0's step "
                       "(medians): its process's CPU seconds, its compute ops' wall seconds and the CPU seconds they "
                       "were slept out from, the host thread's optimizer steps and all-reduces, state swapped, its "
                       "copies' seconds on the emulated host link"))
    for k, v in systems.items():
        if v and v.get("SIMULATED_sharing"):
            print(f"{k}, SIMULATED server: {v['SIMULATED_sharing']}")
    figures = {f"emulated {k} samples/s": v for k, v in speed.items()}
    others = [speed[k] for k in ("data parallel 4bit", "pipeline alone (2 ranks)") if k in speed]
    if "grid 4bit" in speed and others:
        figures["emulated grid 4bit / best other"] = speed["grid 4bit"] / max(others)
    for k, v in systems.items():
        if v and v.get("SIMULATED_step_s"):
            figures[f"emulated {k} predicted/measured"] = v["SIMULATED_step_s"] / v["step_s"]
    figures["setting"] = dict(link=setting["link"], rate=setting["tc_rate"], network_bytes_per_s=setting["network"],
                              host_link_bytes_per_s=setting["host_link"] or "memcpy (not emulated)",
                              compute_flops_per_rank=setting["compute_flops"],
                              bytes_per_flop=setting["bytes_per_flop"],
                              named_server_bytes_per_flop=setting["named_bytes_per_flop"],
                              named_server=setting["named"],
                              speed_factor=args.speed_factor, budget_per_param=args.budget_per_param,
                              width=args.width, layers=args.layers, server_cores=cores or "all (not pinned)",
                              nice=args.nice, core_share=got["core_share"])
    figures["load before/after each run (1, 5, 15 min)"] = {k: v["load"] for k, v in systems.items() if v}
    numbers = {k: v for k, v in figures.items() if isinstance(v, float)}
    print(common.table([numbers], f"EMULATED, --link {setting['link']}: ratios, measured; predicted/measured: the "
                                  "SIMULATED step over the measured one (target: grid 4bit >= 1.5x the better other; "
                                  "the simulator within 15%)"))
    return figures


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--emulated", action="store_true", help="the EMULATED part only (as root: network namespaces)")
    ap.add_argument("--rate", default="1gbit", help="--link none's link between the two servers (default 1gbit)")
    ap.add_argument("--link", default="a100", choices=("a100", "none", "both"), help="the emulated links: a100 (each "
                    "link against the emulated compute as the 8 x A100 40 GB server's PCIe 4 and 10 Gbit/s are "
                    "against an A100's), none (the host link a memcpy, --rate between servers), both (default a100)")
    ap.add_argument("--out", default="hybrid-emulated", help="the emulated part's files (default hybrid-emulated)")
    ap.add_argument("--steps", type=int, default=6, help="emulated steps timed after 2 warm-up (default 6)")
    ap.add_argument("--width", type=int, default=512, help="the emulated GPT's width (default 512)")
    ap.add_argument("--layers", type=int, default=4, help="the emulated GPT's blocks (default 4)")
    ap.add_argument("--speed-factor", type=float, default=4.0, help="emulated devices: compute slept out to this "
                                                                     "many times its CPU time (default 4)")
    ap.add_argument("--budget-per-param", type=float, default=14.0, help="each rank's memory budget in bytes per "
                    "parameter (default 14: one stage's AdamW state fits, the whole model's 16 does not)")
    ap.add_argument("--profile-seconds", type=float, default=6.0, help="seconds the machine is profiled for, once "
                                                                       "before the runs (default 6)")
    ap.add_argument("--nice", type=int, default=0, help="the ranks' priority (as root, negative: ahead of the "
                                                        "machine's other jobs; default 0)")
    ap.add_argument("--no-pin", action="store_true", help="every rank on every core (default: each emulated server's "
                                                          "ranks on half of the cores)")
    ap.add_argument("--systems", default=None, help="the emulated systems to run, comma-separated (default: all: grid "
                                                    "fp32, grid 4bit, data parallel 4bit, pipeline alone (2 ranks))")
    ap.add_argument("--emulated-inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--compression", default="none", help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--host-cores", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--cores", default="", help=argparse.SUPPRESS)
    ap.add_argument("--rate-bytes", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--host-link", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="the 1.3B GPT only (a few minutes)")
    ap.add_argument("--models", nargs="+", default=None, choices=sorted(MODELS), help="default: gpt-13b gpt-30b")
    ap.add_argument("--servers", nargs="+", type=int, default=list(SERVERS), help="server counts (default 2 4)")
    ap.add_argument("--batch", type=int, default=64, help="global batch in sequences of 1024 (default 64)")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="compute precision (default fp32)")
    ap.add_argument("--json", default=str(RESULTS), help=f"where the figures go (default {RESULTS})")
    args = ap.parse_args(argv)
    if args.emulated or args.emulated_inner or args.worker:
        if not args.rate_bytes:
            import re
            m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", args.rate.lower())
            args.rate_bytes = float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m[2]] / 8 if m else 125e6
        figures = emulated(args)
        if args.emulated:
            for link, got in figures.items():
                name = "hybrid-emulated" + ("" if link == "a100" else "-memcpy") + \
                    ("" if args.speed_factor == 4 else f"-speed{args.speed_factor:g}") + ".json"
                # --json given (python -m benchmarks, one setting): there; else beside the simulated results
                mine = args.json != str(RESULTS) and len(figures) == 1
                common.save_json(args.json if mine else str(RESULTS.with_name(name)), got)
            return next(iter(figures.values())) if len(figures) == 1 else figures
        return figures
    models = args.models or (["gpt-1.3b"] if args.quick else ["gpt-13b", "gpt-30b"])
    print(f"SIMULATED, not measured: servers of {GPUS} x A100 SXM4 40 GB, {', '.join(map(str, args.servers))} of "
          f"them on {' or '.join(LINKS)}; global batch {args.batch} x 1024 tokens in microbatches of 1, "
          f"{args.precision}", flush=True)
    all_rows, all_ratios, figures = [], [], {}
    for name in models:
        got = plan_model(name, args)
        rows, ratios = rows_of(name, got, args)
        all_rows += rows
        all_ratios += ratios
        print(common.table(rows, f"SIMULATED {name} (planned in {got['seconds']:.0f} s)"), flush=True)
        for r in ratios:
            for k, v in r.items():
                if "/" in k:
                    figures[f"simulated {args.precision} {r['model']} {r['servers']} servers {r['link']} {k}"] = v
        figures.update({f"simulated {args.precision} {r['model']} {r['servers']} servers {r['link']} {r['system']} "
                        f"samples/s":
                        r["samples_per_s"] for r in rows})
        common.save_json(args.json, figures)      # after each model: a long run keeps what it has
    print()
    print(common.table(all_ratios, "SIMULATED: throughput ratios (hybrid 4-bit over the better of data parallel "
                                   "4-bit and one server's pipeline)"))
    return figures


if __name__ == "__main__":
    main()
