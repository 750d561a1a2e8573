"""A kept forward's graph on the host until its backward (the swap pass's ``Choice.offloaded``): the forward's saved
tensors go out after it (``stash`` of a kept forward), come back before its backward (``unstash``, hoisted by the
prefetch pass over one forward or backward where the budget has room), and the backward runs on them instead of
recomputing the forward. It saves the recompute for two copies, and holds only the pack's inputs and outputs on the
device meanwhile."""
import copy

import pytest
import torch

import harmony
from harmony.compiler.hardware import Hardware
from harmony.compiler.passmanager import DEFAULT_PIPELINE
from harmony.models import GPT, GPTConfig
from harmony.runtime.tiers.state import CopyEngine
from models import CASES, eager_accumulate, training_state_bytes


def handed(partition, swap) -> tuple:
    """The default passes, the partition and the swap pass handed their choices."""
    return tuple(("partition", partition) if p == "partition" else ("swap", swap) if p == "swap" else p
                 for p in DEFAULT_PIPELINE)


def bare(choice, packs, on_host):
    """``choice`` keeping nothing on the device but the graphs of ``packs``, those of ``on_host`` on the host."""
    return choice._replace(kept=frozenset(packs), offloaded=frozenset(on_host), resident=set(), held=frozenset(),
                           parts=frozenset(), steps=frozenset(), optim=frozenset(), device=frozenset(),
                           carried=frozenset())


def calls(sm, name):
    return [n for n in sm.graph.nodes if n.op == "call_function" and n.target.__name__ == name]


def trained(sm, model, reference, data, m):
    for x, y in data:
        sm(x, y)
    ref, _ = eager_accumulate(reference, data, m)
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name
    return max(e.peak_bytes for e in sm.runtime.events)


@pytest.mark.parametrize("case, policy", [("gpt", "harmony"), ("gpt", "sequential"), ("cnn", "harmony")])
def test_graphs_on_the_host_train_as_eager_within_the_predicted_peak(case, policy):
    """Every pack but the last keeps its graph on the host: bitwise as eager gradient accumulation (the batch norm
    CNN's running statistics advance once per microbatch, as no forward runs twice), the schedule reads as said
    above, and the measured peak is within the budget and the prediction, below the same graphs kept on the
    device."""
    model, data = CASES[case](**(dict(layers=8) if case == "gpt" else {}))
    m, budget = 4, int(training_state_bytes(model) * 0.5)
    kw = dict(memory_budget=budget, microbatches=m, policy=policy, optimizer_on="host")
    plain = harmony.compile(copy.deepcopy(model), example_batch=data[0], **kw)
    packs = range(len(plain.plan.packs) - 1)
    assert len(packs) >= 1
    ours, cuts = copy.deepcopy(model), plain.program.partition_choice
    sm = harmony.compile(ours, example_batch=data[0], **kw,
                         passes=handed(cuts, bare(plain.program.swap_choice, packs, packs)))
    graphs = [s for s in calls(sm, "stash") if s.args[0].target.__name__ == "forward" and s.args[0].kwargs.get("keep")]
    assert len(graphs) == len(packs) * m
    order = {n: i for i, n in enumerate(sm.graph.nodes)}
    for s in graphs:
        (un,) = [u for u in s.users if u.target.__name__ == "unstash"]
        (back,) = [u for u in un.users if u.target.__name__ == "backward"]
        assert back.kwargs["saved"] is un and back.args[:2] == s.args[0].args[:2]
        assert order[s.args[0]] < order[s] < order[un] < order[back]
        between = [n for n in sm.graph.nodes if order[un] < order[n] < order[back]
                   and n.op == "call_function" and n.target.__name__ in ("forward", "backward")]
        assert len(between) <= 1          # the prefetch pass hoists it over one at most
    assert all(b.kwargs.get("saved") is not None for b in calls(sm, "backward")), "no pack recomputes"
    peak = trained(sm, ours, model, data, m)
    assert peak <= budget and peak <= sm.predicted.peak * 1.1 and sm.predicted.peak <= peak * 1.25
    mine = copy.deepcopy(model)
    on_device = harmony.compile(mine, example_batch=data[0], **{**kw, "memory_budget": 4 * budget},
                                passes=handed(cuts, bare(plain.program.swap_choice, packs, ())))
    assert on_device.predicted.peak > sm.predicted.peak
    assert trained(on_device, mine, model, data, m) > peak
    for s in (plain, sm, on_device):
        s.close()


@pytest.fixture
def late(monkeypatch):
    monkeypatch.setattr(CopyEngine, "late_out", 0.002)


def test_the_planner_sends_graphs_to_the_host_where_that_beats_recompute(late):
    """Without a hardware description the swap pass prices a recompute at the default compute rate and a copy at the
    default link: a graph on the host that saves more recompute than its copies cost is taken where the device has
    no room for it (``recompute="auto"``), never under ``recompute="device"``. The copies out land late here
    (``CopyEngine.late_out``: the host copies are NaN until they do): the copies back wait for them."""
    model, data = CASES["gpt"](layers=8)
    kw = dict(memory_budget=int(training_state_bytes(model) * 0.5), microbatches=4)
    device = harmony.compile(copy.deepcopy(model), example_batch=data[0], recompute="device", **kw)
    assert not device.program.swap_choice.offloaded
    ours = copy.deepcopy(model)
    sm = harmony.compile(ours, example_batch=data[0], **kw)
    choice = sm.program.swap_choice
    assert choice.offloaded and choice.offloaded <= choice.kept
    assert len(choice.kept) > len(device.program.swap_choice.kept)
    assert "activations on the host (no recompute)" in sm.report()
    swap = next(r for r in sm.program.reports if r.title.startswith("swap"))
    assert swap.totals["graphs_on_host"] == len(choice.offloaded)
    peak = trained(sm, ours, model, data, 4)
    assert peak <= kw["memory_budget"]
    for s in (device, sm):
        s.close()


def meta_gpt(hw, per_param=8, **kw):
    c = GPTConfig(vocab=8192, seq=1024, layers=6, width=1024, heads=8, tie=False)
    with torch.device("meta"):
        model = GPT(c)
    x = torch.zeros(8, c.seq, dtype=torch.long, device="meta")
    return harmony.compile(model, (x, x), memory_budget=per_param * c.n_params(), microbatches=4, device="meta",
                           hardware=hw, **kw)


def test_the_simulator_costs_a_graph_on_the_host_as_its_two_copies_and_no_recompute():
    """On an H100 the graphs-first choice is also tried with graphs on the host, and the report says what each
    simulated at. A plan handed graphs on the host: each graph's stash runs on the d2h engine and its unstash on
    the h2d one, for the pack's saved bytes each way, and those packs' backwards cost no forward."""
    h100 = Hardware.preset("h100-sxm")
    hw = h100.replace(devices=(h100.devices[0].replace(queued=True, efficiency=0.9),))
    sm = meta_gpt(hw)
    assert "graphs first, on the host too" in " ".join(sm.report().split())
    packs = range(len(sm.plan.packs) - 1)
    cuts = sm.program.partition_choice
    recompute = meta_gpt(hw, 16, passes=handed(cuts, bare(sm.program.swap_choice, (), ())))
    host = meta_gpt(hw, 16, passes=handed(cuts, bare(sm.program.swap_choice, packs, packs)))
    dev = hw.devices[0]
    sims = {name: s.simulate(hw) for name, s in (("recompute", recompute), ("host", host))}
    events = {name: {e.name: e for e in sim.events} for name, sim in sims.items()}
    saved = 0
    for s in calls(host, "stash"):
        if not s.args[0].kwargs.get("keep"):
            continue
        spec = host.plan.packs[s.args[0].args[0]]
        (un,) = [u for u in s.users if u.target.__name__ == "unstash"]
        out, back = events["host"][s.name], events["host"][un.name]
        assert out.stream == "d2h" and back.stream == "h2d"
        assert out.end - out.start == pytest.approx(spec.saved_bytes / dev.d2h_bandwidth)
        assert back.end - back.start == pytest.approx(spec.saved_bytes / dev.h2d_bandwidth)
        saved += spec.saved_bytes
    assert saved and sims["host"].moved["d2h"] >= saved and sims["host"].moved["h2d"] >= saved
    backwards = {name: {(n.args[0], n.args[1]): events[name][n.name] for n in calls(s, "backward")}
                 for name, s in (("recompute", recompute), ("host", host))}
    for key, e in backwards["host"].items():
        if key[0] in packs:
            r = backwards["recompute"][key]
            assert e.end - e.start < r.end - r.start
    for s in (sm, recompute, host):
        s.close()


def test_compute_waits_for_copies_out_only_where_memory_says_so():
    """The ops reading a graph's stash (the next pack's forward) need the forward's outputs, which stay on the
    device, not the copy: without a memory curve they start before it lands. With one, a compute op waits while
    copies out in flight (device bytes the runtime holds until they land) would take it past the step's predicted
    peak, as the runtime's meter makes it; behind a d2h link slowed four times, that is what holds the step up."""
    h100 = Hardware.preset("h100-sxm")
    dev = h100.devices[0].replace(queued=True, efficiency=0.9)
    hw = h100.replace(devices=(dev.replace(d2h_bandwidth=dev.d2h_bandwidth / 4),))
    plain = meta_gpt(hw)
    packs = range(len(plain.plan.packs) - 1)
    sm = meta_gpt(hw, 16, passes=handed(plain.program.partition_choice,
                                        bare(plain.program.swap_choice, packs, packs)))
    from harmony.compiler.verify import state_sizes
    from harmony.runtime.simulate import simulate
    free = simulate(sm.graph, sm.plan, hw, sizes=state_sizes(sm.program))
    held = sm.simulate(hw)
    ends = {e.name: e for e in free.events}
    early = [u for s in calls(sm, "stash") if s.args[0].kwargs.get("keep")
             for u in s.users if u.target.__name__ != "unstash" and ends[u.name].start < ends[s.name].end]
    assert early, "no reader of a graph's stash started before its copy landed"
    curve, at = sm.predicted, {n.name: i for i, n in enumerate(sm.predicted.nodes)}

    def over(sim) -> list:      # compute ops that start with more in flight than their room under the peak
        copies = [e for e in sim.events if e.stream == "d2h" and e.end > e.start]
        return [e.name for e in sim.events if e.stream == "compute" and e.name in at and
                sum((c.end - c.start) * hw.devices[0].d2h_bandwidth for c in copies if c.start <= e.start < c.end)
                > curve.peak - curve.peak_at[at[e.name]] + 1]
    assert over(free) and not over(held)
    for s in (plain, sm):
        s.close()
