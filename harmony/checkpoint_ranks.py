"""Checkpoints under data parallelism: every rank must take part, and a checkpoint names the world it was saved in.

``meet(op, timeout)``: before rank 0 writes the checkpoint the ranks share (or any rank reads), the ranks meet at a
monitored barrier (gloo; a plain barrier elsewhere, bounded by the process group's timeout). A rank that does not
come within ``comm_timeout`` seconds (the process group's: HARMONY_COMM_TIMEOUT, default 300) is named in a
``CommunicationError`` on the ranks that came, which says that every rank must call the operation: the common DDP
habit of saving on rank 0 alone would otherwise wait for the whole timeout and end in a raw gloo error.

``check_world(path, sm)``: a checkpoint saved by W ranks with sharded optimizer state is a directory of
``rank-R-of-W`` checkpoints; loading it into another world size (or an unsharded run), or an unsharded checkpoint into
a sharded run, names both sizes and what to do, instead of "no manifest.json".
"""
from __future__ import annotations

import os
import re
from datetime import timedelta
from pathlib import Path

from harmony.base.errors import CheckpointError, CommunicationError

_RANK_DIR = re.compile(r"rank-(\d+)-of-(\d+)")


def meet(op: str, timeout: float) -> None:
    """Every rank reaches ``op`` (``harmony.save`` / ``harmony.load``) within ``timeout`` seconds (the module's
    ``comm_timeout``), or a CommunicationError."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=timeout), wait_all_ranks=True)
        else:
            dist.barrier()
    except (RuntimeError, dist.DistError) as e:
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CommunicationError(
            f"{op} on rank {rank} of {world}: not every rank called {op} within {timeout:g} s ({detail}). Every "
            f"rank must call {op} with the same path, at the same point of training (rank 0 writes the checkpoint "
            f"the ranks share, or each rank its shard); calling it on rank 0 alone is not supported. If a rank "
            f"died, restart all ranks (torchrun --max-restarts) and load the last checkpoint.") from e


def saved_world(path: Path) -> int | None:
    """The world size a sharded checkpoint at ``path`` was saved by (its ``rank-R-of-W`` entries), or None."""
    try:
        sizes = {int(m.group(2)) for p in path.iterdir() if (m := _RANK_DIR.fullmatch(p.name))}
    except OSError:
        return None
    return max(sizes) if sizes else None


def check_world(path, sm) -> None:
    """Refuse, naming both world sizes, a checkpoint saved by another world (or sharding) than this run's."""
    plan, cfg = getattr(sm.program, "plan", None), sm.program.config
    sharded = bool(getattr(plan, "sharded", False))
    full = sharded and not getattr(plan, "state_owner", None)     # shard_state="full": weights partitioned too
    staged = getattr(plan, "stage", None) is not None      # a pipeline rank saves its packs' state
    world = (getattr(cfg, "world_size", 1) or 1) if getattr(cfg, "data_parallel", False) or staged else 1
    path = Path(os.path.realpath(os.fspath(path)))
    saved = saved_world(path)
    if saved is None:
        if staged and (path / "manifest.json").is_file():
            raise CheckpointError(f"cannot load {path}: it was saved by one process, and this pipeline of {world} "
                                  f"ranks loads each rank's packs from rank-R-of-{world}. Nothing was changed.")
        if sharded and (path / "manifest.json").is_file():
            raise CheckpointError(
                f"cannot load {path}: it was saved with the whole optimizer state (shard_state off), and this run "
                f"of {world} ranks shards it (shard_state={cfg.shard_state!r}); compile with shard_state=False to "
                f"load it. Nothing was changed.")
        return
    if staged and saved != world:
        raise CheckpointError(
            f"cannot load {path}: it was saved by {saved} ranks (rank-R-of-{saved}, each with its own packs' state), "
            f"and this pipeline runs on {world}: load it with --nproc_per_node {saved} (moving packs to another "
            f"number of ranks is not supported). Nothing was changed.")
    if not sharded or saved != world:
        here = f"{world} rank{'s' if world != 1 else ''}" + (" with sharded optimizer state" if sharded else
                                                             " with the whole optimizer state on each")
        raise CheckpointError(
            f"cannot load {path}: it was saved by {saved} ranks, each with its shard of the "
            f"{'weights and ' if full else ''}optimizer state (rank-R-of-{saved}), and this run has {here}. Load it "
            f"in a run of {saved} ranks with shard_state={'full' if full else True!r} (resharding into another world "
            f"size is not supported). Nothing was changed.")
