"""The swap pass's search: what to keep on the device, from the least-memory schedule up.

The greedy (``greedy``) ranks what could stay (a pack's weights, optimizer state or gradients, an activation
group, a forward graph on the device or the host) by bytes moved saved per byte held and keeps each while the
schedule fits; the parts of packs then fill what room is left (single parameters' optimizer state, weights held
between visits, parameters stepped on the device: passes/swap/parts.py; weights carried across steps). Where the
integer program applies (``lp``), its plan is checked against the greedy's. The result is a ``Choice``
(``graph``), which ``passes.swap.run`` applies.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from harmony.base.tiers import Tier
from harmony.base.units import fmt_bytes
from harmony.compiler.ir import Program
from harmony.passes.swap import lp as swap_lp
from harmony.passes.swap.graph import Choice, computes, param_swaps, stepped_after_release
from harmony.passes.swap.parts import (
    keep_optimizer_parts,
    keep_step_parts,
    keep_weight_parts,
    may_step_on_device,
    tied_weights,
)
from harmony.runtime import ops
from harmony.runtime.plan import STATE_KINDS

TIE = 0.01    # of the bytes in, what the integer program's plan must save to replace the greedy's outright


def _row(what, size, per_byte) -> dict:
    if what[0] == "graph":
        kind = "activations (no recompute)"
    elif what[0] == "offload":
        kind = "activations on the host (no recompute)"
    elif what[0] == "held":
        kind = "params between visits"
    elif what[0] == "device":
        kind = "all state (device step)"
    elif what[0] == "carry":
        kind = "params across steps"
    elif what[0] == "keep":
        kind = f"{what[1]} outputs" if ops.op_named(what[1]).runs_forward else "input grads"
    else:
        kind = what[0]
    return dict(kept=kind, pack=what[-1], MiB=size / 2**20, saves_per_byte=per_byte)


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
    kind, pack = what[0], what[-1]
    if kind == "offload":      # its inputs and outputs over its pack's span, but other ops' peaks may fall: no bound
        return 0
    if kind == "keep":
        spans, pack = _stash_spans(curve, groups[what[1:]]), None     # no compute op changes
    elif kind == "graph":
        spans = swap_lp.graph_spans(curve, plan, pack)
    elif kind in ("held", "params"):
        spans = _weight_spans(curve, plan, pack, kind == "params", sizes, shared)
    else:                                              # "optim", "device": optimizer state resident for good
        resident = plan.at(pack).optim_kept
        spans = [(-1, len(nodes),
                  sum(sizes.get(("optim", n), 0) for n in plan.packs[pack].stepped if n not in resident))]
    rise = [0] * (len(nodes) + 1)
    for a, b, size in spans:      # ``size`` more at the nodes strictly between a and b
        if size > 0 and b - a > 1:
            rise[a + 1] += size
            rise[b] -= size
    best = acc = 0
    for i, n in enumerate(nodes):
        acc += rise[i]
        if acc and computes(n) and (pack is None or n.args[0] != pack):
            best = max(best, curve.peak_at[i] + acc)
    return best


def _stash_spans(curve, names):
    """(start, end, bytes) over which an activation group kept stays where it is now stashed: each of its values
    from its stash to its first unstash."""
    nodes = curve.nodes
    at = {n.name: i for i, n in enumerate(nodes)}
    for name in names:
        i = at.get(name)
        if i is not None and nodes[i].kwargs.get("keep"):
            continue                               # its stash sends the graph: the group is not stashed
        s = next((u for u, op in ops.ops_of(nodes[i].users) if op.stashes), None) if i is not None else None
        back = [at[u.name] for u, op in ops.ops_of(s.users) if op.unstashes] if s is not None else []
        if back:
            yield at[s.name], min(back), curve.out[i]


def _weight_spans(curve, plan, pack: int, resident: bool, sizes: dict, shared: set[str]):
    """(start, end, bytes) over which pack ``pack``'s weights kept stay where they are now swapped out: held, from
    each release to the next swap_in; ``resident``, also from the start and to the end of the schedule."""
    spec, since = plan.packs[pack], (-1 if resident else None)

    def weights(held=()) -> int:   # a weight tied to another pack's may be on the device for that one
        return sum(sizes.get(("params", x), 0) for x in ops.moving_names(spec, "params", held) if x not in shared)
    size = weights()
    for i, n in enumerate(curve.nodes):
        op = ops.op_of(n)
        if op.state_copy and n.args[0] == pack and n.args[1] == "params":     # a swap_in or a release
            if op.releases:
                since, size = i, weights(n.kwargs.get("held", ()))
            else:
                if since is not None:
                    yield since, i, size
                since = None
    if resident and since is not None:
        yield since, len(curve.nodes), size


def with_kept(chosen: Choice, what) -> Choice:
    if what[0] == "keep":
        return chosen._replace(stashed=chosen.stashed - {what[1:]})
    if what[0] == "graph":       # (on the device: where it went to the host before, no more)
        return chosen._replace(kept=chosen.kept | {what[1]}, offloaded=chosen.offloaded - {what[1]})
    if what[0] == "offload":
        return chosen._replace(kept=chosen.kept | {what[1]}, offloaded=chosen.offloaded | {what[1]})
    if what[0] == "held":
        return chosen._replace(held=chosen.held | {what[1]})
    if what[0] == "carry":
        return chosen._replace(carried=chosen.carried | {what[1]})
    if what[0] == "device":
        return chosen._replace(resident=chosen.resident | {(what[1], k) for k in STATE_KINDS},
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


def greedy(candidates, chosen: Choice, fits, room, bound=None, curve=None) -> tuple[Choice, list[dict]]:
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
        if _stays(chosen, items[i][2]):
            i += 1
            continue
        batch = [c for c in items[i:i + run] if not _stays(chosen, c[2])]
        run = len(batch)
        if len(batch) == 1 and bound is not None:
            curve = curve if curve is not None else fits(chosen)
            if bound(curve, batch[0][2]) > room:
                i += 1
                continue
        trial = chosen
        for _, _, what in batch:
            trial = with_kept(trial, what)
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


def _stays(chosen: Choice, what) -> bool:
    """A pack's graph kept on the device (or on the host already) is not then sent to the host."""
    return what[0] == "offload" and what[1] in chosen.kept


def _candidates(program: Program, base, groups: dict, graphs: list) -> list[tuple]:
    """(bytes saved per byte held, bytes held, what) for everything that could stay on the device."""
    plan = program.plan
    n_packs, m = len(plan.packs), plan.microbatches
    candidates = list(graphs)
    swaps = param_swaps(base)
    # mixed precision keeps no compute copy between steps (the fp32 masters are the weights): those of packs stepped
    # on the device come in afresh too, and only their optimizer state may stay
    mixed = program.config.precision != "fp32"
    for spec in plan.packs:
        if plan.at(spec.index).step_on == Tier.HOST or mixed:   # the host updates the weights: they come in afresh
            visits = len(swaps.get(spec.index, ([], []))[0])
            if visits > 1:
                candidates.append((visits - 1, spec.param_bytes + spec.buffer_bytes, ("held", spec.index)))
            # beyond held weights: their swap_in, grads out
            if spec.stepped and may_step_on_device(program, spec.index):
                held = spec.param_bytes + spec.buffer_bytes + spec.optim_bytes
                candidates.append(((spec.param_bytes + spec.buffer_bytes) * 2 / held, held, ("device", spec.index)))
            if plan.at(spec.index).step_on != Tier.HOST:
                candidates.append((2, spec.optim_bytes, ("optim", spec.index)))   # in and out around the step
            continue
        phases = m if program.config.policy == "sequential" else 1
        per_byte = phases * (2 if spec.index == n_packs - 1 else 3)   # in for forward and backward, out once
        candidates.append((per_byte, spec.param_bytes + spec.buffer_bytes, ("params", spec.index)))
        candidates.append((2, spec.optim_bytes, ("optim", spec.index)))   # in and out around the step
    for key, names in groups.items():
        spec = plan.packs[key[1]]
        size = (spec.out_bytes if ops.op_named(key[0]).runs_forward else spec.in_bytes) * len(names)
        candidates.append((2, size, ("keep",) + key))                   # out and back in
    return candidates


def choose(program: Program, chosen: Choice, curve, base, groups: dict, sizes: dict, graphs: list, fits, report):
    """From the least-memory schedule (``chosen``, its ``curve``), what to keep on the device: the greedy by bytes
    saved per byte held, checked against the integer program where it applies. (chosen, rows, how, curve)."""
    plan, budget = program.plan, program.config.usable_budget
    candidates = _candidates(program, base, groups, graphs)
    # Fill the budget: every byte held is traffic saved, and the prefetch pass still hoists swap_ins
    # wherever the curve is below its peak. (Leaving the largest pack's weights free for prefetching where
    # compute outweighs copies simulated slower in every case tried: the demo and benchmarks/swap_volume.py.)
    room = budget
    shared = tied_weights(plan)
    fill = _Fill(program, candidates, fits, room, sizes,
                 lambda c, what: peak_bound(program, c, what, groups, sizes, shared))
    exact = swap_lp.applies(program, shared)
    least = param_swaps(program.schedule) if exact else None      # the least-memory schedule's, which ``curve`` is of
    chosen, rows = fill(chosen, curve)
    how = "greedy"
    if exact:
        chosen, rows, how, curve = _against_program(fill, chosen, rows, curve, groups, least, graphs, report)
    if how == "greedy":        # the schedule the greedy chose, built again where the program's was built last
        curve = fits(chosen)
    return chosen, rows, how, curve


@dataclass
class _Fill:
    """``choose``'s greedy from a choice on: what saves the most per byte held first, then the parts of packs.

    A graph worth less than a single parameter's optimizer state (2 bytes per byte) takes what that leaves
    (``low``), and one worth less than a single held weight or device-stepped parameter (1 byte per byte) what
    those leave (``lowest``): the bytes a graph saves are its recompute time at the link's rate, below a byte per
    byte behind a fast link (tests/test_passes.py:
    test_graphs_worth_less_than_traffic_take_only_the_room_residency_leaves).
    """
    program: Program
    candidates: list
    fits: Callable
    room: int
    sizes: dict
    bound: Callable          # ``peak_bound`` of a choice and a candidate
    low: list = field(init=False)
    lowest: list = field(init=False)

    def __post_init__(self):
        self.low = [c for c in self.candidates if c[2][0] in ("graph", "offload") and 1 <= c[0] < 2]
        self.lowest = [c for c in self.candidates if c[2][0] in ("graph", "offload") and c[0] < 1]

    def __call__(self, chosen: Choice, curve=None) -> tuple[Choice, list[dict]]:
        program, fits, room, sizes, bound = self.program, self.fits, self.room, self.sizes, self.bound
        free = [c for c in self.candidates if not _taken(chosen, c[2])]
        chosen, rows = greedy([c for c in free if c not in self.low + self.lowest], chosen, fits, room, bound, curve)
        chosen, more = keep_optimizer_parts(program, chosen, fits, room, sizes)
        rows += more
        chosen, more = greedy([c for c in self.low if c in free], chosen, fits, room, bound)
        rows += more
        chosen, more = keep_weight_parts(program, chosen, fits, room, sizes)
        rows += more
        chosen, more = keep_step_parts(program, chosen, fits, room, sizes)
        rows += more
        chosen, more = greedy([c for c in self.lowest if c in free], chosen, fits, room, bound)
        rows += more
        chosen, more = carry_weights(program, chosen, fits, room, sizes)
        return chosen, rows + more


def _against_program(fill: _Fill, chosen: Choice, rows: list, curve, groups: dict, least, graphs: list,
                     report) -> tuple:
    """The greedy's plan (``chosen``, ``rows``) or the integer program's over the least-memory ``curve``, filled as
    the greedy fills, where that is worth more by over ``TIE`` of the bytes in: (chosen, rows, how, curve), the
    curve the program's plan's where the program found one."""
    program, fits = fill.program, fill.fits
    by_greedy = fits(chosen)
    found = swap_lp.select(program, curve, groups, fill.sizes, least, fill.candidates, fill.room, fits,
                           lambda p: may_step_on_device(program, p))
    if found is None:
        return chosen, rows, "greedy", curve
    picked, picked_rows = fill(*found)
    curve = fits(picked)
    how = "greedy"
    # near ties go to the greedy's plan. Where they move the same, what decides the step's time is which
    # parameters step on the device (on the compute stream) and which on the host (beside it, but the next
    # forward waits for the first pack's), and neither objective sees it: on the GTX 1080 Ti preset's 18
    # configurations of the partition's sweep, taking the integer program's with the most stepped on the
    # device simulated 0.68x to 1.19x the greedy's (geomean 0.91), slower at 80% of the state and 64
    # microbatches
    if _worth(picked, curve, graphs) > _worth(chosen, by_greedy, graphs) + TIE * by_greedy.moved["h2d"]:
        chosen, rows, how = picked, _pick_rows(program.plan, picked, fill.candidates) + picked_rows, "integer program"
    report.notes.append(
        f"integer program over the memory curve (swap.lp): its plan moves "
        f"{fmt_bytes(curve.moved['h2d'] + curve.moved['d2h'])}, the greedy's "
        f"{fmt_bytes(by_greedy.moved['h2d'] + by_greedy.moved['d2h'])}; "
        f"{'kept' if how != 'greedy' else 'the greedy kept (within 1%, or ahead)'}")
    return chosen, rows, how, curve


def _taken(chosen: Choice, what) -> bool:
    """Whether ``chosen`` already keeps ``what`` (or, for a pack's weights or step, any part of them)."""
    kind, pack = what[0], what[-1]
    if kind == "keep":
        return what[1:] not in chosen.stashed
    if kind == "graph":
        return pack in chosen.kept and pack not in chosen.offloaded
    if kind == "offload":
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
    saved = sum(per_byte * held for per_byte, held, what in graphs if what[0] == "graph" and what[1] in chosen.kept)
    return saved - curve.moved["h2d"] - curve.moved["d2h"]


def _pick_rows(plan, chosen: Choice, candidates: list) -> list[dict]:
    """Report rows for what the integer program kept whole (``keep_weight_parts`` and ``keep_step_parts`` list the
    parts): held packs, packs stepped on the device, activation groups and graphs, as the greedy's candidates."""
    def whole(what) -> bool:
        if what[0] == "held":
            return what[1] in chosen.held
        if what[0] == "device":
            return what[1] in chosen.device
        if what[0] == "offload":
            return what[1] in chosen.offloaded
        return what[0] in ("keep", "graph") and _taken(chosen, what)
    return [_row(what, size, per_byte) for per_byte, size, what in candidates if whole(what)]


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
    Under ``shard_state="full"`` a pack whose share is on disk is carried too: its step all-gathers the updated
    chunks into the device copy (runtime/partitioned/carry.py), saving the forward's read of this rank's chunks.
    """
    plan = program.plan
    swaps = param_swaps(program.schedule)
    # shard_state="full": a pack whose share is on disk all-gathers its updated chunks into the device copy at the
    # end of its step (runtime/partitioned/), unless another pack reads one of its weights (a tied head), whose
    # gather would then find the weight it reads on the device in a copy the simulator does not know of
    full = getattr(program.config, "shard_state", None) == "full"
    stepped = stepped_after_release(program.schedule) if full else set()
    readers = {}
    for spec in plan.packs:
        for n in spec.params:
            readers.setdefault(n, set()).add(spec.index)
    candidates = []
    for spec in plan.packs:
        outs = swaps.get(spec.index, ((), ()))[1]
        if plan.at(spec.index).master_on != Tier.DISK or not outs:
            continue
        if full and (spec.index not in stepped or any(readers.get(n, set()) - {spec.index} for n in spec.owned)):
            continue
        if not full and not outs[-1].kwargs.get("handoff"):
            continue
        size = sum(sizes.get(("params", n), 0) for n in ops.carried_names(plan, spec.index))
        if size:
            candidates.append((1, size, ("carry", spec.index)))
    if not candidates:
        return chosen, []
    return greedy(candidates, chosen, fits, room)
