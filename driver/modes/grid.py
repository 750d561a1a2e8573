"""``parallel=("pipeline", "data")``: a pipeline inside each server, data parallelism across servers, as one plan.

Under ``torchrun --nnodes R --nproc_per_node P`` the ``W = P x R`` ranks form R pipelines of P consecutive ranks
(runtime/comm/grid.py); each pipeline trains on its replica's rows of the global batch (``harmony.data.shard(batch,
pipeline_size=P)``: every rank of a pipeline gets the same rows). The stage pass places the packs within a pipeline as
``parallel="pipeline"`` does, the same on every pipeline; the compress pass then averages each pack's gradients over
the ranks that hold that pack (its replica group, one rank per pipeline) right after the pack's last backward, on the
host thread, compressed as ``compression=`` says, while the pipeline's backward goes on. A step's outcome is the
job's: a failure travels along a pipeline in the messages' masks, across pipelines in the replica all-reduces' meets,
and every rank hears every rank's word in the loss's all-reduce that ends the step (runtime/comm/jobwide.py).

``shard_state=True`` (ZeRO-1) splits each stage's optimizer state over its replica group (passes/stage.py);
``shard_state="full"`` (ZeRO-3) partitions each stage's weights, gradients and optimizer state over it: the shard pass
and runtime/partitioned/ of data parallelism, with the replica group for the job (its gathers and carried-weight
agreements on replica groups of their own, made here at plan time on every rank; a weight tied across stages is
an all-reduce group of its own, so its chunks line up across the stages for the tied sum: passes/tied.py).

``balance=`` (driver/modes/grid_balance.py) gives each pipeline its rows of the global batch by its speed, weighting
its gradients and loss by its rows; the pipelines cut the model into the same packs, so the replica groups still
hold the same parameters. Under ``shard_state="full"`` the ranks of a replica group, whose microbatches differ,
keep only the holds all of them chose (passes/swap/agree.py), so they gather alike.

A checkpoint holds each stage once, written by pipeline 0's ranks (``grid`` layout, driver/checkpoint/ranks.py), or
under sharding every rank its share (``grid_zero1``, ``grid_zero3``); it loads into another grid, one pipeline or
data-parallel ranks through the reshard machinery.
"""
from __future__ import annotations

import os

from harmony.base.errors import ConfigError
from harmony.compiler.config_checks import HYBRID
from harmony.compiler.ir import PassReport
from harmony.driver.modes.base import Mode
from harmony.driver.modes.data import Partitioned
from harmony.driver.modes.grid_balance import plan_grid_rank
from harmony.driver.modes.pipeline import Pipeline
from harmony.driver.modes.pipeline_plan import node_hardware, simulate_rank_node
from harmony.passes import shard
from harmony.passes.compress import label
from harmony.passes.stage import grid_of as stage_grid
from harmony.runtime.comm.grid import grid_of, groups, replica_groups_for

NOT_YET = "is not supported with parallel=('pipeline', 'data') yet"


def refusals(cfg) -> list[tuple[bool, str, str]]:
    """(refused, what, what to use instead) of what a grid does not do yet."""
    return [(cfg.balance is not None and cfg.shard_state == "full" and cfg.pipeline_group is not None,
             "pipeline_group= with balance= and shard_state='full'", "pipeline_group=None (each pipeline's "
             "microbatches in one group: the pipelines' rows differ, and other groupings would gather other packs "
             "over the replica groups)"),
            (cfg.policy == "ondemand", "policy='ondemand'", "policy='harmony' or 'sequential'"),
            (cfg.pipeline_group is not None and cfg.policy != "harmony", f"policy={cfg.policy!r} and "
             f"pipeline_group=", "policy='harmony' (the sequential policy runs one microbatch at a time)")]


class Grid(Pipeline):
    """``parallel=("pipeline", "data")``: this rank's packs of its server's pipeline, averaged over the replicas."""

    name = "pipeline x data parallel (grid)"

    @classmethod
    def applies(cls, options, world: dict) -> bool:
        return options.parallel == HYBRID

    def resolve(self, options, world: dict) -> dict:
        """The job's world, data parallel across the pipelines, ``pipeline_size`` resolved (torchrun's node size)."""
        if not world["data_parallel"]:
            raise ConfigError("parallel=('pipeline', 'data') needs several processes, a pipeline of each server's "
                              "devices: launch with `torchrun --nnodes S --nproc_per_node P --rdzv-backend c10d "
                              "--rdzv-endpoint HOST:PORT train.py` on every server")
        size = options.pipeline_size
        if size is None:
            local = os.environ.get("LOCAL_WORLD_SIZE")
            if not (local and local.isdigit()):
                raise ConfigError("parallel=('pipeline', 'data'): give pipeline_size= (ranks per pipeline, a "
                                  "server's devices), or launch with torchrun, whose LOCAL_WORLD_SIZE says it")
            size = int(local)
        grid_of(world["world_size"], size, world["rank"])      # a bad shape refused, saying what to launch
        return dict(Mode.resolve(self, options, world), data_parallel=True, pipeline_size=size)

    def passes(self, entries) -> tuple:
        """The stage pass after the partition; under ``shard_state="full"`` the shard pass last (after compress,
        whose all-reduces it rewrites into reduce-scatters over the replica group), as data parallelism adds it."""
        entries = super().passes(entries)
        if self.options is not None and self.options.shard_state == "full":
            entries = Partitioned.passes(self, entries)
        return entries

    def check(self, cfg, options) -> None:
        for bad, what, instead in refusals(cfg):
            if bad:
                raise ConfigError(f"{what} {NOT_YET}: use {instead}, or parallel='pipeline' (one server) or "
                                  f"parallel=None (data parallelism)")
        if cfg.shard_state == "full":
            shard.check_config(cfg, options.optimizer_kwargs or {})   # what ZeRO-3 does not do yet, refused there

    def plan_rank(self, model, gm, batch, cfg):
        """The job's process groups (every rank makes every one, in one order), then this rank's device."""
        import torch.distributed as dist
        if not cfg.offline and dist.is_available() and dist.is_initialized():
            grid = stage_grid(cfg)
            groups(grid, cfg.comm_timeout)
            if cfg.shard_state == "full":    # ZeRO-3's gathers and carried-weight agreements: groups of their own
                for purpose in ("gather", "carry"):
                    replica_groups_for(grid, purpose, cfg.comm_timeout)
        if cfg.balance is not None:        # each pipeline's rows of the global batch (driver/modes/grid_balance.py)
            return plan_grid_rank(model, gm, batch, cfg)
        return super().plan_rank(model, gm, batch, cfg)

    def shares(self, plan, tensors: dict, cfg, fill=None):
        """``shard_state="full"``: this rank's chunks of its stage's packs, cut over its replica group."""
        return Partitioned.shares(self, plan, tensors, cfg, fill)

    def checkpoint_layout(self, plan) -> str:
        if plan.stage is None:
            return "whole"
        # each stage once, by pipeline 0's ranks; under shard_state=True every rank its packs' weights and the
        # optimizer state of the parameters it owns; under "full" every rank its chunks of its packs' state
        return "grid_zero3" if _partitioned(plan) else "grid_zero1" if plan.state_owner else "grid"

    def saves_state(self, plan) -> bool:
        return (plan.stage is None or plan.stage.grid is None or plan.stage.grid.replica == 0
                or bool(plan.state_owner) or _partitioned(plan))

    def report(self, program):
        return grid_report(program)

    def simulate(self, sm, hardware):
        """This rank's server simulated (``Pipeline.simulate``), its ranks' replica all-reduces sharing the server's
        link to the others (``network_bandwidth``, the server's link: each rank's share 1/P of it, pooled by
        ``network_shared``, so a stage that reduces while the others compute has the whole link)."""
        if sm.plan.stage is None:
            return None
        hw = node_hardware(sm.program.config, hardware)
        return simulate_rank_node(sm, hw.server_link(hw.network_bandwidth, sm.plan.stage.world))


_SHARDING = {True: "optimizer (ZeRO-1)", "full": "full (ZeRO-3)"}


def _sharding_note(shard_state) -> str:
    if shard_state == "full":
        return ("shard_state='full' (ZeRO-3): each rank keeps one chunk of its stage's weights and optimizer state; a "
                "pack's weights are gathered from its replica group before it runs, its gradients reduce-scattered "
                "over the group after its last backward, and each rank steps its chunk")
    if shard_state is True:
        return ("shard_state='optimizer' (ZeRO-1): each rank keeps and steps its share of its stage's optimizer "
                "state and broadcasts the stepped weights to its replica group")
    return "every rank of a replica group keeps its stage's whole training state"


def _rows_note(cfg, grid) -> str:
    if cfg.sample_weight is not None:
        return (f"balance=: this pipeline trains on its {cfg.batch_size} rows of the global batch of "
                f"{cfg.global_batch} (sm(*global_batch) takes them), its gradients and loss weighted by "
                f"{cfg.batch_size}/{cfg.global_batch} over the pipelines (the balance section shows every pipeline's)")
    return (f"each pipeline trains on its {cfg.batch_size} rows of the global batch of {cfg.batch_size * grid.replicas}"
            " (harmony.data.shard(batch, pipeline_size=P)); the loss is the mean over the pipelines")


def _partitioned(plan) -> bool:
    return any(r.shares is not None for r in plan.residency.values())


def grid_report(program) -> PassReport | None:
    """The report's "grid" section: P x R, which ranks hold which packs, the replica groups, the codec."""
    cfg, stage = program.config, program.plan.stage
    grid = getattr(stage, "grid", None)
    if grid is None:
        return None
    rows = []
    for s in range(grid.pipeline):
        packs = [g for g, r in enumerate(stage.rank_of) if r == s]
        rows.append(dict(stage=s, packs=",".join(map(str, packs)), layers=f"{stage.names[packs[0]]} .. "
                         f"{stage.names[packs[-1]]}" if len(packs) > 1 else stage.names[packs[0]],
                         ranks=",".join(map(str, grid.replica_ranks(s)))))
    report = PassReport(f"grid: {grid.pipeline} x {grid.replicas} (pipeline x data parallel)", rows, totals=dict(
        pipeline_size=grid.pipeline, replicas=grid.replicas, world=grid.world, this_rank=grid.rank,
        stage=grid.stage, replica=grid.replica, compression=label(cfg.compression) if cfg.compression else "fp32",
        shard_state=_SHARDING.get(cfg.shard_state, "replicated")))
    report.notes += [
        "pipelines: " + "; ".join(f"ranks {','.join(map(str, grid.pipeline_ranks(r)))}"
                                  for r in range(grid.replicas)) + " (each a server's ranks, one replica each)",
        "each row's ranks hold that stage's packs, one per pipeline, and average the packs' gradients over "
        "themselves (its replica group) right after each pack's last backward, overlapping the pipeline's backward",
        _sharding_note(cfg.shard_state),
        _rows_note(cfg, grid)]
    return report
