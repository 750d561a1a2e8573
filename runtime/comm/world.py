"""The world a plan runs in: this process's rank, the ranks of its process group, the group made from torchrun's
environment, and the check that a plan runs on the world size it was compiled for.
"""
from __future__ import annotations

import os

from harmony.base.errors import ConfigError
from harmony.runtime.comm.process_group import init_process_group


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
    gloo, beside nccl for CUDA tensors where CUDA exists, timeout ``comm_timeout`` seconds: ``HARMONY_COMM_TIMEOUT``).
    ``True``: the same, but one process is an error. ``False``: each rank trains on its own.
    """
    if data_parallel is False:
        return dict(data_parallel=False, world_size=None)
    if not initialized() and int(os.environ.get("WORLD_SIZE", 1)) > 1:
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
