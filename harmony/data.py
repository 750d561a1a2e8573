"""Data parallelism from the user's side: which rank am I, my shard of the data, the world a plan runs on.

Under ``torchrun --nproc_per_node N train.py`` every rank compiles the same model with
its own share of the batch and trains it; ``harmony.compile`` picks the world up from the
environment (``data_parallel=None``) and averages gradients across ranks:

    >>> x, y = harmony.data.shard((X, Y))          # this rank's rows of the global batch
    >>> sm = harmony.compile(model, example_batch=(x, y), memory_budget="1GiB", compression="4bit")
    >>> loss = sm(x, y)                             # every rank ends the step with the same parameters
"""
from __future__ import annotations

import os

import torch

from harmony.base.errors import ConfigError, InputError


def _dist():
    import torch.distributed as dist
    return dist if dist.is_available() else None


def initialized() -> bool:
    dist = _dist()
    return dist is not None and dist.is_initialized()


def rank_and_world() -> tuple[int, int]:
    """(rank, world size): from the process group if there is one, else torchrun's RANK / WORLD_SIZE, else (0, 1)."""
    if initialized():
        dist = _dist()
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def current_world() -> int:
    """Ranks of the live process group (1 when there is none)."""
    return _dist().get_world_size() if initialized() else 1


def resolve(data_parallel=None, comm_timeout: float = 300.0) -> dict:
    """The ``CompileConfig`` fields of the world this process trains in, for ``data_parallel=`` (``ParallelConfig``).

    ``None``: data parallel when this process is one of several -- a process group is initialised
    with more than one rank, or torchrun's ``WORLD_SIZE`` > 1 (then the group is initialised here,
    gloo on the CPU, nccl with CUDA, timeout ``comm_timeout`` seconds: ``HARMONY_COMM_TIMEOUT``).
    ``True``: the same, but one process is an error. ``False``: each rank trains on its own.
    """
    if data_parallel is False:
        return dict(data_parallel=False, world_size=None)
    if not initialized() and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        from harmony.runtime.process_group import init_process_group
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "RANK") if v not in os.environ]
        if missing:
            raise ConfigError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but {', '.join(missing)} not set: launch "
                              f"with torchrun, or call torch.distributed.init_process_group before compile")
        init_process_group(timeout=comm_timeout)
    world = current_world()
    if data_parallel is True and not initialized():
        raise ConfigError("data_parallel=True needs several processes: launch with `torchrun --nproc_per_node N "
                          "train.py` or call torch.distributed.init_process_group before harmony.compile")
    return dict(data_parallel=world > 1, world_size=world, rank=rank_and_world()[0] if world > 1 else 0)


def check_world(config, capabilities=()) -> None:
    """Raise ``ConfigError`` if the plan was compiled for another number of ranks than are running it."""
    want = getattr(config, "world_size", 1)
    if want is None:
        return
    have = current_world()
    if have != want:
        how = f"a group of {have} ranks" if have > 1 else "one process (no process group)"
        raise ConfigError(
            f"this plan was compiled for {want} rank{'s' if want != 1 else ''} but runs in {how}: its gradient "
            f"all-reduces and batch shares are for {want}. Compile again in this job (harmony.compile on every "
            f"rank picks the world size up from torchrun), or compile with data_parallel=False to train each "
            f"process on its own.")
    if config.data_parallel and want > 1 and "communication" not in set(capabilities):
        raise ConfigError("this plan averages gradients over ranks but was compiled without the 'compress' pass: "
                          "ranks would drift apart. Include 'compress' in passes= (after 'offload').")


def shard(data, rank: int | None = None, world: int | None = None):
    """This rank's share of ``data``.

    * a tensor, a tuple/list of tensors or a dict of tensors (a batch): rows
      ``[rank * b, (rank + 1) * b)`` of dimension 0, ``b = batch / world`` -- the batch must divide
      evenly, so every rank runs the same compiled shapes and the average of the ranks' mean
      gradients is the mean gradient of the whole batch;
    * a map-style dataset (``__len__`` and ``__getitem__``): a ``torch.utils.data.Subset`` of
      every ``world``-th item from ``rank`` (as ``DistributedSampler`` without shuffling), the
      last ``len % world`` items dropped so every rank has as many.

    ``rank`` and ``world`` default to the process group's (or torchrun's environment).
    """
    r, w = rank_and_world()
    rank = r if rank is None else rank
    world = w if world is None else world
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


