"""Ranks agree on what they are doing before a call that uses collectives: a mismatch is named at once, on every rank.

Under data parallelism (and a pipeline) every rank must make the same collective calls in the same order: a step
(``sm(...)``), ``harmony.save``, ``harmony.load``, ``sm.sync_model()`` under ``shard_state="full"``. The common DDP
habit ``if rank == 0: harmony.save(sm, path)`` breaks that: rank 0 would wait in the save's collectives for the
whole communication timeout while the others fail at their next step with a raw gloo error. So each such call
starts with ``agree``: one all-gather of two integers (the call's code and the module's step count) over a process
group of its own, made at compile time on every rank (its collectives never interleave with the host thread's
all-reduces on the default group). Where the ranks' calls differ, every rank raises ``CommunicationError`` naming
each rank's call, before anything of the module changes; where a rank never comes, its peers raise it after
``comm_timeout`` seconds naming the call they waited in.

``outcome`` is the second half of a call that must succeed on every rank or on none (``harmony.load``): each rank
says whether its part is ready, and a rank whose peers failed raises their errors instead of going on.
"""
from __future__ import annotations

import datetime

import torch

from harmony.base.errors import CheckpointError, CommunicationError, InputError, TornStepError
from harmony.runtime.comm.jobwide import StepStatus
from harmony.runtime.precision import overflow_ghost
from harmony.runtime.transaction import describe_torn

CALLS = ("sm(...) (a training step)", "harmony.save", "harmony.load", "sm.sync_model()",
         "sm.evaluate(...) (a pipeline's)")


class Handshake:
    """The module's own gloo process group and what each rank's calls were."""

    def __init__(self, rank: int, world: int, timeout: float):
        import torch.distributed as dist
        self.rank, self.world, self.timeout = rank, world, timeout
        self.same_shapes: list[list[int]] = []     # ranks that pass the same batch: a pipeline's (``attach``)
        self.own_shapes = False     # a balanced grid's pipelines: each its rows, of its own shape (``attach``)
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))

    def agree(self, call: str, steps: int, refused: Exception | None = None, plans: bool = False,
              torn: dict | None = None, shapes: int = 0) -> None:
        """Every rank is making ``call`` (one of ``CALLS``), or CommunicationError on every rank; a step's batch is
        refused on every rank where one rank refused its own (``refused``: that rank raises it), and the ranks'
        batches are all run by the compiled plan or all by plans of one shape (``plans``, ``shapes``: a digest of
        it), else InputError on every rank. A rank left with a torn step (``torn``, ``Runtime.torn``) makes every
        rank refuse a step or a save alike (TornStepError), until it loads a checkpoint or accepts the mix."""
        import torch.distributed as dist
        mine = torch.tensor([CALLS.index(call), steps, 2 if refused is not None else int(plans), torn is not None,
                             shapes], dtype=torch.int64)
        got = [torch.empty_like(mine) for _ in range(self.world)]
        try:
            dist.all_gather(got, mine, group=self.group)
        except (RuntimeError, dist.DistError) as e:
            detail = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CommunicationError(
                f"{call} on rank {self.rank} of {self.world}: not every rank made a collective call within "
                f"{self.timeout:g} s (comm_timeout; {detail}). Every rank must call {call} at the same point of "
                f"training. If a rank died, restart all ranks (torchrun --max-restarts) and load the last "
                f"checkpoint.") from e
        calls = [CALLS[int(t[0])] if 0 <= int(t[0]) < len(CALLS) else f"call {int(t[0])}" for t in got]
        if len(set(calls)) > 1:
            each = ", ".join(f"rank {r}: {c} at step {int(t[1])}" for r, (c, t) in enumerate(zip(calls, got)))
            raise CommunicationError(
                f"{call} on rank {self.rank} of {self.world}: the ranks are making different calls ({each}); "
                f"nothing was run. Every rank must call {_who(calls)} at the same point of training, with the same "
                f"arguments: each rank holds its part of the state and takes part in the collectives that write, "
                f"read or update it" + (" (calling harmony.save on rank 0 alone, as with DDP, is not supported: call "
                                        "it on every rank; rank 0 writes what the ranks share)" if CALLS[1] in calls
                                        else "") + ".")
        refuse_torn(call, self.rank, self.world, [r for r, t in enumerate(got) if int(t[3])], torn)
        routes = [int(t[2]) for t in got]
        if refused is None and 2 in routes:
            bad = [str(r) for r, c in enumerate(routes) if c == 2]
            raise InputError(f"{call} on rank {self.rank} of {self.world}: rank{'s' if len(bad) > 1 else ''} "
                             f"{', '.join(bad)} refused its batch at this step (its error says why); nothing was run "
                             f"on any rank. Fix that rank's batch and call again on every rank.")
        if refused is None and len(set(routes)) > 1:
            each = ", ".join(f"rank {r}: {'a plan of its own shape' if c else 'the compiled plan'}"
                             for r, c in enumerate(routes))
            raise InputError(f"{call} on rank {self.rank} of {self.world}: the ranks' batches need different plans "
                             f"({each}); nothing was run. Every rank must pass batches the same plan runs: shapes "
                             f"up to the compiled example's with at least one row a microbatch (drop_last=True, a "
                             f"DistributedSampler).")
        if refused is None and any(len({int(got[r][4]) for r in ranks}) > 1 for ranks in self.same_shapes):
            raise InputError(f"{call} on rank {self.rank} of {self.world}: the ranks of a pipeline passed batches of "
                             f"different shapes; nothing was run on any rank. Every pipeline rank passes the whole "
                             f"batch (the first reads its inputs, the last its targets): the same batch on every "
                             f"rank (the same seed for the DataLoader's shuffle and padding).")
        if refused is None and routes[0] == 1 and not self.own_shapes and len({int(t[4]) for t in got}) > 1:
            raise InputError(f"{call} on rank {self.rank} of {self.world}: the ranks passed batches of different "
                             f"shapes, each needing a plan of its own; nothing was run on any rank. Every rank must "
                             f"pass the same shapes at a step (drop_last=True, a DistributedSampler, the same "
                             f"padding).")

    def outcome(self, call: str, error: Exception | None, refusal: type = CheckpointError, failed: str = "failed",
                then: str = "Nothing was changed on any rank.") -> None:
        """Every rank's part of ``call`` is ready; else each rank raises: its own error, or ``refusal`` naming each
        rank that ``failed`` and its error, then what follows (``then``)."""
        import torch.distributed as dist
        got: list = [None] * self.world
        try:
            dist.all_gather_object(got, None if error is None else f"{type(error).__name__}: {error}",
                                   group=self.group)
        except (RuntimeError, dist.DistError) as e:
            raise CommunicationError(f"{call} on rank {self.rank} of {self.world}: the ranks could not tell each "
                                     f"other whether their parts are ready within {self.timeout:g} s ({e}); "
                                     f"nothing was changed. A peer probably died: call it again on every rank, or "
                                     f"restart all ranks and load the last checkpoint.") from e
        if error is not None:
            raise error
        ranks = [(r, msg) for r, msg in enumerate(got) if msg is not None]
        if ranks:
            raise refusal(f"{call} on rank {self.rank} of {self.world}: "
                          + "; ".join(f"rank {r} {failed} ({msg})" for r, msg in ranks) + f". {then}")


def refuse_torn(call: str, rank: int, world: int, ranks: list[int], torn: dict | None) -> None:
    """A step or a save refused on every rank where a rank holds a torn step's mix (a failure after its last
    collective, which its peers could not hear of then: runtime/comm/jobwide.py)."""
    if not ranks or call not in (CALLS[0], CALLS[1]):
        return
    here = f": {describe_torn(torn)}" if torn is not None else ""
    raise TornStepError(
        f"{call} on rank {rank} of {world} refused on every rank: rank{'s' if len(ranks) > 1 else ''} "
        f"{', '.join(map(str, ranks))} hold{'s' if len(ranks) == 1 else ''} a step that updated some packs only"
        f"{here}. Call harmony.load(sm, checkpoint) on every rank to go back to a checkpoint, or "
        f"sm.accept_partial_step() on the rank{'s' if len(ranks) > 1 else ''} named to keep the mix.")


def planned(sm, error: Exception | None) -> None:
    """After a new shape's planning on every rank (``sm(...)``): a rank that could not plan it makes every rank
    raise InputError (that rank its own), before any collective of the step."""
    handshake = getattr(sm, "handshake", None)
    if handshake is not None:
        handshake.outcome("sm(...)", error, InputError, "could not plan its batch's shape",
                          "Nothing was run on any rank; every rank must pass batches each can train.")


def _who(calls: list[str]) -> str:
    """The call to name: the one other than a step (a save or load the others did not make)."""
    rest = [c for c in dict.fromkeys(calls) if c != CALLS[0]]
    return " and ".join(rest) if rest else calls[0]


def attach(sm) -> None:
    """``sm.handshake``: a Handshake where ``sm`` runs over several ranks (data parallel, a pipeline), else None.
    Every rank compiles, so every rank makes the group here, in the same order."""
    cfg, plan = sm.program.config, sm.program.plan
    world = cfg.world_size or 1
    sm.handshake = None
    if sm.mode.ranks_meet(cfg, plan):
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            sm.handshake = Handshake(dist.get_rank(), world, cfg.comm_timeout)
            # a pipeline's ranks all pass its whole batch (a grid's pipelines each their own rows)
            if plan.stage is not None:
                grid = plan.stage.grid
                sm.handshake.same_shapes = [list(range(world))] if grid is None else \
                    [grid.pipeline_ranks(r) for r in range(grid.replicas)]
                sm.handshake.own_shapes = grid is not None and plan.stage.weight is not None
            # each step's outcome is the job's: a failure is told at the next collective (runtime/comm/jobwide.py)
            sm.runtime.status = StepStatus(sm.handshake.rank, world, sm.handshake.group, cfg.comm_timeout)
            if world > 2:       # the words beside each all-reduce of three ranks or more: a group of their own
                sm.runtime.status.beside = dist.new_group(backend="gloo",
                                                          timeout=datetime.timedelta(seconds=cfg.comm_timeout))
            sm.runtime.status.any_key = plan.stage is not None
            if sm.runtime.scaler is not None and sm.runtime.scaler.agree is not None:
                sm.runtime.status.tails.append(overflow_ghost)    # fp16: the overflow agreement after the schedule


def agree(sm, call: str, refused: Exception | None = None, plans: bool = False, shapes: int = 0) -> None:
    """``sm.handshake.agree`` where there is one (several ranks), else nothing."""
    handshake = getattr(sm, "handshake", None)
    if handshake is not None:
        handshake.agree(call, sm.steps, refused, plans, getattr(sm.runtime, "torn", None), shapes)
