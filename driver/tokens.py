"""Whole-batch token losses at compile and at every call: the weighting chosen, the batch's token count handed in.

Compile (``prepare``) chooses the weighting (compiler/loss_weighting.py) and, for tokens, traces the step with the
example batch's count as its last input; ``settle`` keeps the choice on the graph (``gm.meta[WEIGHTING]``) once
the trace shows whether the loss reads the count, and puts a section in the report saying which weighting and
why. Each ``sm(...)`` and ``sm.evaluate(...)`` counts its batch (``with_count``) once its tensors are checked and
its plan found: the count travels beside the batch, not in it (shape keys and ``example_batch`` are the user's
tensors), and is appended to the runtime's inputs last; a 0-dim tensor, which the runtime never cuts by rows.

Data parallel: a step divides by the count of the global batch, every rank's summed (an all-reduce on the ranks'
handshake group, after they agreed to step), and seeds each microbatch's loss times the world size, since the
all-reduce averages the ranks' gradients: the step is the gradient of the global batch's token mean, what Hugging
Face's Trainer computes with ``average_tokens_across_devices``. Each rank returns its term times the world size,
so the mean of the ranks' losses is the global token mean. An evaluation counts its own rank's batch only (it
runs no collective) and returns that batch's token mean.
"""
from __future__ import annotations

import torch

from harmony.base.errors import InputError
from harmony.compiler.ir import PassReport
from harmony.compiler.loss_weighting import ITEMS, Weighting, choose, count, read_by
from harmony.compiler.trace.batch import Batch
from harmony.runtime.comm.collectives import guarded

WEIGHTING = "harmony.loss_weighting"     # gm.meta key (the graph module's): the step's Weighting
ROWS = Weighting("rows", "each microbatch's mean loss counts for its rows")


def prepare(cfg, model, example) -> tuple[Weighting, torch.Tensor | None]:
    """The weighting for compiling ``model`` on ``example`` (a dict or a tuple of tensors), and the example batch's
    token count to trace the step with (None: the step takes no count)."""
    names = list(Batch.of(model, example, cfg.loss_fn).names)
    weighting = choose(cfg, model, names)
    if not weighting.fed:
        return weighting, None
    tensors = example.values() if isinstance(example, dict) else example
    return weighting, count(weighting, dict(zip(names, tensors)))


def settle(program, weighting: Weighting, items) -> None:
    """Keep ``weighting`` on the traced graph as the trace bears it out, and report it."""
    weighting = read_by(weighting, program.gm, program.config.loss_weighting)
    program.gm.meta[WEIGHTING] = weighting
    report = PassReport(f"loss weighting: {weighting.kind}", notes=[weighting.why])
    if weighting.tokens:
        # a simulated compile's batch is on the meta device: no count to read
        report.totals = dict(example_tokens=int(items) if items.device.type != "meta" else None)
        program.step_hooks.append(token_stats)
    program.reports.insert(0, report)


def weighting_of(program) -> Weighting:
    return program.gm.meta.get(WEIGHTING, ROWS)


def user_names(program) -> list[str]:
    """The batch tensors a call gives (the plan's inputs but the count)."""
    names = list(program.plan.input_names)
    return [n for n in names if n != ITEMS] if weighting_of(program).fed else names


def traced(batch, items) -> tuple:
    """The tensors the traced step takes: ``batch``'s, then the count where it takes one."""
    return tuple(batch) if items is None else (*batch, items)


def any_count(program) -> torch.Tensor | None:
    """A count to trace ``program``'s step again with (a batch of another shape: the trace reads its shape only)."""
    return torch.ones((), dtype=torch.int64) if weighting_of(program).fed else None


def with_count(sm, batch: tuple, across_ranks: bool = False) -> tuple:
    """``batch`` (the call's tensors in the plan's order) with its token count appended where the step takes one.
    ``across_ranks`` (a step): summed over the data-parallel ranks, a collective every rank calls at the same
    point of the step; an ``InputError`` where no token is counted (the loss would be 0 / 0)."""
    weighting = weighting_of(sm.program)
    if not weighting.fed:
        return batch
    n = count(weighting, dict(zip(user_names(sm.program), batch)))
    handshake = getattr(sm, "handshake", None)
    if across_ranks and weighting.tokens and weighting.scale > 1 and handshake is not None:
        import torch.distributed as dist
        guarded("the sum of the ranks' token counts", dist.all_reduce, n, op=dist.ReduceOp.SUM,
                group=handshake.group, timeout=handshake.timeout)
        grid = getattr(getattr(sm.program.plan, "stage", None), "grid", None)
        if grid is not None:         # every rank of a pipeline counted its pipeline's batch
            n = n // grid.pipeline
    if weighting.tokens and int(n) == 0:
        raise InputError(f"the batch has no label token to count (every {weighting.labels} is -100"
                         f"{' on every rank' if across_ranks and weighting.scale > 1 else ''}): its token mean "
                         f"would be 0 / 0")
    if across_ranks:
        sm.runtime.tokens = int(n)
    return (*batch, n)


def token_stats(sm) -> dict:
    """``sm.stats["loss_tokens"]``: the label tokens the step's loss is the mean over (all ranks')."""
    return {"loss_tokens": getattr(sm.runtime, "tokens", None)}
