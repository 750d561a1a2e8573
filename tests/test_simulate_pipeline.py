"""The node simulator (runtime/simulate/node.py) and the planning-only path of a pipeline node
(driver/modes/pipeline_plan.py): one device is ``simulate``'s result exactly; a recv waits for its send; a shared
host link slows concurrent swaps; the planned ranks are what the stage pass gives real ranks; a row per device.
No processes are spawned: a real rank's compile runs here with its world given by hand.
"""
from __future__ import annotations

import json

import pytest
import torch

import harmony
import harmony.viz
from harmony.compiler.hardware import Hardware
from harmony.compiler.printer import schedule_code
from harmony.compiler.verify import state_sizes
from harmony.errors import ConfigError
from harmony.models import GPT, GPTConfig, copy_task
from harmony.driver.node import plan_node, simulate_programs
from harmony.runtime.simulate import simulate
from harmony.runtime.simulate.node import _Links, simulate_node
from harmony.viz.timeline import trace_events

CFG = GPTConfig(layers=4, width=128, heads=4, vocab=256, seq=64, tie=False)
BUDGET = 3 * 2**20           # about 60% of the GPT's training state: every rank swaps
MICROBATCHES = 4


def _model_and_batch():
    torch.manual_seed(0)
    return GPT(CFG), next(iter(copy_task(CFG, 8, 1, seed=0)))


def _node(world=2, changes=None):
    hw, changes = Hardware.node("4x1080ti"), changes or {}
    return hw.replace(devices=tuple(d.replace(**changes.get(i, {})) for i, d in enumerate(hw.devices[:world])),
                      switches=((tuple(range(world)),) if world > 1 else ()))


@pytest.fixture(scope="module")
def one():
    model, batch = _model_and_batch()
    sm = harmony.compile(model, batch, memory_budget=BUDGET, microbatches=MICROBATCHES)
    yield sm
    sm.close()


@pytest.fixture(scope="module")
def planned():
    model, batch = _model_and_batch()
    return plan_node(model, batch, _node(), memory_budget=BUDGET, microbatches=MICROBATCHES, device="cpu")


def _times(sim):
    return [(e.name, e.stream, e.start, e.end) for e in sim.events]


def test_one_device_is_the_single_device_simulation(one):
    hw = Hardware.node("4x1080ti")           # device 0 on the shared switch, alone there
    alone = simulate(one.graph, one.plan, hw, memory=one.predicted, sizes=state_sizes(one.program))
    node = simulate_node([(one.graph, one.plan, one.predicted, state_sizes(one.program))], hw)
    assert sum(alone.moved.values()) > 0                     # it swaps, so the shared link is consulted
    assert node.step_seconds == alone.step_seconds
    assert _times(node) == _times(alone)
    assert node.devices[0].busy == alone.busy and node.devices[0].moved == alone.moved
    assert node.devices[0].memory == alone.memory


def test_a_shared_host_link_slows_concurrent_swaps(one):
    rank = (one.graph, one.plan, one.predicted, state_sizes(one.program))
    hw = Hardware.node("4x1080ti")
    shared = simulate_node([rank] * 4, hw)
    private = simulate_node([rank] * 4, hw.replace(switches=()))
    alone = simulate_node([rank], hw)
    assert private.step_seconds == alone.step_seconds        # private links: every replica as if alone
    assert shared.step_seconds > private.step_seconds
    assert shared.moved["h2d"] == 4 * alone.moved["h2d"]     # the same bytes, more slowly
    wide = simulate_node([rank] * 4, hw.replace(switch_bandwidth=4 * hw.switch_bandwidth))
    assert wide.step_seconds == private.step_seconds         # room for all four at their own rate


def test_a_shared_link_books_first_come_first_served():
    hw = Hardware.node("4x1080ti")
    links = _Links(hw, [None] * 4)
    assert links.book(0, "h2d", 0.0, 1.0) == 1.0
    assert links.book(1, "h2d", 0.0, 1.0) == 2.0             # none left until the first is done
    assert links.book(2, "h2d", 0.5, 1.0) == 3.0             # after both
    wide = _Links(hw.replace(switch_bandwidth=2 * hw.switch_bandwidth), [None] * 4)
    assert wide.book(0, "h2d", 0.0, 1.0) == 1.0 and wide.book(1, "h2d", 0.0, 1.0) == 1.0
    assert wide.book(2, "h2d", 0.0, 1.0) == 2.0


def test_a_recv_waits_for_its_send_and_shifts_with_the_sender(planned):
    hw = _node()
    node = simulate_programs(planned, hw)
    slow = simulate_programs(planned, _node(changes={0: dict(speed_factor=3.0)}))
    ends = {}
    for d, sim in enumerate(node.devices):
        for e in sim.events:
            ends[(d, e.name)] = e
    sends = [n for n in planned[0].schedule.nodes if n.op == "call_function" and n.target.__name__ == "send"]
    recvs = {(n.kwargs["src"], n.kwargs["tag"]): n for n in planned[1].schedule.nodes
             if n.op == "call_function" and n.target.__name__ == "recv"}
    assert sends and node.messages[0] == len(sends) and node.sent[0] > 0
    for s in sends:
        r = recvs[(0, s.kwargs["tag"])]
        assert ends[(1, r.name)].end >= ends[(0, s.name)].end
    first = next(n for n in recvs.values())

    def start_of_first_forward(sim):
        return next(e.start for e in sim.events if e.name.startswith("forward"))
    assert start_of_first_forward(slow.devices[1]) > start_of_first_forward(node.devices[1])
    assert [e.end for e in slow.devices[1].events if e.name == first.name][0] > ends[(1, first.name)].end
    assert slow.step_seconds > node.step_seconds


def test_planned_ranks_are_what_the_stage_pass_gives_real_ranks(planned, monkeypatch, tmp_path):
    """A real rank's compile (harmony.compile under torchrun) with its world given by hand: the same packs on the
    same ranks, the same schedule, op for op."""
    import harmony.driver.compile
    import harmony.passes.compress
    monkeypatch.setattr(harmony.passes.compress, "check_same_plan", lambda *a, **k: None)
    for rank, program in enumerate(planned):
        monkeypatch.setattr(harmony.driver.compile, "resolve_world",
                            lambda *a, rank=rank, **k: dict(data_parallel=True, world_size=2, rank=rank))
        model, batch = _model_and_batch()
        sm = harmony.compile(model, batch, memory_budget=BUDGET, microbatches=MICROBATCHES, parallel="pipeline",
                             hardware=_node())
        try:
            assert sm.plan.stage.rank_of == program.plan.stage.rank_of
            assert sm.plan.stage.local == program.plan.stage.local
            assert [s.name for s in sm.plan.packs] == [s.name for s in program.plan.packs]
            assert sm.code == schedule_code(program)
            if rank == 1:        # the rank's own simulate: the whole node, its report a row per device
                node = sm.simulate(_node())
                assert node.step_seconds == simulate_programs(planned, _node()).step_seconds
                text = sm.report()
                assert "simulated node: 2 devices" in text and "device 1 (GeForce GTX 1080 Ti)" in text
                assert [r["device"] for r in json.loads(sm.report("json"))["node"]["rows"]] == \
                    [d.device for d in node.devices]
                drawn = harmony.viz.draw(sm, "timeline", out_dir=tmp_path)
                assert [p.name for p in drawn] == ["gpt_node_timeline.json"]
        finally:
            sm.close()
    assert planned[0].plan.stage.rank_of == [0] * 4 + [1] * 4      # contiguous halves of 8 packs


def test_the_node_report_and_timeline_have_a_row_per_device(planned):
    node = simulate_programs(planned, _node())
    rows = node.rows()
    assert [r["device"] for r in rows] == [s.device for s in node.devices] and len(rows) == 2
    assert all(r["busy_compute_s"] > 0 and r["sends"] > 0 and r["swapped_in_MiB"] > 0 for r in rows)
    assert all(abs(r["busy_compute_s"] + r["idle_compute_s"] - node.step_seconds) < 1e-12 for r in rows)
    text = node.summary().splitlines()
    assert len(text) == 2 + 2 and "device 1" in text[-1]
    processes = {e["args"]["name"] for e in trace_events(node.events) if e.get("name") == "process_name"}
    assert processes == {f"harmony {s.device}" for s in node.devices}


def test_too_few_devices_is_refused(planned):
    with pytest.raises(ConfigError, match="a device per rank"):
        simulate_programs(planned, Hardware.preset("gtx1080ti"))


def test_layers_placement_balances_stages_layer_by_layer_and_a_group_of_one_pipelines_them():
    """placement="layers" cuts packs where the best stages over the layers end: its slowest rank's predicted compute
    is below contiguous's (whole packs); with pipeline_group=1 the node's simulated step is shorter than with
    Harmony's grouping, where a rank hands a microbatch on only after its first packs ran all of them (with packs
    that stay on the device; where they swap, a group of one swaps them per microbatch and is slower)."""
    cfg = GPTConfig(layers=5, width=128, heads=4, vocab=256, seq=64, tie=False)
    torch.manual_seed(0)
    model, batch = GPT(cfg), next(iter(copy_task(cfg, 8, 1, seed=0)))
    kw = dict(memory_budget=int(0.8 * 16 * sum(p.numel() for p in model.parameters())), microbatches=MICROBATCHES,
              device="cpu")

    def stage(programs):
        return next(r for r in programs[0].reports if r.title.startswith("stage"))

    whole = plan_node(model, batch, _node(), **kw)
    layers = plan_node(model, batch, _node(), placement="layers", **kw)
    grouped = plan_node(model, batch, _node(), placement="layers", pipeline_group=1, **kw)
    assert stage(layers).totals["max_rank_compute_s"] < stage(whole).totals["max_rank_compute_s"]
    assert sum(len(p.plan.packs) for p in layers) > sum(len(p.plan.packs) for p in whole)
    assert any("packs cut where the best contiguous stages" in n for n in stage(layers).notes)
    assert stage(grouped).totals["group"] == 1 and stage(layers).totals["group"] == MICROBATCHES
    assert simulate_programs(grouped, _node()).step_seconds < simulate_programs(layers, _node()).step_seconds
    again = plan_node(model, batch, _node(), placement="layers", memory_budget=kw["memory_budget"] * 3 // 4,
                      microbatches=MICROBATCHES, device="cpu")        # whole packs balance as well: nothing cut
    assert not any("packs cut" in n for n in stage(again).notes)


def test_auto_group_is_the_candidate_whose_simulated_node_step_is_shortest():
    """pipeline_group="auto" (harmony/pipeline_plan.choose_group): every candidate M, M/2, ..., 1 planned for the
    whole node and simulated, offline; each prediction equals plan_node's for that group, and the choice is the
    fastest."""
    from harmony.compiler.ir import Program
    from harmony.driver.modes.pipeline_plan import choose_group, group_candidates
    cfg = GPTConfig(layers=5, width=128, heads=4, vocab=256, seq=64, tie=False)
    torch.manual_seed(0)
    model, batch = GPT(cfg), next(iter(copy_task(cfg, 8, 1, seed=0)))
    kw = dict(memory_budget=int(0.8 * 16 * sum(p.numel() for p in model.parameters())), microbatches=MICROBATCHES,
              device="cpu", placement="layers")
    first = plan_node(model, batch, _node(), **kw)[0]
    probe = Program(model=model, gm=first.gm, example_batch=first.example_batch, config=first.config)
    probe.fake, probe.optim_profile = first.fake, first.optim_profile
    best, predicted = choose_group(probe, first.config.passes)
    assert group_candidates(MICROBATCHES) == list(predicted) == [4, 2, 1]
    for group, step in predicted.items():
        assert step == simulate_programs(plan_node(model, batch, _node(), pipeline_group=group, **kw),
                                         _node()).step_seconds
    assert predicted[best] == min(predicted.values()) and best == 1
    with pytest.raises(ConfigError, match="plan_node plans one pipeline_group"):
        plan_node(model, batch, _node(), pipeline_group="auto", **kw)
