"""The swap pass's fillers: once the greedy has kept whole packs' state, graphs and activation groups, the room left
is filled with parts of packs (single parameters' optimizer state, weights held between visits, parameters stepped on
the device), and the tests those choices share (which weights are tied, which packs may step on the device).
"""
from __future__ import annotations

from harmony.base.tiers import Tier
from harmony.compiler.ir import Program
from harmony.passes.swap.graph import Choice, param_swaps
from harmony.runtime import ops


def tied_weights(plan) -> set[str]:
    """Weights (parameters and buffers) that more than one pack reads: tied, as GPT-2's embedding and head."""
    seen, tied = set(), set()
    for spec in plan.packs:
        mine = set(ops.state_names(spec, "params"))
        tied |= seen & mine
        seen |= mine
    return tied


def mixed_placement(cfg) -> bool:
    """Whether host-stepped packs may move to a device step: left to the compiler (``optimizer_on="auto"``),
    fp32, one rank (the compress pass placed the all-reduce for a host step). The partition asks too."""
    return cfg.optimizer_on == "auto" and cfg.precision == "fp32" and (cfg.world_size or 1) <= 1


def may_step_on_device(program: Program, pack: int) -> bool:
    """Whether the swap pass may move this host-stepped pack's step to the device: ``mixed_placement``, and
    the pack's weights and optimizer state in host memory (not files)."""
    record = program.plan.at(pack)
    return mixed_placement(program.config) and record.optim_on == Tier.HOST and record.master_on == Tier.HOST


def _largest_first(sized, slack: int) -> list:
    """The ``(size, key)`` items taken largest first while each fits what is left of ``slack``: their keys."""
    taken = []
    for size, key in sorted(sized, key=lambda item: -item[0]):
        if 0 < size <= slack:
            taken.append(key)
            slack -= size
    return taken


def keep_optimizer_parts(program: Program, chosen: Choice, fits, room: int, sizes: dict) -> tuple[Choice, list[dict]]:
    """Fill what room is left with single parameters' optimizer state, largest first.

    A pack's optimizer state is kept whole or not at all above; what is left over is often
    most of a pack's. A parameter whose state stays on the device is neither brought in nor
    sent out by its streamed step (2 bytes saved per byte held, as for the whole pack's).
    Held for the whole run, it adds its bytes at every point of the memory curve, so the
    room left is filled by size, then checked once with the curve (dropping the smallest
    until it fits).
    """
    plan = program.plan
    chosen = chosen._replace(optim=frozenset())
    slack = room - fits(chosen).peak
    if slack <= 0:
        return chosen, []
    parts = sorted(((sizes.get(("optim", n), 0), (spec.index, n)) for spec in plan.packs
                    if (spec.index, "optim") not in chosen.resident and plan.at(spec.index).step_on != Tier.HOST
                    for n in spec.stepped), reverse=True)
    kept = _largest_first(parts, slack)
    while kept and fits(chosen._replace(optim=frozenset(kept))).peak > room:
        kept.pop()
    chosen = chosen._replace(optim=frozenset(kept))
    rows = []
    for spec in plan.packs:
        held = [n for p, n in kept if p == spec.index]
        if held:
            rows.append(dict(kept=f"optimizer state of {len(held)}/{len(spec.stepped)} params", pack=spec.index,
                             MiB=sum(sizes[("optim", n)] for n in held) / 2**20, saves_per_byte=2))
    return chosen, rows


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
             if plan.at(spec.index).step_on == Tier.HOST and spec.index not in chosen.held
             and spec.index not in chosen.device and plan.at(spec.index).master_on == Tier.HOST
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
        if (plan.at(spec.index).step_on != Tier.HOST or spec.index in chosen.device or spec.index in weight_parts
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
