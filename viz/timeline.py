"""Trace events as a Chrome / Perfetto timeline: open the JSON in ui.perfetto.dev or chrome://tracing.

>>> chrome_trace(sm.runtime.events, "step.json")      # measured; simulated events work alike
PosixPath('step.json')

One track per stream (compute, copy, or the simulator's h2d/d2h), one complete ("X")
event per op, and a counter track "device bytes" of the live device bytes after each op.
An event is anything with the fields of ``runtime.executor.TraceEvent`` (name, kind,
stream, start, end in seconds, live_bytes, peak_bytes), as attributes or dict keys; an
optional ``device`` field puts each device in its own process.
"""
from __future__ import annotations

import json
from pathlib import Path

from harmony.base.errors import ConfigError
from harmony.base.units import fmt_bytes

STREAM_ORDER = ("compute", "h2d", "copy", "d2h", "sync")   # top to bottom; other streams follow


def _get(event, field, default=None):
    if isinstance(event, dict):
        return event.get(field, default)
    return getattr(event, field, default)


def trace_events(events) -> list[dict]:
    """The Chrome trace event list for ``events`` (times in microseconds)."""
    events = list(events)
    devices = list(dict.fromkeys(str(_get(e, "device", "device")) for e in events)) or ["device"]
    seen = list(dict.fromkeys(str(_get(e, "stream", "compute")) for e in events))
    streams = sorted(seen, key=lambda s: (STREAM_ORDER.index(s) if s in STREAM_ORDER else len(STREAM_ORDER),
                                          seen.index(s)))
    pid = {d: i + 1 for i, d in enumerate(devices)}
    tid = {s: i + 1 for i, s in enumerate(streams)}
    out: list[dict] = []
    for d, p in pid.items():
        out.append(dict(ph="M", name="process_name", pid=p, tid=0, args=dict(name=f"harmony {d}")))
        for s, t in tid.items():
            out.append(dict(ph="M", name="thread_name", pid=p, tid=t, args=dict(name=s)))
            out.append(dict(ph="M", name="thread_sort_index", pid=p, tid=t, args=dict(sort_index=t)))
    for e in events:
        p = pid[str(_get(e, "device", "device"))]
        start, end = float(_get(e, "start", 0.0)), float(_get(e, "end", 0.0))
        live, peak = int(_get(e, "live_bytes", 0) or 0), int(_get(e, "peak_bytes", 0) or 0)
        out.append(dict(ph="X", name=str(_get(e, "name", "op")), cat=str(_get(e, "kind", "op")), pid=p,
                        tid=tid[str(_get(e, "stream", "compute"))], ts=start * 1e6,
                        dur=max(0.0, end - start) * 1e6, args=dict(live_bytes=live, peak_bytes=peak)))
        out.append(dict(ph="C", name="device bytes", pid=p, tid=0, ts=end * 1e6, args=dict(live=live)))
    return out


def chrome_trace(events, path) -> Path:
    """Write ``events`` to ``path`` as Chrome trace JSON; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(traceEvents=trace_events(events), displayTimeUnit="ms")))
    return path


# -- memory over time, as an SVG line plot (no plotting library) --------------------------------
def memory_points(sim_or_events) -> list[tuple[float, int]]:
    """(seconds, device bytes) in time order: a ``Simulation``'s ``memory``, or from trace events.

    From events (measured or simulated alike): the op's peak bytes from its start to its
    end, then its live bytes until the next op.
    """
    memory = getattr(sim_or_events, "memory", None)
    if memory:
        return [(float(t), int(b)) for t, b in memory]
    events = sorted(getattr(sim_or_events, "events", sim_or_events), key=lambda e: float(_get(e, "start", 0.0)))
    points: list[tuple[float, int]] = []
    for e in events:
        start, end = float(_get(e, "start", 0.0)), float(_get(e, "end", 0.0))
        peak, live = int(_get(e, "peak_bytes", 0) or 0), int(_get(e, "live_bytes", 0) or 0)
        points += [(start, peak), (end, peak), (end, live)]
    return points


def memory_plot(sim_or_events, path, budget: int | None = None, title: str = "device memory") -> Path:
    """Write device bytes over time as an SVG step plot; returns the path.

    >>> memory_plot(sim, "memory.svg", budget=sm.runtime.meter.budget)   # or memory_plot(sm.runtime.events, ...)
    PosixPath('memory.svg')
    """
    from xml.sax.saxutils import escape

    points = memory_points(sim_or_events)
    if not any(b for _, b in points):
        raise ConfigError("no memory numbers to plot: run a step first, or simulate with "
                          "memory=memory_curve(program, graph)")
    w, h, left, right, top, bottom = 720, 360, 90, 20, 34, 48
    t_max = max(t for t, _ in points) or 1.0
    b_max = max(max(b for _, b in points), budget or 0) * 1.05

    def x(t):
        return left + (w - left - right) * t / t_max

    def y(b):
        return h - bottom - (h - top - bottom) * b / b_max

    steps, t_prev, b_prev = [], 0.0, None
    for t, b in points:            # horizontal to the next time, then vertical to the next value
        t = max(t, t_prev)         # overlapping copies may end after the next op starts
        if b_prev is not None:
            steps.append((t, b_prev))
        steps.append((t, b))
        t_prev, b_prev = t, b
    unit = (1e-3, "ms") if t_max < 1 else (1.0, "s")
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
           f'font-size="11">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>',
           f'<line x1="{left}" y1="{y(0)}" x2="{w - right}" y2="{y(0)}" stroke="black"/>',
           f'<line x1="{left}" y1="{y(0)}" x2="{left}" y2="{top}" stroke="black"/>']
    for k in range(5):
        t, b = t_max * k / 4, b_max / 1.05 * k / 4
        svg.append(f'<line x1="{x(t):.1f}" y1="{y(0)}" x2="{x(t):.1f}" y2="{y(0) + 4}" stroke="black"/>')
        svg.append(f'<text x="{x(t):.1f}" y="{y(0) + 16}" text-anchor="middle">{t / unit[0]:.3g}</text>')
        svg.append(f'<line x1="{left - 4}" y1="{y(b):.1f}" x2="{w - right}" y2="{y(b):.1f}" stroke="#ddd"/>')
        svg.append(f'<text x="{left - 6}" y="{y(b) + 4:.1f}" text-anchor="end">{fmt_bytes(b)}</text>')
    svg.append(f'<text x="{(left + w - right) / 2}" y="{h - 10}" text-anchor="middle">time ({unit[1]})</text>')
    svg.append(f'<text x="14" y="{(top + h - bottom) / 2}" text-anchor="middle" '
               f'transform="rotate(-90 14 {(top + h - bottom) / 2})">device bytes</text>')
    if budget:
        svg.append(f'<line x1="{left}" y1="{y(budget):.1f}" x2="{w - right}" y2="{y(budget):.1f}" '
                   f'stroke="#c00" stroke-dasharray="6 4"/>')
        svg.append(f'<text x="{w - right}" y="{y(budget) - 4:.1f}" text-anchor="end" fill="#c00">'
                   f'budget {fmt_bytes(budget)}</text>')
    svg.append('<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="'
               + " ".join(f"{x(t):.1f},{y(b):.1f}" for t, b in steps) + '"/>')
    svg.append("</svg>")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(svg) + "\n")
    return path
