"""The schedule as Python a person reads: each op named plainly, each line saying what it moves and the memory.

>>> print(sm.code)                     # doctest: +SKIP
def forward(self):
    load_batch = load_batch(0, ('idx',))                  # h2d 2.00 KiB · device 2.00 KiB live, 2.00 KiB peak
    swap_in = swap_in(0, 'params')                        # h2d 128.00 KiB · device 130.00 KiB live, ...
    wait = wait(swap_in);  swap_in = wait = None          # · device 130.00 KiB live, 130.00 KiB peak
    ...

The bytes are the memory model's (``compiler.verify.memory_curve``, the replay ``verify`` checks the budget with):
what each op copies between host and device, and the device's live bytes after it and its peak while it runs.
"""
from __future__ import annotations

import re

import torch.fx

from harmony.base.units import fmt_bytes
from harmony.compiler.verify import memory_curve

# fx's qualified names of the runtime's op stubs
_OP_PREFIX = re.compile(r"\bharmony_runtime_(?:ops|shard|partitioned|pipeline)_")


def plain(graph: torch.fx.Graph) -> str:
    """The graph's Python with the op stubs named as the op table names them (``swap_in``, not its module path)."""
    return _OP_PREFIX.sub("", graph.python_code("self").src).strip("\n") + "\n"


def schedule_code(program, graph: torch.fx.Graph | None = None, memory: bool = True) -> str:
    """``graph`` (default the program's schedule) as Python; with ``memory`` and a plan whose residency is complete
    (after the swap pass), every op's line ends with the bytes it moves and the device's live and peak bytes."""
    graph = graph if graph is not None else program.schedule
    if graph is None:
        return ""
    src = plain(graph)
    if not memory or "residency" not in program.capabilities:
        return src
    curve = memory_curve(program, graph, check_residency=False)
    notes = {}
    for node, (h2d, d2h), live, peak in zip(curve.nodes, curve.moves, curve.after, curve.peak_at):
        moved = " ".join(f"{way} {fmt_bytes(b)}" for way, b in (("h2d", h2d), ("d2h", d2h)) if b)
        notes[node.name] = f"# {moved + ' · ' if moved else ''}device {fmt_bytes(live)} live, {fmt_bytes(peak)} peak"
    lines = []
    width = min(COMMENT_COLUMN, max((len(line) for line in src.splitlines()
                                     if line.strip().split(" = ")[0] in notes), default=0))
    for line in src.strip("\n").splitlines():
        name = line.strip().split(" = ")[0]
        lines.append(f"{line:<{width}}  {notes[name]}" if name in notes and " = " in line else line)
    budget = program.config.memory_budget
    head = (f"# budget {fmt_bytes(budget)}; predicted peak {fmt_bytes(curve.peak)}; moved per step h2d "
            f"{fmt_bytes(curve.moved.get('h2d', 0))}, d2h {fmt_bytes(curve.moved.get('d2h', 0))}")
    return head + "\n" + "\n".join(lines) + "\n"


COMMENT_COLUMN = 72    # comments line up here; a longer line takes its comment two spaces after it
