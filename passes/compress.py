"""compress: average each pack's gradients across data-parallel ranks, right after its last backward.

With ``world_size > 1`` every pack that owns trainable parameters gets one ``allreduce(pack, kind, ...)`` op right
after the backward that completes its gradients (CGX / DDP): the op averages the pack's gradients over ranks in place,
compressed as the ``compression`` spec says (tensors of dimension <= 1 or fewer than ``min_size`` elements travel
uncompressed, fused into one buffer: CGX's rule for biases and norms). In a grid (``parallel=("pipeline", "data")``)
a rank's packs are averaged over the ranks holding the same packs in the other pipelines (its replica group).

Every collective runs on the runtime's one host thread, in schedule order, so every rank issues the same collectives
in the same order. How it overlaps compute depends on where the optimizer steps (the offload pass decided that):

* **host step** (the training state does not fit the budget): the swap pass releases the pack's gradients to the host
  after its backward; ``allreduce(..., where='host')`` then averages the host copies on the host thread and the host
  step, queued behind it on the same thread, updates the weights -- while the device runs the next pack's backward.
* **device step, all state resident**: the all-reduce of pack ``p`` runs on the host thread while the device runs the
  backward of the next pack; a ``wait`` joins it before the next all-reduce is issued (one in flight, so one
  communication buffer on the device) and, in the ``harmony`` policy, pack ``p``'s step moves after that wait.
* **device step with swapped state** (``optimizer_on='device'`` under a tight budget) and the ``ondemand`` policy:
  synchronous (``sync=True``); deferring the step would swap the pack's state in twice.

The pass also makes every rank start equal (rank 0's parameters and buffers are broadcast,
as DDP's constructor does) and checks that every rank compiled the same communication plan.

Ranks may cut the model into different packs (their memory budgets differ: ``balance``, or simply different
``memory_budget``s): a pack's all-reduce then runs one collective per group of its parameters that every rank's packs
agree on (``comm_groups``), so every rank still issues the same collectives over the same tensors in the same order.
Ranks of a balanced plan train on different numbers of samples; each passes ``weight`` = its samples / the global
batch, and the all-reduce sums the weighted mean gradients (``collectives.allreduce(weight=...)``).
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import torch
import torch.fx

from harmony.base.errors import ConfigError
from harmony.base.tiers import Tier
from harmony.base.units import nbytes
from harmony.compiler.ir import PassReport, PassResult, Program, add_call, calls, copy_graph
from harmony.compiler.meta import SCHEDULE
from harmony.passes.broadcast import broadcast_state
from harmony.passes.offload import everything_fits
from harmony.passes.tied import tied_apart
from harmony.runtime import ops, shard  # shard registers sync_state
from harmony.runtime.comm.collectives import DEFAULT_FUSION_BYTES, ring_bytes
from harmony.runtime.comm.communicator import comm_stats
from harmony.runtime.comm.compression import (
    DEFAULT_MIN_SIZE,
    NO_COMPRESSION,
    CompressionSpec,
    spec_for,
    wire_bytes,
)
from harmony.runtime.comm.failures import guarded
from harmony.runtime.comm.grid import groups as grid_groups
from harmony.runtime.pipeline import share_norms

NAME = "compress"
REQUIRES = {"schedule", "placement"}
PROVIDES = {"communication"}
ADAPTIVE_WARMUP = 3          # steps measuring quantization errors (sent in fp32) before bits are fixed


def spec_kwargs(spec: CompressionSpec) -> dict:
    """The fields of ``spec`` that differ from the defaults, as the allreduce op's keyword arguments."""
    default = CompressionSpec(spec.kind)
    return {k: getattr(spec, k) for k in ("bits", "bucket_size", "rounding", "error_feedback", "meta")
            if getattr(spec, k) != getattr(default, k) or (spec.kind == "quantized" and k == "bits")}


def label(spec: CompressionSpec, adaptive: bool = False) -> str:
    if adaptive:
        return f"adaptive bits (total error <= uniform {spec.bits}-bit)"
    if spec.kind == "quantized":
        return f"{spec.bits}-bit, buckets of {spec.bucket_size}, {spec.rounding} rounding" + \
            (", error feedback" if spec.error_feedback else "")
    return {"none": "fp32 (uncompressed)"}.get(spec.kind, spec.kind)


# -- bytes on the wire, predicted exactly as collectives.allreduce counts them --------------------------
def predict_wire(tensors, specs, world: int, fusion_bytes: int = DEFAULT_FUSION_BYTES) -> int:
    """Bytes one rank sends for ``allreduce(tensors, specs)`` (specs already passed through ``spec_for``)."""
    groups: dict = {}
    for t, s in zip(tensors, specs):
        groups.setdefault(s, []).append(t.numel())
    total = 0
    for s, sizes in groups.items():
        cur: list[int] = []
        for n in sizes + [None]:
            if n is not None and not (cur and 4 * (sum(cur) + n) > fusion_bytes):
                cur.append(n)
                continue
            if cur:
                total += _job_bytes(cur, s, world)
            cur = [n] if n is not None else []
    return total


def _job_bytes(sizes, s: CompressionSpec, world: int) -> int:
    n = sum(sizes)
    if s.kind == "none":
        return ring_bytes(4 * n, world)
    if s.kind in ("fp16", "bf16"):
        return ring_bytes(2 * n, world)
    off = sum(-(-k // s.bucket_size) * s.bucket_size for k in sizes)
    align = s.bucket_size
    chunk = -(-off // (world * align)) * align if off >= world * align else -(-off // world)
    return 2 * (world - 1) * wire_bytes(chunk, s.bits, s.bucket_size, s.meta_dtype)


# -- the pass ---------------------------------------------------------------------------------------
def _emit(graph, after, fn, args, kwargs, name):
    with graph.inserting_after(after):
        node = add_call(graph, fn, args, kwargs)
    node._rename(name)       # a readable name in the plan and in the runtime's trace events
    node.meta[SCHEDULE] = {"pack": args[0] if isinstance(args[0], int) else None}
    return node


def insert(graph: torch.fx.Graph, packs: list[int], plan, kwargs: dict, policy: str, sync: bool) -> dict:
    """Insert the all-reduces (and the waits that join them) into ``graph``; returns pack -> overlap mode."""
    last_bwd, steps = {}, {}
    for n in calls(graph):
        op = ops.op_of(n)
        if op.runs_backward:
            last_bwd[n.args[0]] = n
        elif op.steps:
            steps[n.args[0]] = n
    order = {n: i for i, n in enumerate(calls(graph))}
    issue = sorted((p for p in packs if p in last_bwd), key=lambda p: order[last_bwd[p]])
    ars, mode = {}, {}
    for p in issue:
        host = plan.at(p).step_on == Tier.HOST
        kw = dict(kwargs, where=Tier.HOST.value) if host else dict(kwargs, sync=True) if sync else dict(kwargs)
        ars[p] = _emit(graph, last_bwd[p], ops.allreduce, (p, kw.pop("kind")), kw, f"ar{p}")
        mode[p] = ("host thread, before the host step" if host else
                   "synchronous" if sync else "host thread, joined by wait")
    if sync:
        return mode
    device = [p for p in issue if plan.at(p).step_on != Tier.HOST]
    for k, p in enumerate(device):       # one all-reduce in flight: join it before the next is issued
        nxt = ars[device[k + 1]] if k + 1 < len(device) else None
        step = steps.get(p)
        order = {n: i for i, n in enumerate(calls(graph))}
        if nxt is not None and (policy == "harmony" or step is None or order[nxt] < order[step]):
            _emit(graph, nxt.prev, ops.wait, (ars[p],), {}, f"join_ar{p}")
            if step is not None and order[step] < order[nxt]:
                nxt.append(step)      # harmony: the step follows the next pack's backward, which hides the all-reduce
            mode[p] += "; overlaps the next pack's backward"
        elif step is not None:
            _emit(graph, step.prev, ops.wait, (ars[p],), {}, f"join_ar{p}")
            mode[p] += ("; overlaps the ops before its step" if order[step] > order[ars[p]] + 1 else
                        "; nothing to overlap: its step follows at once")
    _join_before_norms(graph)
    return mode


def _join_before_norms(graph: torch.fx.Graph) -> None:
    """A grid's pipeline rank under clipping: the norms' exchange (``share_norms``) reads the averaged gradients,
    so every all-reduce is joined before it (the waits that followed it move up; the steps still follow)."""
    norms = next((n for n in calls(graph) if n.target is share_norms), None)
    if norms is None:
        return
    order = {n: i for i, n in enumerate(calls(graph))}
    for n in calls(graph):
        if n.target is ops.wait and order[n] > order[norms] and any(
                a.target is ops.allreduce for a in n.all_input_nodes):
            norms.prepend(n)


def insert_sync(program: Program, world: int) -> dict:
    """A ``sync_state`` after the last op of the iteration, when there is something to send: the parameters
    of sharded optimizer state (plan.state_owner) and the buffers forward mutates (from rank 0)."""
    plan = program.plan
    sizes = dict(program.gm.named_buffers())
    plan.sync_buffers = {n: nbytes(sizes[n])
                         for n in sorted({b for s in plan.packs for b in s.mutated}) if n in sizes}
    if not plan.state_owner and not plan.sync_buffers:
        return {}
    node = _emit(program.schedule, calls(program.schedule)[-1], shard.sync_state, (world,), {}, "sync_state")
    node.meta[SCHEDULE] = {"pack": None}
    out = dict(sync_buffer_bytes=sum(plan.sync_buffers.values()))
    if plan.state_owner:
        stepped = [n for s in plan.packs for n in s.stepped]
        total = sum(plan.state_bytes.values()) or 1
        out.update(stepped_params=len(stepped),
                   stepped_share=sum(plan.state_bytes.get(n, 0) for n in stepped) / total,
                   optimizer_state_MiB=sum(s.optim_bytes for s in plan.packs) / 2**20,
                   sync_param_bytes=sum(b for n, b in plan.state_bytes.items() if plan.state_owner[n] != plan.rank))
    return out


def owned_grads(program: Program) -> dict[int, list[tuple[str, torch.Tensor]]]:
    params = dict(program.gm.named_parameters())
    out = {}
    for spec in program.plan.packs:   # in the model's order: ``owned`` comes from a set, whose order varies by process
        mine = set(spec.owned)
        got = [(n, t) for n, t in params.items() if n in mine and t.requires_grad]
        if got:
            out[spec.index] = got
    return out


FAILED = -1      # the digest a rank sends when it failed to compile (``report_failure``)

def report_failure(what: str) -> None:
    """Called by a rank whose compile failed before this pass: the others, waiting in ``check_same_plan``, stop too."""
    check_same_plan(None, failed=what)


SAME_PLAN = ("every rank must compile the same model with the same policy, global batch, compression and min_size "
             "(packs and memory budgets may differ)")


def check_same_plan(signature: str | None, failed: str | None = None, what: str = "communication plan",
                    advice: str = SAME_PLAN, among: list[int] | None = None) -> None:
    """Every rank must issue the same collectives: compare a digest of the communication plan (with the ranks
    ``among``, job ranks, where only those issue them together: a grid's replica group; gathered from every rank
    all the same, so a rank that failed to compile is heard)."""
    import torch.distributed as dist

    digest = FAILED if failed else int.from_bytes(hashlib.sha256(signature.encode()).digest()[:7], "little")
    mine = torch.tensor([digest], dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    guarded(f"the ranks' check of their {what}", dist.all_gather, every, mine)
    if failed:
        return
    dead = [r for r, d in enumerate(every) if int(d) == FAILED]
    if dead:
        error = ConfigError(f"ranks {dead} could not compile their plans (their errors are in their logs; a "
                            f"BudgetError there names the budget they need), so no rank trains: fix them and start "
                            f"again")
        error.harmony_echo = True    # another rank's failure heard: the compile's agreement names it (driver/agree.py)
        raise error
    differ = [r for r, d in enumerate(every) if int(d) != digest and (among is None or r in among)]
    if differ:
        raise ConfigError(f"rank {dist.get_rank()} compiled another {what} than ranks {differ}: {advice}")


def comm_groups(program: Program, owned: dict[int, list], issue: list[int]) -> dict[int, list[list[str]]]:
    """Each pack's gradients cut into all-reduce groups that every rank issues alike.

    Ranks with different memory budgets cut the model into different packs, so one all-reduce per pack would not
    match across ranks. Each parameter is keyed by the position, on every rank, of the all-reduce that carries it
    (``issue``: this rank's packs in the order their all-reduces run); parameters with equal keys form a group (the
    common refinement of every rank's packs), groups run in key order, and a pack's all-reduce reduces its groups
    one after another. With equal packs on every rank a group is a pack. Needs the live process group (one
    ``all_gather_object``)."""
    import torch.distributed as dist

    position = {p: i for i, p in enumerate(issue)}
    pack_of = {n: p for p, named in owned.items() for n, _ in named}
    names = [n for n, t in program.gm.named_parameters() if n in pack_of]      # the model's order on every rank
    mine = [position[pack_of[n]] for n in names]
    every: list = [None] * dist.get_world_size()
    guarded("the ranks' exchange of their packs' all-reduce order", dist.all_gather_object, every, mine)
    keys = {n: tuple(pos[i] for pos in every) for i, n in enumerate(names)}
    order = sorted(set(keys.values()))
    for a, b in zip(order, order[1:]):
        if any(x > y for x, y in zip(a, b)):       # packs are contiguous runs of one graph: never happens
            raise ConfigError(f"ranks all-reduce gradients in orders that cannot be matched (positions {a} and "
                              f"{b} per rank); compile every rank with the same policy")
    me = dist.get_rank()
    groups: dict[int, list[list[str]]] = {}
    for key in order:
        group = [n for n in names if keys[n] == key]
        groups.setdefault(issue[key[me]], []).append(group)
    return groups


@dataclass(frozen=True)
class _Comm:
    """What this rank's all-reduces are asked to do, read once from the config."""
    world: int
    spec: CompressionSpec
    adaptive: bool
    warmup: int            # steps sending fp32 while the adaptive codec measures errors (0: not adaptive)
    min_size: int
    weight: float | None   # a balanced rank's share of the global batch (None: every rank's is equal)
    batch_size: int
    global_batch: int
    policy: str

    @classmethod
    def of(cls, cfg, world: int) -> _Comm:
        adaptive = bool(getattr(cfg, "adaptive", False))
        return cls(world=world, spec=cfg.compression or NO_COMPRESSION, adaptive=adaptive,
                   warmup=getattr(cfg, "adaptive_warmup", ADAPTIVE_WARMUP) if adaptive else 0,
                   min_size=cfg.min_size, weight=getattr(cfg, "sample_weight", None), batch_size=cfg.batch_size,
                   global_batch=getattr(cfg, "global_batch", None) or cfg.batch_size * world, policy=cfg.policy)

    def kwargs(self) -> dict:
        return _allreduce_kwargs(self.spec, self.world, self.min_size, self.warmup, self.weight)


def run(program: Program, ctx) -> PassResult:
    start = time.perf_counter()
    cfg, plan = program.config, program.plan
    world = getattr(cfg, "world_size", 1) or 1
    report = PassReport("compress: gradient all-reduce across ranks")
    if not getattr(cfg, "data_parallel", False) or world <= 1:
        report.notes.append("a pipeline: each rank steps its own packs, no gradient to average, nothing inserted"
                            if getattr(plan, "stage", None) is not None else
                            "one rank: no gradient to average, nothing inserted")
        report.totals = dict(world_size=world, allreduces=0)
        return PassResult(program, report)
    if step_stats not in program.step_hooks:      # sm.stats: the wire's bytes, seconds and bits of each step
        program.step_hooks.append(step_stats)
    grid = getattr(getattr(plan, "stage", None), "grid", None)
    comm = _Comm.of(cfg, world if grid is None else grid.replicas)     # a grid: over the stage's replicas
    owned = owned_grads(program)
    broadcast = _agree_replicas(program, comm, owned, grid) if grid else _agree_across_ranks(program, comm, owned)
    mode, overlap = _insert_allreduces(program, owned, comm)
    shard = insert_sync(program, comm.world)     # a grid's broadcasts: over the stage's replica group
    _report_plan(report, plan, comm, owned, mode, shard, broadcast, start)
    report.notes.append(overlap)
    return PassResult(program, report)


def _agree_across_ranks(program: Program, comm: _Comm, owned: dict) -> int | None:
    """With a live process group of ``comm.world`` ranks: check that every rank compiled the same communication plan,
    broadcast rank 0's parameters and buffers, and cut the packs into groups every rank's packs agree on
    (``plan.comm_groups``). Returns the bytes broadcast; None without a live group (nothing to agree with)."""
    import torch.distributed as dist
    live = dist.is_available() and dist.is_initialized() and dist.get_world_size() == comm.world
    if not live:
        return None
    signature = repr((comm.world, comm.spec, comm.adaptive, comm.warmup, comm.min_size, comm.policy,
                      comm.global_batch, comm.weight is None,
                      sorted((n, tuple(t.shape)) for p in owned for n, t in owned[p])))
    check_same_plan(signature)
    broadcast = broadcast_state(program)
    position = {n: i for i, n in enumerate(calls(program.schedule))}
    last_bwd = {n.args[0]: position[n] for n in position if ops.op_of(n).runs_backward}
    program.plan.comm_groups = comm_groups(program, owned, sorted(owned, key=lambda p: last_bwd.get(p, -1)))
    return broadcast


def _agree_replicas(program: Program, comm: _Comm, owned: dict, grid) -> int | None:
    """``_agree_across_ranks`` in a grid for a live rank's own plan: the ranks check their codecs agree; this stage's
    weights come from pipeline 0's rank; a pack's gradients are a group (ZeRO-3's tied weights: ``tied_apart``)."""
    import torch.distributed as dist
    if program.config.offline or not dist.is_initialized() or dist.get_rank() != program.config.rank:
        return None
    check_same_plan(repr((comm.world, comm.spec, comm.adaptive, comm.min_size, comm.policy, comm.global_batch)))
    sent = broadcast_state(program, {n for s in program.plan.packs for n in s.params + s.buffers},
                           src=grid.replica_ranks()[0], group=grid_groups(grid)[1][grid.stage])
    program.plan.comm_groups = tied_apart(owned, program.plan.stage.tied, program.config.shard_state == "full")
    return sent



def _insert_allreduces(program: Program, owned: dict, comm: _Comm) -> tuple[dict, str]:
    """All-reduce after each pack's last backward into ``program.schedule``: asynchronous where nothing swaps the
    gradients under it, else synchronous. Returns pack -> overlap mode and the note saying how they overlap."""
    plan, kwargs = program.plan, comm.kwargs()
    base = program.schedule
    host = any(plan.at(p).step_on == Tier.HOST for p in owned)
    sync = comm.policy == "ondemand"
    program.schedule = copy_graph(base)
    mode = insert(program.schedule, list(owned), plan, kwargs, comm.policy, sync)
    why = ""
    if not sync and not host and not everything_fits(program):
        program.schedule = copy_graph(base)
        mode = insert(program.schedule, list(owned), plan, kwargs, comm.policy, True)
        why = ("synchronous: the optimizer steps on the device and the pack's state is swapped, so its "
               "step must follow its backward at once (deferring it would swap the state in twice)")
    elif sync:
        why = "synchronous: the ondemand runtime moves state on the main thread as ops touch it"
    return mode, why or _overlap(host, mode)


def _report_plan(report: PassReport, plan, comm: _Comm, owned: dict, mode: dict, shard: dict,
                 broadcast: int | None, start: float) -> None:
    """The report's rows per pack, its totals (bytes on the wire per step against fp32's) and its notes."""
    spec, warmup = comm.spec, comm.warmup
    report.rows = rows = _rows(plan, owned, spec, comm.min_size, comm.world, mode)
    tot_wire, tot_fp32 = (round(sum(r[k] for r in rows) * 2**20) for k in ("wire_MiB", "fp32_MiB"))
    report.totals = dict(world_size=comm.world, compression=label(spec, comm.adaptive), allreduces=len(mode),
                         wire_bytes_per_step=tot_wire, fp32_bytes_per_step=tot_fp32,
                         ratio=tot_fp32 / tot_wire if tot_wire else 1.0, min_size=comm.min_size,
                         seconds=time.perf_counter() - start)
    if warmup:
        report.totals["warmup_wire_bytes_per_step"] = tot_fp32
    if broadcast is not None:
        report.totals["broadcast_bytes"] = broadcast
        report.notes.append("rank 0's parameters and buffers were broadcast to every rank (as DDP's constructor "
                            "does)" + ("; the buffers forward mutates (batch-norm statistics) are broadcast from "
                                       "rank 0 again after every step (sync_state), as DDP's broadcast_buffers does"
                                       if plan.sync_buffers else ""))
    report.notes.append(_average_note(comm.batch_size, comm.global_batch, comm.world, comm.weight))
    report.totals.update(shard)
    if shard.get("stepped_params"):
        report.notes.append(_shard_note(plan, comm.world, shard))
    if getattr(plan, "stage", None) is None and any(len(g) > 1 for g in plan.comm_groups.values()):
        report.notes.append("other ranks cut the model into other packs: a pack's all-reduce runs one collective per "
                            "group of parameters that every rank's packs agree on (column groups)")
    if warmup:
        report.notes.append(f"adaptive: the first {warmup} steps send fp32 and measure each layer's quantization "
                            f"error at 2, 3, 4, 6, 8 bits; then an integer program fixes bits per layer (total "
                            f"error <= uniform {spec.bits}-bit). Bytes above are uniform {spec.bits}-bit's; "
                            f"once chosen, bits per layer appear here (per pack) and in .stats['adaptive_bits']")


def _average_note(batch: int, global_batch: int, world: int, weight) -> str:
    """What the averaged gradients are: of the mean loss over the global batch, a balanced rank's weighted."""
    if weight is None:
        return (f"each rank runs this schedule on its own shard (example_batch is one rank's batch); gradients of the "
                f"loss scaled by 1/microbatches, averaged over {world} ranks, are the gradients of the mean loss over "
                f"the global batch of {global_batch}")
    return (f"balanced: this rank trains on {batch} of the global batch of {global_batch} samples; its mean gradient "
            f"is weighted by {batch}/{global_batch} = {weight:.4g} in the all-reduce (scaled by weight x {world} "
            f"before the average), so the update is the one a homogeneous cluster makes on the same global batch")


def _shard_note(plan, world: int, shard: dict) -> str:
    return (f"optimizer state sharded over the {world} ranks (ZeRO stage 1): this rank (rank {plan.rank}) steps and "
            f"keeps state for {shard['stepped_params']} of {len(plan.state_owner)} parameters "
            f"({shard['stepped_share']:.0%} of the parameter bytes); sync_state at the end of the iteration "
            f"broadcasts each rank's updated parameters to the others")


def _allreduce_kwargs(spec, world: int, min_size: int, warmup: int, weight) -> dict:
    """The keywords every all-reduce op of the plan carries: the codec, the world, and what differs from the
    defaults (``min_size``, the adaptive ``warmup``, a balanced rank's sample ``weight``)."""
    kwargs = dict(kind=spec.kind, world=world, **spec_kwargs(spec))
    if min_size != DEFAULT_MIN_SIZE:
        kwargs["min_size"] = min_size
    if warmup:
        kwargs["warmup"] = warmup
    if weight is not None:     # a balanced plan: this rank's share of the global batch (compiler/balance.py)
        kwargs["weight"] = weight
    return kwargs


def _rows(plan, owned: dict, spec, min_size: int, world: int, mode: dict) -> list[dict]:
    """The report's row per pack: its tensors and all-reduce groups, the bytes fp32 and the codec put on the wire
    (adaptive: uniform bits, which its choice may only undercut), and how its all-reduce overlaps."""
    rows = []
    for p in sorted(owned, key=lambda q: -q):
        ts = [t for _, t in owned[p]]
        named = dict(owned[p])
        groups = [[named[n] for n in g] for g in plan.comm_groups.get(p, [])] or [ts]
        fp32 = sum(predict_wire(g, [NO_COMPRESSION] * len(g), world) for g in groups)
        wire = sum(predict_wire(g, [spec_for(t, spec, min_size) for t in g], world) for g in groups)
        rows.append(dict(pack=p, layers=plan.packs[p].name, tensors=len(ts), groups=len(groups),
                         compressed=sum(spec_for(t, spec, min_size).lossy for t in ts),
                         elements=sum(t.numel() for t in ts), fp32_MiB=fp32 / 2**20, wire_MiB=wire / 2**20,
                         overlap=mode.get(p, "")))
    return rows


def _overlap(host: bool, mode: dict) -> str:
    """How the all-reduces overlap the compute: ``mode`` is ``insert``'s, ``host`` whether packs step on the host."""
    if host:
        return ("asynchronous: the host thread averages the gradients the swap pass released to the host, then "
                "steps the optimizer, while the device runs the next pack's backward")
    if any("next pack" in m for m in mode.values()):
        return ("asynchronous: each all-reduce runs on the host thread while the next pack's backward runs; one in "
                "flight at a time, and each pack steps once its all-reduce is joined")
    return ("not overlapped: all state fits in one pack, so its all-reduce follows the whole backward and its step "
            "waits for it (DDP overlaps buckets inside one backward with autograd hooks; the schedule's unit is the "
            "pack)")


# -- what a step measured (ScheduledModule.stats) -----------------------------------------------------
def step_stats(sm) -> dict:
    """Measured communication of the last step, for ``sm.stats``; fills adaptive bits into the report once."""
    got = comm_stats(sm.runtime)
    if got is None:
        return {}
    waited = sum(e.end - e.start for e in sm.runtime.events if e.name.startswith("join_ar"))
    out = dict(comm_wire_bytes=got["wire_bytes"], comm_fp32_bytes=got["fp32_bytes"],
               comm_ratio=got["fp32_bytes"] / got["wire_bytes"] if got["wire_bytes"] else 1.0,
               comm_seconds=got["seconds"], comm_wait_seconds=waited, comm_calls=got["calls"])
    bits = got.get("bits")
    if bits is not None:
        out["adaptive_bits"] = dict(bits["bits"])
        report = next((r for r in sm.program.reports if r.title.startswith("compress")), None)
        if report is not None and "adaptive_layer_bytes" not in report.totals:
            # the integer program's bytes count each quantized layer alone; the step's also count the
            # uncompressed tensors and the chunking of fused buffers
            report.totals.update(wire_bytes_after_warmup=got["wire_bytes"],
                                 adaptive_layer_bytes=bits["objective_bytes"],
                                 adaptive_uniform_bytes=bits["uniform_bytes"],
                                 adaptive_lower_bound_bytes=bits["lower_bound_bytes"],
                                 adaptive_solve_seconds=bits["solve_seconds"], adaptive_status=bits["status"])
            chosen = bits["bits"]
            for row in report.rows:      # bits: layers, e.g. "3:2 4:3" = two layers at 3 bits, three at 4
                hist: dict = {}
                for n in sm.plan.packs[row["pack"]].owned:
                    if n in chosen:
                        hist[chosen[n]] = hist.get(chosen[n], 0) + 1
                row["bits"] = " ".join(f"{b}:{k}" for b, k in sorted(hist.items())) or "-"
    return out
