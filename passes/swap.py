"""swap: insert the data movement the budget forces, and nothing else.

1. If every pack's state and every activation fit at once, everything stays resident
   and no op is inserted (the nothing-to-do case).
2. Otherwise each visit of a pack (a run of ops on it) gets ``swap_in`` + ``wait``
   before its first op and ``release`` after its last, for the kinds of state the ops
   need: parameters (forward), plus gradients (backward), plus optimizer state (step).
3. Every activation handle that a later op reads is stashed to the host (after its
   first use when it has two, the pack's forward and its recompute).
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
   (``plan.device_parts``): the host step of their pack leaves them.
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
   (``plan.carried``; ``release(..., carry=True)`` and ``swap_in(..., carried=True)``): one
   disk read less per byte held (runtime/diskparams.py).

Recompute is a choice made here too (``recompute="auto"``): a pack that keeps its
forward's graph (its activations, for every microbatch until its backward) runs its
backward without recomputing the forward. Its value per byte held is the recompute
time it saves, counted as the bytes the host link moves in that time, so it competes
with the traffic the same bytes could save: on a CPU, where a copy is cheap beside a
layer's forward, keeping graphs comes first; on a GPU behind PCIe, traffic does. That
holds in the nothing-to-do case as well: everything resident, graphs kept while they fit.

This module decides; how each decision reads in the schedule (the swap ops, stashes, ``held=``
and so on) is ``passes/swap_graph.py``.
"""
from __future__ import annotations

import time

from harmony.base.errors import BudgetError
from harmony.base.units import fmt_bytes
from harmony.compiler.ir import PassReport, PassResult, Program, calls
from harmony.compiler.verify import memory_curve, state_sizes
from harmony.passes import swap_lp
from harmony.passes.swap_graph import COMPUTE, KINDS, Choice, build, insert_swaps, param_swaps, stash_groups
from harmony.runtime import ops
from harmony.runtime.plan import step_extra

NAME = "swap"
REQUIRES = {"schedule", "placement"}
PROVIDES = {"residency"}
TIE = 0.01    # of the bytes in, what the integer program's plan must save to replace the greedy's outright


def graph_candidates(program: Program) -> list[tuple]:
    """(value per byte held, bytes held, ("graph", pack)) for every pack that could keep its forward's graph.

    The value is the recompute time saved, counted as the bytes the host link moves in that
    time, per byte held; bytes held are one microbatch's activations, for every microbatch
    under the harmony policy (they wait for the pack's backward), for one under sequential.
    """
    cfg, plan = program.config, program.plan
    if cfg.recompute != "auto" or cfg.policy == "ondemand":
        return []
    m = plan.microbatches
    out = []
    for spec in plan.packs[:-1]:
        held = (spec.saved_bytes + spec.in_bytes) * (m if cfg.policy == "harmony" else 1)
        if spec.fwd_flops and held:
            seconds = m * spec.fwd_flops / cfg.flops
            out.append((seconds * cfg.copy_bandwidth / held, held, ("graph", spec.index)))
    return out


def _row(what, size, per_byte) -> dict:
    if what[0] == "graph":
        kind = "activations (no recompute)"
    elif what[0] == "held":
        kind = "params between visits"
    elif what[0] == "device":
        kind = "all state (device step)"
    elif what[0] == "carry":
        kind = "params across steps"
    elif what[0] == "keep":
        kind = f"{what[1]} outputs" if what[1] == "forward" else "input grads"
    else:
        kind = what[0]
    return dict(kept=kind, pack=what[-1], MiB=size / 2**20, saves_per_byte=per_byte)


def _with(chosen: Choice, what) -> Choice:
    if what[0] == "keep":
        return chosen._replace(stashed=chosen.stashed - {what[1:]})
    if what[0] == "graph":
        return chosen._replace(kept=chosen.kept | {what[1]})
    if what[0] == "held":
        return chosen._replace(held=chosen.held | {what[1]})
    if what[0] == "carry":
        return chosen._replace(carried=chosen.carried | {what[1]})
    if what[0] == "device":
        return chosen._replace(resident=chosen.resident | {(what[1], k) for k in KINDS},
                               held=chosen.held - {what[1]}, device=chosen.device | {what[1]})
    kinds = (what[0], "grads") if what[0] == "params" else (what[0],)
    return chosen._replace(resident=chosen.resident | {(what[1], k) for k in kinds})


def _rank(candidate) -> tuple:
    """Most saved per byte first; among equals the largest, except weights held between visits: the last packs
    first, whose visits are closest (an early pack's weights would be held through every other pack's), and
    device steps: the first packs first (theirs are held the longest), and weights carried across steps: the
    first packs first (the last stepped, the first the forward takes)."""
    per_byte, size, what = candidate
    if what[0] == "held":
        return -per_byte, -what[1]
    if what[0] in ("device", "carry"):
        return -per_byte, what[1]
    return -per_byte, -size


def _greedy(candidates, chosen: Choice, fits, room, bound=None, curve=None) -> tuple[Choice, list[dict]]:
    """Keep what saves the most per byte held first, each while the predicted peak stays within ``room``.

    Candidates are tried in runs that double while they fit and fall back to one at a time
    where one does not: keeping more never lowers the curve, so a run that fits is what one
    at a time would keep, for a few evaluations of the curve instead of one per candidate
    (a 24-layer model cut into 48 packs has some 140). Once the budget is nearly full, most
    single candidates do not fit: ``bound(curve, what)`` (``peak_bound``), a lower bound on the
    peak read off the chosen schedule's ``curve``, turns those away without building a schedule.
    """
    items = [c for c in sorted(candidates, key=_rank) if c[1]]
    rows, i, run = [], 0, 1
    while i < len(items):
        batch = items[i:i + run]
        if len(batch) == 1 and bound is not None:
            curve = curve if curve is not None else fits(chosen)
            if bound(curve, batch[0][2]) > room:
                i += 1
                continue
        trial = chosen
        for _, _, what in batch:
            trial = _with(trial, what)
        got = fits(trial)
        if got.peak <= room:
            chosen, curve = trial, got
            rows += [_row(what, size, per_byte) for per_byte, size, what in batch]
            i += len(batch)
            run *= 2
        elif run > 1:
            run = 1
        else:
            i += 1
    return chosen, rows


def tied_weights(plan) -> set[str]:
    """Weights (parameters and buffers) that more than one pack reads: tied, as GPT-2's embedding and head."""
    seen, tied = set(), set()
    for spec in plan.packs:
        mine = set(ops.state_names(spec, "params"))
        tied |= seen & mine
        seen |= mine
    return tied


def peak_bound(program: Program, curve, what, groups: dict, sizes: dict, shared: set[str]) -> int:
    """A lower bound on the predicted peak once ``what`` is kept as well, read off ``curve``, the chosen
    schedule's, without building the schedule that keeps it (``shared``: the plan's ``tied_weights``).

    Keeping ``what`` leaves bytes on the device over spans of the chosen schedule where they are not now:
    a stashed activation from its stash to its unstash; a kept graph's saved activations from the pack's
    forward to its backward, less the inputs the backward is the last to read (they may die sooner); held
    weights from a release to the next swap_in; resident weights wherever they are not swapped in; resident
    optimizer state everywhere. The forward, backward and step ops of other packs stay in the schedule
    that keeps ``what``, with the same effects, so inside a span the bytes live before and after each of
    them, and its peak, rise by at least that much. Nothing is claimed at the ops the candidate changes or
    removes: its own pack's, the stashes and swaps.
    """
    plan, nodes = program.plan, curve.nodes
    rise = [0] * (len(nodes) + 1)

    def hold(a: int, b: int, size: int) -> None:      # ``size`` more at the nodes strictly between a and b
        if size > 0 and b - a > 1:
            rise[a + 1] += size
            rise[b] -= size

    kind, pack = what[0], what[-1]
    if kind == "keep":
        pack = None                                    # no compute op changes
        at = {n.name: i for i, n in enumerate(nodes)}
        for name in groups[what[1:]]:
            i = at.get(name)
            s = next((u for u in nodes[i].users if u.target is ops.stash), None) if i is not None else None
            back = [at[u.name] for u in s.users if u.target is ops.unstash] if s is not None else []
            if back:
                hold(at[s.name], min(back), curve.out[i])
    elif kind == "graph":
        for a, b, size in swap_lp.graph_spans(curve, plan, pack):
            hold(a, b, size)
    elif kind in ("held", "params"):
        spec, since = plan.packs[pack], (-1 if kind == "params" else None)

        def weights(held=()) -> int:   # a weight tied to another pack's may be on the device for that one
            return sum(sizes.get(("params", x), 0) for x in ops.moving_names(spec, "params", held) if x not in shared)
        size = weights()
        for i, n in enumerate(nodes):
            if n.target in (ops.swap_in, ops.release) and n.args[0] == pack and n.args[1] == "params":
                if n.target is ops.release:
                    since, size = i, weights(n.kwargs.get("held", ()))
                else:
                    if since is not None:
                        hold(since, i, size)
                    since = None
        if kind == "params" and since is not None:
            hold(since, len(nodes), size)
    else:                                              # "optim", "device": optimizer state resident for good
        resident = getattr(plan, "optim_resident", None) or {}
        hold(-1, len(nodes), sum(sizes.get(("optim", n), 0) for n in plan.packs[pack].stepped if n not in resident))
    best = acc = 0
    for i, n in enumerate(nodes):
        acc += rise[i]
        if acc and n.target in COMPUTE and (pack is None or n.args[0] != pack):
            best = max(best, curve.peak_at[i] + acc)
    return best


def run(program: Program, ctx) -> PassResult:
    start = time.perf_counter()
    plan, budget = program.plan, program.config.usable_budget
    report = PassReport("swap: data movement")
    if program.config.policy == "ondemand":
        report.notes.append("policy ondemand: no planned movement; the runtime fetches state when an op "
                            "touches it and evicts the least recently used state when the budget is hit")
        return PassResult(program, report)
    plan.optim_resident, plan.held, plan.params_held, plan.device_parts, plan.carried = {}, set(), {}, {}, set()
    plan.resident = {(p.index, k) for p in plan.packs for k in KINDS}
    mixed = program.config.precision != "fp32"   # host steps update fp32 masters: compute copies come in afresh
    graphs = graph_candidates(program)
    if not mixed and memory_curve(program, check_residency=False).peak <= budget:
        base = program.schedule

        def fits_all(c: Choice):     # only graphs are candidates here
            program.schedule = build(base, c.resident, c.stashed, {}, c.kept)
            return memory_curve(program, check_residency=False)
        sizes = state_sizes(program)
        chosen, rows = _greedy(graphs, Choice(plan.resident, set()), fits_all, budget,
                               lambda c, what: peak_bound(program, c, what, {}, sizes, set()))   # graphs only
        fits_all(chosen)
        report.rows = rows
        report.notes.append("everything fits the budget: all state stays resident, no swap inserted"
                            + (f"; {len(chosen.kept)} packs keep their forward's graph (no recompute)" if chosen.kept
                               else ""))
        report.totals = dict(resident_packs=len(plan.packs), swaps=0, stashes=0,
                             recomputing_packs=len(plan.packs) - 1 - len(chosen.kept))
        return PassResult(program, report)

    # start from the least memory: every pack swapped, every activation handle stashed, every pack recomputed ...
    plan.resident = set()
    insert_swaps(program.schedule, plan.resident)
    base = program.schedule
    groups = stash_groups(base)
    chosen = Choice(set(), set(groups))
    sizes = state_sizes(program)

    def fits(c: Choice):
        program.schedule = build(base, c.resident, c.stashed, groups, c.kept, c.held, c.device, c.parts, c.carried)
        plan.resident = c.resident
        plan.held = set(c.held)
        plan.carried = set(c.carried)
        plan.params_held = {n: sizes[("params", n)] for _, n in c.parts}
        plan.device_parts = {n: step_extra(program.optim_profile, [sizes[("params", n)]]) for _, n in c.steps}
        plan.device_part_bytes = {n: sizes[("params", n)] for _, n in c.steps}     # fp32: device parts need it
        return memory_curve(program, check_residency=False)

    curve = fits(chosen)
    inline = [n for n in calls(base) if n.target is ops.step and n.kwargs.get("overlap")]
    if curve.peak > budget and inline:   # a disk step overlapping the next backward holds its gradients that long
        for n in inline:
            n.kwargs = {**n.kwargs, "overlap": False}
        curve = fits(chosen)
        report.notes.append(f"{len(inline)} disk steps run inline: the device cannot also hold a pack's gradients "
                            f"through the next pack's backward")
    if curve.peak > budget:
        at = curve.nodes[curve.argmax()]
        need = program.config.budget_for(curve.peak)
        raise BudgetError(
            f"no schedule fits memory_budget={fmt_bytes(program.config.memory_budget)}: with every pack swapped "
            f"and every activation stashed, the predicted peak is {fmt_bytes(curve.peak)} at {at.name}, over "
            f"the {fmt_bytes(budget)} the planner may fill. Raise memory_budget to about {fmt_bytes(need)} "
            f"({need} bytes) or use more microbatches.", min_budget=need)
    # ... then keep on the device what saves the most bytes moved per byte held, while it fits
    n_packs, m = len(plan.packs), plan.microbatches
    candidates = list(graphs)
    swaps = param_swaps(base)
    for spec in plan.packs:
        if plan.step_on.get(spec.index) == "host":   # the host updates the weights: they come in afresh each iteration
            visits = len(swaps.get(spec.index, ([], []))[0])
            if visits > 1:
                candidates.append((visits - 1, spec.param_bytes + spec.buffer_bytes, ("held", spec.index)))
            # beyond held weights: their swap_in, grads out
            if spec.stepped and may_step_on_device(program, spec.index):
                held = spec.param_bytes + spec.buffer_bytes + spec.optim_bytes
                candidates.append(((spec.param_bytes + spec.buffer_bytes) * 2 / held, held, ("device", spec.index)))
            continue
        phases = m if program.config.policy == "sequential" else 1
        per_byte = phases * (2 if spec.index == n_packs - 1 else 3)   # in for forward and backward, out once
        candidates.append((per_byte, spec.param_bytes + spec.buffer_bytes, ("params", spec.index)))
        candidates.append((2, spec.optim_bytes, ("optim", spec.index)))   # in and out around the step
    for key, names in groups.items():
        spec = plan.packs[key[1]]
        size = (spec.out_bytes if key[0] == "forward" else spec.in_bytes) * len(names)
        candidates.append((2, size, ("keep",) + key))                   # out and back in
    # Fill the budget: every byte held is traffic saved, and the prefetch pass still hoists swap_ins
    # wherever the curve is below its peak. (Leaving the largest pack's weights free for prefetching where
    # compute outweighs copies simulated slower in every case tried: the demo and benchmarks/swap_volume.py.)
    room = budget
    # a graph worth less than a single parameter's optimizer state (2 bytes per byte) takes what that leaves, and one
    # worth less than a single held weight or device-stepped parameter (1 byte per byte) what those leave: the
    # bytes a graph saves are its recompute time at the link's rate, below a byte per byte behind a fast link
    # (tests/test_passes.py: test_graphs_worth_less_than_traffic_take_only_the_room_residency_leaves)
    low = [c for c in candidates if c[2][0] == "graph" and 1 <= c[0] < 2]
    lowest = [c for c in candidates if c[2][0] == "graph" and c[0] < 1]

    shared = tied_weights(plan)

    def bound(c, what):
        return peak_bound(program, c, what, groups, sizes, shared)

    def fill(chosen: Choice, curve=None) -> tuple[Choice, list[dict]]:
        """The greedy from ``chosen`` on: what saves the most per byte held first, then the parts of packs."""
        free = [c for c in candidates if not _taken(chosen, c[2])]
        chosen, rows = _greedy([c for c in free if c not in low + lowest], chosen, fits, room, bound, curve)
        rows += keep_optimizer_parts(program, chosen, fits, room, sizes)
        chosen, more = _greedy([c for c in low if c in free], chosen, fits, room, bound)
        rows += more
        chosen, more = keep_weight_parts(program, chosen, fits, room, sizes)
        rows += more
        chosen, more = keep_step_parts(program, chosen, fits, room, sizes)
        rows += more
        chosen, more = _greedy([c for c in lowest if c in free], chosen, fits, room, bound)
        rows += more
        chosen, more = carry_weights(program, chosen, fits, room, sizes)
        return chosen, rows + more

    exact = swap_lp.applies(program, shared)
    least = param_swaps(program.schedule) if exact else None      # the least-memory schedule's, which ``curve`` is of
    chosen, rows = fill(chosen, curve)
    how = "greedy"
    if exact:
        greedy = fits(chosen)
        found = swap_lp.select(program, curve, groups, sizes, least, candidates, room, fits,
                               lambda p: may_step_on_device(program, p))
        if found is not None:
            picked, picked_rows = fill(*found)
            curve = fits(picked)
            # near ties go to the greedy's plan. Where they move the same, what decides the step's time is which
            # parameters step on the device (on the compute stream) and which on the host (beside it, but the next
            # forward waits for the first pack's), and neither objective sees it: on the GTX 1080 Ti preset's 18
            # configurations of the partition's sweep, taking the integer program's with the most stepped on the
            # device simulated 0.68x to 1.19x the greedy's (geomean 0.91), slower at 80% of the state and 64
            # microbatches
            if _worth(picked, curve, graphs) > _worth(chosen, greedy, graphs) + TIE * greedy.moved["h2d"]:
                chosen, rows, how = picked, _pick_rows(plan, picked, candidates) + picked_rows, "integer program"
            report.notes.append(
                f"integer program over the memory curve (swap_lp): its plan moves "
                f"{fmt_bytes(curve.moved['h2d'] + curve.moved['d2h'])}, the greedy's "
                f"{fmt_bytes(greedy.moved['h2d'] + greedy.moved['d2h'])}; "
                f"{'kept' if how != 'greedy' else 'the greedy kept (within 1%, or ahead)'}")
    if how == "greedy":        # the schedule the greedy chose, built again where the program's was built last
        curve = fits(chosen)
    for p in chosen.device:
        plan.step_on[p] = plan.optim_on[p] = "device"
    counts = {}
    for n in calls(program.schedule):
        counts[n.target.__name__] = counts.get(n.target.__name__, 0) + 1
    report.rows = rows
    report.totals = dict(swap_ins=counts.get("swap_in", 0), releases=counts.get("release", 0),
                         stashes=counts.get("stash", 0), unstashes=counts.get("unstash", 0),
                         kept_on_device=len(rows), held_between_visits=len(chosen.held),
                         params_held_between_visits=len(chosen.parts), params_stepped_on_device=len(chosen.steps),
                         device_stepped=len(chosen.device), carried_across_steps=len(chosen.carried),
                         recomputing_packs=n_packs - 1 - len(chosen.kept),
                         predicted_peak_MiB=curve.peak / 2**20,
                         h2d_MiB=curve.moved["h2d"] / 2**20, d2h_MiB=curve.moved["d2h"] / 2**20,
                         seconds=time.perf_counter() - start)
    report.totals["chosen_by"] = how
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
    return PassResult(program, report)


def _taken(chosen: Choice, what) -> bool:
    """Whether ``chosen`` already keeps ``what`` (or, for a pack's weights or step, any part of them)."""
    kind, pack = what[0], what[-1]
    if kind == "keep":
        return what[1:] not in chosen.stashed
    if kind == "graph":
        return pack in chosen.kept
    if kind == "carry":
        return pack in chosen.carried
    if kind in ("held", "device"):
        return (pack in chosen.held or pack in chosen.device or any(p == pack for p, _ in chosen.parts)
                or any(p == pack for p, _ in chosen.steps))
    return (pack, kind) in chosen.resident


def _worth(chosen: Choice, curve, graphs: list) -> float:
    """What the swap pass maximises: bytes not moved, and the recompute a kept graph saves counted as the bytes the
    host link moves in that time (``graph_candidates``)."""
    saved = sum(per_byte * held for per_byte, held, what in graphs if what[1] in chosen.kept)
    return saved - curve.moved["h2d"] - curve.moved["d2h"]


def _pick_rows(plan, chosen: Choice, candidates: list) -> list[dict]:
    """Report rows for what the integer program kept whole (``keep_weight_parts`` and ``keep_step_parts`` list the
    parts): held packs, packs stepped on the device, activation groups and graphs, as the greedy's candidates."""
    def whole(what) -> bool:
        if what[0] == "held":
            return what[1] in chosen.held
        if what[0] == "device":
            return what[1] in chosen.device
        return what[0] in ("keep", "graph") and _taken(chosen, what)
    return [_row(what, size, per_byte) for per_byte, size, what in candidates if whole(what)]


def mixed_placement(cfg) -> bool:
    """Whether host-stepped packs may move to a device step: left to the compiler (``optimizer_on="auto"``),
    fp32, one rank (the compress pass placed the all-reduce for a host step). The partition asks too."""
    return cfg.optimizer_on == "auto" and cfg.precision == "fp32" and (cfg.world_size or 1) <= 1


def may_step_on_device(program: Program, pack: int) -> bool:
    """Whether the swap pass may move this host-stepped pack's step to the device: ``mixed_placement``, and
    the pack's weights and optimizer state in host memory (not files)."""
    plan = program.plan
    return (mixed_placement(program.config) and plan.optim_on.get(pack) == "host"
            and plan.master_on.get(pack, "host") == "host")


def _largest_first(sized, slack: int) -> list:
    """The ``(size, key)`` items taken largest first while each fits what is left of ``slack``: their keys."""
    taken = []
    for size, key in sorted(sized, key=lambda item: -item[0]):
        if 0 < size <= slack:
            taken.append(key)
            slack -= size
    return taken


def keep_optimizer_parts(program: Program, chosen: Choice, fits, room: int, sizes: dict) -> list[dict]:
    """Fill what room is left with single parameters' optimizer state, largest first.

    A pack's optimizer state is kept whole or not at all above; what is left over is often
    most of a pack's. A parameter whose state stays on the device is neither brought in nor
    sent out by its streamed step (2 bytes saved per byte held, as for the whole pack's).
    Held for the whole run, it adds its bytes at every point of the memory curve, so the
    room left is filled by size, then checked once with the curve (dropping the smallest
    until it fits).
    """
    plan = program.plan
    slack = room - fits(chosen).peak
    if slack <= 0:
        return []
    parts = sorted(((sizes.get(("optim", n), 0), n) for spec in plan.packs
                    if (spec.index, "optim") not in chosen.resident and plan.step_on.get(spec.index) != "host"
                    for n in spec.stepped), reverse=True)
    kept = {n: sizes[("optim", n)] for n in _largest_first(parts, slack)}
    while kept:
        plan.optim_resident = kept
        if fits(chosen).peak <= room:
            break
        kept = dict(list(kept.items())[:-1])
    plan.optim_resident = kept
    rows = []
    for spec in plan.packs:
        held = [n for n in spec.stepped if n in kept]
        if held:
            rows.append(dict(kept=f"optimizer state of {len(held)}/{len(spec.stepped)} params", pack=spec.index,
                             MiB=sum(kept[n] for n in held) / 2**20, saves_per_byte=2))
    return rows


def keep_weight_parts(program: Program, chosen: Choice, fits, room: int, sizes: dict) -> tuple[Choice, list[dict]]:
    """Fill what room is left with single weights held between a pack's visits, the last packs first.

    A pack's weights are held between visits whole or not at all above, and what is left over is
    often most of a pack's. A host-stepped pack's weight held from its forward to its backward is
    not released after the one nor brought in again for the other (1 byte saved per byte held, as
    for the whole pack's). It adds its bytes only between the pack's first visit and its last, so
    each pack (from the last, whose visits are closest) takes, largest first, what fits under the
    highest point of the curve between its two, and raises the curve there by what it took (no new
    schedule is built for that: a 24-layer GPT has 48 packs); one check of the whole curve then drops
    the last taken until it fits.
    """
    plan = program.plan
    curve = fits(chosen)
    swaps = param_swaps(program.schedule)
    order = [spec for spec in reversed(plan.packs)
             if plan.step_on.get(spec.index) == "host" and spec.index not in chosen.held
             and spec.index not in chosen.device and plan.master_on.get(spec.index, "host") == "host"
             and len(swaps.get(spec.index, ((), ()))[0]) > 1]
    shared = tied_weights(plan)
    peak_at, at = list(curve.peak_at), {n: i for i, n in enumerate(curve.nodes)}
    taken: list = []
    for spec in order:
        ins, outs = swaps[spec.index]
        span = peak_at[at[outs[0]]:at[ins[-1]]]     # the last swap_in's own peak is the same either way
        mine = _largest_first([(sizes.get(("params", n), 0), (spec.index, n)) for n in spec.params + spec.buffers
                               if (spec.index, n) not in chosen.parts and (spec.index, n) not in chosen.steps],
                              room - max(span, default=room))
        if not mine:
            continue
        chosen = chosen._replace(parts=chosen.parts | frozenset(mine))
        taken += mine
        if shared & {n for _, n in mine}:     # tied to another pack's weight: on the device for that one too
            curve = fits(chosen)
            peak_at, at = list(curve.peak_at), {n: i for i, n in enumerate(curve.nodes)}
            swaps = param_swaps(program.schedule)
            continue
        # between a release and the next swap_in they add their bytes before and after every op, so to its peak;
        # at those two ops the peak stays (the release's is before it frees, the swap_in's after it brings)
        size = sum(sizes.get(("params", n), 0) for _, n in mine)
        for r, i in zip(outs, ins[1:]):
            for k in range(at[r] + 1, at[i]):
                peak_at[k] += size
    if taken:
        curve = fits(chosen)
    while taken and curve.peak > room:
        chosen = chosen._replace(parts=chosen.parts - {taken.pop()})
        curve = fits(chosen)
    rows = []
    for spec in plan.packs:
        held = [n for p, n in chosen.parts if p == spec.index]
        if held:
            rows.append(dict(kept=f"params between visits ({len(held)}/{len(spec.params + spec.buffers)})",
                             pack=spec.index, MiB=sum(sizes[("params", n)] for n in held) / 2**20, saves_per_byte=1))
    return chosen, rows


def keep_step_parts(program: Program, chosen: Choice, fits, room: int, sizes: dict) -> tuple[Choice, list[dict]]:
    """Fill what room is left with single parameters of host-stepped packs stepping on the device.

    A pack moves to a device step whole or not at all above, and the room left is often less
    than its optimizer state. A parameter stepped on the device with its weight, gradient and
    optimizer state resident for good moves nothing, where its host step moved its weight in
    and its gradient out (2 bytes saved per 2 of optimizer state held, as for the whole pack's).
    Where its weight is on the device at the peak anyway (its pack's weights held between
    visits, or the last pack's single visit) the optimizer state is all it adds there; else
    its weight too. The first packs go first (their weights are held the longest), each
    parameter largest first while it fits what the peak leaves; one check of the whole curve
    then drops the last taken until it fits.
    """
    plan = program.plan
    slack = room - fits(chosen).peak
    swaps = param_swaps(program.schedule)
    weight_parts = {p for p, _ in chosen.parts}
    taken: list = sorted(chosen.steps)      # the integer program's, if it ran
    for spec in plan.packs:
        if (plan.step_on.get(spec.index) != "host" or spec.index in chosen.device or spec.index in weight_parts
                or not may_step_on_device(program, spec.index)):
            continue
        there = spec.index in chosen.held or len(swaps.get(spec.index, ((), ()))[0]) <= 1
        need = {n: sizes.get(("optim", n), 0) + (0 if there else sizes.get(("params", n), 0)) for n in spec.stepped}
        mine = _largest_first([(need[n], (spec.index, n)) for n in spec.stepped if (spec.index, n) not in chosen.steps],
                              slack)
        taken += mine
        slack -= sum(need[n] for _, n in mine)
    chosen = chosen._replace(steps=frozenset(taken))
    while taken and fits(chosen).peak > room:
        taken.pop()
        chosen = chosen._replace(steps=frozenset(taken))
    rows = []
    for spec in plan.packs:
        mine = [n for p, n in chosen.steps if p == spec.index]
        if mine:
            rows.append(dict(kept=f"all state (device step, {len(mine)}/{len(spec.stepped)} params)", pack=spec.index,
                             MiB=sum(sizes[("optim", n)] for n in mine) / 2**20, saves_per_byte=1))
    return chosen, rows


def carry_weights(program: Program, chosen: Choice, fits, room: int, sizes: dict) -> tuple[Choice, list[dict]]:
    """Fill what room is left with the weights of wholly-disk packs kept on the device across the step boundary.

    Such a pack's weights are read from its files for the forward and again for the backward,
    after which its step updates them where they are (on the CPU device) and writes them back.
    At the end of the backward the device holds little, and the packs stepped last are the first
    the next forward reads: weights left on the device from the step to that forward are not read
    again (1 byte saved per byte held, a disk read rather than a host copy). They live over the end
    of the backward and the start of the forward, where the activations held for the backward
    are fewest, so they use room the choices above (all at the turn) cannot. First packs first;
    the files kept in host memory are stepped and copied there as before (``ops.carried_names``).
    """
    plan = program.plan
    swaps = param_swaps(program.schedule)
    candidates = []
    for spec in plan.packs:
        outs = swaps.get(spec.index, ((), ()))[1]
        if plan.master_on.get(spec.index) != "disk" or not outs or not outs[-1].kwargs.get("handoff"):
            continue
        size = sum(sizes.get(("params", n), 0) for n in ops.carried_names(plan, spec.index))
        if size:
            candidates.append((1, size, ("carry", spec.index)))
    if not candidates:
        return chosen, []
    return _greedy(candidates, chosen, fits, room)
