"""stage: place the packs across the ranks of one node (``parallel="pipeline"``) and keep this rank's.

Every rank traces the same model and partitions it the same way, for the per-device budget; this pass
then (1) cuts packs further where there are fewer than ranks (the largest pack by predicted compute, at
the layer that halves it best), (2) places the packs: ``"contiguous"`` stages by an exact dynamic
program that minimises the largest predicted compute of a rank (forward, backward and recompute at the
planner's FLOP/s), so the fewest boundaries cross ranks (N - 1); or ``"round_robin"``, pack p on rank
p mod N, the Harmony paper's vPP, where consecutive packs run on different ranks at once but every
boundary crosses; (3) checks that the ranks agree on the packs and their placement (one all-gather of a
digest, as the compress pass does), and (4) restricts ``program.plan`` to this rank's packs, re-indexed
from 0, with the whole model's packs in ``plan.stage`` (runtime/pipeline.Stages). The passes after it
plan this rank's schedule, swaps and steps under its own budget, as for one device; the schedule pass
adds the ``recv`` and ``send`` of each microbatch's values at the boundaries that cross ranks
(passes/stage_schedule.py).

A weight packs on several ranks use (an embedding tied to the output head) is tied across those ranks, as Megatron's
embedding group: each keeps a full copy and its own optimizer state, owned by its earliest pack using it (whose
backward completes its gradient there), and the tied pass (passes/tied.py) sums the copies' gradients over exactly
those ranks before they step, so every copy takes the same update. A buffer forward writes may not be shared.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from harmony.base.errors import ConfigError
from harmony.base.units import nbytes
from harmony.compiler.config_checks import HYBRID
from harmony.compiler.ir import PassReport, PassResult, Program
from harmony.compiler.meta import PACK
from harmony.passes import compress
from harmony.passes.partition import build_packs, find_units, measure_kept, own_state
from harmony.passes.tied import own_tied, tie_copies
from harmony.runtime.comm.grid import Grid
from harmony.runtime.pipeline import Stages
from harmony.runtime.shard import owners_among

NAME = "stage"
REQUIRES = {"packs"}
PROVIDES = {"stages"}
PLACEMENTS = ("contiguous", "layers", "round_robin")


def grid_of(cfg) -> Grid | None:
    """This rank's grid under ``parallel=("pipeline", "data")`` (driver/modes/grid.py), else None."""
    size = getattr(cfg, "pipeline_size", None)
    if getattr(cfg, "parallel", None) != HYBRID or not size:
        return None
    return Grid(size, (cfg.world_size or 1) // size, cfg.rank)


def pipeline_ranks(cfg) -> list[int]:
    """The job ranks of this rank's pipeline, in stage order: the node's ranks (a grid's pipeline of them)."""
    grid = grid_of(cfg)
    return list(range(cfg.world_size)) if grid is None else grid.pipeline_ranks()


def check_config(cfg) -> None:
    """What ``parallel="pipeline"`` does not do yet, refused by name with what to use instead."""
    if (cfg.world_size or 1) < 2:
        raise ConfigError("parallel='pipeline' places packs across the ranks of one node: launch N >= 2 processes "
                          "with `torchrun --nproc_per_node N train.py`, or drop parallel= to train one process")
    refused = [(cfg.compression is not None and cfg.compression.kind != "none" or cfg.adaptive,
                "compression=", "no compression (there is no gradient all-reduce in a pipeline)"),
               (cfg.balance is not None, "balance=", "memory_budget= (one budget per device)"),
               (bool(cfg.shard_state), f"shard_state={cfg.shard_state!r}", "shard_state=None (each rank holds "
                                                                            "only its packs' state already)"),
               (cfg.data_parallel, "data_parallel=True", "data_parallel=None"),
               (cfg.policy == "ondemand", "policy='ondemand'", "policy='harmony' or 'sequential'"),
               (cfg.pipeline_group is not None and cfg.policy != "harmony", f"policy={cfg.policy!r} and "
                f"pipeline_group=", "policy='harmony' (the sequential policy runs one microbatch at a time)")]
    for bad, what, instead in refused:
        if bad:
            raise ConfigError(f"parallel='pipeline' with {what} is not supported yet: use {instead}, or "
                              f"parallel=None for data parallelism")


# -- (1) enough packs ------------------------------------------------------------------------------
def _cuts(program: Program, units) -> list[tuple[int, int]]:
    """The partition's packs as runs of layers (``build_packs`` marks each node with its pack)."""
    at = [u.nodes[0].meta[PACK] for u in units]
    starts = [i for i in range(len(units)) if i == 0 or at[i] != at[i - 1]]
    return list(zip(starts, starts[1:] + [len(units)]))


def enough_packs(program: Program, world: int) -> list[str]:
    """Cut the largest packs until there are ``world``; returns notes of the cuts made."""
    plan = program.plan
    if len(plan.packs) >= world:
        return []
    units = find_units(program)
    flops = [u.fwd_flops + u.bwd_flops for u in units]
    cuts = _cuts(program, units)
    while len(cuts) < world:
        splittable = [i for i, (b, e) in enumerate(cuts) if e - b > 1]
        if not splittable:
            raise ConfigError(f"parallel='pipeline' over {world} ranks needs at least {world} packs, but the model "
                              f"has {len(units)} layers (cut points); use fewer ranks (--nproc_per_node)")
        i = max(splittable, key=lambda j: sum(flops[cuts[j][0]:cuts[j][1]]))
        b, e = cuts[i]
        k = min(range(b + 1, e), key=lambda k: abs(sum(flops[b:k]) - sum(flops[k:e])))
        cuts[i:i + 1] = [(b, k), (k, e)]
    _rebuild(program, cuts, units)
    return [f"the partition made {len(plan.packs)} packs for {world} ranks: the largest were cut at layer "
            f"boundaries into {len(cuts)}"]


def balanced_stages(program: Program, world: int) -> list[str]:
    """``placement="layers"``: cut packs where the best contiguous stages over the layers (not the packs) end.

    The partition sizes packs for the device's budget, not for the pipeline: stages made of whole packs can be far
    from equal (two ranks of three packs each may differ by a third). The exact min-max DP over the layers' predicted
    compute (forward, backward, and the recompute of every pack but the last, as ``pack_seconds``) gives the stage
    boundaries; a pack that straddles one is cut there (a part of a pack fits wherever the pack did), and placing
    the packs then finds those stages again. More packs per rank cost pipelining under Harmony's grouping (a rank
    hands a microbatch on after its first packs ran every microbatch): it pays with a small ``pipeline_group``.
    Returns notes of the cuts made."""
    units = find_units(program)
    cuts = _cuts(program, units)
    last = cuts[-1][0]
    cost = [u.fwd_flops * (1 if i >= last else 2) + u.bwd_flops for i, u in enumerate(units)]
    stage_of = contiguous(cost, world)

    def slowest(of, parts):
        return max(sum(sum(cost[b:e]) for (b, e), r in zip(parts, of) if r == k) for k in range(world))
    singles = [(i, i + 1) for i in range(len(units))]
    if slowest(stage_of, singles) >= 0.99 * slowest(contiguous([sum(cost[b:e]) for b, e in cuts], world), cuts):
        return []         # whole packs balance as well: no cut buys anything
    starts = sorted({b for b, _ in cuts} | {i for i in range(1, len(units)) if stage_of[i] != stage_of[i - 1]})
    finer = list(zip(starts, starts[1:] + [len(units)]))
    before = len(cuts)
    _rebuild(program, finer, units)
    return [f"packs cut where the best contiguous stages over the layers end: {before} packs became {len(finer)}, "
            f"so that the stages balance the predicted compute layer by layer, not pack by pack"]


def _rebuild(program: Program, cuts, units) -> None:
    """``program.plan``'s packs become ``cuts`` (runs of ``units``)."""
    specs = build_packs(program, cuts, units)
    if program.config.recompute != "always":
        measure_kept(program, specs)
    program.plan = dataclasses.replace(program.plan, packs=specs, residency={})


# -- (2) placement -----------------------------------------------------------------------------------
def pack_seconds(plan, flops: float) -> list[float]:
    """Predicted compute of each pack per step: forward, backward, and the recompute of every pack but the last."""
    last = len(plan.packs) - 1
    return [plan.microbatches * (s.fwd_flops * (1 if i == last else 2) + s.bwd_flops) / flops
            for i, s in enumerate(plan.packs)]


def contiguous(costs: list[float], world: int) -> list[int]:
    """Contiguous stages, each of at least one pack, minimising the largest stage's sum (an exact DP)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(world + 1)]   # best[r][j]: first j packs on r ranks
    cut = [[0] * (n + 1) for _ in range(world + 1)]
    best[0][0] = 0.0
    for r in range(1, world + 1):
        for j in range(r, n - (world - r) + 1):
            for i in range(r - 1, j):
                v = max(best[r - 1][i], prefix[j] - prefix[i])
                if v < best[r][j]:
                    best[r][j], cut[r][j] = v, i
    rank_of, j = [0] * n, n
    for r in range(world, 0, -1):
        i = cut[r][j]
        rank_of[i:j] = [r - 1] * (j - i)
        j = i
    return rank_of


def place(costs: list[float], world: int, placement: str) -> list[int]:
    if placement == "round_robin":
        return [p % world for p in range(len(costs))]
    return contiguous(costs, world)


def _check_shared(plan, rank_of: list[int]) -> tuple[dict, list[str]]:
    """The weights packs on several ranks use (tied: name -> those ranks, sorted); refuse a buffer written in forward
    that packs on two ranks use; note read-only buffers (each of those ranks keeps a copy)."""
    ranks: dict[str, set] = {}
    for spec in plan.packs:
        for n in spec.params + spec.buffers:
            ranks.setdefault(n, set()).add(rank_of[spec.index])
    params = {n for s in plan.packs for n in s.params}
    mutated = {n for s in plan.packs for n in s.mutated}
    shared = {n: r for n, r in ranks.items() if len(r) > 1}
    bad = [n for n in shared if n in mutated]
    if bad:
        users = [s.index for s in plan.packs if bad[0] in s.params + s.buffers]
        raise ConfigError(f"parallel='pipeline': buffer {bad[0]!r} is written in forward by packs {users} on ranks "
                          f"{sorted(shared[bad[0]])}; its copies would drift apart. Keep the layers that update it "
                          f"on one rank (placement=, or a stage pass choice), or use parallel=None")
    tied = {n: tuple(sorted(r)) for n, r in shared.items() if n in params}
    buffers = len(shared) - len(tied)
    return tied, [f"{buffers} read-only buffers are used on several ranks: each of those keeps a copy"] if buffers \
        else []


# -- (4) this rank's packs ----------------------------------------------------------------------------
def _crossing_values(program: Program, rank_of: list[int]) -> dict:
    """Each value a pack reads from a pack on another rank: (shape, dtype name) at the microbatch size, or
    ("const", value) for one that is not a tensor (the same in every step)."""
    plan = program.plan
    producer = {o: s.index for s in plan.packs for o in s.outputs}
    nodes = {n.name: n for n in program.gm.graph.nodes}
    out = {}
    for spec in plan.packs:
        for n in spec.inputs:
            if n in producer and rank_of[producer[n]] != rank_of[spec.index]:
                v = program.fake.vals[nodes[n]]
                out[n] = ((tuple(int(d) for d in v.shape), str(v.dtype).removeprefix("torch."))
                          if isinstance(v, torch.Tensor) else ("const", v))
    return out


def restrict(program: Program, rank_of: list[int], tied: dict | None = None) -> None:
    """``program.plan`` becomes this rank's packs, re-indexed from 0, with the whole model's in ``plan.stage``; a weight
    ``tied`` across ranks is owned here by this rank's earliest pack using it."""
    plan, cfg = program.plan, program.config
    grid = grid_of(cfg)
    rank, world = (cfg.rank, cfg.world_size) if grid is None else (grid.stage, grid.pipeline)
    local = [s.index for s in plan.packs if rank_of[s.index] == rank]
    stage = Stages(rank=rank, world=world, rank_of=list(rank_of), local=local, grid=grid,
                   inputs=[list(s.inputs) for s in plan.packs], outputs=[list(s.outputs) for s in plan.packs],
                   names=[s.name for s in plan.packs], values=_crossing_values(program, rank_of),
                   placement=cfg.placement, timeout=cfg.comm_timeout, tied=dict(tied or {}),
                   weight=getattr(cfg, "sample_weight", None) if grid is not None else None)
    specs = [dataclasses.replace(plan.packs[g], index=i) for i, g in enumerate(local)]
    program.plan = dataclasses.replace(plan, packs=specs, residency={}, stage=stage)
    if stage.tied:
        own_tied(program)


def run(program: Program, ctx) -> PassResult:
    """Place the packs; ``ctx``, where given, is the rank of every pack (a list as long as the packs)."""
    start = time.perf_counter()
    cfg = program.config
    world = len(pipeline_ranks(cfg))
    notes = enough_packs(program, world)
    if cfg.placement == "layers" and ctx is None:
        notes += balanced_stages(program, world)
    plan = program.plan
    costs = pack_seconds(plan, cfg.flops)
    if ctx is not None:
        if sorted(set(ctx)) != list(range(world)) or len(ctx) != len(plan.packs):
            raise ConfigError(f"the stage pass's choice is the rank of each of the {len(plan.packs)} packs, every "
                              f"rank 0..{world - 1} given at least one; got {ctx!r}")
        rank_of = list(ctx)
    else:
        # a balanced grid's pipelines run different microbatches: placed by one microbatch's compute, alike on all
        rank_of = place(pack_seconds(dataclasses.replace(plan, microbatches=1), cfg.flops) if _balanced(cfg)
                        else costs, world, cfg.placement)
    tied, shared_notes = _check_shared(plan, rank_of)
    notes += shared_notes
    if _live(cfg):     # the ranks of a running node agree; a node planned in one process (pipeline_plan) has none
        packs = [(s.name, s.inputs, s.outputs, s.params) for s in plan.packs]
        if not _balanced(cfg):
            compress.check_same_plan(repr((world, cfg.policy, cfg.microbatches, cfg.pipeline_group, rank_of, packs)))
        else:     # the job's packs and placement alike; the microbatches a pipeline's own
            compress.check_same_plan(repr((world, cfg.policy, rank_of, packs)))
            compress.check_same_plan(repr((cfg.microbatches, cfg.pipeline_group)), what="microbatches",
                                     among=grid_of(cfg).pipeline_ranks())
    rows = _rows(plan, rank_of, costs, world)
    restrict(program, rank_of, tied)
    notes += tie_copies(program, _live(cfg))
    notes += shard_over_replicas(program)
    crossing = sum(_bytes(v) for v in program.plan.stage.values.values())
    worst, total = max(r["compute_s"] for r in rows), sum(costs)
    report = PassReport(f"stage: packs across {world} ranks ({cfg.placement})", rows, totals=dict(
        ranks=world, packs=len(plan.packs), this_rank=program.plan.stage.rank, max_rank_compute_s=worst,
        group=cfg.pipeline_group or plan.microbatches,
        lower_bound_s=max(total / world, max(costs)), ideal_speedup=total / worst if worst else 1.0,
        boundary_MiB_per_microbatch=crossing / 2**20, seconds=time.perf_counter() - start))
    report.notes += notes + [
        f"placement {cfg.placement!r}: " + ("pack p on rank p mod N" if cfg.placement == "round_robin" else
                                            "contiguous stages by an exact DP minimising the largest rank's "
                                            "predicted compute (forward, backward, recompute)"
                                            + (" over the layers" if cfg.placement == "layers" else "")),
        f"microbatches go through a rank's packs in groups of {cfg.pipeline_group or plan.microbatches} "
        f"(pipeline_group): the next rank starts on a group once this rank's packs ran it"
        + ("" if not getattr(cfg, "group_predicted", None) else "; chosen by pipeline_group='auto' from the node's "
           "simulated step per group size: " + ", ".join(f"{g}: {'does not fit' if t is None else f'{t:.4g} s'}"
                                                        for g, t in cfg.group_predicted.items())),
        f"each microbatch's boundary values cross ranks forward and their gradients back: "
        f"{2 * plan.microbatches * crossing / 2**20:.3f} MiB per step in all; every rank is given the whole batch",
        "each rank holds, steps and saves only its packs' fp32 weights and optimizer state: one copy on the node; "
        + ("contiguous stages never move a pack between devices, so no shared host copy is needed"
           if cfg.placement != "round_robin" else "packs stay on their ranks, so no shared host copy is needed")]
    return PassResult(program, report)


def shard_over_replicas(program: Program) -> list[str]:
    """A grid's ZeRO-1 (``shard_state=True``): this stage's parameters owned in equal byte shares by the ranks of its
    replica group, contiguous in the model's order (runtime/shard.py ``owners``, over those ranks as data
    parallelism does over the job's); each steps its own and broadcasts them to the group (``sync_state``)."""
    grid, cfg = program.plan.stage.grid, program.config
    if grid is None or cfg.shard_state is not True:
        return []
    params = dict(program.gm.named_parameters())
    mine = {n for s in program.plan.packs for n in s.owned}
    sizes = [(n, nbytes(p)) for n, p in params.items() if n in mine]
    ranks = grid.replica_ranks()
    own_state(program, owners_among(sizes, ranks))
    return [f"shard_state=True: this stage's optimizer state is split over its replica group (ranks "
            f"{','.join(map(str, ranks))}), each stepping its share and broadcasting it to the others"]


def _balanced(cfg) -> bool:
    """A grid under ``balance=``: its pipelines run their own rows (driver/modes/grid_balance.py)."""
    return grid_of(cfg) is not None and getattr(cfg, "sample_weight", None) is not None


def _live(cfg) -> bool:
    """Whether this plan is for a rank of the live process group (not one planned by driver/node.py)."""
    import torch.distributed as dist
    return not getattr(cfg, "offline", False) and dist.is_available() and dist.is_initialized() \
        and dist.get_world_size() == cfg.world_size and dist.get_rank() == cfg.rank


def _bytes(v) -> int:
    shape, dtype = v
    if shape == "const":
        return 0
    n = 1
    for d in shape:
        n *= d
    return n * getattr(torch, dtype).itemsize


def _rows(plan, rank_of, costs, world) -> list[dict]:
    rows = []
    for r in range(world):
        mine = [s for s in plan.packs if rank_of[s.index] == r]
        rows.append(dict(rank=r, packs=",".join(str(s.index) for s in mine),
                         layers=f"{mine[0].name} .. {mine[-1].name}" if len(mine) > 1 else mine[0].name,
                         GFLOP=sum(s.fwd_flops + s.bwd_flops for s in mine) * plan.microbatches / 1e9,
                         compute_s=sum(costs[s.index] for s in mine),
                         params_MiB=sum(s.master_bytes for s in mine) / 2**20,
                         optim_MiB=sum(s.optim_bytes for s in mine) / 2**20))
    return rows
