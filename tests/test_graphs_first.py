"""Behind a fast link the swap pass keeps packs' graphs first where the simulator finds that faster
(passes/swap/compare.py); where copies hold the compute up (the CPU device, or no hardware given) it ranks by
traffic saved alone, as before."""
import torch

import harmony
from harmony.compiler.hardware import Hardware
from harmony.models import GPT, GPTConfig
from models import CASES, training_state_bytes


def planned(hw):
    c = GPTConfig(vocab=8192, seq=1024, layers=6, width=1024, heads=8, tie=False)
    with torch.device("meta"):
        model = GPT(c)
    x = torch.zeros(8, c.seq, dtype=torch.long, device="meta")
    return harmony.compile(model, (x, x), memory_budget=8 * c.n_params(), microbatches=4, device="meta", hardware=hw)


def test_behind_a_fast_link_graphs_go_first_where_the_simulator_finds_it_faster():
    h100 = Hardware.preset("h100-sxm")
    overlap = h100.replace(devices=(h100.devices[0].replace(queued=True, efficiency=0.9),))
    blocking = h100.replace(devices=(overlap.devices[0].replace(sync_copies=True),))
    sm, by_traffic = planned(overlap), planned(blocking)
    assert sm.program.compute_to_copies > 1 and by_traffic.program.compute_to_copies == 1
    assert len(by_traffic.program.swap_choice.kept) == 0 < len(sm.program.swap_choice.kept)
    report = sm.report()
    assert "took graphs first" in " ".join(report.split())
    # the same hardware, the two plans: the one taken is the faster, by what kept graphs save of the recompute
    assert sm.simulate(overlap).step_seconds < by_traffic.simulate(overlap).step_seconds
    assert without_recompute(sm) == without_recompute(by_traffic) + 4 * len(sm.program.swap_choice.kept)


def without_recompute(sm) -> int:
    """The schedule's backward ops that take their forward's saved activations instead of recomputing them."""
    return sum(n.target.__name__ == "backward" and n.kwargs.get("saved") is not None
               for n in sm.graph.nodes if n.op == "call_function")


def test_without_hardware_the_ranking_is_by_traffic_saved():
    model, data = CASES["gpt"](layers=2)
    sm = harmony.compile(model, example_batch=data[0], microbatches=2,
                         memory_budget=int(training_state_bytes(model) * 0.5))
    assert sm.program.compute_to_copies == 1.0
    assert "outlasts its copies" not in sm.report()
    sm.close()


def test_the_schedules_the_swap_pass_keeps_plan_as_building_each_afresh(monkeypatch):
    """The swap pass keeps the last schedules it built by choice (``_Fits``), and the comparison here prefetches
    each schedule it simulates (on a copy): the plan equals the one made building every schedule afresh."""
    from harmony.passes import swap
    h100 = Hardware.preset("h100-sxm")
    overlap = h100.replace(devices=(h100.devices[0].replace(queued=True, efficiency=0.9),))
    kept = planned(overlap)
    assert "outlasts its copies" in kept.report()        # the simulated comparison ran
    monkeypatch.setattr(swap._Fits, "KEEP", 0)
    fresh = planned(overlap)
    assert kept.graph.python_code("self").src == fresh.graph.python_code("self").src
    assert kept.program.predicted_peak == fresh.program.predicted_peak
