"""Shared bits of the benchmarks: tables and the models they run."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def table(rows: list[dict], title: str = "") -> str:
    """A plain aligned text table; floats to 3 significant figures."""
    if not rows:
        return f"{title}\n(no rows)"
    cols = list(dict.fromkeys(k for r in rows for k in r))

    def cell(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"
        return str(v)
    cells = [[cell(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = [title] if title else []
    lines.append("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def add_json_arg(ap) -> None:
    """``--json PATH``: also write the run's headline figures there (``python -m benchmarks`` reads them)."""
    ap.add_argument("--json", default=None, help="write the headline figures to this JSON file")


def save_json(path, figures: dict) -> None:
    """Write a benchmark's headline figures (plain numbers and strings) for ``python -m benchmarks``."""
    if not path:
        return
    import json
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(figures, indent=1, default=float))
