"""The smallest budget that plans, found by planning: what a ``BudgetError`` from compile's passes names.

A pass that refuses a budget estimates the one that would do (its largest pack, its least-memory peak, with room for
the prediction's error added), but the budget decides more than the figure the pass checks: a larger one lets the
partition pick larger packs, whose schedule may not fit it either, and a pass's estimate counts what another pass
would not (frozen parameters' gradients). So compile plans again from the same trace at other budgets, as another
rank's plan is made (driver/replan.py): up from the pass's figure until one plans, down until one does not, then
halving the gap, each try a budget 1% from a budget that does not plan. The swap pass is handed its least-memory
plan (``passes.swap.LEAST``: it fits wherever the pass fits anything), so no try pays for its search.

The figure found is the smallest budget at which the passes plan, to within 1%; where the tries run out (``TRIES``,
``SECONDS``) before one plans, the pass's figure stands.

Halving the gap finds the smallest budget only where a larger budget plans wherever a smaller one does. The partition
checks each pack alone, and at some budgets picks packs whose whole schedule does not fit (a pack's gradients arrive
from several later packs; activations wait for their next use) while at a smaller budget it picks others that do. So
where the packs it chose do not plan, the passes plan again with every layer a pack of its own (``layers_alone``),
the packs the partition falls back to where nothing else fits: a budget at which they plan plans whatever it picks.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time

from harmony.base.errors import BudgetError
from harmony.base.units import fmt_bytes
from harmony.compiler.passmanager import split_choices
from harmony.driver.replan import another_rank
from harmony.passes.partition import first_nodes
from harmony.passes.swap import LEAST

TOLERANCE = 0.01        # the named budget plans; one 1% below it does not
TRIES = 24
SECONDS = 60.0

log = logging.getLogger("harmony")


@dataclasses.dataclass
class Search:
    """What the search found: ``smallest``, a budget that plans (None: none found), ``refused``, the largest that
    did not, and how many tries it took how long."""

    smallest: int | None
    refused: int
    tries: int = 0
    seconds: float = 0.0


def searchable(program, error: BudgetError) -> bool:
    """Whether compile can search for ``error``'s budget: it names one, of an option of this program's config, and
    the plan is this process's alone (ranks that planned together would each have to try every budget)."""
    cfg = program.config
    return (error.min_budget is not None and getattr(cfg, error.option, None) is not None
            and (cfg.world_size or 1) <= 1 and cfg.balance is None)


def smallest_budget(program, mode, passes, error: BudgetError) -> Search:
    """The smallest value of ``error.option`` at which ``mode`` plans ``program`` (see the module's docstring)."""
    start = time.perf_counter()
    option, entries = error.option, _least_swap(passes)
    search = Search(None, max(1, getattr(program.config, option)))
    quiet = log.level
    log.setLevel(max(logging.WARNING, quiet))   # the tries' passes would log as the compile's own
    try:
        def plans(budget: int) -> BudgetError | None:
            search.tries += 1
            config = dataclasses.replace(program.config, offline=True, **{option: budget})
            try:
                run_or_layers_alone(mode, another_rank(program, config), entries)
            except BudgetError as e:
                search.refused = max(search.refused, budget)
                return e
            search.smallest = budget if search.smallest is None else min(search.smallest, budget)
            return None

        def spent() -> bool:
            return search.tries >= TRIES or time.perf_counter() - start > SECONDS

        _up(plans, spent, option, max(error.min_budget, search.refused + 1))
        if search.smallest is not None:
            _down(search, plans, spent)
    finally:
        log.setLevel(quiet)
        search.seconds = time.perf_counter() - start
    return search


def run_or_layers_alone(mode, program, passes):
    """``mode.run_passes(program, passes)``, or where that raises a ``BudgetError`` of the device's budget and the
    partition chose its packs, the passes on a copy of ``program`` with every layer a pack of its own, where they plan
    (the first error stands where they do not); the partition's report then says so."""
    try:
        return mode.run_passes(program, passes)
    except BudgetError as refused:
        names, given = split_choices(passes)
        cfg = program.config      # ranks that plan together would each have to try it
        # the device budget's refusals only: the host's (``host_memory_budget``) is a sum the partition counts whole
        if refused.option != "memory_budget" or "partition" not in names or "partition" in given \
                or (cfg.world_size or 1) > 1 or cfg.balance is not None:
            raise
        entries = tuple(("partition", first_nodes(program)[1:]) if e == "partition" else e for e in passes)
        alone = another_rank(program, dataclasses.replace(program.config))
        try:
            mode.run_passes(alone, entries)
        except BudgetError:
            raise refused from None
        for report in alone.reports:
            if report.title.startswith("partition"):
                report.notes.append(f"every layer a pack of its own: the packs the search chose do not plan as a "
                                    f"whole at this budget ({str(refused).splitlines()[0]})")
        return alone


def _up(plans, spent, option: str, guess: int) -> None:
    """From the pass's figure up until a budget plans: the refusing try's own figure, or 1%, 2%, 4% ... more."""
    step = TOLERANCE
    while not spent():
        refused = plans(guess)
        if refused is None:
            return
        ahead = refused.min_budget if refused.option == option else None
        guess = max(int(guess * (1 + step)) + 1, ahead or 0)
        step *= 2


def _down(search: Search, plans, spent) -> None:
    """From the smallest budget that plans down until one does not (1%, 2%, 4% ... less), then halving the gap
    (geometrically) until the two are within ``TOLERANCE``."""
    step, galloping = TOLERANCE, True
    while search.smallest > search.refused * (1 + TOLERANCE) and not spent():
        below = int(search.smallest / (1 + step))
        if not galloping or below <= search.refused:
            galloping, below = False, int(math.sqrt(search.smallest * search.refused))
        if plans(below) is None:
            step *= 2
        else:
            galloping = False


def _least_swap(passes) -> tuple:
    """``passes`` with the swap pass handed its least-memory plan, unless it is handed a choice already."""
    return tuple(("swap", LEAST) if entry == "swap" else entry for entry in passes)


def named(error: BudgetError, search: Search) -> BudgetError:
    """``error`` naming ``search.smallest`` instead of its pass's estimate: the pass's explanation, its figure
    replaced where the message quotes it, and a line saying how the figure was found."""
    old, new = error.min_budget, search.smallest
    message = str(error.args[0])
    for before, after in ((fmt_bytes(old), fmt_bytes(new)), (f"({old} bytes)", f"({new} bytes)")):
        message = message.replace(before, after)
    message += (f"\n{error.option}={fmt_bytes(new)} ({new} bytes) is the smallest that plans: compile planned this "
                f"model at {search.tries} budgets ({search.seconds:.1f} s) and {fmt_bytes(search.refused)} does not "
                f"(the pass estimated {fmt_bytes(old)}).")
    found = BudgetError(message, min_budget=new, option=error.option)
    for note in getattr(error, "__notes__", ()):
        found.add_note(note)
    return found
