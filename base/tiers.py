"""Where training state can live: the memory tiers, as one enum every layer names them by.

``Tier.DEVICE`` is the accelerator's memory (or a logical device's budgeted memory on the CPU), ``Tier.HOST``
the CPU's memory, ``Tier.DISK`` files in a private directory. A ``Tier`` is a ``str`` whose value is the
name users write (``optimizer_on="host"``, ``weights_on="disk"``), so it compares, hashes, prints, formats
and serialises (JSON, checkpoint manifests, printed schedules) exactly as that name does: a config value
given as a plain string and the enum are interchangeable, and nothing a user reads changes. A new tier is
one member here and the places that move state to and from it.

One exception: torch.fx writes an enum argument of a graph node by its class (``where = Tier.HOST``), not
by its repr, so the passes put a tier into a schedule op's arguments as its plain value (``Tier.HOST.value``),
and ``sm.code`` still reads ``where = 'host'``; the ops compare what they are given with the members.
"""
from __future__ import annotations

import enum


class Tier(str, enum.Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"

    # the name as users write it, wherever it is shown: repr in printed schedules, str and format in reports
    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(t.value for t in cls)


DEVICE, HOST, DISK = Tier.DEVICE, Tier.HOST, Tier.DISK
