"""Harmony on one GPU against eager PyTorch, its own baseline policies and FSDP2 with CPU offload.

The built-in GPT (untied head, random weights), or with ``--model llama`` Hugging Face's LlamaForCausalLM at the
Llama-3-8B shape (benchmarks/gpu_models.py; Harmony's rows build it under ``harmony.empty_weights()``), trains the
same batches under each system, each row in its own subprocess (a fresh CUDA context, allocator and peak counters; a
row that hangs or dies costs only itself):

  eager        the model and AdamW (fused) on the GPU, gradient accumulation over the same microbatches:
               the compute reference, where the training state and activations fit the card
  harmony-F    harmony.compile(device="cuda", memory_budget=F x the training state), policy harmony
  sequential-F / ondemand-F   the same budget under the Harmony paper's two baselines
  hostonly-F   harmony-F with every optimizer step on the host (optimizer_on="host"): in bf16, harmony-F may step
               the packs that step last on the card instead, as many as its simulation finds fastest
               (driver/mixed_steps.py; the row's device_steps says how many)
  alloc-F      harmony-F counting device memory with the caching allocator's counters (accounting="allocator"),
               no hook around each tensor op: what that hook costs a host issuing ops to the card
  torchao      torchao's CPUOffloadOptimizer: bf16 weights and gradients on the card, AdamW's state and step on the
               host (pure bf16, no fp32 masters: a cheaper recipe than the others')
  fsdp2        torch's fully_shard per block and at the root with CPUOffloadPolicy(pin_memory=True)
               on a one-GPU NCCL mesh: parameters, gradients and optimizer state on the host,
               AdamW stepping on the CPU (peak allocated beside its time)

Before the rows the card is probed in the parent (``Hardware.profile`` on CUDA: matmul FLOP/s per dtype,
pinned h2d / d2h GB/s, kernel launch latency, device memory bandwidth), and the host's AdamW step traffic per second
in each torch implementation against its memory-bandwidth probe (benchmarks/host_step.py); each Harmony row also reports
``sm.simulate`` on that measured description against its measured step.

A row that runs past ``--row-timeout`` reports the steps it finished (``timed_out`` says how many).

Figures per row: median step time of the steps after the first, tokens/s, model TFLOP/s (6 x parameters
x tokens, plus the recompute Harmony does as 2 x more, not counted) and its share of the probed matmul rate
at the compute dtype, h2d / d2h GB/s the runtime moved against the probe, peak allocated and reserved
against the budget, the predicted step and peak against the measured ones.

    python benchmarks/gpu.py --width 2048 --layers 24 --out results/     # on a GPU machine
    python benchmarks/gpu.py --model llama --precision bf16 --rows harmony-50,torchao,fsdp2 --out results/
    python benchmarks/gpu.py --quick                                     # a small model, a minute
    python benchmarks/gpu.py --quick --model llama --device cpu --rows eager,harmony-50   # the dry run, here

``benchmarks/gpu.sh`` runs it with the CUDA tests on the GPU machine (offline install of the wheels).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

import common
from gpu_models import LLAMA_8B, LLAMA_QUICK, shape_of

GiB = 2**30
LR, WD = 3e-4, 0.1


def batches(c, a):
    import torch
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(a.steps):
        x = torch.randint(0, c.vocab, (a.batch, c.seq), generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def adamw_kwargs(device_types=("cpu", "cuda")) -> dict:
    import torch
    from harmony.runtime.optim import optimizer_kwargs
    return optimizer_kwargs(torch.optim.AdamW, dict(lr=LR, weight_decay=WD), device_types)


# -- the rows ---------------------------------------------------------------------------------------
def setup_eager(a, c, data):
    import torch
    model = c.build().to(a.device)
    opt = torch.optim.AdamW(model.parameters(), **adamw_kwargs((torch.device(a.device).type,)))
    amp = torch.autocast(torch.device(a.device).type, dtype=torch.bfloat16) if a.precision == "bf16" else None

    def step(x, y):
        total = 0.0
        for xm, ym in zip(x.chunk(a.microbatches), y.chunk(a.microbatches)):
            xm, ym = xm.to(a.device), ym.to(a.device)
            if amp is not None:
                with amp:
                    loss = c.loss(model, xm, ym)
            else:
                loss = c.loss(model, xm, ym)
            (loss / a.microbatches).backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(total) / a.microbatches
    return step, {}, lambda: None


def setup_fsdp2(a, c, data):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl", rank=0, world_size=1)
    mesh = init_device_mesh("cuda", (1,))
    model = c.build()
    kw = dict(offload_policy=CPUOffloadPolicy(pin_memory=True), mesh=mesh)
    if a.precision == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in c.blocks(model):
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), **adamw_kwargs(("cpu",)))

    def step(x, y):
        total = 0.0
        for xm, ym in zip(x.chunk(a.microbatches), y.chunk(a.microbatches)):
            loss = c.loss(model, xm.cuda(), ym.cuda())
            (loss / a.microbatches).backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(total) / a.microbatches
    return step, {}, dist.destroy_process_group


def setup_harmony(a, c, data, policy, frac):
    import torch
    import harmony
    from harmony.compiler.hardware import Hardware
    model = c.build(empty=c.kind != "gpt")     # a Hugging Face model at its full size: made as compile places it
    budget = int(c.state_bytes() * frac)
    hw = Hardware.this_machine()       # the parent's profile of this card (cached), planned for and simulated on
    hw = hw.computing_in(a.precision, "allocator" if policy == "alloc" else "ops")   # as compile costs the plan
    where = dict(hostonly=dict(optimizer_on="host"), alloc=dict(accounting="allocator")).get(policy, {})
    sm = harmony.compile(model, c.batch(*data[0]), optimizer=torch.optim.AdamW,
                         optimizer_kwargs=dict(lr=LR, weight_decay=WD),
                         memory_budget=budget, microbatches=a.microbatches, device=a.device, precision=a.precision,
                         hardware=hw, policy="harmony" if policy in ("hostonly", "alloc") else policy, **where)
    cfg = sm.program.config
    info = dict(budget=budget, compile_s=round(sm.compile_seconds["total"], 2), packs=len(sm.plan.packs),
                device_steps=list(sm.plan.by_pack("step_on").values()).count("device"),
                steps_predicted={str(k): v for k, v in (cfg.steps_predicted or {}).items()})
    stats = info.setdefault("stats", [])
    sim = sm.simulate(hw.logical([budget]))
    idle = round(1 - sim.utilisation.get("compute", 0), 3)
    info.update(predicted_step_s=sim.step_seconds, predicted_compute_idle=idle, predicted_peak=sm.predicted.peak,
                predicted_host_s=sim.busy.get("host", 0.0),
                hardware=hw.devices[0].name)

    def step(x, y):
        loss = float(c.call(sm, x, y))
        stats.append({k: v for k, v in sm.stats.items() if isinstance(v, (int, float, str, bool))})
        return loss
    return step, info, sm.close


def setup_torchao(a, c, data):
    """torchao's CPUOffloadOptimizer: the model's weights and gradients in bf16 on the card, AdamW's state and its
    step on the host (fused CPU AdamW), each parameter's update copied back after it. Pure bf16 training (no fp32
    masters): cheaper than the other rows' state, and numerically another recipe."""
    import torch
    from torchao.optim import CPUOffloadOptimizer
    model = c.build().to(torch.bfloat16).to(a.device)
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=False, fused=True,
                              lr=LR, weight_decay=WD)

    def step(x, y):
        total = 0.0
        for xm, ym in zip(x.chunk(a.microbatches), y.chunk(a.microbatches)):
            loss = c.loss(model, xm.to(a.device), ym.to(a.device))
            (loss / a.microbatches).backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        return float(total) / a.microbatches
    return step, {}, lambda: None


SETUPS = {"eager": setup_eager, "fsdp2": setup_fsdp2, "torchao": setup_torchao}


def probe_hardware(a):
    """This machine's device measured (and cached for the rows' ``Hardware.this_machine()``)."""
    from harmony.compiler.hardware import Hardware
    if a.probe_seconds <= 0:     # the profile an earlier run on this machine cached (this_machine() checks it fits)
        return Hardware.this_machine()
    return Hardware.profile(seconds=a.probe_seconds, device=a.device)


def sync(a):
    import torch
    if torch.device(a.device).type == "cuda":
        torch.cuda.synchronize()


def row(a) -> dict:
    """One system, in this process: its steps' times and the allocator's peaks."""
    import torch
    c = shape_of(a)
    data = batches(c, a)
    out = dict(system=a.row, params=c.n_params(), state_bytes=c.state_bytes())
    kind, _, frac = a.row.partition("-")
    t0 = time.perf_counter()
    if kind in SETUPS:
        step, info, close = SETUPS[kind](a, c, data)
    else:
        step, info, close = setup_harmony(a, c, data, kind, float(frac) / 100)
    out["setup_s"] = round(time.perf_counter() - t0, 2)
    out.update(info)
    times, losses, allocated, reserved = [], [], [], []
    try:
        cuda = torch.device(a.device).type == "cuda"
        for x, y in data:
            sync(a)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            losses.append(step(x, y))
            sync(a)
            times.append(time.perf_counter() - t)
            allocated.append(torch.cuda.max_memory_allocated() if cuda else 0)
            reserved.append(torch.cuda.max_memory_reserved() if cuda else 0)
            # after every step, what the row has so far: a row cut off by --row-timeout reports these
            print(json.dumps(dict(out, step_s=times, losses=losses, allocated=allocated, reserved=reserved,
                                  partial=True)), flush=True)
        if cuda and a.profile_step:
            out["compute_idle"] = compute_idle(step, *data[-1])
    finally:
        close()
    out.update(step_s=times, losses=losses, allocated=allocated, reserved=reserved)
    return out


def compute_idle(step, x, y) -> float:
    """Share of one more step during which no kernel ran on the GPU (torch.profiler's CUDA activity: the union
    of kernel intervals against the step's wall time). Copies are not kernels: time spent only copying counts
    as idle compute. An extra step, outside the timed ones (the profiler slows the host a little)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step(x, y)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name.lower()
                   and "memset" not in e.name.lower())
    busy, end = 0.0, None
    for a, b in spans:
        if end is None or a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    return round(max(0.0, 1 - busy / 1e6 / wall), 3)


def _text(b) -> str:
    return b.decode() if isinstance(b, bytes) else (b or "")


def run_row(a, name: str) -> dict:
    cmd = [sys.executable, __file__, "--row", name] + [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
                                                       if k not in ("row", "rows", "out", "quick") and v is not None]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.row_timeout)
    except subprocess.TimeoutExpired as e:
        done = [ln for ln in _text(e.stdout).splitlines() if ln.startswith("{")]
        if done:     # the steps it finished (the first is the warm-up the summary leaves out)
            r = json.loads(done[-1])
            r["timed_out"] = f"timed out after {a.row_timeout} s, {len(r['step_s'])} of {a.steps} steps done"
            return r
        return dict(system=name, error=f"timed out after {a.row_timeout} s, in setup or its first step",
                    log=_text(e.stderr)[-2000:])
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        return dict(system=name, error=f"exit {p.returncode}", log=(p.stdout + p.stderr)[-4000:],
                    wall_s=round(time.perf_counter() - t0, 1))
    return json.loads(lines[-1])


def summarize(r: dict, a, card: dict, tokens: int) -> dict:
    if "error" in r:
        return dict(system=r["system"], error=r["error"])
    steady = r["step_s"][1:] or r["step_s"]
    step = statistics.median(steady)
    flops = 6 * r["params"] * tokens
    rate = card.get("bf16_flops" if a.precision == "bf16" else "fp32_flops")
    s = dict(system=r["system"], step_s=round(step, 3), tokens_per_s=round(tokens / step),
             model_tflops=round(flops / step / 1e12, 1),
             of_matmul=round(flops / step / rate, 3) if rate else None,
             peak_alloc_gib=round(max(r["allocated"]) / GiB, 2), peak_reserved_gib=round(max(r["reserved"]) / GiB, 2),
             budget_gib=round(r["budget"] / GiB, 2) if "budget" in r else None, setup_s=r["setup_s"])
    if "timed_out" in r:     # one step only: the warm-up's time stands for the row's, an overestimate
        s["timed_out"] = r["timed_out"] + (" (the first step's time)" if len(r["step_s"]) == 1 else "")
    st = r.get("stats") or []
    if st:
        last = st[-1]
        s.update(h2d_GBps=round(last["h2d_bytes"] / step / 1e9, 2), d2h_GBps=round(last["d2h_bytes"] / step / 1e9, 2),
                 meter_peak_gib=round(last["measured_peak"] / GiB, 2),
                 predicted_peak_gib=round(last["predicted_peak"] / GiB, 2))
        if "host_step_seconds" in last:     # the host thread's optimizer updates: what bounds a bf16 step
            s["host_step_s"] = round(statistics.median(x["host_step_seconds"] for x in st[1:] or st), 3)
        for k in ("ondemand_fetch_seconds", "ondemand_evict_seconds"):   # where the ondemand baseline's step goes
            if k in last:
                s[k.replace("_seconds", "_s")] = round(statistics.median(x[k] for x in st[1:] or st), 3)
    if "compute_idle" in r:
        s["compute_idle"] = r["compute_idle"]
    if "predicted_step_s" in r:
        s["predicted_step_s"] = round(r["predicted_step_s"], 3)
        s["predicted/measured"] = round(r["predicted_step_s"] / step, 3)
        s["predicted_compute_idle"] = r.get("predicted_compute_idle")
        if "predicted_host_s" in r:
            s["predicted_host_s"] = round(r["predicted_host_s"], 3)
    if r.get("device_steps") is not None and r.get("packs"):
        s["device_steps"] = f"{r['device_steps']} of {r['packs']}"
    return s


TARGETS = {"harmony-50": 0.8, "harmony-25": 0.6}     # tokens/s against eager's, where eager fits (issue 30)


def ratios(rows: list[dict]) -> list[str]:
    """The headline ratios, each with its target: Harmony against eager, FSDP2 with CPU offload and the baselines,
    peaks against budgets, predictions against measurements."""
    by = {r["system"]: r for r in rows if "error" not in r}
    out = []
    for name, r in by.items():
        if not name.startswith("harmony-"):
            continue
        if "eager" in by:
            x = r["tokens_per_s"] / by["eager"]["tokens_per_s"]
            target = TARGETS.get(name)
            verdict = f"   (target >= {target}: {'met' if x >= target else 'MISSED'})" if target else ""
            out.append(f"{name} / eager tokens/s      {x:.2f}{verdict}")
        frac = name.split("-")[1]
        for peer, target in (("fsdp2", 1.3), ("ondemand-" + frac, 2.0), ("sequential-" + frac, None)):
            if peer in by:
                x = r["tokens_per_s"] / by[peer]["tokens_per_s"]
                verdict = f"target >= {target}: {'met' if x >= target else 'MISSED'}; " if target else ""
                cut = f"; {peer} {by[peer]['timed_out']}" if "timed_out" in by[peer] else ""
                out.append(f"{name} / {peer} tokens/s  {x:.2f}   ({verdict}"
                           f"peaks {r['peak_alloc_gib']} vs {by[peer]['peak_alloc_gib']} GiB{cut})")
        if r.get("budget_gib"):
            within = "within" if r["peak_alloc_gib"] <= r["budget_gib"] else "OVER"
            out.append(f"{name} peak allocated {r['peak_alloc_gib']} GiB, reserved {r['peak_reserved_gib']} GiB, "
                       f"budget {r['budget_gib']} GiB ({within})")
        if "predicted/measured" in r:
            x = r["predicted/measured"]
            out.append(f"{name} predicted / measured step {x:.2f}   (target within 15%: "
                       f"{'met' if abs(x - 1) <= 0.15 else 'MISSED'}); predicted / measured peak "
                       f"{r['predicted_peak_gib']} / {r['meter_peak_gib']} GiB")
    return out


def show(path: str) -> None:
    """Print a saved run's table and ratios (``--show benchmarks/results/h200-fp32.json``)."""
    with open(path) as f:
        d = json.load(f)
    print(f"{d['card']['name']}, torch {d['card']['torch']}, CUDA {d['card']['cuda']}; {d['args']['precision']}, "
          f"{d['args'].get('model', 'gpt')} width {d['args']['width']} x {d['args']['layers']} layers, "
          f"batch {d['args']['batch']} x "
          f"{d['args']['seq']} in {d['args']['microbatches']} microbatches")
    print(common.table(d["rows"]))
    print("\n".join(ratios(d["rows"])))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt", choices=("gpt", "llama"),
                   help="the built-in GPT, or Hugging Face's LlamaForCausalLM (default: the 8B shape)")
    p.add_argument("--width", type=int, default=None, help="hidden size (gpt 2048, llama 4096)")
    p.add_argument("--layers", type=int, default=None, help="(gpt 24, llama 32)")
    p.add_argument("--heads", type=int, default=None, help="llama's attention heads (32)")
    p.add_argument("--kv-heads", type=int, default=None, help="llama's key/value heads (8)")
    p.add_argument("--intermediate", type=int, default=None, help="llama's MLP width (14336)")
    p.add_argument("--seq", type=int, default=None, help="(gpt 1024, llama 2048)")
    p.add_argument("--vocab", type=int, default=None, help="(gpt 50304, llama 32000)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--rows", default="eager,harmony-50,harmony-25,sequential-50,ondemand-50,fsdp2")
    p.add_argument("--row-timeout", type=int, default=240)
    p.add_argument("--probe-seconds", type=float, default=6.0, help="0: reuse the profile cached on this machine")
    p.add_argument("--profile-step", type=int, default=1, help="1: one more step under torch.profiler for compute_idle")
    p.add_argument("--device", default="cuda", help="cuda (cpu: a dry run of the script, no FSDP2 row)")
    p.add_argument("--quick", action="store_true", help="a small model: width 512, 4 layers, sequence 256")
    p.add_argument("--out", default=None, help="folder for gpu-<precision>.json (gpu-llama-<precision>.json)")
    p.add_argument("--show", default=None, help="print a saved JSON's table and ratios, run nothing")
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.show:
        return show(a.show)
    gpt = dict(width=2048, layers=24, seq=1024, vocab=50304)
    defaults = (LLAMA_QUICK if a.quick else LLAMA_8B) if a.model == "llama" else \
        (dict(width=512, layers=4, seq=256, vocab=8192) if a.quick else gpt)
    for k, v in defaults.items():       # --quick: the small model, whatever else is given
        if getattr(a, k) is None or a.quick:
            setattr(a, k, v)
    if a.row:
        try:
            print(json.dumps(row(a)))
        except BaseException:
            traceback.print_exc()
            sys.exit(1)
        return
    import torch
    c = shape_of(a)
    hw = probe_hardware(a)
    dev = hw.devices[0]
    card = dict(name=dev.name, fp32_flops=dev.peak_flops.get("fp32"), bf16_flops=dev.peak_flops.get("bf16"),
                h2d=dev.h2d_bandwidth, d2h=dev.d2h_bandwidth, kernel_latency=dev.kernel_latency,
                plain_kernel_latency=dev.plain_kernel_latency,
                memory_bandwidth=dev.memory_bandwidth, torch=torch.__version__, cuda=torch.version.cuda,
                # what else the simulator's predictions rest on, so that plans can be simulated again off the card
                efficiency=dev.efficiency, host_memory_bandwidth=hw.host_memory_bandwidth, host_flops=hw.host_flops)
    print(f"card: {hw.describe()}", flush=True)
    if a.probe_seconds > 0:    # the host's AdamW against its memory bandwidth (what bounds a host step)
        from host_step import adamw_rates, describe
        card["host_adamw"] = adamw_rates(mib=16 if a.quick else 512, seconds=min(a.probe_seconds, 4.0))
        print(describe(card["host_adamw"]), flush=True)
    print(f"model: {c.describe()}, {c.n_params() / 1e9:.2f}B parameters, training state "
          f"{c.state_bytes() / GiB:.1f} GiB, "
          f"batch {a.batch} x {a.seq} in {a.microbatches} microbatches, {a.precision}", flush=True)
    tokens = a.batch * a.seq
    raw, rows = [], []
    for name in a.rows.split(","):
        r = run_row(a, name)
        raw.append(r)
        rows.append(summarize(r, a, card, tokens))
        print(json.dumps(rows[-1]), flush=True)
        if "error" in r:
            print(r.get("log", ""), flush=True)
        if a.out:       # after every row: a run cut off by its time limit keeps the rows it finished
            os.makedirs(a.out, exist_ok=True)
            name = f"gpu-{a.precision}.json" if a.model == "gpt" else f"gpu-{a.model}-{a.precision}.json"
            with open(os.path.join(a.out, name), "w") as f:
                json.dump(dict(card=card, args=vars(a), rows=rows, raw=raw), f, indent=1)
    print(common.table(rows))
    print("\n".join(ratios(rows)))


if __name__ == "__main__":
    main()
