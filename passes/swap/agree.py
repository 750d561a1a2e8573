"""The swap choices of a balanced ZeRO-3 grid's replica group, made alike (``balance=`` with ``shard_state="full"`` in
``parallel=("pipeline", "data")``).

Under ``balance=`` the pipelines of a grid train on different rows: the ranks of a stage's replica group run its packs
over microbatches of other sizes and counts, so each one's swap search weighs its own activations against the budget
and may hold another pack's weights between its forward and backward visits. Under ``shard_state="full"`` each of
those visits is a gather, a collective of the replica group, so the group must gather the same packs in the same
order. Each rank therefore keeps only the holds every rank of its replica group chose (the intersection of ``held``,
``parts`` and ``carried``): dropping a hold only lowers a rank's peak (the weights come again by a gather), so the
choice still fits every rank's budget, and every rank gathers where any of them would.
"""
from __future__ import annotations

from harmony.passes.swap.graph import Choice
from harmony.runtime.comm.failures import guarded


def applies(program) -> bool:
    """Whether this rank's live plan is a balanced ZeRO-3 grid's (the same answer on every rank of the job)."""
    import torch.distributed as dist
    cfg = program.config
    grid = getattr(getattr(program.plan, "stage", None), "grid", None)
    return (grid is not None and getattr(cfg, "shard_state", None) == "full"
            and getattr(cfg, "sample_weight", None) is not None and not cfg.offline
            and dist.is_available() and dist.is_initialized() and dist.get_rank() == cfg.rank)


def common_holds(program, chosen: Choice) -> Choice:
    """``chosen`` with only the holds every rank of this rank's replica group chose (a collective of the job: every
    rank calls it at the same point of its swap pass)."""
    import torch.distributed as dist
    stage = program.plan.stage.grid.stage
    mine = (stage, sorted(chosen.held), sorted(chosen.parts), sorted(chosen.carried))
    every: list = [None] * dist.get_world_size()
    guarded("the replica groups' exchange of their swap choices (balance= with shard_state='full')",
            dist.all_gather_object, every, mine)
    peers = [e for e in every if e[0] == stage]

    def common(i: int) -> frozenset:
        return frozenset.intersection(*(frozenset(tuple(x) if isinstance(x, list) else x for x in e[i])
                                        for e in peers))
    return chosen._replace(held=common(1), parts=common(2), carried=common(3))
