"""compiler/ir.py: the schedule's graph copies and inserted nodes are made without Graph.create_node's argument scan
(``add_node``); what they make must be what create_node makes, on this torch and any other."""
from __future__ import annotations

import torch
import torch.fx

import harmony
from harmony.compiler import ir
from harmony.runtime import ops


def _shape(graph: torch.fx.Graph) -> list:
    """Everything a pass or the runtime reads of a graph: each node's name, op, target, arguments, users, meta."""
    return [(n.name, n.op, n.target, str(n.args), str(n.kwargs), type(n.kwargs).__name__,
             sorted(u.name for u in n.users), sorted(a.name for a in n.all_input_nodes), n.meta) for n in graph.nodes]


def _schedule():
    from models import CASES, training_state_bytes
    model, data = CASES["gpt"]()
    sm = harmony.compile(model, data[0], memory_budget=int(training_state_bytes(model) * 0.4), microbatches=2)
    graph = sm.program.schedule
    sm.close()
    return graph


def _made(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of ``graph``, a stash inserted after its first op, a node named like a builtin, and an unstash."""
    g = ir.copy_graph(graph)
    first = next(n for n in g.nodes if n.op == "call_function")
    with g.inserting_after(first):
        s = ir.add_call(g, ops.stash, (first,))
    with g.inserting_after(s):
        ir.add_node(g, "call_function", ops.unstash, (s,), {"late": True}, name="input")
    g.lint()
    return g


def test_schedule_copies_and_inserts_are_what_create_node_makes(monkeypatch):
    graph = _schedule()
    fast = _made(graph)
    monkeypatch.setattr(ir, "_FAST", False)       # torch's own create_node
    slow = _made(graph)
    assert _shape(fast) == _shape(slow)
    assert fast.python_code("self").src == slow.python_code("self").src
    for target in (ops.stash, ops.unstash, ops.forward):     # fx's lookup table knows the nodes
        assert [n.name for n in fast.find_nodes(op="call_function", target=target)] == \
            [n.name for n in slow.find_nodes(op="call_function", target=target)]
    assert len(fast.nodes) == len(slow.nodes) == len(list(fast.nodes))     # fx counts what it holds
    assert [n.name for n in ir.copy_graph(graph).nodes] == [n.name for n in graph.nodes]
    # each copy's meta is its own dict, equal to the original's: a pass that edits it leaves the original alone
    assert all(a.meta == b.meta and a.meta is not b.meta for a, b in zip(graph.nodes, ir.copy_graph(graph).nodes))
    # the namespaces agree: a later insert of the same target takes the same next free name in both
    monkeypatch.setattr(ir, "_FAST", True)
    added = [ir.add_call(g, ops.stash, (next(n for n in g.nodes if n.op == "call_function"),)).name
             for g in (fast, slow)]
    assert added[0] == added[1]
