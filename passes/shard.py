"""shard: partition parameters, gradients and optimizer state over data-parallel ranks (``shard_state="full"``).

ZeRO stage 3 with ZeRO-Infinity's bandwidth-centric reads: each rank keeps on its host, and steps, one
contiguous chunk of every pack's parameters (equal elements per rank, or under ``balance`` the plan's state
shares, ``CompileConfig.state_shares``: Cephalo's uneven shards; runtime/partitioned/ has the layout and the
ops). The plan: every pack that owns parameters steps on the host, with its fp32 weights and
optimizer state there (``optimizer_on="host"``, which ``shard_state="full"`` makes the default); its
``Residency.shares`` says which chunk is this rank's. The rewrite: each ``swap_in`` of such a pack's weights
becomes a ``gather`` (an all-gather of the chunks into the device copy), its host ``allreduce`` a
``reduce_scatter`` (this rank's chunk of the averaged gradients, which its ``step`` updates). Nothing is
broadcast after the step: the next gather reads the updated chunks. The pack records count only this
rank's chunk (``master_bytes``, ``optim_bytes``), so ``verify``, the simulator (whose ``network`` stream
carries the gathers and reduce-scatters) and the report see this rank's share.

The disk tiers work on the share: under ``host_memory_budget`` (or ``weights_on="disk"``) the offload pass plans this
rank's bytes, and a pack it places on disk keeps this rank's chunks and their optimizer state in one file of the rank's
own ``offload_dir`` (runtime/partitioned/disk.py): each gather reads the chunks from it, each step the whole file, so
N ranks read a pack from N disks, each 1/N of it (ZeRO-Infinity's bandwidth-centric partitioning). A pack the swap pass
carries across its step (``Residency.carried``) keeps its device copy from the backward, its step all-gathers the
updated chunks into it, and the next forward's ``gather(..., carried=True)`` takes it, reading nothing
(runtime/partitioned/carry.py); where such a gather is the pack's last before the step, the step's read starts there
(``reads``: its optimizer state alone, its chunks coming from the carried copy; in mixed precision, whose device
copy is not the fp32 weights, its whole file). The ranks compare a digest of their gathers and reduce-scatters, so ranks
that planned different swaps fail at compile time, not in a collective that never matches. ``rewrite`` serves the
evaluation schedule too (passes/eval_schedule.py).

Clipping by the global norm (``clip_grad_norm``) works: each rank has the whole averaged buffer for a moment in the
reduce-scatter (runtime/partitioned/), takes every gradient's norm there, and the norm of those norms is the
replicated run's, bitwise, on every rank, with no collective of its own.

Quantized gradients (``compression="4bit"``, any of 1..8 bits, either rounding) work too: a buffer with quantized
tensors is cut where the codec cuts it (each parameter from a bucket boundary, rank r owning the codec's chunk r),
and the reduce-scatter is the first half of the quantized all-reduce (``collectives.reduce_scatter``): each owner
gets its chunk's quantized sum, decoded from the bytes the all-gather would have sent, so it trains bitwise like
the replicated run with the same compression, with half its quantized bytes on the wire. Under clipping as well,
the whole quantized all-reduce runs (the replicated run's bytes): each rank needs every whole decoded gradient for
its norm, and then cuts its chunks from them.

With error feedback each rank keeps the replicated run's residuals (what its quantization of the others' chunks and
the re-quantization of its own chunk's sum lost) and adds them to the next step's gradients: bitwise the replicated
run with error feedback.

Under ``balance`` every rank runs the same microbatch shape and plans under the smallest device's memory and the
slowest device's speed (driver/modes/balance.py), so the ranks' gathers match as they must; the digest check below still
names any difference.

fp16/bf16 compression and adaptive bits average the gradients by the replicated run's own all-reduce (its
``Communicator``: the warm-up's fp32 sends, the chosen bits, the residuals, the generator's draws), and each rank keeps
its chunks of the result (``PackShares.allreduce``): bitwise the replicated run, at its bytes on the wire (twice a
reduce-scatter's). Their chunks are cut as fp32 buffers are, once: adaptive bits change the codec's buffers when
they are chosen, and a cut that followed them would move the live state between ranks mid-training.

On a CUDA device the chunks are pinned host memory, cut once; a gather's collective runs on the copy thread on host
tensors (into a pinned staging buffer, allocated once) and its copies to the device on the copy stream, behind an
event the ``wait`` makes the compute stream wait for; a reduce-scatter's gradients come to the host on the copy-out
stream, and the host thread's collective starts once their event has passed (runtime/partitioned/).

What is not built yet is refused at compile with a ``ConfigError`` (``check_config``): device steps, devices other
than CUDA and the CPU, the ondemand policy, and optimizers that are not element-wise.

A weight two packs read (a tied embedding and head) is partitioned with the pack that steps it; the other pack's
``swap_in`` becomes a ``gather`` too, of the segments of the first pack's chunks that hold the weight
(``partitioned.gathered``), so the network and the report count it.
"""
from __future__ import annotations

import time

from harmony.base.errors import ConfigError
from harmony.base.tiers import Tier
from harmony.compiler.ir import PassReport, PassResult, Program, calls, copy_graph
from harmony.passes import compress
from harmony.runtime import ops, partitioned
from harmony.runtime.comm.compression import NO_COMPRESSION, spec_for
from harmony.runtime.optim import elementwise, group_of
from harmony.runtime.plan import optim_state_bytes

NAME = "shard"
REQUIRES = {"communication", "residency"}
PROVIDES = {"partitioned_state"}
AFTER = {"prefetch"}      # it rewrites the swap_ins where the prefetch pass has put them
FULL = "full"


def check_config(cfg, given_kwargs: dict) -> None:
    """Refuse what ``shard_state="full"`` does not do yet, naming what to use instead; settle the optimizer's
    implementation (an element-wise one) and the default ``optimizer_on`` (``Tier.HOST``) on ``cfg`` (a
    CompileConfig)."""
    instead = "use shard_state=True (ZeRO stage 1: optimizer state sharded, weights replicated), which supports it"
    kind = str(cfg.device).split(":")[0]
    refused = [
        (cfg.optimizer_on == Tier.DEVICE, f"optimizer_on={Tier.DEVICE!r} (partitioned packs step on the host): use "
                                          f"optimizer_on={Tier.HOST!r} or 'auto', or {instead}"),
        (kind not in ("cpu", "cuda", "meta"),   # meta: a plan to simulate, never run (no collective either)
         f"device={cfg.device!r} (the gathers are gloo collectives on host tensors, whose copies to the device "
         f"are built for CUDA devices and the CPU): use device='cuda' or 'cpu', or {instead}"),
        (cfg.policy == "ondemand", f"policy='ondemand': use policy='harmony', or {instead}"),
        (kind != "meta" and not host_collectives(default_backend()),
         f"a default process group of backend {default_backend()!r} (its reduce-scatters and the ranks' words "
         f"on a step are collectives on host tensors, which NCCL does not take): call "
         f"torch.distributed.init_process_group('cpu:gloo,cuda:nccl') (or 'gloo') before compile"),
    ]
    for bad, why in refused:
        if bad:
            raise ConfigError(f"shard_state='full' does not support {why}")
    if cfg.optimizer_on == "auto":
        cfg.optimizer_on = Tier.HOST
    if not elementwise(cfg.optimizer, cfg.optimizer_kwargs):
        plain = {k: v for k, v in cfg.optimizer_kwargs.items() if k != "fused"}
        if "fused" not in given_kwargs and elementwise(cfg.optimizer, plain):
            cfg.optimizer_kwargs = plain       # torch's fused kernel rounds a chunk apart from the whole: its loop
            return
        raise ConfigError(f"shard_state='full' steps each rank's flat chunk of the parameters, which needs an "
                          f"element-wise optimizer; {cfg.optimizer.__name__}({cfg.optimizer_kwargs}) updates a "
                          f"chunk differently from the whole tensor: use AdamW, Adam or SGD (without fused=True), "
                          f"or {instead}")


def default_backend() -> str | None:
    """The default process group's backend (None where there is none)."""
    import torch.distributed as dist
    return str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else None


def host_collectives(backend: str | None) -> bool:
    """Whether a default group of ``backend`` runs collectives on host tensors: gloo's, alone or beside NCCL (as
    ``'cpu:gloo,cuda:nccl'``, which torch's ``'undefined'``, no backend named, stands for); no group at all."""
    return backend is None or backend == "undefined" or "gloo" in backend


def _quantized(cfg) -> bool:
    return cfg.compression is not None and cfg.compression.kind == "quantized"


def through_allreduce(cfg) -> bool:
    """Whether the gradients are averaged by the replicated run's all-reduce, each rank keeping its chunks
    (``PackShares.allreduce``): fp16 or bf16 compression, whose reduce-scatter half is not built, and adaptive
    bits, whose codec buffers change once the bits are chosen (the chunks are cut once, as fp32 buffers)."""
    c = cfg.compression
    return c is not None and (c.kind in ("fp16", "bf16") or (c.kind == "quantized" and getattr(cfg, "adaptive", False)))


def run(program: Program, ctx) -> PassResult:
    start = time.perf_counter()
    cfg, plan = program.config, program.plan
    report = PassReport("shard: parameters, gradients and optimizer state partitioned over ranks (ZeRO-3)")
    if getattr(cfg, "shard_state", None) != FULL:
        report.notes.append("shard_state is not 'full': every rank keeps its whole copy of the weights")
        return PassResult(program, report)
    world, rank = sharing(program)
    owned = compress.owned_grads(program)
    base = cfg.compression or NO_COMPRESSION
    specs = {n: spec_for(t, base, cfg.min_size) for named in owned.values() for n, t in named}
    _, which = group_of([n for s in plan.packs for n in s.stepped], cfg.param_groups)
    via = through_allreduce(cfg)
    for p, named in owned.items():
        _check_pack(plan, p)
        numel = {n: t.numel() for n, t in named}
        groups = plan.comm_groups.get(p) or [[n for n, _ in named]]
        record = plan.at(p)
        record.shares = partitioned.layout([[(n, numel[n]) for n in g] for g in groups], world, rank, which,
                                           specs=None if via else specs, fractions=cfg.state_shares,
                                           pairwise=cfg.clip_grad_norm is None and not via)   # clipping: whole
        record.shares.padded = base.kind == "none"     # where the replicated run's words ride (its buffers padded)
        if via:
            _replicated_bytes(record.shares, groups, dict(named), specs, world)
        _count_share(program, plan.packs[p], record.shares, dict(named))
    program.schedule = rewrite(program.schedule, plan, world, fp32=cfg.compute_dtype is None)
    if not getattr(cfg, "offline", False):     # (not a peer's plan made here: driver/modes/pipeline_plan.py)
        _check_same_collectives(program.schedule, _grid(plan), cfg.rank)
    if partitioned.step_stats not in program.step_hooks:
        program.step_hooks.append(partitioned.step_stats)
    report.rows, report.totals = _rows(program, owned), _totals(program, owned)
    report.totals["seconds"] = time.perf_counter() - start
    how = ("equal elements" if cfg.state_shares is None else
           "the balance plan's state shares " + ", ".join(f"{f:.3f}" for f in cfg.state_shares))
    report.notes.append(
        f"each of the {world} ranks{_over(plan)} keeps one contiguous chunk of every pack's parameters ({how}, cut in "
        f"the all-reduce's fused buffers) and its optimizer state on its host; a pack's weights come to the device "
        f"by an all-gather of the chunks (gather), its gradients go to their owners by a reduce-scatter "
        f"(reduce_scatter), each rank steps its chunk, and nothing is broadcast after the step")
    if via:
        report.notes.append(
            f"{'adaptive bits' if getattr(cfg, 'adaptive', False) else cfg.compression.kind}: each reduce_scatter "
            f"runs the replicated run's all-reduce of the gradients (its codec, warm-up and random draws) and keeps "
            f"this rank's chunks, so it sends the all-reduce's bytes (twice a reduce-scatter's); the chunks are cut as "
            f"fp32 buffers, once")
    return PassResult(program, report)


def _grid(plan):
    return getattr(getattr(plan, "stage", None), "grid", None)


def sharing(program: Program) -> tuple[int, int]:
    """(ranks, this rank's place among them) that share each pack's state: the job's data-parallel ranks; in a grid
    (``parallel=("pipeline", "data")``) the replica group of this rank's stage, one rank per pipeline."""
    grid, cfg = _grid(program.plan), program.config
    return (cfg.world_size, cfg.rank) if grid is None else (grid.replicas, grid.replica)


def _over(plan) -> str:
    grid = _grid(plan)
    return "" if grid is None else (f" of stage {grid.stage}'s replica group (job ranks "
                                    f"{','.join(map(str, grid.replica_ranks()))})")


def _check_pack(plan, p: int) -> None:
    r = plan.at(p)
    why = ("it steps on the device" if r.step_on != Tier.HOST else
           "the plan keeps some of its state on the device" if r.kept or r.device_parts or r.optim_kept else "")
    if why:
        # the swap pass swaps every partitioned pack whatever the room (passes/swap): only a swap choice handed to
        # compile can keep its state resident
        fix = ("let the swap pass choose what moves (do not hand it a choice that keeps state resident)"
               if r.step_on == Tier.HOST else f"pass optimizer_on={Tier.HOST!r}")
        raise ConfigError(f"shard_state='full' partitions packs that step on the host with their state there, but "
                          f"pack {p} ({plan.packs[p].name}): {why}; {fix}, or use shard_state=True")


def _replicated_bytes(shares, groups: list[list[str]], tensors: dict, specs: dict, world: int) -> None:
    """``allreduce`` shares: each segment sends its part (by elements) of what the replicated run's all-reduce of its
    group sends (adaptive: uniform bits, which the chosen bits may only undercut, as the compress pass counts)."""
    shares.allreduce = True
    for call, names in enumerate(groups):
        segs = [seg for seg in shares.segments if seg.call == call]
        whole = compress.predict_wire([tensors[n] for n in names], [specs[n] for n in names], world)
        total = sum(seg.total for seg in segs)
        for seg in segs:
            seg.sent = whole * seg.total // total


def _count_share(program, spec, shares, tensors: dict) -> None:
    """The pack's record counts this rank's chunk: its fp32 masters and the optimizer state of its pieces."""
    size = next(iter(tensors.values())).element_size()
    spec.master_bytes = size * shares.elements()
    spec.optim_bytes = sum(optim_state_bytes(program.optim_profile, size * (q.end - q.start)) for q in shares.pieces)


def rewrite(graph, plan, world: int, fp32: bool = True):
    """A copy of ``graph``: a partitioned pack's weights swap in by ``gather``, its gradients go by
    ``reduce_scatter`` instead of the all-reduce. A carried gather that is its pack's last before the step starts
    the step's read there (``reads``): of the optimizer state alone where the device copy holds the fp32 weights
    (``fp32``: the step takes this rank's chunks from it), else of the whole file."""
    graph = copy_graph(graph)
    k = 0
    for n in calls(graph):
        pack = n.args[0] if n.args and isinstance(n.args[0], int) else None
        if pack is None or pack >= len(plan.packs):
            continue
        if n.target is ops.swap_in and n.args[1] == "params" and partitioned.gathered(
                plan, pack, n.kwargs.get("held", n.args[2] if len(n.args) > 2 else ())):
            # its weights, or a weight another pack partitions (tied): gathered from the chunks
            n.target = partitioned.gather
            n._rename(f"gather_{k}")
            k += 1
        elif n.target is ops.allreduce and plan.at(pack).shares is not None:
            weight = n.kwargs.get("weight")       # a balanced rank's share of the average
            codec = {key: v for key, v in n.kwargs.items() if key not in ("world", "where", "sync", "weight")}
            kind = n.args[1] if len(n.args) > 1 else n.kwargs.get("kind", "none")
            n.target, n.args = partitioned.reduce_scatter, (pack,)
            n.kwargs = {"world": world, **({"weight": weight} if weight is not None else {}),
                        # the replicated run's all-reduce, which averages these gradients (PackShares.allreduce)
                        **({"comm": {"kind": kind, **codec}} if plan.at(pack).shares.allreduce else {})}
            n._rename(f"rs{pack}")
    last = {}
    for n in calls(graph):
        if _gathers(n):
            last[n.args[0]] = n
        elif ops.op_of(n).steps and n.args[0] in last:
            g = last.pop(n.args[0])
            if g.kwargs.get("carried"):
                g.kwargs = {**g.kwargs, "reads": "state" if fp32 else "file"}
    return graph


def _gathers(node) -> bool:
    """Whether ``node`` brings its pack's weights from every rank's chunks (a ``gather``)."""
    op = ops.op_of(node)
    return op.fetches and op.partitioned


def _check_same_collectives(graph, grid=None, rank: int | None = None) -> None:
    """Every rank must gather and reduce-scatter the same packs in the same order, with the same carried copies
    (runtime/partitioned/carry.py): a digest compared over the ranks (a grid's: over each replica group, whose ranks
    hold the same packs), so a difference is named at compile time."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or (rank is not None and rank != dist.get_rank()):
        return
    compress.check_same_plan(repr([(n.target.__name__, n.args[0], bool(n.kwargs.get("carried")))
                                   for n in calls(graph) if ops.op_of(n).partitioned]),
                             what="order of gathers and reduce-scatters (shard_state='full')",
                             advice="every rank must plan the same packs and swaps, since each gather is a collective: "
                                    "give every rank the same memory_budget and host_memory_budget",
                             among=None if grid is None else grid.replica_ranks())


def _rows(program, owned) -> list[dict]:
    plan = program.plan
    gathers = {}
    for n in calls(program.schedule):
        if _gathers(n):
            gathers[n.args[0]] = gathers.get(n.args[0], 0) + 1
    rows = []
    for p in sorted(owned):
        s = plan.at(p).shares
        got = 4 * sum(partitioned.received(s, k) for k in range(len(s.segments)))
        spec = plan.packs[p]
        rows.append(dict(pack=p, layers=spec.name, elements=s.elements(-1), segments=len(s.segments),
                         share_elements=s.elements(), pieces=len(s.pieces), master_share_MiB=spec.master_bytes / 2**20,
                         optim_share_MiB=spec.optim_bytes / 2**20, gathers=gathers.get(p, 0),
                         gather_in_MiB=got / 2**20,
                         reduce_scatter_out_MiB=sum(g.sent for g in s.segments) / 2**20))
    return rows


def _totals(program, owned) -> dict:
    plan = program.plan
    shares = [plan.at(p).shares for p in owned]
    world, rank = sharing(program)
    per_rank = [sum(4 * s.elements(r) for s in shares) for r in range(world)]
    whole = sum(4 * s.elements(-1) for s in shares)
    wire = {"gather": 0, "reduce_scatter": 0}
    for n in calls(program.schedule):
        s = plan.at(n.args[0]).shares if ops.op_of(n).partitioned else None
        if _gathers(n):
            held = n.kwargs.get("held", n.args[2] if len(n.args) > 2 else ())
            wire["gather"] += partitioned.gather_bytes(plan, n.args[0], held)
        elif s is not None:
            wire["reduce_scatter"] += sum(seg.sent for seg in s.segments)
    disk = _disk_bytes(program, owned)
    return dict(world_size=world, rank=rank, partitioned_packs=len(shares),
                master_bytes_whole=whole, master_bytes_this_rank=per_rank[rank],
                master_bytes_by_rank=per_rank,
                optim_bytes_this_rank=sum(plan.packs[p].optim_bytes for p in owned),
                gather_wire_bytes_per_step=int(wire["gather"]),
                reduce_scatter_wire_bytes_per_step=int(wire["reduce_scatter"]),
                **({"disk_read_bytes_per_step": disk[0], "disk_write_bytes_per_step": disk[1]} if disk[1] else {}))


def _disk_bytes(program, owned) -> tuple[int, int]:
    """This rank's disk bytes read and written per step for its shares on disk (runtime/partitioned/disk.py): each
    pack's file (its chunks where its weights are on disk, and their optimizer state) is written once and read
    once, by the last gather before the step where the weights are there, and each earlier gather reads the chunks,
    but for one that takes the copy the pack's last step carried (``carried``, not the last one:
    runtime/partitioned/carry.py)."""
    plan = program.plan
    gathers = [n.args[0] for n in calls(program.schedule) if _gathers(n)
               and (not n.kwargs.get("carried") or n.kwargs.get("reads") == "file")]
    read = written = 0
    for p in owned:
        record, spec = plan.at(p), plan.packs[p]
        if record.optim_on != Tier.DISK:
            continue
        weights = spec.master_bytes if record.master_on == Tier.DISK else 0
        written += weights + spec.optim_bytes
        read += spec.optim_bytes + weights * gathers.count(p)
    return read, written


