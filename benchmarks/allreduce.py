"""One full gradient sync of GPT-2 small (124M parameters), side by side, under torchrun.

Peers: gloo fp32 all_reduce, DDP's fp16_compress_hook, DDP's PowerSGD hook (rank 4); Harmony's
quantized all-reduce (scatter-reduce + all-gather of densely packed levels) at 8, 4, 2 bits and
with layer-wise adaptive bits (total error <= uniform 4 bits). Prints seconds per sync (slowest
rank; the median of --reps, the methods taking turns rep by rep so that the machine's drift falls on
all of them alike), bytes each rank sends, the ratio to fp32 and the error against the exact fp32
average; ``--json FILE`` also writes the ratios (rank 0).

    sudo benchmarks/netns.sh 1gbit 4 --reps 2        # rate-limited loopback in a namespace
    torchrun --nproc_per_node 2 benchmarks/allreduce.py --reps 2        # unlimited loopback
    torchrun --nproc_per_node 2 benchmarks/allreduce.py --convergence   # 200 steps, fp32 vs 4-bit vs adaptive
    torchrun --nproc_per_node 2 benchmarks/allreduce.py --compiled --steps 40   # through harmony.compile

Gradients are random: per rank Gaussian, with one scale per tensor drawn log-uniformly from
[1e-4, 1e-1] (the same on every rank), since real layers' gradients differ in size by orders of
magnitude and that is what adaptive bits exploit.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from harmony.runtime.comm.adaptive_bits import ErrorMeter, choose_bits_across_ranks, specs_for_bits
from harmony.runtime.comm.collectives import DEFAULT_FUSION_BYTES, Workspace, allreduce, ring_bytes
from harmony.runtime.comm.process_group import init_process_group
from harmony.runtime.comm.compression import DEFAULT_MIN_SIZE, CompressionSpec, spec_for

MB = 1e6


def save_json(path, figures: dict) -> None:
    """As benchmarks/common.py's, which this script does not import: it puts the checkout first on ``sys.path``,
    and a bisection runs this script against a build installed into a folder (``PYTHONPATH``;
    benchmarks/compare_builds.sh)."""
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, indent=1)


# -- the gradient set ------------------------------------------------------------------------------
def gpt2_shapes(n_layer: int = 12, n_embd: int = 768) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter shapes of ``GPT2LMHeadModel(GPT2Config())`` (built on the meta device; the head is tied).

    The defaults are GPT-2 small (124M); smaller values make a quick smoke test.
    """
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
        with torch.device("meta"):
            model = GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=max(1, n_embd // 64)))
        return [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    except ImportError:   # the same shapes, written out
        d = n_embd
        shapes = [("transformer.wte.weight", (50257, d)), ("transformer.wpe.weight", (1024, d))]
        for i in range(n_layer):
            h = f"transformer.h.{i}."
            shapes += [(h + "ln_1.weight", (d,)), (h + "ln_1.bias", (d,)), (h + "attn.c_attn.weight", (d, 3 * d)),
                       (h + "attn.c_attn.bias", (3 * d,)), (h + "attn.c_proj.weight", (d, d)),
                       (h + "attn.c_proj.bias", (d,)), (h + "ln_2.weight", (d,)), (h + "ln_2.bias", (d,)),
                       (h + "mlp.c_fc.weight", (d, 4 * d)), (h + "mlp.c_fc.bias", (4 * d,)),
                       (h + "mlp.c_proj.weight", (4 * d, d)), (h + "mlp.c_proj.bias", (d,))]
        return shapes + [("transformer.ln_f.weight", (d,)), ("transformer.ln_f.bias", (d,))]


def random_grads(shapes, rank: int, seed: int = 0) -> list[torch.Tensor]:
    scales = torch.empty(len(shapes)).uniform_(-4, -1, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed * 1000 + rank + 1)
    return [torch.randn(s, generator=g).mul_(10 ** float(k)) for (_, s), k in zip(shapes, scales)]


# -- the methods -----------------------------------------------------------------------------------
class _Inject(torch.autograd.Function):
    """A backward that hands fixed gradients to the parameters, so DDP's hooks see exactly them."""

    @staticmethod
    def forward(ctx, holder, *params):
        ctx.holder = holder
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return (None, *ctx.holder.grads)


class _Holder(nn.Module):
    def __init__(self, shapes):
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.zeros(s)) for _, s in shapes)
        self.grads = None

    def forward(self):
        return _Inject.apply(self, *self.ps)


def powersgd_bytes(shapes, world: int, rank_: int = 4, min_rate: float = 2.0) -> int:
    """Bytes one rank sends under DDP's PowerSGD hook: P and Q all-reduced, small tensors in fp32."""
    total = 0
    for _, s in shapes:
        rows, cols = s[0], math.prod(s[1:]) if len(s) > 1 else 1
        if len(s) > 1 and (rows + cols) * rank_ * min_rate < rows * cols:
            total += ring_bytes(4 * rank_ * rows, world) + ring_bytes(4 * rank_ * cols, world)
        else:
            total += ring_bytes(4 * rows * cols, world)
    return total


def ddp_method(shapes, grads, hook: str):
    """(once, result, warm-up syncs it needs) of a DDP comm hook over the gradient set."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    holder = _Holder(shapes)
    holder.grads = grads
    # PowerSGD's callbacks block a gloo worker thread while waiting for their next all_reduce; with
    # gloo's two worker threads, two buckets in flight deadlock. One bucket avoids it.
    cap = 25 if hook != "powersgd" else 1 + sum(4 * math.prod(s) for _, s in shapes) / 2**20
    ddp = DDP(holder, init_sync=False, bucket_cap_mb=cap, gradient_as_bucket_view=True)
    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=2,
                                            min_compression_rate=2, use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)

    def once():
        for p in holder.ps:
            if p.grad is not None:
                p.grad.zero_()
        dist.barrier()
        start = time.perf_counter()
        ddp().backward()              # DDP's reducer finishes every bucket before backward returns
        return time.perf_counter() - start

    def result():
        return [p.grad.detach().clone() for p in holder.ps]
    return once, result, 2 if hook == "powersgd" else 0   # PowerSGD all-reduces plainly before start_powerSGD_iter


def harmony_method(grads, spec, fusion_bytes: int = DEFAULT_FUSION_BYTES):
    """(once, result, stats) of Harmony's all-reduce of the gradient set under ``spec``, its fused buffers kept
    from sync to sync in a ``Workspace``, as a loop that calls ``allreduce`` each step would keep them (and as DDP
    keeps its buckets; Harmony's own runtime allocates them per call)."""
    last, workspace = {}, Workspace()

    def once():
        last["work"] = work = [g.clone() for g in grads]
        dist.barrier()
        last["stats"] = allreduce(work, spec, timeout=600, fusion_bytes=fusion_bytes, workspace=workspace)
        return last["stats"].seconds
    return once, lambda: last["work"], lambda: last["stats"]


def interleaved(methods: dict, reps: int, warmup: int) -> dict:
    """Seconds per sync of each method (the slowest rank's), the methods taking turns rep by rep so that a change
    in the machine's speed during the run falls on all of them alike. ``methods``: name -> (once, warm-up)."""
    for once, extra in methods.values():
        for _ in range(warmup + extra):
            once()
    times = {name: [] for name in methods}
    for _ in range(reps):
        for name, (once, _) in methods.items():
            t = torch.tensor([once()], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)     # a sync is as slow as its slowest rank
            times[name].append(float(t))
    return times


def adaptive_specs(shapes, grads, uniform_bits: int, base: CompressionSpec, min_size: int = DEFAULT_MIN_SIZE):
    """Measure on this rank's gradients, agree on one plan across ranks, return (specs, report)."""
    names = [n for n, _ in shapes]
    meter = ErrorMeter(bucket_size=base.bucket_size, rounding=base.rounding)
    meter.update({n: g for n, g in zip(names, grads) if spec_for(g, base, min_size).kind == "quantized"})
    bits, report = choose_bits_across_ranks(meter.errors(), meter.sizes, uniform_bits, bucket_size=base.bucket_size)
    return specs_for_bits(names, bits, base), report


# -- the sync benchmark ----------------------------------------------------------------------------
def sync_benchmark(args):
    rank, world = dist.get_rank(), dist.get_world_size()
    shapes = gpt2_shapes(args.n_layer, args.n_embd)
    n = sum(math.prod(s) for _, s in shapes)
    grads = random_grads(shapes, rank)
    fp32_bytes = ring_bytes(4 * n, world)
    rows, reference = [], None

    def record(name, times, result, sent, note=""):
        nonlocal reference
        if rank != 0:           # only rank 0 keeps the reference and prints
            return
        if reference is None:
            reference = result
        num = sum(float((a - b).double().pow(2).sum()) for a, b in zip(result, reference))
        den = sum(float(b.double().pow(2).sum()) for b in reference)
        rows.append((name, statistics.median(times), min(times), sent, math.sqrt(num / den), note))
        print(f"  {name}: {[round(t, 3) for t in times]} s", flush=True)

    methods = args.methods.split(",")
    if rank == 0:
        print(f"GPT-2 (n_layer={args.n_layer}, n_embd={args.n_embd}) gradient sync: {n / 1e6:.1f}M parameters in "
              f"{len(shapes)} tensors, {world} ranks, link {args.link}, torch threads {torch.get_num_threads()}, "
              f"{args.reps} reps after {args.warmup} warm-up",
              flush=True)
    # name -> (once, result, bytes sent, note, extra warm-up); fp32 first: its result is the exact average every
    # other method is compared with
    runs = {}
    once, result, _ = harmony_method(grads, CompressionSpec("none"))
    runs["fp32 all_reduce (gloo)"] = (once, result, lambda: fp32_bytes, "", 0)
    if "ddp-fp16" in methods:
        once, result, extra = ddp_method(shapes, grads, "fp16")
        runs["DDP fp16_compress_hook"] = (once, result, lambda: ring_bytes(2 * n, world), "", extra)
    if "ddp-powersgd" in methods:
        once, result, extra = ddp_method(shapes, grads, "powersgd")
        runs["DDP PowerSGD hook, rank 4"] = (once, result, lambda: powersgd_bytes(shapes, world),
                                             "one DDP bucket (gloo deadlocks with more); same grads every rep: warm "
                                             "start flatters its error", extra)
    base = CompressionSpec("quantized", bits=4, bucket_size=args.bucket, rounding="stochastic")
    for b in (8, 4, 2):
        if f"q{b}" in methods:
            spec = CompressionSpec("quantized", bits=b, bucket_size=args.bucket, rounding="stochastic")
            once, result, stats = harmony_method(grads, spec)
            runs[f"Harmony {b}-bit"] = (once, result, lambda stats=stats: stats().wire_bytes, "", 0)
    for mb in filter(None, args.fusion_mb.split(",")):    # the 4-bit sync with other fused buffer sizes
        once, result, stats = harmony_method(grads, base, int(float(mb) * 2**20))
        runs[f"Harmony 4-bit, {mb} MiB buffers"] = (once, result, lambda stats=stats: stats().wire_bytes, "", 0)
    if "adaptive" in methods:
        specs, report = adaptive_specs(shapes, grads, 4, base)
        once, result, stats = harmony_method(grads, specs)
        hist = {}
        for s in specs:
            if s.kind == "quantized":
                hist[s.bits] = hist.get(s.bits, 0) + 1
        runs["Harmony adaptive (<= 4-bit error)"] = (
            once, result, lambda stats=stats: stats().wire_bytes,
            f"bits:tensors {dict(sorted(hist.items()))}; ILP {report['solve_seconds']:.2f} s predicts "
            f"{report['objective_bytes'] / report['uniform_bytes']:.2f}x uniform 4-bit's bytes", 0)
    times = interleaved({name: (r[0], r[4]) for name, r in runs.items()}, args.reps, args.warmup)
    for name, (_, result, sent, note, _) in runs.items():
        record(name, times[name], result(), sent(), note)
    if rank == 0:
        print_table(rows, fp32_bytes)
        med = {name: statistics.median(t) for name, t in times.items()}
        fp32 = med["fp32 all_reduce (gloo)"]
        common_json = {f"fp32/{name} sync": fp32 / s for name, s in med.items() if name.startswith("Harmony")}
        save_json(args.json, dict(common_json, link=args.link, world=world,
                                  **{f"{name} s": s for name, s in med.items()}))


def print_table(rows, fp32_bytes):
    print("\nHarmony's rows (its fp32 row included) keep their fused buffers across syncs (collectives.Workspace)")
    base = rows[0][1]
    print(f"\n{'method':36s} {'s/sync med':>10s} {'min':>8s} {'MB sent/rank':>12s} {'bytes vs fp32':>13s} "
          f"{'speedup':>8s} {'rel L2 err':>10s}  note")
    for name, tmed, tmin, sent, err, note in rows:
        print(f"{name:36s} {tmed:10.3f} {tmin:8.3f} {sent / MB:12.1f} {sent / fp32_bytes:13.3f} "
              f"{base / tmed:7.2f}x {err:10.2e}  {note}")


# -- convergence -----------------------------------------------------------------------------------
def convergence(args):
    from harmony.models import GPT, GPTConfig, copy_task

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig()
    per_rank = args.batch // world
    base = CompressionSpec("quantized", bits=4, bucket_size=args.bucket, rounding="stochastic")
    curves = {}
    for mode in ("fp32", "4-bit", "adaptive"):
        torch.manual_seed(0)
        model = GPT(cfg)
        params = list(model.parameters())
        names = [n for n, _ in model.named_parameters()]
        opt = torch.optim.AdamW(params, lr=args.lr)
        spec = CompressionSpec("none") if mode == "fp32" else base
        meter = ErrorMeter(bucket_size=base.bucket_size) if mode == "adaptive" else None
        gen = torch.Generator().manual_seed(1234 + rank)
        losses, comm = [], None
        for step, (x, y) in enumerate(copy_task(cfg, args.batch, args.steps, seed=1)):
            mine = slice(rank * per_rank, (rank + 1) * per_rank)
            loss = model(x[mine], y[mine])
            opt.zero_grad(set_to_none=False)
            loss.backward()
            grads = [p.grad for p in params]
            if meter is not None and step < args.warmup_steps:        # measure on real gradients, sync in fp32
                meter.update({n: g for n, g in zip(names, grads) if spec_for(g, base).kind == "quantized"})
                stats = allreduce(grads, CompressionSpec("none"))
                if step == args.warmup_steps - 1:
                    bits, report = choose_bits_across_ranks(meter.errors(), meter.sizes, 4,
                                                            bucket_size=base.bucket_size)
                    spec = specs_for_bits(names, bits, base)
                    if rank == 0:
                        print(f"adaptive bits after {args.warmup_steps} warm-up steps: "
                              f"{sorted(bits.values())}; predicted {report['objective_bytes']} B vs uniform-4 "
                              f"{report['uniform_bytes']} B", flush=True)
            else:
                stats = allreduce(grads, spec, generator=gen)
            comm = stats if comm is None else comm + stats
            opt.step()
            t = loss.detach().reshape(1)
            dist.all_reduce(t)
            losses.append(float(t) / world)
        curves[mode] = (losses, comm)
    if rank == 0:
        ref = sum(curves["fp32"][0][-10:]) / 10
        marks = [0, args.steps // 4, args.steps // 2, 3 * args.steps // 4, args.steps - 1]
        print(f"\nconvergence: harmony.models.GPT {GPTConfig()} on copy_task, global batch {args.batch}, "
              f"{world} ranks, AdamW lr {args.lr}, {args.steps} steps")
        print(f"{'mode':10s} " + " ".join(f"{'step ' + str(m):>9s}" for m in marks)
              + f" {'last-10 mean':>12s} {'vs fp32':>8s} {'bytes vs fp32':>13s}")
        for mode, (losses, comm) in curves.items():
            end = sum(losses[-10:]) / 10
            print(f"{mode:10s} " + " ".join(f"{losses[m]:9.4f}" for m in marks)
                  + f" {end:12.4f} {100 * (end - ref) / ref:+7.2f}% {comm.wire_bytes / comm.fp32_bytes:13.3f}")


# -- training through harmony.compile ------------------------------------------------------------------
def compiled(args):
    """Train through ``harmony.compile(..., data_parallel=None)``: the compress pass's all-reduces in the schedule.

    Every rank compiles the same GPT on its shard of each global batch, under a memory budget of
    ``--budget-frac`` of its training state (0.5: the state is swapped and the optimizer steps on
    the host, behind each pack's all-reduce). Prints, per compression, the median step time, the
    seconds the host thread spent communicating per step, bytes per step against fp32 and the
    loss at the end; every rank's parameters are hashed to show they agree.
    """
    import hashlib

    import harmony
    import harmony.data
    from harmony.models import GPT, GPTConfig, copy_task

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(layers=args.n_layer_compiled, width=args.width)
    modes = args.compression.split(",")
    rows = []
    for mode in modes:
        torch.manual_seed(0)
        model = GPT(cfg)
        state = 16 * sum(p.numel() for p in model.parameters())
        data = list(copy_task(cfg, args.batch, args.steps, seed=1))
        sm = harmony.compile(model, example_batch=harmony.data.shard(data[0]), microbatches=args.microbatches,
                             memory_budget=int(state * args.budget_frac), optimizer_kwargs=dict(lr=args.lr),
                             compression=None if mode == "fp32" else mode)
        times, comm, wire, fp32, losses = [], [], [], [], []
        for x, y in data:
            loss = sm(*harmony.data.shard((x, y)))
            t = loss.detach().reshape(1)
            dist.all_reduce(t)
            losses.append(float(t) / world)
            s = sm.stats
            times.append(s["step_seconds"])
            comm.append(s["comm_seconds"])
            wire.append(s["comm_wire_bytes"])
            fp32.append(s["comm_fp32_bytes"])
        h = hashlib.sha256()
        for p in model.parameters():
            h.update(p.detach().numpy().tobytes())
        digests = [None] * world
        dist.all_gather_object(digests, h.hexdigest()[:12])
        where = {n.kwargs.get("where", "device") for n in sm.graph.nodes
                 if n.op == "call_function" and n.target.__name__ == "allreduce"}
        sm.close()
        med = sorted(times)[len(times) // 2]
        rows.append((mode, len(sm.plan.packs), ",".join(sorted(where)), med, sum(comm[1:]) / max(len(comm) - 1, 1),
                     wire[-1], wire[-1] / fp32[-1], sum(losses[-10:]) / len(losses[-10:]),
                     len(set(digests)) == 1, sm.stats.get("adaptive_bits")))
    if rank == 0:
        print(f"\nharmony.compile data parallel: GPT {cfg}, global batch {args.batch} on {world} ranks, "
              f"{args.microbatches} microbatches per rank, budget {args.budget_frac:g} x training state, "
              f"AdamW lr {args.lr}, {args.steps} steps")
        print(f"{'compression':12s} {'packs':>5s} {'all-reduce':>10s} {'step s':>8s} {'comm s':>8s} "
              f"{'KB/step':>9s} {'vs fp32':>8s} {'last-10 loss':>12s} {'ranks equal':>11s}")
        for mode, packs, where, med, c, w, ratio, end, same, bits in rows:
            print(f"{mode:12s} {packs:5d} {where:>10s} {med:8.4f} {c:8.4f} {w / 1e3:9.1f} {ratio:8.3f} "
                  f"{end:12.4f} {str(same):>11s}")
            if bits:
                hist = {}
                for b in bits.values():
                    hist[b] = hist.get(b, 0) + 1
                print(f"{'':12s} adaptive bits:layers {dict(sorted(hist.items()))}")
        print("comm s: seconds the host thread spent in all-reduces per step (after the first), overlapped "
              "with the next pack's backward where the optimizer steps on the host")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--bucket", type=int, default=512, help="elements per quantization bucket")
    ap.add_argument("--methods", default="ddp-fp16,ddp-powersgd,q8,q4,q2,adaptive")
    ap.add_argument("--link", default="unlimited loopback", help="label printed with the table")
    ap.add_argument("--fusion-mb", default="",
                    help=f"extra 4-bit rows fusing gradients into buffers of these MiB (default buffers: "
                         f"{DEFAULT_FUSION_BYTES >> 20} MiB), e.g. 16,8")
    ap.add_argument("--json", default=None, help="rank 0 writes the headline figures here")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds before a stuck collective fails")
    ap.add_argument("--n-layer", type=int, default=12, help="GPT-2 small: 12")
    ap.add_argument("--n-embd", type=int, default=768, help="GPT-2 small: 768")
    ap.add_argument("--convergence", action="store_true", help="train a small GPT: fp32 vs 4-bit vs adaptive")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup-steps", type=int, default=5, help="adaptive: steps measuring errors before choosing")
    ap.add_argument("--compiled", action="store_true", help="train through harmony.compile(data_parallel) instead")
    ap.add_argument("--compression", default="fp32,fp16,4bit,adaptive", help="--compiled: modes to compare")
    ap.add_argument("--n-layer-compiled", type=int, default=4, help="--compiled: GPT layers")
    ap.add_argument("--width", type=int, default=128, help="--compiled: GPT width")
    ap.add_argument("--microbatches", type=int, default=4, help="--compiled: microbatches per rank")
    ap.add_argument("--budget-frac", type=float, default=0.5, help="--compiled: memory budget / training state")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    init_process_group(timeout=args.timeout, backend="gloo")
    try:
        if args.compiled:
            compiled(args)
        elif args.convergence:
            convergence(args)
        else:
            sync_benchmark(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
