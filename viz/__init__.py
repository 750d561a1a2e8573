"""Drawings, timelines and reports of a compiled program.

>>> harmony.viz.draw(sm, "plan", out_dir="out")     # model + schedule drawings, timeline after a step
[PosixPath('out/gpt_model.svg'), PosixPath('out/gpt_schedule.svg'), PosixPath('out/gpt_timeline.json')]

``report.render`` (text / markdown / JSON), ``dot.model_dot`` / ``dot.schedule_dot``
(DOT source) and ``timeline.chrome_trace`` (Perfetto JSON) are the pieces ``draw`` uses.
Submodules are imported on first use so ``import harmony.viz`` stays cheap.
"""
from __future__ import annotations

import sys
from pathlib import Path

from harmony.base.errors import ConfigError

WHAT = ("plan", "model", "schedule", "timeline")


def draw(sm, what: str = "plan", out_dir=".", name: str | None = None) -> list[Path]:
    """Write drawings of ``sm`` into ``out_dir`` and return their paths.

    ``what``: "model" (model graph by pack), "schedule" (schedule graph by op), "timeline"
    (Chrome trace of the last step), or "plan" (both drawings, and the timeline once a step
    has run). A pipeline rank whose node was simulated (``sm.simulate()``) also gets
    ``<name>_node_timeline.json``: the simulated step, one process row per device.
    Drawings are SVG if graphviz's ``dot`` is installed, else DOT source.
    ``name`` prefixes the files (default: the model's class name, lower case).
    """
    if what not in WHAT:
        raise ConfigError(f"unknown drawing what={what!r}; choose one of {', '.join(WHAT)}")
    from harmony.viz import dot, timeline  # deferred: submodules load on first use (dot imports graphviz)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = name or type(sm.program.model).__name__.lower()
    events = list(getattr(getattr(sm, "runtime", None), "events", None) or [])
    node = getattr(sm, "node_simulation", None)    # a pipeline rank's sm.simulate(): every device's row
    if what == "timeline" and not events and node is None:
        raise ConfigError("what='timeline' needs a step that has run: call sm(*batch) once, then draw")
    drawings = {"model": dot.model_dot, "schedule": dot.schedule_dot}
    paths: list[Path] = []
    for kind in ("model", "schedule"):
        if what in (kind, "plan"):
            paths.append(dot.render(drawings[kind](sm), out_dir / f"{name}_{kind}", quiet=True))
    fallback = [p for p in paths if p.suffix == ".dot"]
    if fallback and not dot.dot_available():
        print(dot.missing_dot_hint(fallback), file=sys.stderr)
    if what in ("timeline", "plan") and events:
        paths.append(timeline.chrome_trace(events, out_dir / f"{name}_timeline.json"))
    if what in ("timeline", "plan") and node is not None:   # one process (row) per simulated device
        paths.append(timeline.chrome_trace(node.events, out_dir / f"{name}_node_timeline.json"))
    return paths


def __getattr__(attr):
    if attr in ("dot", "report", "timeline"):
        import importlib
        return importlib.import_module(f"harmony.viz.{attr}")
    raise AttributeError(f"module 'harmony.viz' has no attribute {attr!r}")
