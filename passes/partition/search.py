"""The partition's searches over contiguous packs, on ``partition.cost``'s estimates: the exact DP for the least
predicted time (``plan_packs``), the partition that leaves the least traffic where the host link binds
(``least_traffic``), and the working-set cap search that picks among their plans (``working_set_cap``).
"""
from __future__ import annotations

import math

from harmony.passes.partition.cost import PackCost
from harmony.passes.partition.units import Unit


def plan_packs(need: PackCost, budget: float) -> list[tuple[int, int]] | None:
    """Exact DP over contiguous partitions of ``need``'s units: least predicted time, every pack within ``budget``."""
    n = len(need.units)
    best = [math.inf] * (n + 1)
    choice = [0] * (n + 1)
    best[0] = 0.0
    for e in range(1, n + 1):          # prefix [0, e) made of non-last packs
        for s in range(e - 1, -1, -1):
            size, secs = need(s, e, last=False)
            if size > budget:
                break                  # a longer pack only needs more
            if best[s] + secs < best[e]:
                best[e], choice[e] = best[s] + secs, s
    final, start = math.inf, None
    for s in range(n - 1, -1, -1):     # the last pack runs forward and backward without recompute
        size, secs = need(s, n, last=True)
        if size > budget:
            break
        if best[s] + secs < final:
            final, start = best[s] + secs, s
    if start is None:
        return None
    return _cuts(choice, start) + [(start, n)]


def _cuts(choice: list[int], end: int) -> list[tuple[int, int]]:
    """The packs of a DP's prefix ending at ``end``, read back through ``choice`` (each prefix's last pack start)."""
    cuts = []
    while end > 0:
        cuts.append((choice[end], end))
        end = choice[end]
    return cuts[::-1]


def least_traffic(units: list[Unit], sizes: dict, microbatches: int, work, cap: float, budget: float,
                  tolerance: float = 1e-3):
    """The contiguous partition of ``units`` that leaves the least traffic under the harmony policy with host steps, by
    a     bound on ``PackCost.residency`` that a DP can minimise: ``(bound, cuts)``, or None if no partition's packs all
    have a working set ``work(s, e)`` within ``cap``.

    From the constraint at pack j's backward in ``residency``: what is held for good or for the packs before j, with
    j's working set ``W_j`` and the activations and gradients crossing the cuts up to j (``A_j``, all microbatches),
    fits the budget ``U``; the packs after j are done by then. So the traffic left is at least
    ``3 P - U + W_j - P_j - P_after_j + 2 A_j - min(A_j, U - W_j)``, ``P`` the parameters' bytes, ``P_j`` pack j's,
    ``P_after_j`` those of the packs after it: a crossing byte held costs a byte of room, one that cannot be costs 2
    moved. The bound is the largest of these over the packs. A large first pack is cheap (its backward comes last,
    when little else is held); small last packs and few cuts leave the most room. Minimising it over partitions is a
    bisection on the bound, each step a DP that keeps the least crossing bytes for each prefix (a pack's term only
    grows with them); the bound returned is the bisection's infeasible side, so no partition does better. It stops
    within ``tolerance`` of the parameters' bytes. It holds for optimizers with at least 2 bytes of state per byte
    (Adam's): a byte stepped on the device then holds at least as much as it saves (tests/test_traffic_bound.py checks
    it against the linear program).
    """
    bounds = _PackTerms(units, sizes, microbatches, work, cap, budget)
    total = bounds.total
    low, high = -total, 4 * total + 2 * sum(bounds.cross)
    found = bounds.within(high)
    if found is None:
        return None
    while high - low > tolerance * total:
        mid = (low + high) / 2
        cuts = bounds.within(mid)
        if cuts is None:
            low = mid
        else:
            high, found = mid, cuts
    return max(0.0, 3 * total - budget + low), found


class _PackTerms:
    """``least_traffic``'s terms of the bound, one per pack, and the DP that cuts the units into packs whose terms all
    stay within a given bound."""

    def __init__(self, units: list[Unit], sizes: dict, microbatches: int, work, cap: float, budget: float):
        self.n, self.work, self.cap, self.budget = len(units), work, cap, budget
        self.known: dict = {}
        seen, pre = set(), [0.0]
        for u in units:       # a parameter two units share counts once, where it is first used
            pre.append(pre[-1] + sum(sizes[q] for q in u.params - seen))
            seen |= u.params
        self.pre, self.total = pre, pre[-1]      # parameters' bytes of each prefix of units, and of all
        self.cross = [u.cross_in * microbatches for u in units] + [0.0]

    def ws(self, s: int, e: int) -> float:      # each pack's working set once: the bisection asks for it a dozen times
        if (s, e) not in self.known:
            self.known[s, e] = self.work(s, e)
        return self.known[s, e]

    def term(self, s: int, e: int, before: float) -> float:
        """The traffic left that the constraint at pack ``s..e``'s backward implies, ``before`` bytes crossing the
        cuts before it."""
        pre, cross = self.pre, self.cross
        w = self.ws(s, e)
        crossing = before + (cross[s] if s else 0.0) + cross[e]
        return w - (pre[e] - pre[s]) - (self.total - pre[e]) + 2 * crossing - min(crossing, max(0.0, self.budget - w))

    def within(self, bound: float) -> list[tuple[int, int]] | None:
        """Cuts whose packs' terms are all <= ``bound`` and working sets within the cap; None if there are none."""
        n, cross = self.n, self.cross
        best = [math.inf] * (n + 1)       # least crossing bytes of a prefix cut into packs whose terms are <= bound
        choice = [0] * (n + 1)
        best[0] = 0.0
        for e in range(1, n + 1):
            for s in range(e - 1, -1, -1):
                if self.ws(s, e) > self.cap:
                    break
                if best[s] < math.inf and self.term(s, e, best[s]) <= bound:
                    crossed = best[s] + (cross[s] if s else 0.0)
                    if crossed < best[e]:
                        best[e], choice[e] = crossed, s
        return None if best[n] == math.inf else _cuts(choice, n)


def least_traffic_packs(need: PackCost, cap: float, budget: float) -> list[tuple[int, int]] | None:
    """``least_traffic`` over ``need``'s units and estimated working sets: the cuts (``PackCost.plan_cost`` then prices
    them with the linear program itself)."""
    n = len(need.units)
    got = least_traffic(need.units, need.sizes, need.p.config.microbatches, lambda s, e: need(s, e, e == n)[0],
                        cap, budget, tolerance=1e-2)
    return None if got is None else got[1]


def working_set_cap(need: PackCost, budget: int):
    """The search and the largest working set a pack may have: ``(cap, search)``, ``search(need, cap)`` the cuts.

    Smaller packs leave room for resident state. Tries caps from the budget down to the largest single
    layer's need with the DP for the least time (``plan_packs``), and, under the harmony policy with host
    steps, the partition that leaves the least traffic (``least_traffic_packs``: where the host link is what
    limits the step, its fewer cuts and small last packs win); keeps the plan with the least predicted
    time, and among those within 2% of it the least traffic.
    """
    n = len(need.units)
    floor = max([need(i, i + 1, False)[0] for i in range(n - 1)] + [need(n - 1, n, True)[0]])
    if floor >= budget:
        return budget, plan_packs
    caps = [budget * (floor / budget) ** (k / 9) for k in range(10)]
    found = [(cap, cuts, plan_packs) for cap in caps for cuts in [plan_packs(need, cap)] if cuts is not None]
    if not found:
        return budget, plan_packs
    plans = [(cap, *need.plan_cost(cuts, budget), search) for cap, cuts, search in found]
    best = min(range(len(plans)), key=lambda i: plans[i][1])
    if need.traffic_model(budget) == "harmony host" and \
            plans[best][2] / need.p.config.copy_bandwidth > need.busy_seconds(found[best][1]):
        # the copies outlast the compute and the host's steps: what stays on the device decides the step, so every
        # plan is priced with the swap pass's linear program, and the partitions that leave the least traffic compete
        def fewest(need, cap):
            return least_traffic_packs(need, cap, budget)
        found += [(cap, cuts, fewest) for cap in caps for cuts in [fewest(need, cap)] if cuts is not None]
        plans = [(cap, *need.plan_cost(cuts, budget, exact=True), search) for cap, cuts, search in found]
    fastest = min(p[1] for p in plans)
    cap, _, _, search = min((p for p in plans if p[1] <= fastest * 1.02), key=lambda p: p[2])
    return int(cap), search
