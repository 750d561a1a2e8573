"""Parallel modes: one object per way of using devices, asked by the driver for everything that differs.

A mode says, for one rank: the world it plans for and the pass list it adds to (``resolve``, ``passes``), what
it refuses (``check``), how this rank's share is planned (``plan_rank``: balance's batch shares, ZeRO's owners),
how its passes run (``run_passes``: ranks that must meet are told of a failure), which of the model's tensors
this rank keeps and how its state is partitioned (``local_tensors``, ``shares``), what a step adds to
``sm.stats`` (``step_stats``), how ``sm.simulate()`` sees it (``simulate``) and the section it adds to the
report (``report``). The driver (driver/compile.py, driver/assemble.py) calls these and nothing else of a mode,
so adding a mode is one module here and one ``register`` call; ``of`` picks the mode of a compile.

The modes: ``Mode`` itself (one process, driver/modes/base.py); in driver/modes/data.py ``DataParallel``
(every rank runs every pack on its share of the batch, gradients all-reduced; ``balance=`` gives mismatched
ranks uneven shares, driver/modes/balance.py), ``ShardedOptimizer`` (ZeRO-1: ``shard_state=True``) and
``Partitioned`` (ZeRO-3: ``shard_state="full"``); ``Pipeline`` (``parallel="pipeline"``: packs placed across a
node's ranks, driver/modes/pipeline.py); ``Grid`` (``parallel=("pipeline", "data")``: a pipeline per server, the
pipelines data-parallel replicas, driver/modes/grid.py). The passes and runtime pieces a mode needs (passes/compress.py,
passes/shard.py, passes/stage.py, runtime/partitioned*.py, runtime/pipeline.py) are declared here by name and
built where they belong.
"""
from __future__ import annotations

from harmony.driver.modes.base import Mode
from harmony.driver.modes.data import DataParallel, Partitioned, ShardedOptimizer
from harmony.driver.modes.grid import Grid
from harmony.driver.modes.pipeline import Pipeline

# most specific first: ``of`` takes the first that applies
MODES: list[type[Mode]] = [Grid, Pipeline, Partitioned, ShardedOptimizer, DataParallel, Mode]


def register(mode: type[Mode], first: bool = True) -> type[Mode]:
    """Add a mode (``first``: before the built-in ones, so it is asked first)."""
    if mode in MODES:
        MODES.remove(mode)
    MODES.insert(0 if first else len(MODES), mode)
    return mode


def of(options, world: dict) -> Mode:
    """The mode of a compile with ``options`` in ``world``."""
    return next(m for m in MODES if m.applies(options, world))(options)


def of_config(cfg) -> Mode:
    """The mode a resolved ``CompileConfig`` was planned in (a module built from a program, not by compile)."""
    world = dict(data_parallel=cfg.data_parallel, world_size=cfg.world_size, rank=cfg.rank)
    return of(cfg, world)
