"""The swap pass's exact selection: one integer program over the memory curve, where the greedy ranks by rate.

The greedy (``swap.search.greedy`` and the ``keep_*_parts`` fills) keeps what saves the most bytes per byte
held first. Where the budget binds at more than one point that ranking can go wrong: a byte of a
host-stepped pack's weights held from its forward to its backward saves 1 and costs its byte only
there; a byte stepped on the device (weight, gradient and optimizer state resident) saves the weight's
trips and the gradient's, but costs 3 bytes everywhere, beside the largest pack's backward too. With a
large first pack (the cut that moves the least across cuts) the best plan steps part of that pack on the
device, whose weights are on the device at its own backward anyway, and holds the later packs' weights,
which are gone by then; ranking by rate holds the first pack whole and is left with no room to step.

Here every choice is a variable and the memory curve a set of constraints, one at each compute op of
the least-memory schedule (everything swapped and stashed):

* per parameter of a host-stepped pack, ``held`` (its weight stays between the pack's visits) or
  ``stepped`` (it steps on the device with all its state resident, as ``Residency.device_parts``), at most one;
* per activation group (a pack's outputs, or its inputs' gradients, for every microbatch), ``kept``;
* per pack that could keep its forward's graph (``recompute="auto"``), ``graph``.

Each adds its bytes over the spans of the schedule where the least-memory plan does not hold them
(``rises``: the same spans ``swap.peak_bound`` reads), so the peak at each op is linear in the choice.
The objective is the swap pass's: bytes moved saved, with recompute time counted as the bytes the host
link moves in that time. HiGHS solves it exactly (a few hundred binaries); ``select`` builds the chosen
schedule and checks it against the exact curve (solving again with less room, then dropping picks, where the
linear model missed an interaction); ``swap.run`` fills what room is left as the greedy does and keeps
whichever of the two plans is worth more.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pulp

from harmony.base import ilp
from harmony.base.tiers import Tier
from harmony.compiler.ir import Program
from harmony.passes.swap.graph import Choice, computes
from harmony.runtime import ops
from harmony.runtime.plan import STATE_KINDS

TIME_LIMIT = 5.0       # seconds: the program is solved in well under one on the benchmark's models


def applies(program: Program, tied: set[str]) -> bool:
    """Where the integer program models the schedule: the harmony policy, fp32, one rank, ``optimizer_on="auto"``
    (the mixed placement ``swap.mixed_placement`` allows), weights and optimizer state in host memory (no disk tier),
    no weight two packs share, and every pack stepped on the host (the state does not fit; the offload pass placed
    the steps)."""
    cfg, plan = program.config, program.plan
    return (cfg.policy == "harmony" and cfg.precision == "fp32" and cfg.optimizer_on == "auto"
            and (cfg.world_size or 1) <= 1 and cfg.host_memory_budget is None and not tied
            and all(plan.at(s.index).step_on == Tier.HOST and plan.at(s.index).master_on == Tier.HOST
                    for s in plan.packs))


def _span(diff: list, a: int, b: int, size: float) -> None:
    """``size`` more at the nodes strictly between a and b (a difference array)."""
    if size and b - a > 1:
        diff[a + 1] += size
        diff[b] -= size


def _total(diff: list, n: int) -> list:
    """The difference array summed: the bytes at each of the n nodes."""
    acc, got = 0, []
    for d in diff[:n]:
        acc += d
        got.append(acc)
    return got


def rises(curve, plan, groups: dict, swaps: dict, optim_per_byte: float) -> dict:
    """For each choice, the bytes it adds at each node of ``curve``: per byte of a pack's weights held
    (``("held", p)``) or stepped on the device (``("stepped", p)``: its weight where no visit holds it, its
    optimizer state everywhere, its gradient at the pack's step), and per whole activation group
    (``("keep", op, p)``)."""
    nodes = curve.nodes
    at = {n: i for i, n in enumerate(nodes)}
    by_name = {n.name: i for i, n in enumerate(nodes)}
    steps = {n.args[0]: i for i, n in enumerate(nodes) if ops.op_of(n).steps}
    n_nodes = len(nodes)
    out = {}
    for spec in plan.packs:
        p = spec.index
        ins, outs = swaps.get(p, ([], []))
        if not ins:
            continue
        held = [0.0] * (n_nodes + 1)
        for r, i in zip(outs, ins[1:]):
            _span(held, at[r], at[i], 1.0)
        out[("held", p)] = _total(held, n_nodes)
        stepped = [0.0] * (n_nodes + 1)
        _span(stepped, -1, n_nodes, 1.0 + optim_per_byte)
        for i, r in zip(ins, outs):
            _span(stepped, at[i] - 1, at[r] + 1, -1.0)
        if p in steps:        # its gradient waits for the pack's step, which its release left for it
            _span(stepped, steps[p] - 1, steps[p] + 1, 1.0)
        out[("stepped", p)] = _total(stepped, n_nodes)
    for key, names in groups.items():
        diff = [0] * (n_nodes + 1)
        for name in names:
            i = by_name.get(name)
            s = next((u for u, op in ops.ops_of(nodes[i].users) if op.stashes), None) if i is not None else None
            back = [at[u] for u, op in ops.ops_of(s.users) if op.unstashes] if s is not None else []
            if back:
                _span(diff, at[s], min(back), curve.out[i])
        out[("keep",) + key] = _total(diff, n_nodes)
    return out


def graph_spans(curve, plan, pack: int):
    """Where keeping ``pack``'s forward graph adds bytes to ``curve``: (forward, backward, bytes) for each microbatch,
    its saved activations from its forward to its backward, less the inputs that backward is the last to read."""
    nodes = curve.nodes
    at = {n: i for i, n in enumerate(nodes)}
    saved, fwd = plan.packs[pack].saved_bytes, {}
    for i, n in enumerate(nodes):
        op = ops.op_of(n)
        if op.runs_forward and n.args[0] == pack:
            fwd[n.args[1]] = i
        elif op.runs_backward and n.args[0] == pack and n.args[1] in fwd:
            last = [a for a in n.all_input_nodes if max(at[u] for u in a.users) == i]   # dying after it
            yield fwd[n.args[1]], i, saved - sum(curve.out[at[a]] for a in last)


def graph_rise(curve, plan, pack: int) -> list:
    """The bytes keeping ``pack``'s forward graph adds at each node of ``curve`` (``graph_spans``)."""
    diff = [0] * (len(curve.nodes) + 1)
    for a, b, size in graph_spans(curve, plan, pack):
        _span(diff, a, b, max(0, size))
    return _total(diff, len(curve.nodes))


def select(program: Program, curve, groups: dict, sizes: dict, swaps: dict, candidates: list, room: int, fits,
           may_step):
    """The integer program's choice, built and fitted to the exact curve: ``(Choice, its curve)``, or None where HiGHS
    finds nothing. ``curve`` is the least-memory schedule's, ``swaps`` its ``param_swaps``; ``candidates`` the greedy's
    (what a kept activation group or graph is worth); ``fits(choice)`` builds a choice's schedule and its curve;
    ``may_step(pack)`` whether the pack's parameters may step on the device. Where the exact curve peaks above the
    linear one, it solves again with that much less room (three tries), then drops what must go."""
    margin = 0
    for _ in range(3):
        picks = solve(program, curve, groups, sizes, swaps, candidates, room - margin, may_step)
        if picks is None:
            return None
        chosen = choice(program.plan, groups, sizes, picks)
        got = fits(chosen)
        if got.peak <= room:
            return chosen, got
        margin += got.peak - room + 4096
    return fitted(chosen, got, groups, fits, room)


def choice(plan, groups: dict, sizes: dict, picks: set) -> Choice:
    """``solve``'s picks as a ``Choice``: a pack all of whose weights are held, or all of whose parameters step on the
    device, whole; the rest parameter by parameter."""
    by_pack: dict = {}
    for what in picks:
        if what[0] in ("held", "stepped"):
            by_pack.setdefault((what[0], what[1]), set()).add(what[2])
    held, device, parts, steps = set(), set(), set(), set()
    for spec in plan.packs:
        p = spec.index
        mine_held, mine_stepped = by_pack.get(("held", p), set()), by_pack.get(("stepped", p), set())
        if spec.stepped and mine_stepped == set(spec.stepped) and not mine_held:
            device.add(p)
        elif mine_held and not mine_stepped and mine_held == {n for n in spec.params + spec.buffers
                                                              if sizes.get(("params", n), 0)}:
            held.add(p)
        else:
            parts |= {(p, n) for n in mine_held}
            steps |= {(p, n) for n in mine_stepped}
    kept_groups = {what[1:] for what in picks if what[0] == "keep"}
    return Choice(resident={(p, k) for p in device for k in STATE_KINDS}, stashed=set(groups) - kept_groups,
                  kept=frozenset(what[1] for what in picks if what[0] == "graph"), held=frozenset(held),
                  device=frozenset(device), parts=frozenset(parts), steps=frozenset(steps))


def fitted(chosen: Choice, curve, groups: dict, fits, room: int) -> tuple[Choice, object]:
    """``chosen`` (whose exact ``curve`` peaks above ``room``) less what must go for it to fit: single weights first,
    then single steps, graphs, activations, whole packs' weights, whole packs' steps, in runs that double. Returns
    it and its curve."""
    run = 1
    while curve.peak > room:
        kept_groups = sorted(set(groups) - chosen.stashed)
        if chosen.parts:
            chosen = chosen._replace(parts=chosen.parts - set(sorted(chosen.parts)[-run:]))
        elif chosen.steps:
            chosen = chosen._replace(steps=chosen.steps - set(sorted(chosen.steps)[-run:]))
        elif chosen.kept:
            chosen = chosen._replace(kept=frozenset(sorted(chosen.kept)[:-run]))
        elif kept_groups:
            chosen = chosen._replace(stashed=chosen.stashed | set(kept_groups[-run:]))
        elif chosen.held:
            chosen = chosen._replace(held=frozenset(sorted(chosen.held)[:-run]))
        elif chosen.device:
            gone = set(sorted(chosen.device)[:run])
            chosen = chosen._replace(device=chosen.device - gone,
                                     resident={r for r in chosen.resident if r[0] not in gone})
        else:
            break
        curve = fits(chosen)
        run *= 2
    return chosen, curve


@dataclass
class _Ilp:
    """``solve``'s integer program as it is built."""
    prob: pulp.LpProblem
    value: list = field(default_factory=list)     # the objective's terms: bytes moved saved
    picks: dict = field(default_factory=dict)     # what may be kept -> its binary variable
    # a pack's bytes held or stepped, an activation group, a graph -> (its variable, its rise)
    rise_of: dict = field(default_factory=dict)


def solve(program: Program, curve, groups: dict, sizes: dict, swaps: dict, candidates: list, room: int, may_step):
    """The choice worth the most whose linear peak fits ``room`` at every compute op of ``curve`` (``select``'s
    arguments): a set of ``("held", pack, name)``, ``("stepped", pack, name)``, ``("keep", op, pack)`` and
    ``("graph", pack)``; None where HiGHS finds nothing."""
    plan = program.plan
    base = [(i, curve.peak_at[i]) for i, n in enumerate(curve.nodes) if computes(n)]
    if not base:
        return None
    r = rises(curve, plan, groups, swaps, program.optim_profile["state_per_byte"])
    lp = _Ilp(pulp.LpProblem("swap", pulp.LpMaximize))
    for spec in plan.packs:
        _add_weights(lp, spec, sizes, swaps, r, may_step)
    _add_kept(lp, curve, plan, candidates, r)
    if not lp.picks:
        return None
    lp.prob += pulp.lpSum(lp.value)
    _add_peaks(lp, base, room)
    if not ilp.solve(lp.prob, time_limit=TIME_LIMIT):
        return None
    return {k for k, v in lp.picks.items() if (v.value() or 0) > 0.5}


def _add_weights(lp: _Ilp, spec, sizes: dict, swaps: dict, r: dict, may_step) -> None:
    """A swapped pack's variables: per parameter, ``held`` (where the pack has more than one visit) and ``stepped``
    (where ``may_step``), at most one of them; and per kind, the pack's bytes of it, which the curve's constraints
    share."""
    p, prob = spec.index, lp.prob
    ins = swaps.get(p, ([], []))[0]
    if not ins:
        return
    visits = len(ins)
    stepped = set(spec.stepped) if may_step(p) else set()
    held_bytes, stepped_bytes = [], []
    for k, n in enumerate(spec.params + spec.buffers):
        w = sizes.get(("params", n), 0)
        if not w:
            continue
        h = prob.add_variable(f"h_{p}_{k}", cat=pulp.LpBinary) if visits > 1 else None
        s = prob.add_variable(f"s_{p}_{k}", cat=pulp.LpBinary) if n in stepped else None
        if h is not None and s is not None:
            prob += h + s <= 1
        if h is not None:
            lp.picks[("held", p, n)] = h
            held_bytes.append(w * h)
            lp.value.append((visits - 1) * w * h)
        if s is not None:   # its weight in for each visit, its gradient out
            lp.picks[("stepped", p, n)] = s
            stepped_bytes.append(w * s)
            lp.value.append((visits * w + sizes.get(("grads", n), 0)) * s)
    for kind, terms in (("held", held_bytes), ("stepped", stepped_bytes)):
        if terms:       # the pack's bytes of that kind, one variable the curve's constraints share
            total = prob.add_variable(f"{kind}_{p}", 0)
            prob += total == pulp.lpSum(terms)
            lp.rise_of[(kind, p)] = (total, r[(kind, p)])


def _add_kept(lp: _Ilp, curve, plan, candidates: list, r: dict) -> None:
    """A variable per activation group kept and per graph kept, worth the bytes it saves moving out and back in,
    or the recompute saved (as bytes the link moves)."""
    worth = {what: per_byte * size for per_byte, size, what in candidates if what[0] in ("keep", "graph")}
    for what, bytes_saved in worth.items():
        rise = r[what] if what[0] == "keep" else graph_rise(curve, plan, what[1])
        if what[0] == "keep" and not max(rise, default=0):     # nothing stashed: nothing to keep
            continue
        x = lp.prob.add_variable("_".join(map(str, what)), cat=pulp.LpBinary)
        lp.picks[what] = x
        lp.value.append(bytes_saved * x)
        lp.rise_of[what] = (x, rise)


def _add_peaks(lp: _Ilp, base: list, room: int) -> None:
    """The memory curve's constraints: what the choice adds at a compute op fits ``room`` less the op's peak in the
    least-memory plan (``base``: (op index, peak)). One constraint per distinct rise, at the highest peak among the
    ops that share it (spans are long: a schedule of a thousand compute ops has a few dozen)."""
    highest: dict = {}
    for i, peak in base:
        key = tuple((k, c) for k, (_, rise) in lp.rise_of.items() for c in [rise[i]] if c)
        if key and peak > highest.get(key, -1):
            highest[key] = peak
    for key, peak in highest.items():
        lp.prob += pulp.lpSum(c * lp.rise_of[k][0] for k, c in key) <= room - peak
