"""Data parallelism from the user's side: which rank am I, and my shard of the data.

Under ``torchrun --nproc_per_node N train.py`` every rank compiles the same model with
its own share of the batch and trains it; ``harmony.compile`` picks the world up from the
environment (``data_parallel=None``) and averages gradients across ranks:

    >>> x, y = harmony.data.shard((X, Y))          # this rank's rows of the global batch
    >>> sm = harmony.compile(model, example_batch=(x, y), memory_budget="1GiB", compression="4bit")
    >>> loss = sm(x, y)                             # every rank ends the step with the same parameters
"""
from __future__ import annotations

import torch

from harmony.base.errors import ConfigError, InputError
from harmony.runtime.comm.world import rank_and_world

__all__ = ["shard", "rank_and_world"]


def shard(data, rank: int | None = None, world: int | None = None, pipeline_size: int | None = None):
    """This rank's share of ``data``.

    * a tensor, a tuple/list of tensors or a dict of tensors (a batch): rows
      ``[rank * b, (rank + 1) * b)`` of dimension 0, ``b = batch / world`` -- the batch must divide
      evenly, so every rank runs the same compiled shapes and the average of the ranks' mean
      gradients is the mean gradient of the whole batch;
    * a map-style dataset (``__len__`` and ``__getitem__``): a ``torch.utils.data.Subset`` of
      every ``world``-th item from ``rank`` (as ``DistributedSampler`` without shuffling), the
      last ``len % world`` items dropped so every rank has as many.

    ``rank`` and ``world`` default to the process group's (or torchrun's environment). ``pipeline_size=P``
    (``parallel=("pipeline", "data")``): the share of this rank's pipeline, ranks ``[k P, (k + 1) P)`` being
    pipeline ``k`` of ``world / P``; every rank of a pipeline gets the same rows.

        >>> x, y = harmony.data.shard((X, Y), pipeline_size=2)     # 4 ranks: ranks 0, 1 rows 0..B/2, 2, 3 the rest
    """
    r, w = rank_and_world()
    rank = r if rank is None else rank
    world = w if world is None else world
    if pipeline_size is not None:
        if isinstance(pipeline_size, bool) or not isinstance(pipeline_size, int) or pipeline_size < 1 \
                or world % pipeline_size:
            raise ConfigError(f"shard: pipeline_size={pipeline_size!r} must divide the world of {world} ranks "
                              f"(the ranks form pipelines of pipeline_size consecutive ranks)")
        rank, world = rank // pipeline_size, world // pipeline_size
    if not isinstance(world, int) or world < 1 or not isinstance(rank, int) or not 0 <= rank < world:
        raise ConfigError(f"shard: rank={rank!r}, world={world!r}; need 0 <= rank < world")
    if isinstance(data, torch.Tensor):
        return _rows(data, rank, world, "tensor")
    if isinstance(data, dict):
        return {k: _rows(v, rank, world, repr(k)) if isinstance(v, torch.Tensor) else v for k, v in data.items()}
    if isinstance(data, (tuple, list)) and data and all(isinstance(t, torch.Tensor) for t in data):
        return type(data)(_rows(t, rank, world, f"item {i}") for i, t in enumerate(data))
    if hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        n = len(data) - len(data) % world
        return torch.utils.data.Subset(data, list(range(rank, n, world)))
    raise InputError(f"shard: give a tensor, a tuple/list/dict of tensors (a batch) or a map-style dataset, "
                     f"got {type(data).__name__}")


def _rows(t: torch.Tensor, rank: int, world: int, what: str) -> torch.Tensor:
    if t.dim() == 0:
        raise InputError(f"shard: {what} is a scalar; batch tensors have the batch in dimension 0")
    n = t.shape[0]
    if n % world:
        raise InputError(f"shard: {what} has {n} rows, which {world} ranks cannot share evenly; use a batch "
                         f"that is a multiple of {world} (every rank must run the same compiled shapes)")
    b = n // world
    return t[rank * b: (rank + 1) * b]


