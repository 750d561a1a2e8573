"""The partition's cost model: what a candidate pack needs on the device, how long it takes, and what a
whole plan moves and costs (``PackCost``; ``residency_lp``, what can stay on the device where the host steps).

``PackCost`` prices packs from the unit summaries ``partition.find_units`` makes (no tracing,
no measuring: the searches ask for thousands of candidates); ``plan_cost`` prices a whole partition as the
swap and offload passes will treat it (what they keep resident, what crosses the cuts, the host's
optimizer steps). The searches that use it are ``partition.search``; ``partition`` measures the packs
they pick and corrects the target until they fit.
"""
from __future__ import annotations

from collections import Counter

import pulp

from harmony.base import ilp
from harmony.base.tiers import Tier
from harmony.base.units import nbytes
from harmony.compiler.ir import Program
from harmony.passes.offload import step_place
from harmony.passes.partition.units import Unit
from harmony.passes.swap import mixed_placement
from harmony.runtime.plan import step_extra, step_traffic
from harmony.runtime.precision import device_bytes

# The planner's fixed cost of one more pack: about ten schedule ops (a swap_in, wait and release of its
# weights per phase, its gradients' release, its step) at a few microseconds of executor loop and copy
# hand-off each. It breaks ties towards fewer packs; it must not outweigh what smaller packs save in
# traffic (their freed room keeps optimizer state resident), which a larger value did on
# benchmarks/swap_volume.py's 12-layer GPT at half its state.
PACK_SECONDS = 3e-5


class PackCost:
    """Working set and time of a candidate pack (units s..e-1), from unit summaries; each pack's figures once
    (the cap search and the corrections run the DP a dozen times over mostly the same packs)."""

    def __init__(self, program: Program, units: list[Unit]):
        self.p, self.units = program, units
        self.memo: dict = {}
        self.lp_memo: dict = {}      # ``residency`` of each partition priced
        self.sizes = device_sizes(program)       # bytes on the device (compute copies under mixed precision)
        self.master = {n: nbytes(t) for n, t in program.gm.named_parameters()}
        self.state_per_byte = program.optim_profile["state_per_byte"]   # per byte of fp32 master
        # the searches price thousands of spans: their sums and maxima come from per-unit figures, not per parameter
        prof, master = program.optim_profile, self.master
        self.param_sum = _SpanSum(units, "params", self.sizes)
        self.buffer_sum = _SpanSum(units, "buffers", self.sizes)
        self.master_sum = _SpanSum(units, "params", master)
        # the step brings one parameter's optimizer state in at a time: the largest parameter's need, per unit
        self.unit_extra = [max((self.state_per_byte * master[n] + step_extra(prof, [master[n]]) for n in u.params),
                               default=0) for u in units]

    def __call__(self, s: int, e: int, last: bool) -> tuple[float, float]:
        key = (s, e, last)
        if key not in self.memo:
            self.memo[key] = self._figures(s, e, last)
        return self.memo[key]

    def _figures(self, s: int, e: int, last: bool) -> tuple[float, float]:
        us = self.units[s:e]
        pbytes, bbytes = self.param_sum(s, e), self.buffer_sum(s, e)
        extra = max(self.unit_extra[s:e], default=0)
        kept = sum(u.kept for u in us)
        boundary = us[0].cross_in + (self.units[e].cross_in if e < len(self.units) else 0)
        act = max(max(u.peak for u in us) + boundary, kept + max(u.bwd for u in us) + 2 * boundary)
        if self.p.config.optimizer_on != Tier.DEVICE:
            extra = 0          # the optimizer steps on the host (offload pass)
        need = pbytes + bbytes + pbytes + max(extra, act)
        cfg = self.p.config
        m = cfg.microbatches
        flops = sum(u.fwd_flops + u.bwd_flops + (0 if last else u.fwd_flops) for u in us) * m
        traffic = (pbytes + bbytes) * self.visits(s, last) + pbytes * self.grad_moves() \
            + self.master_sum(s, e) * 2 * self.state_per_byte + self.stash(s)
        seconds = max(flops / cfg.flops, traffic / cfg.copy_bandwidth) + PACK_SECONDS
        return need, seconds

    def traffic(self, s: int, e: int, last: bool, host: bool = False) -> float:
        """Bytes a swapped pack moves per iteration: weights in per visit (``visits``), out once updated, optimizer
        state in and out (``host``: the optimizer steps on the host, so gradients go out instead of weights and its
        state never moves), gradients around each microbatch's backward under the sequential policy
        (``grad_moves``), and what its input's stashes move (``stash``)."""
        pbytes = self.param_sum(s, e)
        optim = 0 if host else self.master_sum(s, e) * 2 * self.state_per_byte
        out = 0 if host and self.grad_moves() else 1
        return pbytes * (self.visits(s, last) + self.grad_moves() + out) + optim + self.stash(s)

    def visits(self, s: int, last: bool) -> int:
        """How often a swapped pack's weights come in per iteration. Harmony: once per phase, the last pack once (its
        forward hands over to its backward). Sequential: for each microbatch's forward and backward, the last pack's
        once, and the first pack's backward of one microbatch and its forward of the next are one visit."""
        if self.p.config.policy != "sequential":
            return 1 if last else 2
        m = self.p.config.microbatches
        return m if last else (m + 1 if s == 0 else 2 * m)

    def grad_moves(self) -> int:
        """Times a swapped pack's gradient bytes cross the link per iteration while it computes: under harmony none
        (they stay through the pack's one backward phase; a host step's single trip out is ``traffic``'s), under
        sequential the host accumulates them: out after every microbatch's backward, back for every one but the
        first, 2 M - 1 (which for a host step include that trip out)."""
        m = self.p.config.microbatches
        return 2 * m - 1 if self.p.config.policy == "sequential" else 0

    def stash(self, s: int) -> float:
        """Bytes a cut before unit ``s`` moves per iteration where nothing crossing it stays on the device.

        Under the harmony policy every microbatch's activations crossing the cut wait on the device or
        the host from the forward to the backward, and their gradients from the backward of the pack
        after the cut to the backward of the pack before it: each byte stashed goes out and comes back
        (4 bytes moved per byte crossing, per microbatch). The swap pass keeps them before weights where
        the budget has room (2 bytes saved per byte held); ``plan_cost`` counts that room.
        """
        if s == 0 or self.p.config.policy != "harmony":
            return 0.0
        return 4.0 * self.units[s].cross_in * self.p.config.microbatches

    def traffic_model(self, budget: float) -> Tier | str:
        """How ``plan_cost`` counts what stays resident: ``Tier.DEVICE`` (the optimizer steps there: where the offload
        pass will put it, which it decides after the partition with the exact curve), "host budget" (packs may live
        on disk), else "<policy> host" (the host steps every pack the swap pass does not move to the device)."""
        total = self.param_sum(0, len(self.units))
        cfg = self.p.config
        if step_place(cfg, lambda: (2 + self.state_per_byte) * total <= budget)[0] != Tier.HOST:
            return Tier.DEVICE
        return "host budget" if cfg.host_memory_budget is not None else f"{cfg.policy} host"

    def plan_cost(self, cuts, budget: float, exact: bool = False) -> tuple[float, float]:
        """(seconds, bytes moved) of a partition, counting what the swap pass will keep resident.

        As the swap pass does: parameters first (a byte kept saves 3 moved: in for forward and
        backward, out once updated), then optimizer state (2: in and out around the step). A pack's
        need already counts its own parameters, so with every parameter resident the room left is
        ``budget - P - max(need - own parameters)``; smaller packs leave more of it. Under a host
        step (harmony policy) weights are held from a pack's forward to its backward, beside the last
        pack's working set: a smaller last pack leaves more room for them. What crosses the cuts for
        every microbatch (``stash``) is held before weights, as the swap pass ranks it: fewer cuts, or
        cuts where less crosses, leave more room and move less. The host's optimizer steps add what
        they keep the step running after the device's last backward (``host_tail``). Under the sequential
        policy every microbatch visits every pack (``visits``, ``grad_moves``), so a byte of weights held from
        a pack's first visit to its last saves all but one of its trips in. ``exact``: under the harmony policy
        with host steps, what stays is ``residency``'s linear program (where the link is what the step waits for,
        ``working_set_cap``), not the rule above, which prices the turn and the device steps' room alone.
        """
        last = len(cuts) - 1
        own = [self.param_sum(s, e) for s, e in cuts]
        model = self.traffic_model(budget)
        host = model != Tier.DEVICE
        moved = sum(self.traffic(s, e, i == last, host) for i, (s, e) in enumerate(cuts))
        needs = [self(s, e, i == last)[0] for i, (s, e) in enumerate(cuts)]
        saved, shares = self.resident_saved(cuts, own, needs, model, budget, exact)
        left = max(0.0, moved - saved)
        share = left / moved if moved else 0.0     # the traffic residency does not save
        kept = self.kept_graphs(cuts, budget, max(own), needs[-1], saved)
        seconds, backward = self.pack_seconds(cuts, share, kept, host)
        return seconds + self.host_tail(cuts, backward, shares), left

    def resident_saved(self, cuts, own: list[float], needs: list[float], model: Tier | str, budget: float,
                       exact: bool) -> tuple[float, list[float]]:
        """(bytes moved that what stays resident saves, each pack's share of its parameters' bytes that steps on the
        host, for ``host_tail``) under ``model``, the ``traffic_model``: ``own`` are the packs' parameter bytes,
        ``needs`` their working sets."""
        last, host_steps = len(cuts) - 1, [1.0] * len(cuts)
        if model == "harmony host" and exact:
            # what stays, and where the budget binds, is the linear program the swap pass solves exactly
            saved, on_device = self.residency(cuts, budget)
            return saved, [1.0 - d / o if o else 0.0 for d, o in zip(on_device, own)]
        if model == "harmony host":
            return self.turn_saved(cuts, own, needs, budget)
        if model == "sequential host":
            # every microbatch visits every pack: weights held from a pack's first visit to its last save all but
            # one of its swap_ins (the swap pass's "held"), beside whichever pack is computing
            return self.fill([(self.visits(s, i == last) - 1, o) for i, ((s, _), o) in enumerate(zip(cuts, own))],
                             budget - max(needs)), host_steps
        if model != Tier.DEVICE:      # a host budget (or the ondemand policy)
            # with a host budget, packs may live on disk, whose reads and writes this model does not price
            # (``turn_saved``'s credit picked 48 packs for the offload benchmark's 600M GPT where 12 had been
            # chosen, 2.5 s a step slower on this machine); the swap pass still holds weights where its curve finds room
            return 0.0, host_steps
        return self.kept_for_good_saved(cuts, own, needs, budget), [0.0] * len(cuts)

    def kept_for_good_saved(self, cuts, own: list[float], needs: list[float], budget: float) -> float:
        """``resident_saved`` where the optimizer steps on the device: parameters kept for good save every trip they
        make, then optimizer state held saves its trips in and out, then the cuts' stashes theirs."""
        last, total = len(cuts) - 1, sum(own)
        all_params = total + max(n - p for n, p in zip(needs, own))
        optim = self.master_sum(0, len(self.units)) * self.state_per_byte
        if self.p.config.optimizer_on != Tier.DEVICE:
            optim = 0.0
        crossing = sum(self.stash(s) / 4 for s, _ in cuts)
        rates = [(self.visits(s, i == last) + self.grad_moves() + 1, o) for i, ((s, _), o) in enumerate(zip(cuts, own))]
        if all_params > budget:
            return self.fill(rates, budget - max(needs))
        optim_held = min(optim, budget - all_params)
        return self.fill(rates, total) + 2 * optim_held + 4 * min(crossing, budget - all_params - optim_held)

    def turn_saved(self, cuts, own: list[float], needs: list[float], budget: float) -> tuple[float, list[float]]:
        """``resident_saved`` under the harmony policy with host steps, by the rule (not the linear program).

        The host updates the weights, so none stay for good; but a pack's can stay from its forward to its
        backward (1 byte saved per byte), all of them beside the last pack's working set at the turn; room
        left then lets packs step on the device with all their state resident (2 more saved per byte of
        parameters, for its optimizer state held), where the swap pass may do that (swap.mixed_placement).
        The cuts' stashes go first: a byte crossing a cut held saves 2, and its gradient as much again.
        """
        total = sum(own)
        cross = [self.stash(s) / 4 for s, _ in cuts]     # activation bytes crossing into each pack, all microbatches
        crossing = sum(cross)
        room = max(0.0, budget - needs[-1])
        held = min(crossing, room)
        room -= held
        weights = min(total - own[-1], room)
        saved = 4 * held + weights
        if not (mixed_placement(self.p.config) and self.state_per_byte):
            return saved, [1.0] * len(cuts)
        on_device = self.device_stepped(own, needs, cross, budget, room - weights, weights,
                                        held / crossing if crossing else 0.0)
        return saved + 2 * on_device, [1.0 - on_device / total if total else 0.0] * len(cuts)

    def pack_seconds(self, cuts, share: float, kept: set, host: bool) -> tuple[float, list[float]]:
        """(seconds of all packs, each pack's backward seconds): a pack takes the longer of its compute (with the
        forward again where its graph is not ``kept``) and the ``share`` of its traffic residency leaves."""
        cfg, m, last = self.p.config, self.p.config.microbatches, len(cuts) - 1
        seconds, backward = 0.0, []
        for i, (s, e) in enumerate(cuts):
            recompute = 0 if i == last or i in kept else 1
            us = self.units[s:e]
            flops = sum(u.fwd_flops * (1 + recompute) + u.bwd_flops for u in us) * m
            copies = share * self.traffic(s, e, i == last, host) / cfg.copy_bandwidth
            pack = max(flops / cfg.flops, copies) + PACK_SECONDS
            seconds += pack
            back = sum(u.fwd_flops * recompute + u.bwd_flops + (u.fwd_flops if i == last else 0) for u in us) * m
            backward.append(pack * back / flops if flops else pack)
        return seconds, backward

    @staticmethod
    def fill(rates: list[tuple[float, float]], room: float) -> float:
        """Bytes moved that ``room`` bytes held save, holding the most saved per byte first: ``rates`` are (bytes saved
        per byte held, bytes that may be held); a pack's weights may be held in part (the swap pass's single
        weights)."""
        saved, room = 0.0, max(0.0, room)
        for rate, size in sorted(rates, reverse=True):
            held = min(size, room)
            saved, room = saved + rate * held, room - held
        return saved

    def device_stepped(self, own, needs, cross, budget: float, turn: float, weights: float, share: float) -> float:
        """Bytes of parameters that can step on the device with all their optimizer state resident (host step,
        harmony policy): at most what the turn from forward to backward leaves after held weights (``turn``),
        and at most what fits beside every pack's backward, for that state stays the whole step. There the
        pack's weights and gradients (``needs``), the weights held for the packs before it (``weights`` in all),
        the activations crossing into it and the packs before it and the gradients coming back through its
        output (``share`` of ``cross`` held); and a parameter stepped on the device keeps its weight there too,
        which for the packs after it nothing else holds by then.
        """
        spb = self.state_per_byte
        on_device = max(0.0, turn) / spb
        before = crossed = 0.0
        for j in range(len(own) - 1):
            crossed += cross[j] * share
            free = max(0.0, budget - needs[j] - min(before, weights) - crossed - cross[j + 1] * share)
            there = before + own[j]          # weights on the device at its backward anyway
            on_device = min(on_device, free / spb if free <= spb * there else (free + there) / (spb + 1))
            before += own[j]
        return min(sum(own), on_device)

    def busy_seconds(self, cuts) -> float:
        """What a partition's step spends besides copies, the longer of: the device's compute at the planner's FLOP/s
        (every pack's forward, backward and recompute, all but the last pack's, for every microbatch) and the host's
        optimizer steps of every parameter (``host_tail``'s rate)."""
        last, cfg = len(cuts) - 1, self.p.config
        flops = sum(u.fwd_flops * (1 if i == last else 2) + u.bwd_flops
                    for i, (s, e) in enumerate(cuts) for u in self.units[s:e])
        master = self.master_sum(0, len(self.units))
        return max(flops * cfg.microbatches / cfg.flops,
                   step_traffic(master, master * self.state_per_byte) / cfg.host_bandwidth)

    def residency(self, cuts, budget: float) -> tuple[float, list[float]]:
        """(bytes saved, bytes of each pack stepped on the device) of a partition under the harmony policy with host
        steps: the linear program the swap pass's integer program (``passes/swap/lp.py``) solves on the exact curve,
        here over packs, from their estimated working sets.

        Per pack, its weights held from its forward to its backward (1 byte saved per byte; the last pack's single
        visit holds them anyway) and its parameters stepped on the device with all their state resident (3 saved per
        byte: weights in twice, gradients out once; 2 for the last pack), where ``swap.mixed_placement`` allows; per
        cut, the activations crossing it and their gradients held (2 saved per byte each, stashed otherwise). At the
        start and at the end of each pack's backward the device holds its working set, every byte stepped on the
        device with its optimizer state, the weights held for the packs before it, and, for every microbatch, the
        activations crossing the cuts before it and the gradients coming back through its output (at the end,
        through its input); each must fit ``budget``.
        """
        key = (tuple(cuts), budget)
        if key in self.lp_memo:
            return self.lp_memo[key]
        n, m = len(self.units), self.p.config.microbatches
        own = [self.param_sum(s, e) for s, e in cuts]
        work = [self(s, e, e == n)[0] for s, e in cuts]
        cross = [0.0] + [self.units[s].cross_in * m for s, _ in cuts[1:]]     # into pack c, all microbatches
        steps = mixed_placement(self.p.config) and self.state_per_byte > 0
        out = residency_lp(own, work, cross, budget, self.state_per_byte if steps else None)
        self.lp_memo[key] = out
        return out

    def host_tail(self, cuts, backward: list[float], shares: list[float]) -> float:
        """Seconds the step ends after the device's last backward because the host is still stepping.

        Each pack steps on the host once its backward ends, one pack at a time, behind the packs before
        it in backward order; the first pack steps last, and the next forward waits for its weights.
        A step moves ``plan.step_traffic`` bytes of the fp32 masters, gradients and optimizer state at the
        host's memory bandwidth, as the simulator prices it; ``shares[i]`` of pack i's step on the host.
        """
        if not any(shares):
            return 0.0
        t = free = 0.0
        for i in reversed(range(len(cuts))):
            t += backward[i]
            master = self.master_sum(*cuts[i])
            step = step_traffic(master, master * self.state_per_byte) / self.p.config.host_bandwidth
            free = max(free, t) + shares[i] * step
        return max(0.0, free - t)

    def kept_graphs(self, cuts, budget: float, largest: float, last_need: float, resident: float) -> set[int]:
        """The packs whose forward's graph the swap pass can keep (no recompute), as it chooses them.

        The binding moment is the turn from forward to backward: the last pack's working set, the
        next pack's weights coming in (where compute outweighs copies the swap pass leaves room for
        that) and every kept graph, for all microbatches under the harmony policy, are on the device
        at once. Graphs go first where recompute outweighs the traffic the same bytes save (the
        swap pass's ranking: recompute time as bytes at the link's speed, per byte held), else into
        what residency leaves. Smaller packs leave more room: this is what lets the cap search see it.
        """
        cfg = self.p.config
        if cfg.recompute == "always" or cfg.policy == "ondemand" or len(cuts) < 2:
            return set()
        m = cfg.microbatches
        times = cfg.microbatches if cfg.policy == "harmony" else 1
        compute, copies = self.compute_and_copies(cuts)
        room = budget - last_need - (largest if compute > copies else 0)
        options = []
        for i, (s, e) in enumerate(cuts[:-1]):
            held = sum(u.kept + u.cross_in for u in self.units[s:e]) * times
            gain = sum(u.fwd_flops for u in self.units[s:e]) * m / cfg.flops * cfg.copy_bandwidth / max(held, 1)
            options.append((gain, held, i))
        if compute <= copies:          # graphs only where residency leaves room (it saves 2 to 3 bytes per byte)
            room -= resident / 2
            options = [o for o in options if o[0] > 3]
        out = set()
        for gain, held, i in sorted(options, reverse=True):
            if held <= room:
                out.add(i)
                room -= held
        return out

    def compute_and_copies(self, cuts, host: bool = False) -> tuple[float, float]:
        """(compute seconds, copy seconds) of a partition's step with every pack swapped: every pack's forward, its
        recompute and backward for every microbatch at the planner's FLOP/s, and what each pack moves (``traffic``)
        at the link's speed (``host``: the optimizer steps on the host, so its state does not move). Where the compute
        outlasts the copies, recompute is on the step's critical path and the copies are not: the swap pass weighs a
        kept graph by how many times (``Program.compute_to_copies``)."""
        cfg = self.p.config
        compute = sum(u.fwd_flops * 2 + u.bwd_flops for u in self.units) * cfg.microbatches / cfg.flops
        copies = sum(self.traffic(s, e, i == len(cuts) - 1, host) for i, (s, e) in enumerate(cuts)) / cfg.copy_bandwidth
        return compute, copies


class _SpanSum:
    """``value`` summed over the names (``attr``: "params" or "buffers") of units s..e-1, each name once, in time
    independent of the span: prefix sums of each unit's own, less what names several units share (tied weights: few)
    counted more than once."""

    def __init__(self, units: list, attr: str, value: dict):
        names = [getattr(u, attr) for u in units]
        self.prefix = [0]
        for own in names:
            self.prefix.append(self.prefix[-1] + sum(value[n] for n in own))
        count = Counter(n for own in names for n in own)
        self.shared = [(value[n], [i for i, own in enumerate(names) if n in own]) for n, c in count.items() if c > 1]

    def __call__(self, s: int, e: int) -> int:
        total = self.prefix[e] - self.prefix[s]
        for size, at in self.shared:
            k = sum(s <= i < e for i in at)
            total -= max(k - 1, 0) * size
        return total


def residency_lp(own: list[float], work: list[float], cross: list[float], budget: float,
                 state_per_byte: float | None) -> tuple[float, list[float]]:
    """``PackCost.residency``'s linear program for packs with parameters ``own``, working sets ``work`` and ``cross[c]``
    bytes crossing into pack c for all microbatches (``cross[0] == 0``); ``state_per_byte`` None where no parameter may
    step on the device. Returns (bytes saved, bytes of each pack stepped on the device); nothing saved where some
    pack's working set alone does not fit."""
    k = len(own)
    steps = state_per_byte is not None
    prob = pulp.LpProblem("residency", pulp.LpMaximize)
    f = [prob.add_variable(f"f{j}", 0, own[j] if steps else 0) for j in range(k)]
    h = [prob.add_variable(f"h{j}", 0, own[j] if j < k - 1 else 0) for j in range(k)]
    x = [prob.add_variable(f"x{c}", 0, cross[c]) for c in range(k)]      # activations held, bytes
    y = [prob.add_variable(f"y{c}", 0, cross[c]) for c in range(k)]      # their gradients held
    for j in range(k):
        prob += f[j] + h[j] <= own[j]
    prob += pulp.lpSum(h) + pulp.lpSum((3 if j < k - 1 else 2) * f[j] for j in range(k)) \
        + 2 * pulp.lpSum(x) + 2 * pulp.lpSum(y)
    stepped = (1 + (state_per_byte or 0)) * pulp.lpSum(f)
    for j in range(k):
        base = stepped + pulp.lpSum(h[:j]) + work[j] - f[j]
        prob += base + pulp.lpSum(x[1:j + 1]) + (y[j + 1] if j + 1 < k else 0) <= budget
        prob += base + pulp.lpSum(x[1:j]) + y[j] <= budget
    if not ilp.solve(prob):
        return 0.0, [0.0] * k
    return max(0.0, pulp.value(prob.objective) or 0.0), [v.value() or 0.0 for v in f]


def device_sizes(program: Program) -> dict[str, int]:
    """Bytes of each parameter and buffer on the device: in the compute dtype under mixed precision."""
    dtype = program.config.compute_dtype
    return {n: device_bytes(t, dtype) for n, t in
            list(program.gm.named_parameters()) + list(program.gm.named_buffers())}
