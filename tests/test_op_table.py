"""An op is one table entry (runtime/ops/): registering one is all the verifier, simulator and drawings need."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.fx

import harmony
from harmony.compiler.hardware import Device, Hardware
from harmony.compiler.ir import copy_graph
from harmony.compiler.verify import memory_curve
from harmony.models import GPT, GPTConfig, copy_task
from harmony.runtime import ops
from harmony.runtime.plan import PackSpec, Plan
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


# -- what an op does, as the simulator times it: read from its entry, never from its name ------------------------
G = 10**9
UNIT = Device(name="unit", memory=100 * G, peak_flops={"fp32": 1e9}, h2d_bandwidth=1e9, d2h_bandwidth=1e9,
              memory_bandwidth=8e9)        # a device step of a 1e9-byte pack: 4 * 2e9 / 8e9 = 1 s
HOST = Hardware((UNIT,), host_memory_bandwidth=8e9)


def fetch(pack: int, what: str): ...     # a new op bringing a pack's state in, one second on the h2d engine
def update(pack: int): ...               # a new optimizer step on the host copies, one second


@contextlib.contextmanager
def toy_ops(declared: bool):
    """``fetch`` and ``update`` in the table; ``declared``: as a fetch on the copy thread and a step, else as plain
    ops on the same streams for the same seconds."""
    def hold(m, pack, what):
        m.hold(what, ops.moving_names(m.plan.packs[pack], what))
        return None, 0
    ops.register(fetch, execute=lambda rt, pack, what: None, effect=hold,
                 cost=lambda plan, hw, pack, what: ("h2d", 1.0), kind="copy", fetches=declared, copy_thread=declared)
    ops.register(update, execute=lambda rt, pack: None, effect=lambda m, pack: (None, 0),
                 cost=lambda plan, hw, pack: ("host", 1.0), kind="compute", steps=declared)
    try:
        yield
    finally:
        ops.OPS.pop(fetch)
        ops.OPS.pop(update)


def _plan(n: int) -> Plan:
    packs = [PackSpec(index=i, name=f"p{i}", module=None, inputs=[], outputs=[], params=[f"w{i}"], buffers=[],
                      owned=[f"w{i}"], mutated=[], random=False, param_bytes=G, out_bytes=0, fwd_flops=G,
                      bwd_flops=G) for i in range(n)]
    return Plan(packs=packs, microbatches=1, microbatch_size=1, input_names=["x"], batch_bytes={})


class Ref(int):
    """An argument that is the value of the ``int``-th call before."""


def _spans(calls, hw, n_packs=2):
    """(stream, start, end) of each of ``calls`` (function, args, kwargs), simulated as a schedule on ``hw``."""
    g = torch.fx.Graph()
    env = []
    for fn, args, kwargs in calls:
        env.append(g.call_function(fn, tuple(env[a] if isinstance(a, Ref) else a for a in args), kwargs))
    g.output(None)
    return [(e.stream, e.start, e.end) for e in simulate(g, _plan(n_packs), hw).events]


@pytest.mark.parametrize("declared", [True, False])
def test_a_new_fetch_waits_for_the_write_back_of_its_state_by_its_entry(declared):
    calls = [(ops.swap_in, (0, "params"), {}), (ops.wait, (Ref(0),), {}),
             (ops.step, (0,), {}),                  # 1..2 on compute: the weights change
             (ops.release, (0, "params"), {}),      # 2..3 on d2h: written back
             (fetch, (0, "params"), {})]            # a fetch reads what the release wrote: 3..4, not 1..2
    with toy_ops(declared):
        spans = _spans(calls, UNIT)
    assert spans[3] == ("d2h", 2.0, 3.0)
    assert spans[4] == (("h2d", 3.0, 4.0) if declared else ("h2d", 1.0, 2.0))


@pytest.mark.parametrize("declared", [True, False])
def test_a_new_fetch_of_weights_a_host_step_updates_stalls_the_issuing_thread_by_its_entry(declared):
    calls = [(ops.swap_in, (0, "grads"), {}),       # nothing to fetch yet
             (ops.backward, (0, 0), {}),            # 0..2
             (ops.release, (0, "grads"), {}),       # 2..3 on d2h
             (ops.step, (0,), {"where": "host"}),   # 4 * 2e9 / 8e9: 3..4 on the host, after the write-back
             (ops.forward, (1, 0), {}),             # 2..3 beside it
             (fetch, (0, "params"), {}),            # the updated weights: the compute stream stalls to 4
             (ops.forward, (1, 1), {})]
    with toy_ops(declared):
        spans = _spans(calls, HOST)
    assert spans[3] == ("host", 3.0, 4.0)
    if declared:
        assert spans[5:] == [("h2d", 4.0, 5.0), ("compute", 4.0, 5.0)]
    else:
        assert spans[5:] == [("h2d", 0.0, 1.0), ("compute", 3.0, 4.0)]


@pytest.mark.parametrize("declared", [True, False])
def test_a_new_step_on_the_host_follows_the_write_back_and_the_next_swap_in_waits_for_it(declared):
    calls = [(ops.swap_in, (0, "grads"), {}),
             (ops.backward, (0, 0), {}),            # 0..2
             (ops.release, (0, "grads"), {}),       # 2..3 on d2h
             (update, (0,), {}),                    # a step: after the write-back, 3..4 on the host
             (ops.swap_in, (0, "params"), {})]      # waits for the update: 4..5
    with toy_ops(declared):
        spans = _spans(calls, HOST)
    if declared:
        assert spans[3:] == [("host", 3.0, 4.0), ("h2d", 4.0, 5.0)]
    else:
        assert spans[3:] == [("host", 0.0, 1.0), ("h2d", 0.0, 1.0)]


@pytest.mark.parametrize("declared", [True, False])
def test_a_new_copy_on_the_copy_thread_leaves_compute_going_where_copies_block(declared):
    calls = [(fetch, (1, "params"), {}),            # 0..1 on h2d
             (ops.forward, (0, 0), {})]             # on the copy thread: 0..1 beside it; else after it, 1..2
    with toy_ops(declared):
        spans = _spans(calls, UNIT.replace(sync_copies=True))
    assert spans == [("h2d", 0.0, 1.0), ("compute", 0.0, 1.0) if declared else ("compute", 1.0, 2.0)]


def test_what_each_op_does_is_declared_in_its_entry():
    def named(field):
        return {op.name for op in ops.OPS.values() if getattr(op, field)}
    assert named("fetches") == {"swap_in", "gather"} and named("steps") == {"step"}
    assert named("releases") == {"release"} and named("copy_thread") == {"swap_in", "gather", "unstash"}
    assert named("reduces") == {"allreduce", "allreduce_tied", "reduce_scatter"}
    assert named("partitioned") == {"gather", "reduce_scatter"}
    assert named("runs_forward") == {"forward"} and named("runs_backward") == {"backward"}
    assert named("sends") == {"send"} and named("receives") == {"recv"}
    assert named("stashes") == {"stash"} and named("unstashes") == {"unstash"} and named("joins") == {"wait"}
    assert named("disk_read_ahead") == {"step", "gather"} and named("loads_batch") == {"load_batch"}


def test_op_named_finds_each_registered_op_and_none_taken_out():
    assert ops.op_named("forward") is ops.OPS[ops.forward] and ops.op_named("no_such_op") is None

    def toy_named(pack: int): ...
    op = ops.register(toy_named, execute=lambda rt, pack: None, effect=lambda memory, pack: (None, 0),
                      cost=lambda plan, hw, pack: ("compute", 0.0), kind="compute")
    try:
        assert ops.op_named("toy_named") is op
    finally:
        ops.OPS.pop(toy_named)
    assert ops.op_named("toy_named") is None
