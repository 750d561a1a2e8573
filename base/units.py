"""Byte sizes as people write them: 512MiB, 2GiB, 1.5e9."""
from __future__ import annotations

import math
import re

from harmony.base.errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(value, what: str = "memory_budget") -> int:
    """``parse_bytes("512MiB") == 536870912``; ints and floats are bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value) or value < 1:     # nan, inf and less than a byte are no size
            raise ConfigError(f"{what}={value!r} must be a positive, finite number of bytes")
        return int(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            n = float(m.group(1)) * _UNITS[m.group(2).lower()]
            if math.isfinite(n) and n >= 1:
                return int(n)
    raise ConfigError(f"{what}={value!r} is not a size; write bytes as an int or a string like '512MiB' or '2GiB'")


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def nbytes(t) -> int:
    """Bytes of a tensor's elements (not of its storage, which a view may share with others)."""
    return t.numel() * t.element_size()
