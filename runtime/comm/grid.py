"""The ranks of a hybrid job (``parallel=("pipeline", "data")``) as a grid, and its process groups.

``W = P x R`` ranks: pipeline ``r`` is ranks ``r*P .. r*P + P-1`` (the devices of one server: torchrun numbers a
node's ranks consecutively), and the ranks holding stage ``s`` of every pipeline, ``s, s+P, .., s+(R-1)P``, are its
replica group, over which that stage's packs' gradients are averaged. ``torch.distributed.new_group`` must be called
by every rank of the job for every group, in the same order, even for groups it is not in: ``groups`` makes all of
them once per grid shape, on every rank, in one order (the pipelines, then the replica groups).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

from harmony.base.errors import ConfigError


@dataclass(frozen=True)
class Grid:
    """``pipeline`` (P) ranks per pipeline, ``replicas`` (R) pipelines; ``rank`` is this process's job rank."""

    pipeline: int
    replicas: int
    rank: int = 0

    @property
    def world(self) -> int:
        return self.pipeline * self.replicas

    @property
    def stage(self) -> int:
        """This rank's place in its pipeline."""
        return self.rank % self.pipeline

    @property
    def replica(self) -> int:
        """Which pipeline this rank is in."""
        return self.rank // self.pipeline

    def pipeline_ranks(self, replica: int | None = None) -> list[int]:
        """The job ranks of pipeline ``replica`` (this rank's by default), in stage order."""
        r = self.replica if replica is None else replica
        return list(range(r * self.pipeline, (r + 1) * self.pipeline))

    def replica_ranks(self, stage: int | None = None) -> list[int]:
        """The job ranks holding stage ``stage`` (this rank's by default), one per pipeline."""
        s = self.stage if stage is None else stage
        return [s + r * self.pipeline for r in range(self.replicas)]


def grid_of(world: int, pipeline: int, rank: int = 0) -> Grid:
    """The grid of ``world`` ranks in pipelines of ``pipeline``; ``ConfigError`` saying what to launch otherwise."""
    launch = ("launch each server's ranks with `torchrun --nnodes S --nproc_per_node P --rdzv-backend c10d "
              "--rdzv-endpoint HOST:PORT train.py` (pipeline_size defaults to P)")
    if isinstance(pipeline, bool) or not isinstance(pipeline, int) or pipeline < 2:
        raise ConfigError(f"parallel=('pipeline', 'data') with pipeline_size={pipeline!r}: a pipeline needs at "
                          f"least 2 ranks; with one device per server use data parallelism (parallel=None), or "
                          f"{launch}")
    if world % pipeline:
        raise ConfigError(f"parallel=('pipeline', 'data'): {world} ranks cannot form pipelines of "
                          f"pipeline_size={pipeline}; the world must be a multiple of it: {launch}")
    if world // pipeline < 2:
        raise ConfigError(f"parallel=('pipeline', 'data') over {world} ranks with pipeline_size={pipeline} is one "
                          f"pipeline, no replica: use parallel='pipeline', or launch several servers ({launch})")
    return Grid(pipeline, world // pipeline, rank)


_GROUPS: dict = {}      # (the default group, P, R) -> (pipeline groups, replica groups), made once per process


def groups(grid: Grid, timeout: float = 300.0) -> tuple[list, list]:
    """Every pipeline group and every replica group of ``grid`` (made at the first call on every rank, in the
    same order: a collective call of the whole job)."""
    import torch.distributed as dist
    key = (id(dist.group.WORLD), grid.pipeline, grid.replicas)     # a new default group: new groups
    if key not in _GROUPS:
        t = datetime.timedelta(seconds=timeout)
        pipes = [dist.new_group(grid.pipeline_ranks(r), timeout=t, backend="gloo") for r in range(grid.replicas)]
        reps = [dist.new_group(grid.replica_ranks(s), timeout=t, backend=_backend())
                for s in range(grid.pipeline)]
        _GROUPS[key] = (pipes, reps)
    return _GROUPS[key]


_MORE: dict = {}       # (the default group, P, R, purpose) -> replica groups of their own, made once per process


def replica_groups_for(grid: Grid, purpose: str, timeout: float = 300.0) -> list:
    """A second set of replica groups (one per stage), for collectives that run on another thread than the host
    thread's all-reduces (``shard_state="full"``: the copy thread's gathers, ``"gather"``; the schedule thread's
    agreement on carried weights, ``"carry"``), so the two never interleave on one group. Made by every rank of the
    job at its first call for ``purpose``, in the same order (driver/modes/grid.py calls it at plan time)."""
    import torch.distributed as dist
    key = (id(dist.group.WORLD), grid.pipeline, grid.replicas, purpose)
    if key not in _MORE:
        t = datetime.timedelta(seconds=timeout)
        _MORE[key] = [dist.new_group(grid.replica_ranks(s), timeout=t, backend="gloo") for s in range(grid.pipeline)]
    return _MORE[key]


def replica_group(grid: Grid):
    """This rank's replica group (made by ``groups``)."""
    return groups(grid)[1][grid.stage]


def pipeline_group(grid: Grid):
    """This rank's pipeline group (made by ``groups``)."""
    return groups(grid)[0][grid.replica]


def _backend() -> str:
    import torch.distributed as dist
    return dist.get_backend()
