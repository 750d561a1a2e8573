"""DOT drawings of the model graph (coloured by pack) and of the schedule graph (coloured by op).

>>> src = model_dot(sm)                    # DOT source, a str
>>> render(src, "out/gpt_model")           # out/gpt_model.svg, or out/gpt_model.dot without graphviz
PosixPath('out/gpt_model.svg')
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import graphviz
import torch

from harmony.base.units import fmt_bytes
from harmony.compiler.meta import COST, MODULE_PATH, PACK
from harmony.runtime.ops import op_named, op_of

# ColorBrewer Set3: light qualitative colours, so black labels stay readable; cycles past 12 packs
PALETTE = ("#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462",
           "#b3de69", "#fccde5", "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f")

KIND_COLOURS = {"compute": "#c6dbef", "copy": "#fdd0a2", "sync": "#d9d9d9"}

BIG_SCHEDULE = 400      # above this many ops, labels shrink to one line and edges go straight
_SMALL = dict(shape="ellipse", style="filled", fillcolor="white", fontsize="8", width="0.3", height="0.2",
              margin="0.02")


def pack_colour(index: int) -> str:
    return PALETTE[index % len(PALETTE)]


def op_colour(name: str) -> str:
    """An op's fill: its table entry's colour, else its kind's (runtime/ops/)."""
    op = op_named(name)
    if op is None:
        return "white"
    return op.colour or KIND_COLOURS.get(op.kind, "white")


def _text(*lines: str) -> str:
    """A DOT label or tooltip of ``lines``: backslashes kept literal, lines joined by DOT's newline."""
    return "\\n".join(str(line).replace("\\", "\\\\") for line in lines)


def _id(prefix: str, node: torch.fx.Node) -> str:
    return f"{prefix}_{node.name}"      # a prefix keeps fx names that are DOT keywords ("graph") legal


# -- the model graph -----------------------------------------------------------------------------
def model_dot(sm) -> str:
    """DOT source of the model graph: one box per compute node, filled and clustered by pack.

    A box reads: node name, the user's module path, the output's shape and bytes at the
    compiled microbatch size. Each cluster is titled with its pack's name and parameter MiB.
    """
    program = sm.program
    b = program.config.microbatch_size
    packs = program.plan.packs if program.plan is not None else []
    vals = getattr(program.fake, "vals", {}) or {}
    g = graphviz.Digraph("model", graph_attr=dict(rankdir="TB", fontname="Helvetica", fontsize="11",
                                                   label=f"{type(program.model).__name__}: model graph, "
                                                         f"{len(packs)} packs, microbatch {b}",
                                                   labelloc="t", nodesep="0.2", ranksep="0.3"),
                         node_attr=dict(shape="box", style="filled,rounded", fontname="Helvetica", fontsize="9",
                                        margin="0.08,0.03"),
                         edge_attr=dict(arrowsize="0.6", color="#555555"))
    clusters: dict[int, graphviz.Digraph] = {}
    for spec in packs:
        clusters[spec.index] = graphviz.Digraph(
            f"cluster_pack{spec.index}",
            graph_attr=dict(label=_text(f"pack {spec.index}: {spec.name}",
                                        f"{spec.param_bytes / 2**20:.2f} MiB params"),
                            style="rounded,dashed", color="#666666", fontsize="10", labeljust="l"))
    for node in program.gm.graph.nodes:
        pack = node.meta.get(PACK)
        target = clusters.get(pack, g)
        if node.op in ("placeholder", "output", "get_attr"):
            target.node(_id("n", node), _text(node.name), tooltip=_tooltip(node), **_SMALL)
            continue
        target.node(_id("n", node), _model_label(node, vals.get(node), b),
                    fillcolor=pack_colour(pack) if pack is not None else "white",
                    tooltip=_tooltip(node))
    for c in clusters.values():
        g.subgraph(c)
    for node in program.gm.graph.nodes:
        for inp in node.all_input_nodes:
            g.edge(_id("n", inp), _id("n", node))
    return g.source


def _model_label(node: torch.fx.Node, val, b: int) -> str:
    lines = [node.name]
    path = node.meta.get(MODULE_PATH, "")
    if path and path.replace(".", "_") != node.name:
        lines.append(path)
    out = []
    shape = _shape(val if val is not None else node.meta.get("val", node.meta.get("tensor_meta")))
    if shape:
        out.append(shape)
    cost = node.meta.get(COST)
    if cost is not None and cost.out_bytes.at(b):
        out.append(fmt_bytes(cost.out_bytes.at(b)))
    if out:
        lines.append(" ".join(out))
    return _text(*lines)


def _tooltip(node: torch.fx.Node) -> str:
    return _text(node.format_node() or node.name)


def _shape(val) -> str:
    """``[2, 32, 64] f32`` for a tensor (or anything with shape and dtype); the first of a tuple."""
    if isinstance(val, (tuple, list)):
        val = next((v for v in val if hasattr(v, "shape")), None)
    shape, dtype = getattr(val, "shape", None), getattr(val, "dtype", None)
    if shape is None:
        return ""
    try:
        dims = ", ".join(str(int(d)) for d in shape)
    except (TypeError, ValueError):     # symbolic sizes
        dims = ", ".join(str(d) for d in shape)
    short = str(dtype).replace("torch.", "").replace("float", "f").replace("bfloat", "bf").replace("int", "i")
    return f"[{dims}] {short}" if dtype is not None else f"[{dims}]"


# -- the schedule graph --------------------------------------------------------------------------
def schedule_dot(sm) -> str:
    """DOT source of the schedule graph: one box per op coloured by op name, edges from data flow.

    Labels read ``forward`` / ``pack 1 · mb 3``. An op no value leads to (``swap_in``,
    ``load_batch``, ``release``, ``step``) hangs by a dotted line from the op before it in
    program order, so the drawing shows when it runs. Schedules above ``BIG_SCHEDULE`` ops get
    one-line labels and straight edges so ``dot`` still lays them out in reasonable time.
    """
    graph = sm.program.schedule
    nodes = [n for n in graph.nodes if n.op == "call_function"] if graph is not None else []
    big = len(nodes) > BIG_SCHEDULE
    attrs = dict(rankdir="TB", fontname="Helvetica", fontsize="11", labelloc="t", nodesep="0.15", ranksep="0.25",
                 label=f"schedule: {len(nodes)} ops, policy {sm.program.config.policy}")
    if big:
        attrs.update(splines="line", nslimit="2", mclimit="0.5")
    g = graphviz.Digraph("schedule", graph_attr=attrs,
                         node_attr=dict(shape="box", style="filled,rounded", fontname="Helvetica",
                                        fontsize="8" if big else "9", margin="0.06,0.02"),
                         edge_attr=dict(arrowsize="0.5", color="#555555"))
    used = []
    for node in nodes:
        name = node.target.__name__
        used.append(name)
        lines = _op_label(node)
        g.node(_id("s", node), _text(" ".join(lines)) if big else _text(*lines), fillcolor=op_colour(name),
               tooltip=_tooltip(node))
    shown = set(nodes)
    for prev, node in zip([None] + nodes, nodes):
        inputs = [inp for inp in node.all_input_nodes if inp in shown]
        for inp in inputs:
            g.edge(_id("s", inp), _id("s", node))
        if not inputs and prev is not None:   # an op no value leads to: dotted, after the op before it
            g.edge(_id("s", prev), _id("s", node), style="dotted", color="#aaaaaa", arrowhead="none")
    if used:
        g.node("legend", _legend(list(dict.fromkeys(used))), shape="plaintext", style="", fontsize="8")
    return g.source


def _op_label(node: torch.fx.Node) -> list[str]:
    """``op`` on the first line; on the second, its arguments as its table entry words them (pack, microbatch,
    what)."""
    detail = op_of(node).label(node.args, node.kwargs)
    return [node.target.__name__, detail] if detail else [node.target.__name__]


def _legend(names: list[str]) -> str:
    cells = "".join(f'<TD BGCOLOR="{op_colour(n)}">{n}</TD>' for n in names)
    return f'<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="2"><TR>{cells}</TR></TABLE>>'


# -- rendering -----------------------------------------------------------------------------------
def dot_available() -> bool:
    return shutil.which("dot") is not None


def render(dot_source: str, path, *, fmt: str = "svg", quiet: bool = False) -> Path:
    """Write ``dot_source`` as ``path.svg`` with graphviz's ``dot``, or as ``path.dot`` without it.

    Without ``dot`` it prints one line to stderr saying how to get the SVG (``quiet`` leaves
    that to the caller, as ``draw`` does to print one line for several files).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    source = path.with_name(f"{path.name}.dot")
    if not dot_available():
        source.write_text(dot_source)
        if not quiet:
            print(missing_dot_hint([source]), file=sys.stderr)
        return source
    out = path.with_name(f"{path.name}.{fmt}")
    try:
        out.write_bytes(graphviz.Source(dot_source).pipe(format=fmt))
        return out
    except (graphviz.ExecutableNotFound, subprocess.CalledProcessError) as e:
        source.write_text(dot_source)
        why = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        print(f"graphviz 'dot' failed on {source} ({why}); the DOT source is there", file=sys.stderr)
        return source


def missing_dot_hint(paths) -> str:
    return (f"graphviz 'dot' not found: wrote {', '.join(str(p) for p in paths)}; "
            "install it (apt-get install graphviz) to get SVG")
