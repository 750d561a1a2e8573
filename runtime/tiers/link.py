"""An emulated host link: a logical device's copies paced to a slower link's rate (``Hardware.logical(...,
link_bandwidth=)``, compiler/hardware/logical.py).

On the CPU a copy "to the device" is a memcpy, about as fast as the compute around it, where a GPU's host link is
far slower than its compute. So that a plan that swaps pays here what it would pay there, each copy of an emulated
link lasts at least its bytes over the link's rate: the copy runs, then the thread that made it sleeps the rest out,
as ``runtime/executor.emulation_pause`` does for compute. The sleep leaves the core to the device's compute (a
GPU's copy engine is not its SMs). Each paced copy is recorded (``copies``) for tests and reports.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkCopy:
    """One paced copy: its direction ("h2d" or "d2h"), bytes, and the seconds it lasted (copy and sleep)."""

    direction: str
    nbytes: int
    seconds: float


class EmulatedLink:
    """The pace of a slower host link: ``h2d`` and ``d2h`` bytes/s."""

    def __init__(self, h2d: float, d2h: float):
        self.rate = {"h2d": float(h2d), "d2h": float(d2h)}
        self.copies: list[LinkCopy] = []       # each paced copy, in the order they ended
        self.seconds = {"h2d": 0.0, "d2h": 0.0}
        self._lock = threading.Lock()

    def pace(self, direction: str, nbytes: int, started: float) -> None:
        """Sleep until a copy of ``nbytes`` in ``direction`` that began at ``started`` (``time.perf_counter()``)
        has lasted ``nbytes`` / the link's rate, then record it."""
        if nbytes <= 0:
            return
        rest = nbytes / self.rate[direction] - (time.perf_counter() - started)
        if rest > 0:
            time.sleep(rest)
        seconds = time.perf_counter() - started
        with self._lock:
            self.copies.append(LinkCopy(direction, nbytes, seconds))
            self.seconds[direction] += seconds

    def run(self, direction: str, nbytes: int, fn):
        """``fn()`` (the copy), paced."""
        started = time.perf_counter()
        out = fn()
        self.pace(direction, nbytes, started)
        return out

