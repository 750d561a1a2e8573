"""Logical devices: one device of a ``Hardware`` (the CPU, most often) as several, each with its own memory budget,
and, for emulation, a slower compute (``speed_factors``) and a slower host link (``link_bandwidth``).

>>> hw = Hardware.this_machine().logical([2**30] * 2, speed_factors=[4, 4], link_bandwidth=2e9)
>>> hw.devices[0].h2d_bandwidth, hw.devices[0].link_emulated
(2000000000.0, True)

Why the link too: a logical device on the CPU copies to and from "the host" with a memcpy, about as fast as its
compute, while a GPU's host link (PCIe) is some hundred times slower than the GPU's compute. Slowing the compute
alone (the speed factor) leaves swaps nearly free, so a plan that swaps (a rank holding a whole model's state under
a budget) runs faster here than it would on the GPUs it stands for. ``link_bandwidth`` makes the runtime pace every
copy of the device to that rate (runtime/tiers/link.py: the copy, then a sleep for the rest of ``bytes / rate``),
and the simulator and planner read it as the device's ``h2d_bandwidth`` and ``d2h_bandwidth``.
"""
from __future__ import annotations

from harmony.base.errors import ConfigError


def _per_device(values, count: int, what: str) -> list[float]:
    values = list(values) if isinstance(values, (list, tuple)) else [values] * count
    if len(values) != count:
        raise ConfigError(f"{count} budgets but {len(values)} {what}")
    return [float(v) for v in values]


def logical(hw, budgets, speed_factors=None, link_bandwidth=None):
    """``Hardware.logical``: ``hw``'s first device as one logical device per budget (``Hardware.logical`` says
    what the arguments are)."""
    budgets = list(budgets)
    factors = _per_device(speed_factors if speed_factors is not None else 1.0, len(budgets), "speed factors")
    base = hw.devices[0]
    links = _per_device(link_bandwidth, len(budgets), "link bandwidths") if link_bandwidth is not None else None
    real = base.real_link_bandwidth or min(base.h2d_bandwidth, base.d2h_bandwidth)
    if links is not None:
        bad = [x for x in links if not 0 < x <= real]
        if bad:
            raise ConfigError(f"link_bandwidth={link_bandwidth!r}: each emulated link's bytes/s must be positive and "
                              f"at most the real link's {real:.4g} bytes/s ({base.name}'s): the runtime can only "
                              f"slow copies down (it sleeps the rest of each copy out); got {bad[0]:g}")
    devices = []
    for i, (b, f) in enumerate(zip(budgets, factors)):
        name = base.name + (f" #{i}" if len(budgets) > 1 else "") + (f" (emulated x{f:g})" if f != 1 else "")
        dev = base.replace(name=name, memory=int(b), speed_factor=float(f))
        if links is not None:
            dev = dev.replace(h2d_bandwidth=links[i], d2h_bandwidth=links[i], real_link_bandwidth=real,
                              link=f"emulated {links[i] / 1e9:.3g} GB/s")
        devices.append(dev)
    notes = hw.notes + (("emulated: speed factors stretch compute time",) if any(f != 1 for f in factors) else ())
    if links is not None:
        notes += (f"emulated: the runtime paces host-link copies to {', '.join(f'{x / 1e9:.3g}' for x in links)} "
                  f"GB/s (really {real / 1e9:.3g} GB/s)",)
    return hw.replace(devices=tuple(devices), notes=notes)
