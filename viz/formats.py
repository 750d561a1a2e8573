"""How the report writes one value: JSON-safe data (``plain``), bytes, seconds and significant digits
(``fmt_value``), and long lines folded (``wrap``)."""
from __future__ import annotations

import math
import textwrap

from harmony.base.units import fmt_bytes


def plain(x):
    """``x`` with only JSON types: tuples/sets become lists, non-finite floats null, the rest str."""
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, (set, frozenset)):
        return sorted((plain(v) for v in x), key=str)
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if hasattr(x, "item") and getattr(x, "ndim", 1) == 0:   # numpy / torch scalars
        return plain(x.item())
    return str(x)


def fmt_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{_sig(s * 1e3)} ms"
    return f"{_sig(s * 1e6)} µs"


def _sig(v: float, digits: int = 3) -> str:
    """``v`` with ``digits`` significant digits, without exponent notation for everyday sizes."""
    if v == 0 or not math.isfinite(v):
        return "0" if v == 0 else str(v)
    if abs(v) >= 10 ** (digits - 1):
        return f"{v:,.0f}"
    if abs(v) < 1e-4:
        return f"{v:.{digits - 1}e}"
    decimals = digits - 1 - math.floor(math.log10(abs(v)))
    return f"{v:.{decimals}f}"


def fmt_value(key: str, value) -> str:
    """One cell: bytes as KiB/MiB, seconds as s/ms, floats to 3 significant digits, ints with commas."""
    k = str(key).lower()
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)) and (k.endswith("bytes") or k in ("budget", "peak")):
        return fmt_bytes(value)
    if isinstance(value, (int, float)) and (k.endswith("_s") or k.endswith("seconds") or k == "s"):
        return fmt_seconds(float(value))
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, float):
        return _sig(value)
    if isinstance(value, (list, tuple, set)):
        return ", ".join(str(v) for v in value)
    return str(value)


def wrap(line: str, indent: int = 4) -> str:
    """``line`` folded at 100 columns; a break falls after a comma when one is near, never inside a pair."""
    chunks = line.replace(", ", ",\0").split("\0")
    out, current = [], ""
    for chunk in chunks:
        if current and len(current) + 1 + len(chunk) > 100:
            out.append(current)
            current = " " * indent + chunk
        else:
            current = f"{current} {chunk}" if current else chunk
    out.append(current)
    return "\n".join(textwrap.fill(o, width=100, subsequent_indent=" " * indent, break_on_hyphens=False)
                     for o in out)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
