"""``sm.evaluate(*batch)``: a batch's loss as ``model.eval()`` under ``torch.no_grad()`` computes it, within the budget.

The evaluation runs a schedule of its own (passes/eval_schedule.py: each pack's weights swapped in
once, its eval-mode forward over every microbatch, released) on the training runtime's state as the
last step left it: the same weights on the same tiers, the same meter and budget. It makes no
gradient, takes no optimizer step, updates no buffer, leaves the RNG and ``sm.steps`` as they were,
and an error inside it is rolled back as a failed step is, so the next ``sm(...)`` trains as if it had
not run. The schedule is built on the first evaluation (``sm.eval_stats["compile_seconds"]``) and
kept; switching between training and evaluation costs nothing after that.

It returns the mean of the microbatches' losses, in fp32, as a step does: the traced graph computes
the loss and nothing else, so a model's other outputs (logits) are not returned. Under data
parallelism each rank evaluates its own batch (its share of a global one) and returns its own loss:
no all-reduce runs (average the ranks' losses with ``torch.distributed`` where one figure is wanted).
Under ``parallel="pipeline"`` every rank calls it with the whole batch, as a step: each runs its packs'
forwards in the step's order, the last rank's loss is every rank's, and a failure on one rank (a bad
batch, an error in the model) ends the evaluation on every rank (the others raise ``StepAbortedError``
naming it), after which training goes on as if it had not run. In a grid each pipeline evaluates its
own batch and every rank returns the mean of the pipelines' losses.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from harmony.base.errors import BudgetError, ConfigError, InputError, TornStepError
from harmony.base.process import peak_rss_bytes
from harmony.compiler.trace.eval import eval_module
from harmony.driver.constants import same_as_compiled, split_call
from harmony.driver.handshake import CALLS, agree
from harmony.driver.shapes import describe, shape_key
from harmony.driver.step import batch_of, leaf_modules, shape_digest
from harmony.driver.tokens import with_count
from harmony.passes.eval_schedule import build
from harmony.runtime.comm.world import check_world
from harmony.runtime.transaction import describe_torn


@dataclasses.dataclass
class Evaluation:
    """A compiled module's evaluation schedule, built once: its graph, the plan of eval-mode packs it runs,
    the leaf modules it runs in eval mode, its predicted memory and the report of how it was made."""

    graph: object
    plan: object
    modules: list
    predicted: object
    report: object
    rewritten: int            # ops of the traced graph turned to eval mode (dropout, batch norm)
    seconds: float
    fewer: dict = dataclasses.field(default_factory=dict)   # microbatches -> the schedule of a batch of fewer rows


def eval_plan(plan):
    """``plan`` with each pack's forward in eval mode (compiler/trace/eval.py): no random numbers to replay, no
    buffer it writes. Returns the plan, the modules to run in eval mode, and how many ops changed."""
    packs, changed = [], 0
    for spec in plan.packs:
        module, n = eval_module(spec.module)
        changed += n
        packs.append(dataclasses.replace(spec, module=module, mutated=[], random=False))
    return dataclasses.replace(plan, packs=packs), leaf_modules(packs), changed


def _reads_mode(module) -> bool:
    """A module whose forward differs in eval mode: dropout, batch and instance norm (others may too: all run in
    eval mode; these are named in the report)."""
    from torch.nn.modules.batchnorm import _NormBase
    from torch.nn.modules.dropout import _DropoutNd
    return isinstance(module, (_DropoutNd, _NormBase))


def compile_evaluation(sm, microbatches: int | None = None) -> Evaluation:
    """The module's evaluation schedule, built on the first call and kept; ``microbatches``: one for a batch of
    fewer rows than the plan's microbatches (built on first use too, and kept beside it)."""
    own = sm.program.plan.microbatches
    if sm._evaluation is not None and microbatches in (None, own):
        return sm._evaluation
    if sm._evaluation is not None and microbatches in sm._evaluation.fewer:
        return sm._evaluation.fewer[microbatches]
    t0 = time.perf_counter()
    plan, modules, changed = eval_plan(sm.program.plan)
    if microbatches not in (None, own):
        plan = dataclasses.replace(plan, microbatches=microbatches, rows=())
    graph, predicted, report = build(sm.program, plan)
    if changed:
        report.notes.append(f"{changed} ops of the traced graph run as in eval mode (dropout off, batch norm on "
                            f"its running statistics, which it leaves as they are)")
    kinds = sorted({type(m).__name__ for m in modules if _reads_mode(m)})
    if kinds:
        report.notes.append(f"the model's own {', '.join(kinds)} modules run in eval mode during it (and in "
                            f"training mode during a step)")
    made = Evaluation(graph, plan, modules, predicted, report, changed, time.perf_counter() - t0)
    if microbatches in (None, own):
        sm._evaluation = made
    else:
        compile_evaluation(sm).fewer[microbatches] = made
    return made


def _check(sm) -> None:
    cfg = sm.program.config
    if sm.runtime is None:
        raise ConfigError(f"this module was compiled with passes={[h[0] for h in sm.history]}, which make no "
                          f"schedule; compile with the default passes to evaluate")
    if cfg.policy == "ondemand":
        raise ConfigError("policy='ondemand' has no planned movement to evaluate with: its runtime fetches state "
                          "as a training step touches it; compile with policy='harmony' or 'sequential' to evaluate")
    check_world(cfg, sm.program.capabilities)
    if sm.runtime.torn is not None:
        raise TornStepError(f"evaluation refused: {describe_torn(sm.runtime.torn)}")


def eval_rows(sm, batch: tuple) -> tuple[int, ...]:
    """The rows of each microbatch the evaluation runs ``batch`` in: the training plan's microbatches, or one a row
    where the batch has fewer rows; ``InputError`` for a batch the compiled plan does not run (driver/shapes.py)."""
    shapes = sm.shapes
    rows = batch[0].shape[0] if batch and batch[0].dim() > 0 else 0
    if rows < 1:
        raise InputError(f"sm.evaluate got a batch of {describe(shape_key(batch), shapes.names)}: 0 rows; give at "
                         f"least one sample")
    split, why = shapes.runs(batch, min(rows, sm.program.plan.microbatches))
    if split is None:
        raise InputError(f"sm.evaluate cannot run a batch of {describe(shape_key(batch), shapes.names)} with the "
                         f"compiled plan (example batch {describe(shapes.example.key, shapes.names)}): {why}. "
                         f"Evaluation runs every batch up to the example's shapes in its free dimensions; compile "
                         f"with a batch of this shape's fixed sizes as example_batch")
    return split


def evaluate(sm, batch: tuple, named: dict) -> torch.Tensor:
    """The mean loss over the batch's microbatches, forward only, in eval mode (see the module docstring)."""
    _check(sm)
    compiled = sm._evaluation is None
    error = given = None
    try:
        given, named, constants = split_call(sm.program, batch, named)   # its constants apart (driver/constants.py)
        same_as_compiled(sm.program, constants, "sm.evaluate")
        given = batch = batch_of(sm, given, named)
        rows = eval_rows(sm, batch)
        ev = compile_evaluation(sm, len(rows))
    except (InputError, BudgetError) as e:
        error = e
    if sm.program.plan.stage is not None:     # a pipeline's ranks run it together: each can, with one shape, or none
        agree(sm, CALLS[4], error, plans=True, shapes=shape_digest(shape_key(given)) if given is not None else 0)
    if error is not None:
        raise error
    rt = sm.runtime
    cuda = rt.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(rt.device)
    t0 = time.perf_counter()
    counted = with_count(sm, batch)      # this rank's token count, last, where the step takes it (driver/tokens.py)
    loss = rt.evaluate(ev.graph, ev.plan, dict(zip(sm.program.plan.input_names, counted)), ev.modules, rows)
    seconds = time.perf_counter() - t0
    stats = sm.eval_stats
    stats.update(eval_seconds=seconds, evaluations=stats.get("evaluations", 0) + 1,
                 compile_seconds=ev.seconds, measured_peak=rt.meter.peak, predicted_peak=ev.predicted.peak,
                 budget=rt.meter.budget, h2d_bytes=rt.eval_moved.get("h2d", 0),
                 d2h_bytes=rt.eval_moved.get("d2h", 0), predicted_h2d=ev.predicted.moved["h2d"],
                 peak_rss_bytes=peak_rss_bytes())
    if rt.safety is not None:     # the evaluation's plan misses (runtime/safety.py)
        stats.update(rt.safety.stats())
    stats.update(getattr(rt, "eval_shares", None) or {})    # shard_state="full": its gathers' bytes, carried copies
    if compiled:
        stats["first_eval_seconds"] = seconds + ev.seconds
    if cuda:
        stats.update(cuda_allocated_peak=torch.cuda.max_memory_allocated(rt.device),
                     cuda_reserved_peak=torch.cuda.max_memory_reserved(rt.device))
    return loss
