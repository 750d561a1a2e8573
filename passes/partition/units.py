"""A unit of the partition: the smallest run of model-graph nodes a pack boundary may not cut (a layer), and how
the graph is cut into them (``find_units``: at its narrowest gaps, never inside a list of tensors on its way to a
reader)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from harmony.compiler.ir import Program
from harmony.compiler.meta import COST, STATE


@dataclass
class Unit:
    nodes: list
    params: frozenset        # trainable state names
    buffers: frozenset
    fwd_flops: float
    bwd_flops: float
    kept: float              # activation bytes kept for backward, one microbatch
    peak: float              # transient bytes of its forward, one microbatch
    bwd: float               # transient bytes of its backward, one microbatch
    cross_in: float          # activation bytes entering it


COMPUTE_OPS = ("call_function", "call_method", "call_module")


def compute_nodes(gm) -> list:
    return [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]


def storage_root(node):
    """The node whose output owns the storage this node's output lives in (itself unless a view)."""
    while node.op in COMPUTE_OPS and node.meta[COST].alias_of is not None:
        node = node.all_input_nodes[node.meta[COST].alias_of]
    return node


def _crossing(nodes, b) -> tuple[list[float], list[int]]:
    """Bytes and number of tensors crossing each gap (gap g sits before nodes[g]); a view keeps its base alive."""
    index = {n: i for i, n in enumerate(nodes)}
    last_use = {}
    for i, n in enumerate(nodes):
        root = storage_root(n)
        for u in n.users:
            last_use[root] = max(last_use.get(root, i), index.get(u, len(nodes)))
    diff = [0.0] * (len(nodes) + 2)
    count = [0] * (len(nodes) + 2)
    for i, n in enumerate(nodes):
        last = last_use.get(n, i)
        size = n.meta[COST].out_bytes.at(b)
        if last > i and size > 0:   # live across every gap g with i < g <= last
            diff[i + 1] += size
            diff[last + 1] -= size
            count[i + 1] += 1
            count[last + 1] -= 1
    out, num, acc, k = [], [], 0.0, 0
    for g in range(len(nodes)):
        acc += diff[g]
        k += count[g]
        out.append(acc)
        num.append(k)
    return out, num


def find_units(program: Program) -> list[Unit]:
    """Layers: the runs of nodes between the narrowest gaps of the graph.

    A gap is narrow when the fewest tensors cross it (between two layers of an MLP or
    CNN one activation crosses, inside a block several do), or when the bytes crossing
    it are within 1.5x of the least (between transformer blocks the hidden state and
    a mask cross, while the fewest tensors cross where the position ids are made);
    crossings under a quarter of the median (index tensors) do not set the least.
    """
    gm, b = program.gm, program.config.microbatch_size
    nodes = compute_nodes(gm)
    cross, count = _crossing(nodes, b)
    fewest = min((c for c in count[1:] if c > 0), default=0)
    positive = sorted(c for c in cross[1:] if c > 0)
    median = positive[len(positive) // 2] if positive else 0.0
    least = min((c for c in positive if c >= 0.25 * median), default=0.0)   # ignore tiny index tensors
    closed = _inside_lists(program, nodes)
    cuts = [0] + [g for g in range(1, len(nodes)) if (count[g] <= fewest or cross[g] <= 1.5 * least)
                  and g not in closed] + [len(nodes)]
    names = dict(program.gm.named_parameters())
    units = []
    for s, e in zip(cuts, cuts[1:]):
        if e > s:
            units.append(_summarise(nodes[s:e], cross[s], names, b))
    return units


def _inside_lists(program: Program, nodes) -> set[int]:
    """The gaps no pack may start at: those a list of floating tensors (a ``chunk``'s, a ``split``'s) crosses on
    its way to a reader. A pack's inputs carry gradients back as tensors only: cut there, the later pack would read
    the list with its gradients going nowhere, and the earlier pack's parameters would train on part of theirs."""
    index = {n: i for i, n in enumerate(nodes)}
    closed: set[int] = set()
    for i, n in enumerate(nodes):
        v = program.fake.vals.get(n)
        if type(v) in (list, tuple) and any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in v):
            last = max((index.get(u, len(nodes)) for u in n.users), default=i)
            closed.update(range(i + 1, min(last, len(nodes) - 1) + 1))
    return closed


def state_of(node):
    names = set(node.meta.get(STATE, ()))
    for a in node.all_input_nodes:
        if a.op == "get_attr":
            names |= set(a.meta.get(STATE, ()))
    return names


def _summarise(nodes, cross_in, trainable, b) -> Unit:
    inside = set(nodes)
    state = set().union(*(state_of(n) for n in nodes))
    params = frozenset(s for s in state if s in trainable and trainable[s].requires_grad)
    kept = live = peak = bwd = 0.0
    saved_by_user = set()
    for n in nodes:
        c = n.meta[COST]
        kept += c.saved_bytes.at(b)
        for i in c.saved_inputs:
            a = n.all_input_nodes[i]
            if a in inside and a not in saved_by_user and not a.meta[COST].saves_output:
                saved_by_user.add(a)
                kept += a.meta[COST].out_bytes.at(b)
    remaining = {n: sum(1 for u in n.users) for n in nodes}
    for n in nodes:
        c = n.meta[COST]
        live += c.out_bytes.at(b)
        peak = max(peak, live + c.fwd_extra.at(b))
        bwd = max(bwd, c.bwd_peak.at(b))
        for a in n.all_input_nodes:
            if a in remaining:
                remaining[a] -= 1
                if remaining[a] == 0 and a not in saved_by_user:
                    live -= a.meta[COST].out_bytes.at(b)
    return Unit(nodes, params, frozenset(state - params),
                sum(n.meta[COST].fwd_flops.at(b) for n in nodes),
                sum(n.meta[COST].bwd_flops.at(b) for n in nodes), kept, peak, bwd, cross_in)
