"""benchmarks/hybrid.py's EMULATED part: two "servers" of 2 ranks each on this machine, in network namespaces
joined by a tc-limited link (benchmarks/netns2.sh), measured side by side:

- the 2 x 2 grid (``parallel=("pipeline", "data")``), fp32 and 4-bit gradients across the link;
- 4-rank data parallelism over both namespaces (4-bit gradients: its best);
- a 2-rank pipeline in one namespace (the other server idle).

The scenario is issue 64's: a model that needs a server's worth of devices, on two servers of their own.

- **Memory**: every rank is a logical device with a budget of ``--budget-per-param`` (default 14) bytes per parameter.
  AdamW's training state is 16 bytes per parameter (weights, gradients, two moments), so one pipeline stage (half of
  it, 8) fits with room for its activations and its 4-bit all-reduce's buffers, and the whole model does not: each
  data-parallel rank plans the whole model under that budget and swaps (host steps, copies). With the budget of 32
  bytes per parameter this benchmark had before, data parallelism held everything on every rank, which is not the
  case the grid is for. The pipelines place their stages by layers (``placement="layers"``): the default contiguous
  placement of the partition's packs put the embedding alone on one rank and the four blocks on the other, whose
  stage then held the whole model's compute and did not fit its budget.
- **Compute**: each emulated server's ranks run on cores of their own (``os.sched_setaffinity`` of its ``torchrun``,
  inherited by its ranks and their threads: server A the first half of this process's cores, server B the other
  half), so the second server brings compute of its own, as a real one would; the pipeline alone runs on server A's
  cores. Before, all four ranks shared every core, and the grid could not gain compute over the 2-rank pipeline.
  ``--no-pin``: as before. Rank 0's ``sm.simulate()`` gets its server's core count as ``host_cores``.
- **Speed**: each rank's compute ops (forwards, backwards, device optimizer steps) are slept out to
  ``--speed-factor`` (default 4) times their CPU time (EMULATED slower devices, runtime/executor.emulation_pause), as a
  GPU's compute is most of a step; what the ranks do on the host stays this machine's CPU work at its own speed: host
  optimizer steps, the copies of swapped state, the 4-bit codec, gloo's sends, receives and reductions and the fused
  buffers' copies. Rank 0 reports its process's CPU seconds per step beside its compute ops' (``cpu_s``,
  ``compute_cpu_s``), so the share that is not scaled is a figure of each run.

- **Links** (``--link``): ``a100`` (default) gives each link the named server's bytes per FLOP (``link_setting``: a
  server of 8 x A100 40 GB, PCIe 4 x16 to the host, 10 Gbit/s between servers), scaled to a rank's emulated compute:
  the host link through ``Hardware.logical(..., link_bandwidth=)``, whose copies the runtime paces (before, a
  logical device's copies were memcpys, hundreds of times cheaper against compute than PCIe is against an A100, and
  data parallelism's swaps nearly free), the network as the tc rate. ``none``: a memcpy and ``--rate``, as before.
  ``both``: one after the other, on one profile.

Every run is launched as users launch: one ``torchrun`` per namespace (``--nnodes 2 --rdzv-backend c10d``), the
pipeline alone with one; ``--nice -10`` (as root) runs them ahead of the machine's other jobs, whose load otherwise
slows the work the speed factor does not scale. Each trains the same GPT on the same global batch; throughput is the
global batch over the median measured step. The ranks compile and simulate with this machine as profiled once before
the runs (``measure_hardware``: one core of server A, at one thread; before, the ranks read
``Hardware.this_machine()``, nominal figures where no profile was cached). Beside the grid's measurement, rank 0's
``sm.simulate()`` of its server (the profile as logical devices, the link's rate as ``network_bandwidth``, pooled by
the server's ranks, ``network_shared``: a stage's all-reduce that runs while the other stage computes has the whole
link, as it does here; the server's cores as ``host_cores``) gives the SIMULATED step. The host's cores are not
scaled by the share of a core the profile got: the machine's other jobs take a share of each runnable thread, not of
this benchmark as a whole, and an emulated rank's compute is slept out from its CPU time whatever they take; what
they do slow is the work the speed factor does not scale (codec, gloo, host steps), so on a loaded machine the
prediction runs short of the measurement there. Every system's figures carry the budget, the cores each server ran
on, the speed factor and the machine's load average before and after the run (``load``); rank 0's measured and
simulated op timelines of the last step are written beside them (``--out``, Chrome trace JSON).

    python benchmarks/hybrid.py --emulated          # as root: makes and removes the namespaces
    python benchmarks/hybrid.py --emulated --link both --nice -10 --steps 4 --width 256     # both settings
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SYSTEMS = {"grid fp32": ("grid", "none", 2), "grid 4bit": ("grid", "4bit", 2),
           "data parallel 4bit": ("data", "4bit", 2), "pipeline alone (2 ranks)": ("pipeline", "none", 1)}


def outer(args) -> dict:
    """Profile this machine once, then run this script's inner part under benchmarks/netns2.sh (as root) for each
    link setting (``--link``); return ``{setting: figures}``."""
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    measured = measure_hardware(args, root)
    got = {}
    for link in (("none", "a100") if args.link == "both" else (args.link,)):
        got[link] = _run_setting(args, root / link if args.link == "both" else root, measured, link)
    return got


def _run_setting(args, out: Path, measured: dict, link: str) -> dict:
    """One link setting's runs in a pair of namespaces joined by its network rate; its figures, with the setting."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "hardware.json").write_text(json.dumps(measured))
    setting = link_setting(measured["hardware"], args.speed_factor, link, args.rate_bytes)
    cmd = ["bash", str(HERE / "netns2.sh"), setting["tc_rate"], sys.executable, str(HERE / "hybrid.py"),
           "--emulated-inner", "--rate", setting["tc_rate"], "--rate-bytes", str(setting["network"]),
           "--host-link", str(setting["host_link"]),
           "--out", str(out), "--steps", str(args.steps), "--width", str(args.width),
           "--layers", str(args.layers), "--speed-factor", str(args.speed_factor),
           "--budget-per-param", str(args.budget_per_param),
           "--profile-seconds", str(args.profile_seconds)]
    cmd += ["--systems", args.systems] if args.systems else []
    cmd += ["--no-pin"] if args.no_pin else []
    cmd += ["--nice", str(args.nice)] if args.nice else []
    subprocess.run(cmd, check=True, timeout=3000)
    return dict(systems=json.loads((out / "emulated.json").read_text()), setting=setting,
                core_share=measured["core_share"])


# The named server the emulated links stand for (issue 64's): a server of 8 x A100 SXM4 40 GB (Hardware.node: its
# GPUs' fp32 FLOP/s, each GPU's PCIe 4 x16 host link at a pinned copy's 80% of the PCI-SIG rate), 10 Gbit/s Ethernet
# between servers (benchmarks/hybrid.py's slower link).
NAMED_SERVER, NAMED_NETWORK = "8xa100-40gb", 10e9 / 8


def link_setting(hardware: dict, speed_factor: float, link: str, memcpy_network: float) -> dict:
    """The emulated links of a setting, from the profile (``hardware``: ``Hardware`` as a dict) and the speed factor:

    - ``"a100"``: each link as fast against the emulated device's compute as the named server's is against an A100's:
      bytes/s per sustained FLOP/s (a layer pack's, ``Device.effective_flops``; the A100's datasheet peak, as the
      simulated part costs it) times the emulated device's, which is the profile's over ``speed_factor``;
    - ``"none"``: the host link a memcpy (not emulated) and the network ``memcpy_network`` (``--rate``).

    Returns the host link's and network's bytes/s (``host_link`` 0: not emulated), the tc rate of the network, and
    each link's bytes per FLOP in the emulation and in the named server."""
    from harmony.compiler.hardware import Hardware
    dev = Hardware.from_dict(hardware).devices[0]
    compute = dev.effective_flops / speed_factor
    named = Hardware.node(NAMED_SERVER).devices[0]
    ratio = dict(host_link=named.h2d_bandwidth / named.effective_flops, network=NAMED_NETWORK / named.effective_flops)
    if link == "a100":
        host, network = ratio["host_link"] * compute, ratio["network"] * compute
    elif link == "none":
        host, network = 0.0, memcpy_network
    else:
        raise SystemExit(f"--link: {link!r}; choose a100, none or both")
    kbit = max(1, round(network * 8 / 1e3))
    return dict(link=link, host_link=host, network=kbit * 1e3 / 8, tc_rate=f"{kbit}kbit", compute_flops=compute,
                bytes_per_flop=dict(host_link=(host or dev.h2d_bandwidth) / compute, network=kbit * 1e3 / 8 / compute),
                named_bytes_per_flop=ratio, named=f"{NAMED_SERVER} ({named.name}, {named.link} host link at "
                                                 f"{named.h2d_bandwidth / 1e9:.3g} GB/s), 10 Gbit/s between servers")


def server_cores(pin: bool = True) -> list[list[int]]:
    """The cores of each emulated server: this process's, server A the first half and server B the rest (one
    server, and every core each, where there is one core or ``pin`` is off)."""
    cores = sorted(os.sched_getaffinity(0))
    if not pin or len(cores) < 2:
        return [cores, cores]
    half = len(cores) // 2
    return [cores[:half], cores[half:]]


def _pinned(cores: list[int], nice: int = 0):
    """What ``Popen`` runs in the child before ``ip netns exec``: the server's cores and the priority (``--nice``),
    inherited by torchrun, its ranks and their threads."""
    def pin():
        os.sched_setaffinity(0, cores)
        if nice:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
    return pin


def _launch(system: str, args, port: int) -> list[subprocess.Popen]:
    kind, codec, nodes = SYSTEMS[system]
    cores = server_cores(not args.no_pin)
    env = dict(os.environ, OMP_NUM_THREADS="1", HARMONY_COMM_TIMEOUT="300")
    result = str(Path(args.out) / f"{system.replace(' ', '_')}.json")
    worker = [str(HERE / "hybrid.py"), "--worker", kind, "--compression", codec, "--result", result,
              "--steps", str(args.steps), "--width", str(args.width), "--layers", str(args.layers),
              "--rate-bytes", str(args.rate_bytes), "--speed-factor", str(args.speed_factor),
              "--host-link", str(args.host_link),
              "--budget-per-param", str(args.budget_per_param), "--host-cores", str(len(cores[0])),
              "--cores", ";".join(",".join(map(str, c)) for c in cores[:nodes])]
    procs = []
    for i in range(nodes):
        ns, addr, dev = (os.environ[f"{k}_{'AB'[i]}"] for k in ("NS", "ADDR", "IF"))
        run = ["--nnodes", str(nodes), "--nproc_per_node", "2"]
        # the store lives in namespace A: c10d cannot tell that 10.77.0.1 is A's own address, so it is told
        run += (["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{os.environ['ADDR_A']}:{port}", "--rdzv-id",
                 f"{kind}{port}", "--rdzv-conf", f"is_host={int(i == 0)},join_timeout=120", "--local-addr", addr]
                if nodes > 1 else
                ["--master_addr", "127.0.0.1", "--master_port", str(port)])
        iface = f"GLOO_SOCKET_IFNAME={dev if nodes > 1 else 'lo'}"
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns, "env", iface, sys.executable, "-m",
                                       "torch.distributed.run", *run, *worker],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      preexec_fn=_pinned(cores[i], args.nice)))
        time.sleep(1)
    return procs


def chosen(args) -> list[str]:
    """The systems ``--systems`` names (comma-separated), all of them by default."""
    names = [n.strip() for n in args.systems.split(",")] if args.systems else list(SYSTEMS)
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise SystemExit(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    return names


def measure_hardware(args, out: Path) -> dict:
    """This machine as the ranks see it, measured once before the runs and written to ``--out``/hardware.json,
    which every rank compiles and simulates with: ``Hardware.profile`` at one intra-op thread (as the ranks run) on
    server A's cores, with a transformer block of the GPT's width and a microbatch's tokens, at a raised priority
    (benchmarks/hetero.py's ``ahead_of_other_jobs``, as root) so that the machine's other jobs slow it less. The
    share of a core it got (``core_share``, its CPU time over wall time while it multiplied) is reported, not
    scaled by: the profile takes the median of short runs, which mostly got the core, and scaled up by the share it
    overshot a core's speed by 1.5-2x at load 10-17."""
    from hetero import ahead_of_other_jobs, core_share

    from harmony.compiler.hardware import Hardware
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, server_cores(not args.no_pin)[0])
    try:
        with ahead_of_other_jobs():
            tokens = 2 * 64                                  # a microbatch of 2 rows of 64 tokens, every system's
            share = core_share(tokens, args.width)
            hw = Hardware.profile(seconds=args.profile_seconds, threads=1, block=(args.width, tokens, 64),
                                  save=False)
            share = min(1.0, (share + core_share(tokens, args.width)) / 2)
    finally:
        os.sched_setaffinity(0, mine)
    got = dict(hardware=dataclasses.asdict(hw), core_share=share)
    (out / "hardware.json").write_text(json.dumps(got))
    return got


def inner(args) -> dict:
    """In the namespaces (netns2.sh's environment): each system's run, one after the other."""
    figures, port = {}, 29611
    measured = json.loads((Path(args.out) / "hardware.json").read_text())     # outer's profile
    device = measured["hardware"]["devices"][0]
    print(f"profile: {device['peak_flops']['fp32'] / 1e9:.3g} GFLOP/s fp32 peak, {device['efficiency']:.0%} of it "
          f"in a block, core share {measured['core_share']:.0%}", flush=True)
    for system in chosen(args):
        port += 1
        before = os.getloadavg()
        procs = _launch(system, args, port)
        logs = [p.communicate(timeout=1500)[0] for p in procs]
        load = dict(before=[round(x, 2) for x in before], after=[round(x, 2) for x in os.getloadavg()])
        if any(p.returncode for p in procs):
            print(f"{system}: failed\n" + "\n".join(log[-2000:] for log in logs), flush=True)
            figures[system] = None
            continue
        figures[system] = json.loads((Path(args.out) / f"{system.replace(' ', '_')}.json").read_text())
        figures[system].update(load=load, core_share=measured["core_share"])
        print(f"{system}: {figures[system]}", flush=True)
    (Path(args.out) / "emulated.json").write_text(json.dumps(figures, indent=1))
    return figures


def _compile(args, model, first, budget: int):
    """The system's plan on this rank, and how it cuts each global batch."""
    import harmony
    import harmony.data
    import torch
    codec = None if args.compression == "none" else args.compression
    # every rank a logical device under the budget, its compute slept out to speed_factor x its CPU time
    hw = measured_hardware(args).logical([budget], [args.speed_factor], args.host_link or None)
    common = dict(optimizer=torch.optim.AdamW, optimizer_kwargs=dict(lr=1e-3), memory_budget=budget, hardware=hw,
                  comm_timeout=300)
    if args.worker == "grid":
        def cut(b):
            return harmony.data.shard(b, pipeline_size=2)
        return cut, harmony.compile(model, cut(first), microbatches=4, parallel=("pipeline", "data"),
                                    pipeline_size=2, compression=codec, placement="layers", **common)
    if args.worker == "data":
        return harmony.data.shard, harmony.compile(model, harmony.data.shard(first), microbatches=2,
                                                   data_parallel=True, compression=codec, **common)
    return (lambda b: b), harmony.compile(model, first, microbatches=8, parallel="pipeline", placement="layers",
                                          **common)


def measured_hardware(args):
    """The ``Hardware`` ``measure_hardware`` wrote beside this rank's result."""
    from harmony.compiler.hardware import Hardware
    return Hardware.from_dict(json.loads((Path(args.result).parent / "hardware.json").read_text())["hardware"])


def _where_time_went(sm, cpu_s: float, factor: float, link_s: float) -> dict:
    """One step of this rank: its process's CPU seconds (every thread: compute, host steps, codec, gloo), its
    compute ops' wall seconds and the CPU seconds they were slept out from, what the host thread measured, and its
    copies' seconds on the emulated host link (``link_s``: the copies in flight beside compute too)."""
    stats = sm.stats
    compute = sum(e.end - e.start for e in sm.runtime.events if e.kind == "compute")
    return dict(cpu_s=cpu_s, compute_wall_s=compute, compute_cpu_s=compute / factor,
                host_step_s=stats.get("host_step_seconds", 0.0), comm_s=stats.get("comm_seconds", 0.0),
                comm_wait_s=stats.get("comm_wait_seconds", 0.0),
                swapped_MiB=(stats["h2d_bytes"] + stats["d2h_bytes"]) / 2**20, link_s=link_s)


def _link_seconds(sm) -> float:
    """Seconds this rank's copies have spent on its emulated host link (copies and sleeps; 0: a memcpy link)."""
    link = sm.runtime.state.link
    return 0.0 if link is None else sum(link.seconds.values())


def _simulated(args, sm, budget):
    """Rank 0's ``sm.simulate`` of its system on the profile, as the runs were set up: the ranks as logical devices
    (speed factor, emulated host link), a server's ranks sharing its cores and its one link to the other server
    (``Hardware.server_link``; the grid's ``Grid.simulate`` pools it itself). The grid and the pipeline simulate
    their server's two ranks together; a data-parallel rank simulates itself, with its 1/2 share of the link."""
    ranks = 1 if args.worker == "data" else 2
    hw = measured_hardware(args).logical([budget] * ranks, [args.speed_factor] * ranks, args.host_link or None)
    hw = hw.replace(host_cores=args.host_cores)
    if args.worker == "grid":
        return sm.simulate(hw.replace(network_bandwidth=args.rate_bytes))
    if args.worker == "data":
        return sm.simulate(hw.server_link(args.rate_bytes, 2))
    return sm.simulate(hw)


def worker(args) -> None:
    """One rank: compile the system's plan, train, time the steps; rank 0 writes the figures."""
    import harmony.data
    import torch
    from harmony.models import GPT, GPTConfig, copy_task
    from harmony.viz.timeline import chrome_trace
    if args.nice:       # torchrun starts each rank in a session of its own: its nice, and the session's
        from hetero import set_priority
        set_priority(args.nice, args.nice)
    torch.manual_seed(0)
    c = GPTConfig(vocab=256, seq=64, layers=args.layers, width=args.width, heads=4, tie=False)
    model = GPT(c)
    n = sum(p.numel() for p in model.parameters())
    batch = 16
    data = list(copy_task(c, batch, args.steps + 2, seed=0))
    budget = int(args.budget_per_param * n)
    cut, sm = _compile(args, model, data[0], budget)
    times, spent = [], []
    for i, b in enumerate(data):
        t0, cpu, link = time.perf_counter(), time.process_time(), _link_seconds(sm)
        sm(*cut(b))
        if i >= 2:          # two warm-up steps
            times.append(time.perf_counter() - t0)
            spent.append(_where_time_went(sm, time.process_time() - cpu, args.speed_factor,
                                          _link_seconds(sm) - link))
    rank, _ = harmony.data.rank_and_world()
    if rank == 0:
        step = statistics.median(times)
        out = dict(params_M=n / 1e6, global_batch=batch, step_s=step, samples_per_s=batch / step,
                   steps=len(times), step_s_all=times, budget_bytes=budget, budget_per_param=args.budget_per_param,
                   speed_factor=args.speed_factor, server_cores=args.cores,
                   rank0={k: statistics.median(s[k] for s in spent) for k in spent[0]})
        stem = Path(args.result).with_suffix("")
        chrome_trace(sm.runtime.events, f"{stem}.measured.trace.json")
        try:        # a simulator failure is a figure of its own, not the loss of the measured run
            sim = _simulated(args, sm, budget)
        except Exception as e:
            out["SIMULATED_error"] = repr(e)
        else:
            out["SIMULATED_step_s"] = sim.step_seconds
            out["SIMULATED_sharing"] = " | ".join(getattr(sim, "sharing", ()))
            first = sim.devices[0] if hasattr(sim, "devices") else sim
            out["SIMULATED_rank0_busy"] = first.busy
            chrome_trace(first.events, f"{stem}.simulated.trace.json")
        Path(args.result).write_text(json.dumps(out))
    sm.close()
