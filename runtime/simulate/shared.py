"""What the devices of one simulated node share, booked first come, first served.

>>> pool = Shared()
>>> pool.book({"cores": (1.0, 1.0)}, start=0.0, seconds=2.0)      # one core's work on a 1-core host
2.0
>>> pool.book({"cores": (1.0, 1.0)}, start=0.0, seconds=2.0)      # a second one waits for the core
4.0

A resource is a key (a host's cores, its memory bus, a PCIe switch's upstream link in one direction) with a
capacity (cores, bytes/s). A piece of work asks each resource it uses for a demand (1 core; a copy's bytes/s) and
takes ``seconds`` at that rate when it gets all of it; where some is taken, it runs at the share the scarcest of its
resources leaves (``min(room / demand)``) and takes longer. The work booked first keeps its rate (first come, first
served, not a fair share), so N pieces of one core's work started together on a 1-core host end at 1, 2, .. N
times their own length: the same total as a fair share, and the capacity is never exceeded.
"""
from __future__ import annotations

Booking = tuple[float, float, float]     # (from, until, amount of the resource used meanwhile)


class Shared:
    """Bookings of every shared resource of a node: ``key -> [(t0, t1, used)]``."""

    def __init__(self):
        self.booked: dict[object, list[Booking]] = {}

    def book(self, needs: dict, start: float, seconds: float) -> float:
        """When work that takes ``seconds`` at full rate, started at ``start``, ends; ``needs``: ``key -> (demand,
        capacity)`` of each resource it uses. Books what it takes of each."""
        if not needs or seconds <= 0:
            return start + max(seconds, 0.0)
        lists = {k: self.booked.setdefault(k, []) for k in needs}
        live = {k: [b for b in v if b[1] > start] for k, v in lists.items()}
        edges = sorted({t for v in live.values() for b in v for t in b[:2] if t > start})
        t, left = start, seconds          # seconds of work still to do at the full rate
        for nxt in edges + [float("inf")]:
            share = min([1.0] + [(cap - sum(u for t0, t1, u in live[k] if t0 <= t < t1)) / demand
                                 for k, (demand, cap) in needs.items()])
            if share > 1e-12:
                need = left / share
                end = min(t + need, nxt)
                for k, (demand, _) in needs.items():
                    lists[k].append((t, end, share * demand))
                if t + need <= nxt:
                    return t + need
                left -= (nxt - t) * share
            t = nxt
        raise AssertionError("unreachable: the last interval is unbounded")

    def used(self, key) -> float:
        """The resource's use integrated over time (core-seconds, bytes)."""
        return sum((t1 - t0) * u for t0, t1, u in self.booked.get(key, ()))
