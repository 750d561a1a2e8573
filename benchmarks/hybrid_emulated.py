"""benchmarks/hybrid.py's EMULATED part: two "servers" of 2 ranks each on this machine, in network namespaces
joined by a tc-limited link (benchmarks/netns2.sh), measured side by side:

- the 2 x 2 grid (``parallel=("pipeline", "data")``), fp32 and 4-bit gradients across the link;
- 4-rank data parallelism over both namespaces (4-bit gradients: its best);
- a 2-rank pipeline in one namespace (the other server idle).

Each rank is a logical device whose compute ops the runtime sleeps out to ``--speed-factor`` (default 4) times their
CPU time (EMULATED slower devices, as benchmarks/pipeline.py does), so that 4 ranks on this 2-core machine do not
spend the measurement waiting for a core (``--speed-factor 1``: CPU-bound). Every run is launched as users launch: one
``torchrun`` per namespace (``--nnodes 2 --rdzv-backend c10d``), the pipeline alone with one. Each trains the same GPT
on the same global batch; throughput is the global batch over the median measured step. Beside the grid's measurement,
rank 0's ``sm.simulate()`` of its server (this machine's profile as logical devices, the link's rate as
``network_bandwidth``, half of the machine's cores for each server's two ranks) gives the SIMULATED step.

    python benchmarks/hybrid.py --emulated          # as root: makes and removes the namespaces
"""
from __future__ import annotations

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
    """Run this script's inner part under benchmarks/netns2.sh (as root), then print and return its figures."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = ["bash", str(HERE / "netns2.sh"), args.rate, sys.executable, str(HERE / "hybrid.py"), "--emulated-inner",
           "--rate", args.rate, "--out", str(out), "--steps", str(args.steps), "--width", str(args.width),
           "--layers", str(args.layers), "--speed-factor", str(args.speed_factor)]
    cmd += ["--systems", args.systems] if args.systems else []
    subprocess.run(cmd, check=True, timeout=3000)
    return json.loads((out / "emulated.json").read_text())


def _launch(system: str, args, port: int) -> list[subprocess.Popen]:
    kind, codec, nodes = SYSTEMS[system]
    env = dict(os.environ, OMP_NUM_THREADS="1", HARMONY_COMM_TIMEOUT="300")
    result = str(Path(args.out) / f"{system.replace(' ', '_')}.json")
    worker = [str(HERE / "hybrid.py"), "--worker", kind, "--compression", codec, "--result", result,
              "--steps", str(args.steps), "--width", str(args.width), "--layers", str(args.layers),
              "--rate-bytes", str(args.rate_bytes), "--speed-factor", str(args.speed_factor)]
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
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        time.sleep(1)
    return procs


def chosen(args) -> list[str]:
    """The systems ``--systems`` names (comma-separated), all of them by default."""
    names = [n.strip() for n in args.systems.split(",")] if args.systems else list(SYSTEMS)
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise SystemExit(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    return names


def inner(args) -> dict:
    """In the namespaces (netns2.sh's environment): each system's run, one after the other."""
    figures, port = {}, 29611
    for system in chosen(args):
        port += 1
        procs = _launch(system, args, port)
        logs = [p.communicate(timeout=1500)[0] for p in procs]
        if any(p.returncode for p in procs):
            print(f"{system}: failed\n" + "\n".join(log[-2000:] for log in logs), flush=True)
            figures[system] = None
            continue
        figures[system] = json.loads((Path(args.out) / f"{system.replace(' ', '_')}.json").read_text())
        print(f"{system}: {figures[system]}", flush=True)
    (Path(args.out) / "emulated.json").write_text(json.dumps(figures, indent=1))
    return figures


def worker(args) -> None:
    """One rank: compile the system's plan, train, time the steps; rank 0 writes the figures."""
    import harmony
    import harmony.data
    import torch
    from harmony.compiler.hardware import Hardware
    from harmony.models import GPT, GPTConfig, copy_task
    torch.manual_seed(0)
    c = GPTConfig(vocab=256, seq=64, layers=args.layers, width=args.width, heads=4, tie=False)
    model = GPT(c)
    n = sum(p.numel() for p in model.parameters())
    batch = 16
    data = list(copy_task(c, batch, args.steps + 2, seed=0))
    codec = None if args.compression == "none" else args.compression
    budget = int(32 * n)       # every rank a logical device, its compute slept out to speed_factor x its CPU time
    hw = Hardware.this_machine().logical([budget], [args.speed_factor])
    common = dict(optimizer=torch.optim.AdamW, optimizer_kwargs=dict(lr=1e-3), memory_budget=budget, hardware=hw,
                  comm_timeout=300)
    if args.worker == "grid":
        def cut(b):
            return harmony.data.shard(b, pipeline_size=2)
        sm = harmony.compile(model, cut(data[0]), microbatches=4, parallel=("pipeline", "data"), pipeline_size=2,
                             compression=codec, **common)
    elif args.worker == "data":
        cut = harmony.data.shard
        sm = harmony.compile(model, cut(data[0]), microbatches=2, data_parallel=True, compression=codec, **common)
    else:
        def cut(b):
            return b
        sm = harmony.compile(model, data[0], microbatches=8, parallel="pipeline", **common)
    times = []
    for i, b in enumerate(data):
        t0 = time.perf_counter()
        sm(*cut(b))
        if i >= 2:          # two warm-up steps
            times.append(time.perf_counter() - t0)
    rank, _ = harmony.data.rank_and_world()
    if rank == 0:
        step = statistics.median(times)
        out = dict(params_M=n / 1e6, global_batch=batch, step_s=step, samples_per_s=batch / step,
                   steps=len(times))
        if args.worker == "grid":
            hw = Hardware.this_machine().logical([budget] * 2, [args.speed_factor] * 2)
            # both emulated servers run on this one machine: each is simulated on its half of the cores, which its
            # two ranks share (with one core each, as the simulator took before it shared a host, it ran 0.84-1.15x)
            node = sm.simulate(hw.replace(network_bandwidth=args.rate_bytes, host_cores=hw.host_cores / 2))
            out["SIMULATED_step_s"] = node.step_seconds
            out["SIMULATED_sharing"] = " | ".join(node.sharing)
        Path(args.result).write_text(json.dumps(out))
    sm.close()
