"""swap: insert the data movement the budget forces, and nothing else.

1. If every pack's state and every activation fit at once, everything stays resident
   and no op is inserted (the nothing-to-do case).
2. Otherwise each visit of a pack (a run of ops on it) gets ``swap_in`` + ``wait``
   before its first op and ``release`` after its last, for the kinds of state the ops
   need: parameters (forward), plus gradients (backward), plus optimizer state (step).
3. Every activation handle that a later op reads is stashed to the host (after its
   first use when it has two, the pack's forward and its recompute). Where that does not fit
   (every microbatch's outputs of a pack wait on the device for the next pack's forward, its
   input gradients for the pack before's backward), each is stashed as soon as it is made and
   brought back for every use (``Choice.early``), the least memory any schedule of these packs
   needs: the partition's check of each pack alone then holds for the whole schedule, so a
   larger budget never fails where a smaller one plans.
4. From that least-memory plan, state and activation groups are kept on the device,
   most bytes moved saved per byte held first (parameters: 3 per byte, optimizer
   state and activations: 2), while the predicted peak fits.
5. A pack whose optimizer steps on the host cannot keep its weights for good (the host
   updates them; they come in afresh after the step), but it can keep them between its
   visits within an iteration: brought in once for the forward and released once after
   the backward. Under the harmony policy that is across the turn from forward to backward
   (1 byte saved per byte held, and held only from the pack's forward to its backward, so
   the last packs, whose two visits are closest, are tried first); under sequential, across
   all 2 x microbatches visits. The room whole packs leave (less than the next pack's weights)
   is then filled with single weights held the same way, largest first from the last pack back:
   the pack's later ``swap_in``s and earlier ``release``s leave them (``held=``), the rest move.
6. Where room is still left (``optimizer_on="auto"``, fp32, one rank), a host-stepped pack
   may step on the device instead, with its weights, gradients and optimizer state resident
   for good: it then moves nothing, where held between visits it moved its weights in once
   and its gradients out once (2 bytes saved per 3 held for Adam), first packs first (their
   weights are held through most of the step anyway). Mixed placement: the packs that fit
   stay on the device, ZeRO-Offload's host step for the rest.
   The room that leaves (less than the next pack's state) goes to single parameters of
   host-stepped packs, stepped on the device with all their state resident, first packs first
   (``Residency.device_parts``): the host step of their pack leaves them.
7. The greedy keeps what saves the most per byte first; where the budget binds at more than one
   point that can go wrong (a large first pack held whole leaves no room at its own backward to
   step any parameter on the device). Under the harmony policy with every pack stepped on the host
   (fp32, one rank, host memory), ``passes/swap_lp.py`` also solves the choice of 4 to 6 exactly,
   parameter by parameter, as an integer program over the least-memory schedule's curve; its plan,
   checked against the exact curve and filled as the greedy fills, replaces the greedy's where it
   saves more than 1% of the bytes moved in (the report's ``chosen_by``).
8. Packs wholly on disk (weights too) read their weights from their files for each visit. The
   room left at the end of the backward and the start of the forward (where the turn's
   activations are gone or not yet made) keeps the weights of the packs stepped last on the
   device from their step to the next iteration's forward, first packs first
   (``Residency.carried``; ``release(..., carry=True)`` and ``swap_in(..., carried=True)``): one
   disk read less per byte held (runtime/tiers/params_disk.py).

Recompute is a choice made here too (``recompute="auto"``): a pack that keeps its
forward's graph (its activations, for every microbatch until its backward) runs its
backward without recomputing the forward. Its value per byte held is the recompute
time it saves, counted as the bytes the host link moves in that time, so it competes
with the traffic the same bytes could save: on a CPU, where a copy is cheap beside a
layer's forward, keeping graphs comes first; on a GPU behind PCIe, traffic does. That
holds in the nothing-to-do case as well: everything resident, graphs kept while they fit.
Where the plan's hardware is given, its copies overlap compute and the compute outlasts them
(a fast link), the traffic saved is hidden behind compute anyway and that ranking undervalues
graphs: the pass also makes the choice that keeps graphs first and takes whichever the
simulator finds faster on that hardware (passes/swap/compare.py; the report says both).

Where the device has no room for a graph, it may wait on the host instead (``Choice.offloaded``, under
``recompute="auto"``; ``"device"`` keeps graphs on the device only): the forward's saved tensors go out after it and
come back before the pack's backward (``graph.offload_graphs``; the prefetch pass starts that copy one forward or
backward earlier where the budget has room), and only the pack's inputs and outputs stay. It saves the same recompute
for the graph's bytes moved out and back, so it is taken where the recompute costs more than the copies
(``graph_candidates``); behind a fast link, where the compute outlasts the copies, the graphs-first choice is also
made with graphs on the host and the simulator decides.

This module decides; how each decision reads in the schedule (the swap ops, stashes, ``held=``
and so on) is ``passes/swap/graph.py``.
"""
from __future__ import annotations

import time
from collections import OrderedDict

from harmony.base.errors import BudgetError, ConfigError
from harmony.base.tiers import Tier
from harmony.base.units import fmt_bytes
from harmony.compiler.ir import PassReport, PassResult, Program, calls
from harmony.compiler.verify import memory_curve, state_sizes
from harmony.passes.swap import agree, compare
from harmony.passes.swap.graph import Choice, build, insert_swaps, place, stash_groups
from harmony.passes.swap.parts import may_step_on_device, mixed_placement
from harmony.passes.swap.search import choose, greedy, peak_bound
from harmony.runtime import ops
from harmony.runtime.plan import STATE_KINDS

__all__ = ["NAME", "REQUIRES", "PROVIDES", "LEAST", "run", "graph_candidates", "may_step_on_device",
           "mixed_placement"]

NAME = "swap"
REQUIRES = {"schedule", "placement"}
PROVIDES = {"residency"}
AFTER = {"communication"}    # the memory curve it fits counts the all-reduces' buffers where compress placed them

# ``passes=(..., ("swap", LEAST))``: the least-memory plan, no search. It fits wherever the pass fits anything, so a
# search for the smallest budget that plans (driver/min_budget.py) asks for it and spares each try the search.
LEAST = "least"


def graph_candidates(program: Program, copies_free: bool = False) -> list[tuple]:
    """(value per byte held, bytes held, what) for every pack that could keep its forward's graph: on the device
    (``("graph", pack)``) and, under ``recompute="auto"``, on the host (``("offload", pack)``: sent
    there after the forward, brought back for the backward, ``graph.offload_graphs``).

    A graph on the device holds one microbatch's saved activations and inputs; on the host only the pack's inputs
    and outputs (the values and the graph's roots); either for every microbatch under the harmony policy (they wait
    for the pack's backward), for one under sequential. The value is the recompute time saved, counted as the bytes
    the host link moves in that time, per byte held; on the host less the graph's bytes moved out and back in,
    unless ``copies_free`` (the graphs-first choice's: behind a fast link the copies run beside compute that
    outlasts them). None on the host with a value of zero or less.
    """
    cfg, plan = program.config, program.plan
    if cfg.recompute == "always" or cfg.policy == "ondemand":
        return []
    m = plan.microbatches
    phases = m if cfg.policy == "harmony" else 1
    host = cfg.recompute == "auto"
    on_device, on_host = [], []
    for spec in plan.packs[:-1]:
        if not spec.fwd_flops:
            continue
        worth = m * spec.fwd_flops / cfg.flops * cfg.copy_bandwidth      # the recompute, as link bytes
        held = (spec.saved_bytes + spec.in_bytes) * phases
        if held:
            on_device.append((worth / held, held, ("graph", spec.index)))
        held = (spec.in_bytes + spec.out_bytes) * phases
        worth -= 0 if copies_free else 2 * m * spec.saved_bytes
        if host and spec.saved_bytes and held and worth > 0:
            on_host.append((worth / held, held, ("offload", spec.index)))
    return on_device + on_host


class _Fits:
    """``fits(choice)``: ``choice``'s schedule built from ``base``, made ``program.schedule`` with the plan placed,
    and its memory curve. The searches try some choices again (the greedy's plan after the integer program's): the
    last few schedules and curves are kept by choice, so a caller that changes the schedule works on a copy
    (``compare.simulated`` prefetches)."""

    KEEP = 8

    def __init__(self, program: Program, base, groups: dict, sizes: dict):
        self.program, self.base, self.groups, self.sizes = program, base, groups, sizes
        self.tried: OrderedDict = OrderedDict()
        self.early = frozenset()     # the stashed groups sent at once, in every choice tried (``Choice.early``)

    def __call__(self, c: Choice):
        program, key = self.program, tuple(frozenset(part) for part in c)
        if key in self.tried:
            self.tried.move_to_end(key)
            program.schedule, curve = self.tried[key]
        else:
            program.schedule = build(self.base, c.resident, c.stashed, self.groups, c.kept, c.held, c.device, c.parts,
                                     c.carried, c.offloaded, c.early | self.early)
            curve = None
        place(program.plan, c, self.sizes, program.optim_profile)
        if curve is None:
            curve = memory_curve(program, check_residency=False, sizes=self.sizes)
            self.tried[key] = program.schedule, curve
            if len(self.tried) > self.KEEP:
                self.tried.popitem(last=False)
        return curve

    def forget(self) -> None:
        """Drop the kept schedules (the base changed)."""
        self.tried.clear()


def run(program: Program, ctx) -> PassResult:
    """Insert the swaps and stashes, then keep on the device what saves the most; ``ctx``, where given, is the
    ``Choice`` to apply instead of searching (``program.swap_choice`` of a compiled module is the one it chose)."""
    start = time.perf_counter()
    plan, budget = program.plan, program.config.usable_budget
    report = PassReport("swap: data movement")
    if program.config.policy == "ondemand":
        report.notes.append("policy ondemand: no planned movement; the runtime fetches state when an op "
                            "touches it and evicts the least recently used state when the budget is hit")
        return PassResult(program, report)
    sizes = state_sizes(program)
    everything = Choice({(p.index, k) for p in plan.packs for k in STATE_KINDS}, set())
    place(plan, everything, sizes, program.optim_profile)
    mixed = program.config.precision != "fp32"   # host steps update fp32 masters: compute copies come in afresh
    graphs = graph_candidates(program)
    # shard_state="full": each pack's state lives partitioned on the hosts and is gathered for each use, whatever the
    # room: its packs swap (the search may still hold a pack's weights between its visits, or carry them to the next
    # forward)
    partitioned = getattr(program.config, "shard_state", None) == "full"
    if not (mixed or partitioned) and ctx in (None, LEAST) \
            and memory_curve(program, check_residency=False).peak <= budget:
        return _all_resident(program, everything, graphs, sizes, report)

    # start from the least memory: every pack swapped, every activation handle stashed, every pack recomputed ...
    insert_swaps(program.schedule, set())
    base = program.schedule
    groups = stash_groups(base)
    least = Choice(set(), set(groups))
    fits = _Fits(program, base, groups, sizes)
    curve = _least_memory(program, fits, least, report)
    if ctx == LEAST:
        chosen, rows, how = least, [], "least memory"
    elif ctx is not None:    # handed its choice: applied as given, no search
        chosen, rows, how, curve = _given(program, ctx, groups, fits)
    else:
        made = choose(program, least, curve, base, groups, sizes, graphs, fits, report)
        chosen, rows, how, curve = _graphs_first(program, made, least, base, groups, sizes, graphs, fits, report)
    chosen = chosen._replace(early=chosen.early | fits.early)
    if agree.applies(program):      # a balanced ZeRO-3 grid: the replica group gathers alike (passes/swap/agree.py)
        chosen = agree.common_holds(program, chosen)
        curve = fits(chosen)
    program.swap_choice = chosen
    for p in chosen.device:
        plan.at(p).step_on = plan.at(p).optim_on = Tier.DEVICE
    report.rows = rows
    report.totals = _totals(program, chosen, rows, curve, how, start)
    _notes(report, program, chosen, graphs)
    return PassResult(program, report)


def _least_memory(program: Program, fits: _Fits, least: Choice, report: PassReport):
    """The memory curve of the least-memory plan (``least``: nothing kept). Disk steps that overlap the next
    backward run inline where it does not fit (such a step holds its gradients that long), then activations go to
    the host as soon as made (``fits.early``: each choice tried from here on stashes them so); raises
    ``BudgetError`` naming the budget needed where even then it does not."""
    budget = program.config.usable_budget
    curve = fits(least)
    inline = [n for n in calls(fits.base) if ops.op_of(n).steps and n.kwargs.get("overlap")]
    if curve.peak > budget and inline:   # a disk step overlapping the next backward holds its gradients that long
        for n in inline:
            n.kwargs = {**n.kwargs, "overlap": False}
        fits.forget()                    # the schedules built from the base before it changed
        curve = fits(least)
        report.notes.append(f"{len(inline)} disk steps run inline: the device cannot also hold a pack's gradients "
                            f"through the next pack's backward")
    if curve.peak > budget:      # every microbatch's activations waiting on the device for their first use
        fits.early = frozenset(fits.groups)
        fits.forget()
        curve = fits(least)
        report.notes.append("every activation goes to the host as soon as it is made and comes back for each use: "
                            "the device cannot hold every microbatch's activations until their first use")
    if curve.peak > budget:
        at = curve.nodes[curve.argmax()]
        need = program.config.budget_for(curve.peak)
        raise BudgetError(
            f"no schedule fits memory_budget={fmt_bytes(program.config.memory_budget)}: with every pack swapped "
            f"and every activation stashed, the predicted peak is {fmt_bytes(curve.peak)} at {at.name}, over "
            f"the {fmt_bytes(budget)} the planner may fill. Raise memory_budget to about {fmt_bytes(need)} "
            f"({need} bytes) or use more microbatches.", min_budget=need)
    return curve


def _given(program: Program, ctx, groups: dict, fits: _Fits) -> tuple:
    """The choice handed in ``ctx`` applied as given (chosen, rows, how, curve); refused where it is not a
    ``Choice`` or does not fit."""
    budget = program.config.usable_budget
    if not isinstance(ctx, Choice):
        raise ConfigError(f"the swap pass's choice is a harmony.passes.swap.graph.Choice (a compiled module's "
                          f"program.swap_choice is one), got {type(ctx).__name__}")
    # a choice made at another batch shape (driver/shapes.py) may name activation groups this schedule lacks
    chosen = ctx._replace(stashed=set(ctx.stashed) & set(groups), early=frozenset(ctx.early) & set(groups))
    curve = fits(chosen)
    if curve.peak > budget:
        raise BudgetError(f"the swap choice given peaks at {fmt_bytes(curve.peak)}, over the {fmt_bytes(budget)} "
                          f"the planner may fill: keep less on the device, or raise memory_budget to about "
                          f"{fmt_bytes(program.config.budget_for(curve.peak))}",
                          min_budget=program.config.budget_for(curve.peak))
    return chosen, [], "given", curve


def _totals(program: Program, chosen: Choice, rows: list, curve, how: str, start: float) -> dict:
    """The report's totals: the movement ops inserted, what of each kind stays, the predicted peak and traffic."""
    counts = {}
    for n in calls(program.schedule):
        counts[n.target.__name__] = counts.get(n.target.__name__, 0) + 1
    return dict(swap_ins=counts.get("swap_in", 0), releases=counts.get("release", 0),
                stashes=counts.get("stash", 0), unstashes=counts.get("unstash", 0),
                kept_on_device=len(rows), held_between_visits=len(chosen.held),
                params_held_between_visits=len(chosen.parts), params_stepped_on_device=len(chosen.steps),
                device_stepped=len(chosen.device), carried_across_steps=len(chosen.carried),
                recomputing_packs=len(program.plan.packs) - 1 - len(chosen.kept),
                graphs_on_host=len(chosen.offloaded), predicted_peak_MiB=curve.peak / 2**20,
                h2d_MiB=curve.moved["h2d"] / 2**20, d2h_MiB=curve.moved["d2h"] / 2**20,
                seconds=time.perf_counter() - start, chosen_by=how)


def _graphs_first(program: Program, made: tuple, start: Choice, base, groups: dict, sizes: dict, graphs: list, fits,
                  report: PassReport) -> tuple:
    """``made`` (the choice by traffic saved from ``start``: chosen, rows, how, curve) or, where it applies
    (passes/swap/compare.py), keeps more graphs and the simulator finds it faster, a choice that ranks graphs
    before any traffic: on the device only, or also on the host where the device has no room for them (their
    copies counted free, as the compute outlasts them)."""
    device_only = [c for c in graphs if c[2][0] == "graph"]
    first = compare.graphs_first(program, device_only)
    if first is None:
        return made
    ways = {"graphs first": first,
            "graphs first, on the host too": compare.graphs_first(program, graph_candidates(program, copies_free=True))}
    others = {}
    for name, ranked in ways.items():
        scratch = PassReport("swap: " + name)
        other = choose(program, start, fits(start), base, groups, sizes, ranked, fits, scratch)
        if len(other[0].kept) > len(made[0].kept) and all(other[0] != o[0][0] for o in others.values()):
            others[name] = other, scratch
    if not others:
        fits(made[0])
        return made
    seconds = compare.simulated(program, fits, [made[0]] + [o[0][0] for o in others.values()], sizes)
    by_traffic, fastest = seconds[0], min(range(1, len(seconds)), key=seconds.__getitem__)
    name = list(others)[fastest - 1]
    took = seconds[fastest] < by_traffic
    hw = compare.hardware(program.config).devices[0].name
    tried = ", ".join(f"{n} ({len(o[0][0].kept)} graphs, {len(o[0][0].offloaded)} on the host) at "
                      f"{t * 1e3:.1f} ms" for (n, o), t in zip(others.items(), seconds[1:]))
    report.notes.append(f"the step's compute outlasts its copies {program.compute_to_copies:.3g} times (every pack "
                        f"swapped): simulated on {hw}, ranking by traffic saved ({len(made[0].kept)} graphs) at "
                        f"{by_traffic * 1e3:.1f} ms, {tried}; took " + (name if took else "traffic saved"))
    if not took:       # the schedule and placement back to the choice taken
        fits(made[0])
        return made
    (chosen, rows, how, _), scratch = others[name]
    for row in rows:       # the value the ranking saw was raised; the table shows the recompute's own
        if row["kept"].startswith("activations"):
            row["saves_per_byte"] /= compare.GRAPHS_FIRST
    report.notes.extend(f"{name}: {note}" for note in scratch.notes)   # (the one by traffic has its own)
    return chosen, rows, f"{how}, {name}", fits(chosen)


def _all_resident(program: Program, everything: Choice, graphs: list, sizes: dict, report: PassReport) -> PassResult:
    """Everything fits the budget: nothing swaps, and the packs' forward graphs are kept where room allows."""
    base, plan, budget = program.schedule, program.plan, program.config.usable_budget

    def fits_all(c: Choice):     # only graphs are candidates here
        program.schedule = build(base, c.resident, c.stashed, {}, c.kept, offloaded=c.offloaded)
        return memory_curve(program, check_residency=False)
    chosen, rows = greedy(graphs, everything, fits_all, budget,
                          lambda c, what: peak_bound(program, c, what, {}, sizes, set()))   # graphs only
    fits_all(chosen)
    program.swap_choice = chosen
    report.rows = rows
    report.notes.append("everything fits the budget: all state stays resident, no swap inserted"
                        + (f"; {len(chosen.kept)} packs keep their forward's graph (no recompute)" if chosen.kept
                           else ""))
    report.totals = dict(resident_packs=len(plan.packs), swaps=0, stashes=0,
                         recomputing_packs=len(plan.packs) - 1 - len(chosen.kept), graphs_on_host=len(chosen.offloaded))
    return PassResult(program, report)


def _notes(report: PassReport, program: Program, chosen: Choice, graphs: list) -> None:
    """What the report says of a plan that swaps: why, and what of each kind it kept on the device."""
    mixed = program.config.precision != "fp32"
    report.notes.append("forced by the budget: the state of all packs does not fit at once; started from "
                        "everything swapped and stashed, then kept on the device what saves most traffic per byte"
                        if not mixed else
                        f"precision={program.config.precision!r}: the host steps the fp32 masters, so every pack's "
                        f"compute copy comes in afresh and its gradients leave after its backward; then kept on "
                        f"the device what saves most traffic per byte")
    if chosen.device:
        one = len(chosen.device) == 1
        report.notes.append(f"{'pack' if one else 'packs'} {', '.join(map(str, sorted(chosen.device)))} "
                            f"{'steps' if one else 'step'} on the device with all {'its' if one else 'their'} state "
                            f"resident (room was left after holding weights): the offload table above shows the "
                            f"placement before this pass; the other packs step on the host")
    if chosen.steps:
        report.notes.append(f"{len(chosen.steps)} parameters of host-stepped packs step on the device, one at a time, "
                            f"with their weights, gradients and optimizer state resident (the room left after "
                            f"whole packs): the host step of their packs leaves them")
    if chosen.carried:
        report.notes.append(f"packs {', '.join(map(str, sorted(chosen.carried)))} keep their weights on the device "
                            f"from their step to the next step's forward (params across steps): stepped there, "
                            f"written to their files all the same, and not read back for the forward (from the "
                            f"second step on)")
    if graphs:
        report.notes.append("activations (no recompute): saves_per_byte is the recompute time saved, as bytes the "
                            "host link moves in that time, per byte held")
    if chosen.offloaded:
        report.notes.append(f"packs {', '.join(map(str, sorted(chosen.offloaded)))} keep their forward's graph on "
                            f"the host (activations on the host): sent out after each forward, back before its "
                            f"backward; their MiB is the inputs and outputs they hold on the device meanwhile, "
                            f"saves_per_byte the recompute saved less the copies, per byte held")


