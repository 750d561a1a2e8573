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
