"""Balance across the pipelines of a grid (``parallel=("pipeline", "data")`` with ``balance=``): each replica's rows.

In a grid the unit that takes a share of the global batch is a pipeline (a server's ranks, one replica), not a rank:
every rank of a pipeline runs the same microbatches through its stage. So the balance chooses, per replica, a
microbatch size and count (its rows), such that the replicas finish their steps together; the replica all-reduce
then weighs each pipeline's mean gradient by its rows over the global batch (``collectives.allreduce(weight=)``).

A replica's predicted step (``pipeline_seconds``) is the planner's compute model of a pipeline: the stages split
a microbatch's work (forward, backward, recompute: ``ModelCost``) equally by FLOPs, as the stage pass places them,
each stretched by its device's speed; Harmony's grouping runs ``g`` microbatches through a stage before handing
them on (``pipeline_group``, all of them by default), so a step of ``m`` microbatches in ``G = m / g`` groups takes
``g * (sum_k t_k + (G - 1) * max_k t_k)``: the first group crosses every stage, each later one waits for the slowest.
The split minimising the slowest replica's step is found exactly (``fastest_split``: the least step bound under which
the replicas' row counts can sum to the batch). The state (the optimizer's, under ``shard_state=True``; everything,
under ``shard_state="full"``) is split over each stage's replica group in equal shares: every replica steps its
stage's share alike.
"""
from __future__ import annotations

import time

from harmony.base.errors import BudgetError, ConfigError
from harmony.base.units import fmt_bytes
from harmony.compiler.balance import BalancePlan, ModelCost, RankShare, given_shares, rank_memory_floor, rank_time
from harmony.compiler.ir import PassReport


def pipeline_seconds(cost: ModelCost, devices, b: int, m: int, group: int | None = None) -> float:
    """Predicted compute seconds of one step of a pipeline over ``devices`` (its stages, in order): ``m``
    microbatches of ``b`` rows, in groups of ``group`` (None: all ``m`` in one)."""
    stages = [rank_time(cost, d, b, 1) / len(devices) for d in devices]
    g = min(group or m, m)
    groups = -(-m // g)
    return g * (sum(stages) + (groups - 1) * max(stages))


def per_replica(spec, replicas: int, pipeline: int) -> list:
    """``balance=``'s list as one entry per replica: given one per replica, or one per rank (``replicas x
    pipeline``, in rank order) where the entries of each pipeline's ranks agree (they train on the same rows)."""
    spec = list(spec)
    if len(spec) == replicas:
        return spec
    if len(spec) == replicas * pipeline:
        out = []
        for r in range(replicas):
            mine = spec[r * pipeline:(r + 1) * pipeline]
            if any(e != mine[0] for e in mine):
                raise ConfigError(f"balance={spec!r} gives the ranks of pipeline {r} (ranks {r * pipeline}.."
                                  f"{(r + 1) * pipeline - 1}) different shares {mine}, but every rank of a pipeline "
                                  f"trains on its pipeline's rows: give one entry per pipeline ({replicas}), or the "
                                  f"same entry to each pipeline's ranks")
            out.append(mine[0])
        return out
    raise ConfigError(f"balance={spec!r} has {len(spec)} entries, but the grid has {replicas} pipelines of "
                      f"{pipeline} ranks: give one entry per pipeline ({replicas}: (microbatch size, microbatches) "
                      f"or a sample count), 'auto' or 'uniform'")


def _given(spec: list, microbatches: int) -> list[tuple[int, int]]:
    return given_shares(spec, microbatches, lambda r: f"balance entry {r} (pipeline {r})")


def fastest_split(cost: ModelCost, replicas: list, global_batch: int, budget: float, group: int | None = None,
                  max_microbatches: int = 16) -> list[tuple[int, int]]:
    """Each replica's ``(microbatch size, count)`` minimising the slowest replica's ``pipeline_seconds``, the rows
    adding up to ``global_batch`` and each microbatch's working set within ``budget``. Exact: the least step bound
    ``T`` (a binary search over the options' steps) for which the replicas' options within ``T`` can sum to the batch
    (the row counts each can reach, as bit sets); then, from the last replica back, each takes the fastest option
    within ``T`` that leaves rows the earlier ones can make (ties: fewer microbatches)."""
    largest = 0
    while largest < global_batch and rank_memory_floor(cost, None, largest + 1) <= budget:
        largest += 1
    if largest == 0:
        raise BudgetError(f"no microbatch of one sample fits the grid's smallest device memory {fmt_bytes(budget)} "
                          f"(a layer's working set needs {fmt_bytes(rank_memory_floor(cost, None, 1))}); give "
                          f"devices more memory", min_budget=int(rank_memory_floor(cost, None, 1)))
    # fewer microbatches first: where the model prices two options alike, the larger microbatch dispatches less
    options = [(b, m) for m in range(1, max_microbatches + 1) for b in range(largest, 0, -1) if b * m <= global_batch]
    fastest = []        # per replica: rows -> (the fastest option's step, the option)
    for devices in replicas:
        mine: dict = {}
        for b, m in options:
            t = pipeline_seconds(cost, devices, b, m, group)
            if b * m not in mine or t < mine[b * m][0]:
                mine[b * m] = (t, (b, m))
        fastest.append(mine)
    mask = (1 << (global_batch + 1)) - 1

    def reachable(bound: float) -> list[int]:
        """Bit ``s`` of entry ``r``: the first ``r`` replicas can make ``s`` rows with options within ``bound``."""
        sets = [1]
        for mine in fastest:
            reach = 0
            for k, (t, _) in mine.items():
                if t <= bound:
                    reach |= sets[-1] << k
            sets.append(reach & mask)
        return sets
    bounds = sorted({t for mine in fastest for t, _ in mine.values()})
    if not reachable(bounds[-1])[-1] >> global_batch & 1:
        raise BudgetError(f"the global batch of {global_batch} does not split over {len(replicas)} pipelines in "
                          f"microbatches of at most {largest} samples (the grid's smallest device memory) and at most "
                          f"{max_microbatches} microbatches each; give more rows or devices with more memory")
    lo, hi = 0, len(bounds) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if reachable(bounds[mid])[-1] >> global_batch & 1:
            hi = mid
        else:
            lo = mid + 1
    sets, rest, choice = reachable(bounds[lo]), global_batch, []
    for r in reversed(range(len(replicas))):
        k, (_, bm) = min(((k, v) for k, v in fastest[r].items()
                          if v[0] <= bounds[lo] and k <= rest and sets[r] >> (rest - k) & 1),
                         key=lambda kv: (kv[1][0], kv[1][1][1]))
        choice.append(bm)
        rest -= k
    return choice[::-1]


def plan_replicas(spec, cost: ModelCost, replicas: list, global_batch: int, budget: float, microbatches: int = 1,
                  group: int | None = None) -> BalancePlan:
    """Each replica's share of ``global_batch`` under ``spec`` (``replicas``: each pipeline's devices, in order).

    ``"auto"``: ``fastest_split``. ``"uniform"``: equal rows, in ``microbatches`` microbatches each. A list:
    ``per_replica``'s entries, ``(microbatch size, microbatches)`` or sample counts run in ``microbatches``."""
    start, n = time.perf_counter(), len(replicas)
    if spec == "auto":
        choice = fastest_split(cost, replicas, global_batch, budget, group)
    elif spec == "uniform":
        per = global_batch // n
        if global_batch % n or per % microbatches:
            raise ConfigError(f"balance='uniform': the global batch of {global_batch} does not split into {n} equal "
                              f"pipeline shares of {microbatches} equal microbatches; use balance='auto' or explicit "
                              f"shares, one per pipeline")
        choice = [(per // microbatches, microbatches)] * n
    elif isinstance(spec, (list, tuple)):
        choice = _given(per_replica(spec, n, len(replicas[0])), microbatches)
        if sum(b * m for b, m in choice) != global_batch:
            raise ConfigError(f"balance={list(spec)!r} shares {sum(b * m for b, m in choice)} samples over the "
                              f"pipelines but the global batch (example_batch) has {global_batch}; the shares must "
                              f"add up to it")
    else:
        raise ConfigError(f"balance={spec!r}: use 'auto', 'uniform', or one entry per pipeline ({n})")
    shares = [RankShare(r, "+".join(d.name for d in devices), b, m, 1 / n,
                        pipeline_seconds(cost, devices, b, m, group), rank_memory_floor(cost, None, b))
              for r, (devices, (b, m)) in enumerate(zip(replicas, choice))]
    status = "optimal" if spec == "auto" else "given" if isinstance(spec, (list, tuple)) else "uniform"
    return BalancePlan(shares, max(s.seconds for s in shares), global_batch, time.perf_counter() - start, status)


def report(plan: BalancePlan, replicas: list, grid, how: str, budget: int, sharded) -> PassReport:
    """The grid balance's ``PassReport``: a row per pipeline (its ranks, rows, microbatches, weight, predicted step),
    this rank's marked."""
    rep = PassReport(f"balance: each pipeline's share of the global batch ({how})")
    for s, devices in zip(plan.shares, replicas):
        slowest = max(getattr(d, "speed_factor", 1.0) for d in devices)
        start = sum(x.samples for x in plan.shares[:s.rank])
        rep.rows.append(dict(pipeline=f"{s.rank}{' (this)' if s.rank == grid.replica else ''}",
                             ranks=",".join(map(str, grid.pipeline_ranks(s.rank))), devices=s.device,
                             speed="1x" if slowest == 1 else f"1/{slowest:g}x EMULATED",
                             rows=f"{start}..{start + s.samples - 1}", samples=s.samples, microbatch=s.microbatch,
                             microbatches=s.microbatches, weight=s.samples / plan.global_batch,
                             predicted_s=s.seconds))
    rep.totals = dict(global_batch=plan.global_batch, predicted_step_s=plan.step_seconds, status=plan.status,
                      budget_MiB=budget / 2**20, solve_s=plan.solve_seconds)
    rep.notes += [
        "every rank of a pipeline trains on its pipeline's rows (sm(*global_batch) takes them); each stage's "
        "gradients are weighted by its pipeline's samples / global batch in the replica all-reduce, and the step's "
        "loss is the pipelines' losses so weighted: the global batch's mean",
        "predicted_s: the planner's compute model of the pipeline's step (stages equal in FLOPs, each stretched by "
        "its device's speed, microbatches in groups of pipeline_group), not the whole step (sm.simulate() simulates "
        "this rank's server)",
        f"every rank plans under the grid's smallest device memory (budget_MiB) and every pipeline cuts the model "
        f"into the packs of the pipeline with the most rows, so that the ranks holding a stage hold the same "
        f"parameters; {_state_note(sharded)}"]
    if any(getattr(d, "speed_factor", 1.0) != 1 for devices in replicas for d in devices):
        rep.notes.append("speed factors are EMULATION: a rank's runtime sleeps each compute op out to factor x its "
                         "time alone on a core; no device is slower")
    return rep


def _state_note(sharded) -> str:
    if sharded is True:
        return ("shard_state=True: each stage's optimizer state is split over its replica group in equal byte "
                "shares (the state's share does not follow the pipelines' speeds)")
    if sharded == "full":
        return ("shard_state='full': each stage's weights and optimizer state are cut in equal chunks over its replica "
                "group; every rank of a replica group keeps the holds (weights kept between a pack's visits) that all "
                "of them chose, so that they gather the same packs in the same order whatever their rows "
                "(passes/swap/agree.py)")
    return "shard_state=False: every rank of a replica group keeps its stage's whole training state"
