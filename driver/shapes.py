"""Batches of other shapes than the example's: one plan for every batch up to the compiled shape.

The example batch is the largest batch the module trains, and its plan serves every batch up to it: fewer rows,
shorter sequences, each batch padded to its own length (dynamic padding). The traced graph computes its sizes
from its inputs (fx) or keeps them symbolic (export, ``Dim.AUTO`` on every batch dimension), and
``TraceInfo.sizes`` says which dimensions it fixes; a batch whose every dimension is at most the example's, and
equal where the trace fixed it, runs the compiled schedule as it is, its rows cut evenly into the plan's
microbatches (``Runtime.run(rows=...)``). Smaller activations fit the budget the plan was made for, so nothing is
planned: the first step at a new shape costs what any step costs.

``ShapeCache.route`` decides, without planning or any collective:

- the compiled plan, for every batch it runs (``served`` counts them for the report);
- a plan of the batch's own, where the compiled one cannot run it: fewer rows than it has microbatches, a
  dimension the trace fixed, other constants (driver/constants.py), or ``shape_plans="each"``. It is traced and
  planned on the batch's first step (logged on the ``"harmony"`` logger at INFO with the seconds it took and why)
  with the compiled plan's choices handed to its passes (the same packs, ``Program.partition_choice``; the same
  placement of the optimizer step; the same ``Program.swap_choice``), so that every pack keeps its parameters,
  its residency and its step order, and only the schedule and the memory of each op differ. The runtime runs that
  schedule over its state as it is (``Runtime.running``). At most ``MAX_SHAPES`` such plans are kept, the example's
  always, the least recently used dropped first (with a warning); a plan that would keep state elsewhere is refused;
- a refusal (``InputError``, before anything changes) for a batch larger than the example in any dimension: the
  message says to compile with the largest batch and what a plan of this one would need under the budget.

Rows: each microbatch's loss counts for its share of the rows (its gradient seed is ``loss_i * rows_i / N``, the
returned loss the row-weighted mean): the gradient of the batch's mean loss for a loss that is a mean over its
rows, what eager gradient accumulation over the same microbatches weighted by their rows computes. Where the
microbatches are alike it is the usual ``loss_i / microbatches``.

Data parallel: each rank may pass its own shapes; the step's handshake (driver/handshake.py) checks that every
rank accepted its batch and that all are run by the compiled plan or all by plans of their own (else every rank
refuses at once); a plan of its own is checked across ranks when it is made (a collective: ranks that pass
different new shapes all refuse). ``balance=`` plans each rank's share of one global batch and refuses other
shapes, as do ``shard_state="full"``, ``parallel="pipeline"`` and the ``ondemand`` baseline.

``sm.code``, ``sm.plan``, ``sm.graph`` and ``sm.history`` stay the compiled plan's; ``sm.shapes.plans`` holds
every cached plan's program, and ``sm.stats`` after a step describes the plan that ran and its rows.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import OrderedDict

import torch

from harmony.base.errors import BudgetError, HarmonyError, InputError
from harmony.base.units import fmt_bytes
from harmony.compiler import cost
from harmony.compiler.ir import Program
from harmony.compiler.passmanager import run_passes, split_choices
from harmony.compiler.trace import TRACE_INFO, retarget, trace
from harmony.compiler.verify import MemoryCurve, memory_curve
from harmony.driver.constants import batch_example, changed, constants_key, key_text
from harmony.driver.tokens import any_count, traced
from harmony.runtime.comm.failures import guarded
from harmony.runtime.ops import ops_of
from harmony.runtime.placeholders import point
from harmony.runtime.plan import even_rows

MAX_SHAPES = 8      # plans kept, the example batch's included
CONSTANTS = "constants"     # the tag of a key's constants
log = logging.getLogger("harmony")


def shape_key(batch, constants: dict | None = None) -> tuple:
    """What a plan is cached by: each batch tensor's shape and dtype, in the plan's order, then the batch's
    constants where it has any (driver/constants.py: another value is another trace)."""
    key = tuple((tuple(t.shape), t.dtype) for t in batch)
    return key + ((CONSTANTS, constants_key(constants)),) if constants else key


def describe(key: tuple, names) -> str:
    """``input_ids int64[4, 24], labels int64[4, 24]`` (and ``; use_cache=False`` where the key has constants)."""
    fixed = [key_text(k[1]) for k in key if k[0] == CONSTANTS]
    text = ", ".join(f"{n} {str(dtype).removeprefix('torch.')}{list(shape)}"
                     for n, (shape, dtype) in zip(names, key[:-1] if fixed else key))
    return text + (f"; {fixed[0]}" if fixed else "")


def split_rows(rows: int, microbatch: int) -> tuple[int, ...]:
    """The rows of each microbatch of a batch of ``rows``, none over ``microbatch`` (see the module's docstring)."""
    count = -(-rows // microbatch)
    size = -(-rows // count)
    count = -(-rows // size)
    return tuple(min(size, rows - i * size) for i in range(count))


@dataclasses.dataclass(frozen=True)
class Route:
    """How a batch is trained (``ShapeCache.route``): by ``plan`` (the compiled one with ``rows``, or one made for
    its shape), or by a plan to make (``plan`` None; ``why``: why the compiled plan does not run it)."""

    key: tuple
    plan: ShapePlan | None
    rows: tuple[int, ...] | None = None
    why: str = ""
    constants: dict | None = None     # the call's, where they differ from the compiled ones


@dataclasses.dataclass
class ShapePlan:
    """One cached plan: the program for one key, its predicted memory curve, and what the report lists of it."""

    key: tuple
    program: Program
    predicted: MemoryCurve
    seconds: float = 0.0      # compile seconds (the example batch's: compile's total)
    steps: int = 0            # steps run with it
    why: str = ""             # why the compiled plan does not run this shape (the plans made after compile)


class ShapeCache:
    """``sm.shapes``: the plan of every batch shape seen, by key; the example batch's is ``sm.program``'s."""

    def __init__(self, sm, limit: int = MAX_SHAPES):
        self.sm, self.limit = sm, limit
        program = sm.program
        self.names = list(program.plan.input_names) if program.plan is not None else []
        self.example = ShapePlan(shape_key(program.example_batch, program.constants), program, sm.predicted)
        self.plans: OrderedDict = OrderedDict({self.example.key: self.example})
        self.served: dict = {}    # key -> steps the compiled plan ran at that shape (not the example's)
        self.compiles = 0         # shapes planned after compile
        self.dropped = 0          # plans dropped to keep at most ``limit``

    def route(self, batch: tuple, constants: dict | None = None) -> Route:
        """Which plan trains ``batch`` (called with ``constants``), without planning or any collective: the compiled
        plan wherever it runs the batch (with its microbatches' rows), a cached plan made for this shape and these
        constants, or none yet (``Route.why``). A batch larger than the compiled one in any dimension is an
        ``InputError``."""
        key = shape_key(batch, constants)
        found = self.plans.get(key)
        if found is not None:
            return Route(key, found)
        differs = changed(self.sm.program.constants, constants or {})
        if differs:
            return Route(key, None, why=f"the batch's constants differ: {differs}", constants=constants)
        rows, why = self.runs(batch, self.example.program.plan.microbatches)
        if rows is not None and self.example.program.config.shape_plans == "each":
            rows, why = None, "shape_plans='each' plans every new shape"
        return Route(key, self.example, rows) if rows is not None else Route(key, None, why=why, constants=constants)

    def plan_for(self, batch: tuple, route: Route | None = None) -> tuple[ShapePlan, tuple[int, ...] | None]:
        """The plan that trains ``batch`` and the rows of each of its microbatches (None: the plan's own): as
        ``route`` says, a plan made now for its shapes and cached where none runs it yet (``InputError`` where none
        can be, with nothing changed)."""
        route = route or self.route(batch)
        if route.plan is None:
            return self._planned(batch, route.key, route.why, route.constants), None
        if route.key in self.plans:
            self.plans.move_to_end(route.key)
        return route.plan, route.rows

    def ran(self, key: tuple, shape: ShapePlan) -> None:
        """Count a step of ``shape``'s plan at ``key`` (the report's figures)."""
        shape.steps += 1
        if shape is self.example and key != self.example.key:
            self.served[key] = self.served.get(key, 0) + 1

    def runs(self, batch: tuple, microbatches: int) -> tuple[tuple[int, ...] | None, str]:
        """The rows of each of ``microbatches`` microbatches where the compiled plan runs ``batch`` as it is (every
        dimension no larger than the example batch's, any that differs free to in the trace, at least one row a
        microbatch), else (None, why not). A dimension larger than the example's is an ``InputError``."""
        base = self.example.program
        if len({t.shape[0] if t.dim() else 1 for t in batch}) > 1:
            raise InputError(f"a batch of {describe(shape_key(batch), self.names)}: every batch tensor needs the same "
                             f"number of rows in dimension 0")
        larger = [(n, tuple(t.shape), tuple(e.shape)) for n, t, e in zip(self.names, batch, base.example_batch)
                  if t.dim() == e.dim() and any(a > b for a, b in zip(t.shape, e.shape))]
        if larger:
            raise InputError(larger_text(self.sm, batch, self.names, larger))
        if any(t.dtype != e.dtype or t.dim() != e.dim() for t, e in zip(batch, base.example_batch)):
            return None, "its dtypes or dimensions differ from the example batch's"
        rows = batch[0].shape[0] if batch and batch[0].dim() > 0 else 0
        same = all(t.shape == e.shape for t, e in zip(batch, base.example_batch))
        if same and microbatches == base.plan.microbatches:      # the example's shapes: every mode runs them
            return base.plan.microbatch_rows(), ""
        refused = refuses_other_shapes(base, planning=False)
        if refused:
            return None, refused
        info = base.gm.meta.get(TRACE_INFO)
        why = info.runs_at([tuple(t.shape) for t in batch]) if info is not None and info.sizes else "no trace info"
        if why is not None:
            return None, why
        if rows == sum(base.plan.microbatch_rows()) and microbatches == base.plan.microbatches:
            return base.plan.microbatch_rows(), ""
        if rows < microbatches:
            return None, f"{rows} rows are fewer than the plan's {microbatches} microbatches"
        return even_rows(rows, microbatches), ""

    def _planned(self, batch: tuple, key: tuple, why: str, constants: dict | None = None) -> ShapePlan:
        """A plan made now for ``batch``'s shapes and ``constants`` (``why``: why the compiled one does not run it),
        cached."""
        start = time.perf_counter()
        differs = changed(self.sm.program.constants, constants or {})
        if differs:
            log.info("harmony: %s: tracing and planning the step again with these constants", differs)
        program = plan_shape(self.sm, batch, self.names, constants)
        made = ShapePlan(key, program, memory_curve(program, check_residency=False), time.perf_counter() - start,
                         why=why)
        self.plans[key] = made
        self.compiles += 1
        while len(self.plans) > self.limit:
            old = next(k for k in self.plans if k != self.example.key)
            del self.plans[old]
            self.dropped += 1
            log.warning("harmony: dropped the plan for batch %s: at most %d shapes are cached (harmony.driver.shapes."
                        "MAX_SHAPES); a shape that comes back compiles again", describe(old, self.names), self.limit)
        log.info("harmony: new batch shape %s: compiled a plan in %.2f s (%d microbatches; predicted peak %s; "
                 "%d shapes cached): the compiled plan does not run it (%s)", describe(key, self.names), made.seconds,
                 program.plan.microbatches, fmt_bytes(made.predicted.peak), len(self.plans), why)
        return made

    def summary(self) -> list[dict]:
        """One row per cached plan, for the report: shapes, microbatch rows, predicted peak, compile seconds."""
        rows = []
        for key, p in self.plans.items():
            plan = p.program.plan
            example = key == self.example.key
            served = (f"the compiled plan: this shape and {len(self.served)} smaller ones seen "
                      f"({sum(self.served.values())} steps at them)") if example else f"planned: {p.why}"
            rows.append(dict(shape=describe(key, self.names), example=example,
                             microbatches="+".join(map(str, plan.microbatch_rows())),
                             predicted_peak_bytes=p.predicted.peak, compile_s=p.seconds, steps=p.steps, serves=served))
        return rows


def refuses_other_shapes(base: Program, planning: bool = True) -> str:
    """Why the modes and policies that train the example batch's shapes only refuse another ("" where none does).
    ``planning``: a shape that needs a plan of its own; else one the compiled plan runs (smaller in a dimension
    the trace leaves free, fewer rows), which a pipeline's ranks run too: each message says its values' shapes."""
    if any(getattr(r, "shares", None) is not None for r in base.plan.residency.values()):
        return ("shard_state='full' trains the example batch's shapes only (each rank's shares of the packs are "
                "laid out for its plan); compile again for this shape")
    if base.plan.stage is not None and planning:
        return ("parallel='pipeline' trains the compiled plan's shapes only: batches up to the example batch's "
                "shapes in the dimensions its trace leaves free, with at least one row a microbatch (its stages "
                "are placed for that plan); compile with an example batch of the largest shape, or drop the "
                "last short batch (DataLoader(drop_last=True))")
    if base.config.policy == "ondemand":
        return ("the 'ondemand' baseline trains the example batch's shapes only (its runtime fetches and evicts "
                "without a plan to reuse); compile again for this shape")
    return ""


def larger_text(sm, batch: tuple, names: list[str], larger: list) -> str:
    """The refusal of a batch larger than the example in some dimension, with what a plan for it would need."""
    base = sm.program
    name, shape, compiled = larger[0]
    text = (f"a batch of {describe(shape_key(batch), names)} is larger than the compiled example batch "
            f"({describe(shape_key(base.example_batch), names)}): {name} is {list(shape)}, compiled for "
            f"{list(compiled)}. The compiled plan is made for the largest batch it trains, and every batch up to "
            f"it runs that plan; compile with your largest batch (the longest sequence the loader pads to, the most "
            f"rows) as example_batch")
    try:      # what that shape would need: a plan of it (this rank's only: no collective), nothing kept
        program = plan_shape(sm, batch, names, sm.program.constants, agree=False)
        need = memory_curve(program, check_residency=False).peak
        return (f"{text}. At memory_budget={fmt_bytes(base.config.memory_budget)} a plan of this shape with the "
                f"compiled packs predicts a peak of {fmt_bytes(need)} in {program.plan.microbatches} microbatches")
    except HarmonyError as e:
        return f"{text}. With the compiled packs and budget, this shape: {str(e).splitlines()[0]}"


def plan_shape(sm, batch: tuple, names: list[str], constants: dict | None = None, agree: bool = True) -> Program:
    """A program for ``batch``'s shapes (traced with ``constants``) with the compiled program's packs and residency;
    ``InputError`` if none. ``agree``: data-parallel ranks check they plan the same shape (a collective)."""
    base = sm.program
    cfg = base.config
    key = shape_key(batch, constants)
    compiled = describe(shape_key(base.example_batch, base.constants), names)
    what = f"a batch of {describe(key, names)} (compiled for {compiled})"
    rows = {t.shape[0] for t in batch if t.dim() > 0}
    if len(rows) != 1:
        raise InputError(f"{what}: every batch tensor needs the same number of rows in dimension 0")
    if 0 in rows:
        raise InputError(f"{what} has 0 rows: give at least one sample")
    refused = refuses_other_shapes(base)
    if refused:
        raise InputError(f"{what}: {refused}")
    if agree:
        _agree_across_ranks(cfg, key, what)
    tensors = dict(base.gm.named_parameters()) | dict(base.gm.named_buffers())
    try:
        with _state_as_planned(sm.runtime.state, tensors):
            program = _plan(base, batch, rows.pop(), constants)
    except BudgetError as e:
        raise InputError(f"{what} cannot be trained with the compiled plan's packs under memory_budget="
                         f"{fmt_bytes(cfg.memory_budget)}, even one row per microbatch: "
                         f"{str(e).splitlines()[0].rstrip('.')}. Compile with the largest batch you will train on "
                         f"as example_batch: smaller batches and shorter sequences reuse its plan's layout.") from e
    except HarmonyError as e:
        raise InputError(f"{what} cannot be planned: {str(e).splitlines()[0]}") from e
    differs = _layout_differs(base, program, tensors)
    if differs:
        raise InputError(f"{what}: its plan would keep training state elsewhere than the compiled plan ({differs}); "
                         f"compile with this shape as example_batch")
    if torch.device(cfg.device).type != "cpu":      # as ScheduledModule does for the compiled packs
        managed = {id(t) for t in tensors.values()}
        for spec in program.plan.packs:
            retarget(spec.module, torch.device(cfg.device), managed)
    program.example_batch = tuple(torch.empty_like(t, device="meta") for t in batch)   # shapes, not the user's data
    return program


def _plan(base: Program, batch: tuple, rows: int, constants: dict | None = None) -> Program:
    """Trace and cost ``batch`` and run the passes with the compiled plan's choices at the compiled microbatch size;
    where that does not fit the budget (a longer sequence), with the least activation memory the same state layout
    allows (every pack recomputes, every activation goes to the host), at that size, then half of it, and so on
    down to one row per microbatch."""
    cfg = base.config
    example = batch_example(base, batch, constants)
    items = any_count(base)       # where the step takes the batch's token count: its last input (driver/tokens.py)
    gm = trace(base.model, example, loss_fn=cfg.loss_fn, leaf_modules=cfg.leaf_modules, dtype=cfg.compute_dtype,
               items=items)
    order, given = split_choices(cfg.passes)
    given["partition"] = base.partition_choice
    size, choices = min(cfg.microbatch_size, rows), [base.swap_choice]
    if base.swap_choice is not None:     # the same state kept, held and stepped; no activation kept on the device
        packs = range(len(base.plan.packs))
        stashed = {(op, p) for op in ("forward", "backward") for p in packs}
        choices.append(base.swap_choice._replace(kept=frozenset(), offloaded=frozenset(), stashed=stashed))
    fake = None
    while True:
        split = split_rows(rows, size)
        config = dataclasses.replace(cfg, batch_size=rows, microbatches=len(split), optimizer_on=_step_place(base))
        if fake is None or fake[0] != split[0]:
            fake = split[0], cost.annotate(gm, traced(batch, items), split[0], dtype=config.compute_dtype)
        program = Program(model=base.model, gm=gm, example_batch=tuple(batch), config=config, fake=fake[1],
                          batch_keys=base.batch_keys, optim_profile=base.optim_profile)
        try:
            given["swap"] = choices[0]
            program = run_passes(program, [(n, given[n]) if given.get(n) is not None else n for n in order])
        except BudgetError:
            if len(choices) > 1:
                choices.pop(0)
            elif split[0] > 1:
                size = -(-split[0] // 2)
            else:
                raise
            continue
        program.plan.rows = split if len(set(split)) > 1 else ()
        return program


def _step_place(base: Program) -> str:
    """Where the compiled plan's offload pass put the optimizer step (``Tier.DEVICE`` or ``Tier.HOST``): the new
    shape's plan must not decide again (``optimizer_on="auto"`` asks whether everything fits, which a smaller batch
    may change)."""
    placed = [r.totals.get("step_on") for r in base.reports if r.title.startswith("offload")]
    return placed[0] if placed and placed[0] else base.config.optimizer_on


def _layout_differs(base: Program, new: Program, tensors: dict) -> str:
    """What of the training state's layout differs between two plans ("" if nothing): the packs' state, their
    residency records, the order they step in, and the tensors the pack modules read."""
    old_plan, plan = base.plan, new.plan
    if len(plan.packs) != len(old_plan.packs):
        return f"{len(plan.packs)} packs, not {len(old_plan.packs)}"
    for a, b in zip(old_plan.packs, plan.packs):
        for field in ("params", "buffers", "owned", "stepped"):
            if getattr(a, field) != getattr(b, field):
                return f"pack {a.index} holds other {field}"
        if old_plan.at(a.index) != plan.at(b.index):
            return f"pack {a.index}'s residency"
    steps, hands = [], []       # the step order, and the weights' releases that the disk tier reads once
    for p in (base, new):
        calls = list(ops_of(p.schedule.nodes))
        steps.append([n.args[0] for n, op in calls if op.steps])
        hands.append({(n.args[0], n.kwargs.get("handoff"), n.kwargs.get("carry")) for n, op in calls
                      if op.releases and n.args[1] == "params"})
    if steps[0] != steps[1]:
        return f"packs step in the order {steps[1]}, not {steps[0]}"
    if hands[0] != hands[1]:
        return "the weights on disk are handed over otherwise"
    mine = dict(new.gm.named_parameters()) | dict(new.gm.named_buffers())
    other = [n for n, t in mine.items() if tensors.get(n) is not t]
    return f"the graph reads {other[0]!r} as another tensor" if other else ""


@contextlib.contextmanager
def _state_as_planned(state, tensors: dict):
    """Every parameter and buffer reads, for the block, as an uninitialised host tensor shaped as its master.

    Tracing and costing read shapes and dtypes only, and compile read them with all state on the host in the
    model's dtype; between steps some of it is a device copy (in the compute dtype under mixed precision) or a
    placeholder of weights on disk, which the user's model refuses to run with. The tensor objects stay: the
    new graph reads the very parameters the runtime trains.
    """
    swapped = []
    for name, t in {id(t): (n, t) for n, t in tensors.items()}.values():
        master = state.master.get(name, t.data)
        swapped.append((t, t.data, t.grad if isinstance(t, torch.nn.Parameter) else None))
        if isinstance(t, torch.nn.Parameter):
            t.grad = None
        t.data = torch.empty(master.shape, dtype=master.dtype)
    try:
        yield
    finally:
        for t, data, grad in reversed(swapped):
            point(t, data)         # a placeholder again: the user's parameter refuses to be read again
            if grad is not None:
                t.grad = grad


def _agree_across_ranks(cfg, key: tuple, what: str) -> None:
    """Data parallel: every rank plans the same new shape at the same step, or all refuse."""
    if not cfg.data_parallel or (cfg.world_size or 1) < 2:
        return
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return
    every: list = [None] * dist.get_world_size()
    guarded(f"{what}: the ranks' exchange of their batch shapes", dist.all_gather_object, every,
            [(list(s), str(d)) for s, d in key], timeout=cfg.comm_timeout)
    if any(k != every[0] for k in every):
        raise InputError(f"{what}: data-parallel ranks passed batches of different shapes at this step "
                         f"({every}); every rank must pass the same shapes (drop_last, or a DistributedSampler)")
