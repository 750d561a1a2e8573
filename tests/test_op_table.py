"""An op is one table entry (runtime/ops.py): registering one is all the verifier, simulator and drawings need."""
from __future__ import annotations

import pytest
import torch

import harmony
from harmony.compiler.ir import copy_graph
from harmony.compiler.verify import memory_curve
from harmony.models import GPT, GPTConfig, copy_task
from harmony.runtime import ops
from harmony.runtime.simulate import simulate
from harmony.viz import dot


def checksum(pack: int): ...        # a new op: reads its pack's weights on the device, one second of compute


@pytest.fixture
def checksum_op():
    op = ops.register(checksum, execute=lambda rt, pack: None, effect=lambda m, pack: (None, 0),
                      cost=lambda plan, hw, pack: ("compute", 1.0), kind="compute",
                      needs=lambda kw: ("params",), colour="#123456", label=lambda args, kw: f"pack {args[0]} sum")
    try:
        yield op
    finally:
        ops.OPS.pop(checksum)


@pytest.fixture(scope="module")
def compiled():
    torch.manual_seed(0)
    c = GPTConfig(layers=2, width=64)
    model = GPT(c)
    x, y = next(copy_task(c, 8, 1))
    sm = harmony.compile(model, (x, y), memory_budget=int(16 * c.n_params() * 0.8), microbatches=4)
    yield sm
    sm.close()


def _with_checksum(graph, before: str, after: bool):
    """The schedule with a ``checksum`` of the pack of the first ``before`` op, just before or after it."""
    g = copy_graph(graph)
    node = next(n for n in g.nodes if n.op == "call_function" and n.target.__name__ == before)
    with (g.inserting_after(node) if after else g.inserting_before(node)):
        new = g.call_function(checksum, (node.args[0],))
    return g, new


def test_a_registered_op_is_verified_simulated_and_drawn(compiled, checksum_op):
    sm = compiled
    # right after a forward its pack's weights are on the device: nothing missing; before the first swap_in they
    # are not, and the verifier says so for the new op, from its entry's ``needs`` alone
    fine, node = _with_checksum(sm.graph, "forward", after=True)
    assert not [m for m in memory_curve(sm.program, fine).missing if m[0] is node]
    early, node = _with_checksum(sm.graph, "swap_in", after=False)
    early_missing = [m for m in memory_curve(sm.program, early).missing if m[0] is node]
    assert early_missing and all(kind == "params" for _, kind, _ in early_missing)
    # the simulator runs it on the stream its cost names, for its seconds
    hw = harmony.Hardware.preset("a100-40gb")
    base = simulate(sm.graph, sm.plan, hw)
    sim = simulate(fine, sm.plan, hw)
    ev = next(e for e in sim.events if e.name == node.name or e.name.startswith("checksum"))
    assert ev.stream == "compute" and ev.end - ev.start == pytest.approx(1.0)
    assert sim.busy["compute"] == pytest.approx(base.busy["compute"] + 1.0) and sim.step_seconds >= 1.0
    # drawings take its colour and label from the entry
    sm.program.schedule, saved = fine, sm.program.schedule
    try:
        src = dot.schedule_dot(sm)
    finally:
        sm.program.schedule = saved
    assert "#123456" in src and "sum" in src and dot.op_colour("checksum") == "#123456"


def test_every_op_knows_what_it_needs_and_how_it_is_drawn():
    names = {op.name for op in ops.OPS.values()}
    assert {"swap_in", "release", "forward", "backward", "step", "allreduce", "sync_state"} <= names
    step = ops.OPS[ops.step]
    assert step.needs({}) == ("params", "grads", "optim")
    assert step.needs({"stream": True}) == ("params", "grads")      # it streams the optimizer state itself
    assert step.needs({"where": "host"}) == ()                         # the host copies are stepped
    assert all(op.colour for op in ops.OPS.values())
    assert {op.name for op in ops.OPS.values() if op.state_copy} == {"swap_in", "release"}
