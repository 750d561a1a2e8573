"""Ranks agree on how their compile went, before the next collective: a rank that fails fails the job's compile.

Over several ranks ``harmony.compile`` runs collectives (ZeRO-3's and the pipeline's plan checks, the data-parallel
weights broadcast, ``balance=``'s plan from rank 0, the process groups the module makes). A rank whose compile fails
(its example batch cannot be traced, its memory budget plans nothing) would leave the others waiting in the next one
for ``comm_timeout``, then a raw backend error. So the compile meets at fixed points (``POINTS``), every rank in
the same order whatever happened: after tracing (before ``balance=``'s plan from rank 0), after planning (before the
passes, whose plan checks hear a rank that fails in them: passes/compress.py ``report_failure``), and once the
runtime is built, before the module's first collective (driver/assemble.py), and once the module is built (the end
of driver/compile.py: what comes after the runtime's process groups, its step status, shape cache, disk tiers and
the weights of a model built without them, fails every rank's compile too). A rank that failed goes to the next
point with its error; there every rank exchanges what it has and each raises: a failed rank its own error, the
others the same class of error naming the rank, its error and the stage. No rank is left with a module: the others
close what they built.
"""
from __future__ import annotations

import contextlib
import threading

from harmony.base import errors
from harmony.base.errors import BudgetError, HarmonyError

POINTS = ("after tracing", "after planning", "before the module's first collective", "once the module is built")
STAGES = ("tracing its example batch", "planning its batch", "running the compiler passes or building its runtime",
          "finishing its module (its step status, shape cache, disk tiers or weights)")
_HERE = threading.local()      # the compile under way on this thread (``compiling``)


class Agreement:
    """One compile's meeting points over the live default process group (``world`` ranks)."""

    def __init__(self, rank: int, world: int, timeout: float):
        self.rank, self.world, self.timeout = rank, world, timeout
        self.next = 0            # the index in POINTS of the next point this rank has not met

    def meet(self, point: str, error: BaseException | None = None) -> None:
        """Meet the others at ``point``, the next of ``POINTS`` (every rank meets the same, in order); raise where any
        rank failed: ``error``, this rank's own failure, or the others'."""
        import torch.distributed as dist

        from harmony.runtime.comm.failures import guarded
        # in order; a simulated compile (device "meta") skips the runtime's point on every rank alike
        assert POINTS.index(point) >= self.next, (point, self.next)
        self.next = POINTS.index(point) + 1
        got: list = [None] * self.world
        try:
            guarded(f"harmony.compile's agreement {point}", dist.all_gather_object, got,
                    None if error is None else _word(error, STAGES[self.next - 1]), timeout=self.timeout)
        except BaseException:
            self.next = len(POINTS)      # the group is gone: nothing more to meet
            raise
        failed = [(r, w) for r, w in enumerate(got) if w is not None and w[4]]     # their own, not an echo
        if not failed:
            failed = [(r, w) for r, w in enumerate(got) if w is not None]
        if not failed:
            return
        self.next = len(POINTS)       # every rank stops here: nothing more to meet
        if error is not None and not getattr(error, "harmony_echo", False):
            raise error
        raise self._theirs(failed, point)

    def _theirs(self, failed: list, point: str) -> HarmonyError:
        """The error a rank raises for the others' failures: the first failed rank's class, naming each."""
        cls_name, _, min_budget, option = failed[0][1][:4]
        cls = getattr(errors, cls_name, None)
        cls = cls if isinstance(cls, type) and issubclass(cls, HarmonyError) else HarmonyError
        each = "; ".join(f"rank {r} failed while {w[5]}: {w[0]}: {w[1].rstrip('.')}" for r, w in failed)
        ranks = ", ".join(str(r) for r, _ in failed)
        message = (f"harmony.compile on rank {self.rank} of {self.world} stopped {point}: {each}. No rank "
                   f"built a module; fix what rank{'s' if len(failed) > 1 else ''} {ranks} named (its example batch, "
                   f"its memory budget, its options) and compile again on every rank.")
        out = cls(message, min_budget, option) if issubclass(cls, BudgetError) else cls(message)
        out.failed_ranks = [r for r, _ in failed]
        return out


def _word(error: BaseException, stage: str) -> tuple:
    """What a rank tells of its failure: class, first line, a BudgetError's budget and option, whether it is its own
    (not an echo of another rank's, which a plan check heard: passes/compress.py), and the stage it failed in."""
    text = str(error).splitlines()[0] if str(error) else "(no message)"
    return (type(error).__name__, text, getattr(error, "min_budget", None), getattr(error, "option", "memory_budget"),
            not getattr(error, "harmony_echo", False), stage)


@contextlib.contextmanager
def compiling(cfg):
    """The block is one rank's compile: on a failure this rank meets the others at its next point with the error
    (raising its own, or theirs). Nothing over one rank, or without a live process group."""
    agreement = _agreement(cfg)
    _HERE.agreement = agreement
    try:
        yield agreement
    except BaseException as e:
        if agreement is not None and agreement.next < len(POINTS):
            agreement.meet(POINTS[agreement.next], e)
        raise
    finally:
        _HERE.agreement = None


def point(name: str) -> None:
    """Meet the other ranks of the compile under way at ``name`` (nothing outside one, or over one rank)."""
    agreement = getattr(_HERE, "agreement", None)
    if agreement is not None:
        agreement.meet(name)


def _agreement(cfg) -> Agreement | None:
    world = cfg.world_size or 1
    if world <= 1:
        return None
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != world:
        return None
    return Agreement(dist.get_rank(), world, cfg.comm_timeout)
