"""An emulated host link (``Hardware.logical(..., link_bandwidth=)``): logical devices whose copies the runtime paces
to a slower link's rate (runtime/tiers/link.py), as it stretches an emulated device's compute; the simulator and the
planner read the rate as the device's h2d and d2h bandwidth. No test here times a step: the runtime's own record of
each paced copy is checked against its bytes over the rate, which a busy machine can only lengthen."""
import copy

import pytest
import torch

from harmony.compiler.hardware import Hardware
from harmony.errors import ConfigError
from harmony.runtime.tiers.link import EmulatedLink
from harmony.runtime.tiers.memory import MemoryMeter
from harmony.runtime.tiers.state import TieredState
from models import CASES, eager_accumulate, training_state_bytes

RATE = 50e6          # bytes/s: slow enough that a copy of the small models here is mostly the sleep
TRAIN_RATE = 400e6   # a whole run's: still far below a memcpy


def test_logical_devices_take_the_emulated_link_as_their_host_link():
    base = Hardware.this_machine()
    real = base.devices[0].h2d_bandwidth
    hw = base.logical([2**30, 2**30], [4, 4], link_bandwidth=RATE)
    for d in hw.devices:
        assert (d.h2d_bandwidth, d.d2h_bandwidth, d.real_link_bandwidth) == (RATE, RATE, real)
        assert d.link_emulated and d.emulated and d.stretch("h2d") == pytest.approx(real / RATE)
        assert d.stretch("compute") == 4 and d.stretch("network") == 1
    assert "emulated link" in hw.describe() and any("paces host-link copies" in n for n in hw.notes)
    per = base.logical([2**30, 2**30], link_bandwidth=[RATE, 2 * RATE])
    assert [d.h2d_bandwidth for d in per.devices] == [RATE, 2 * RATE]
    plain = base.logical([2**30])
    assert not plain.devices[0].link_emulated and plain.devices[0].h2d_bandwidth == real


@pytest.mark.parametrize("link,match", [(0, "must be positive"), (-1e9, "must be positive"),
                                        (1e15, "at most the real link"), ([RATE], "2 budgets but 1 link")])
def test_bad_link_bandwidths_are_refused(link, match):
    with pytest.raises(ConfigError, match=match):
        Hardware.this_machine().logical([2**30, 2**30], link_bandwidth=link)


def test_a_device_refuses_a_negative_real_link():
    dev = Hardware.this_machine().devices[0]
    with pytest.raises(ConfigError, match="real_link_bandwidth >= 0"):
        dev.replace(real_link_bandwidth=-1.0)


def test_each_copy_of_an_emulated_link_lasts_its_bytes_over_the_rate():
    """Copies in on the copy engine, copies out on their thread, and a copy made on the spot (``to_host``): each
    recorded with its bytes and seconds, never shorter than bytes / rate; the values arrive whole."""
    link = EmulatedLink(RATE, RATE)
    st = TieredState({"w": torch.nn.Parameter(torch.arange(250_000.0))}, {}, MemoryMeter("cpu:logical"),
                     torch.device("cpu"), link=link)
    st.wait(st.fetch("params", ["w"]))
    w = st.tensors["w"]
    w.data.mul_(2)
    st.dirty.add("w")
    st.release("params", ["w"])            # the write-back: a copy out, on its own thread
    assert st.last_out is not None
    st.land()
    assert torch.equal(st.master["w"], 2 * torch.arange(250_000.0))
    st.to_host(torch.ones(1000))
    st.close()
    assert [c.direction for c in link.copies] == ["h2d", "d2h", "d2h"]
    assert [c.nbytes for c in link.copies] == [1_000_000, 1_000_000, 4000]
    for c in link.copies:
        assert c.seconds >= c.nbytes / RATE


def test_training_on_an_emulated_link_is_bitwise_eager_and_paces_every_copy():
    """A plan that swaps, on a logical device with a slow link: the same bits as eager gradient accumulation, every
    byte the step moved went through the link's pace, each copy no shorter than its bytes over the rate, and the
    plan's copies are priced at the rate (the simulator's h2d and d2h seconds are its bytes over it)."""
    import harmony
    model, data = CASES["gpt"]()
    ref, _ = eager_accumulate(model, data, 4)
    ours = copy.deepcopy(model)
    budget = int(training_state_bytes(model) * 0.25)
    hw = Hardware.this_machine().logical([budget], link_bandwidth=TRAIN_RATE)
    sm = harmony.compile(ours, example_batch=data[0], memory_budget=budget, microbatches=4, hardware=hw)
    assert sm.program.config.link_bandwidth == TRAIN_RATE and sm.program.config.copy_bandwidth == TRAIN_RATE
    link = sm.runtime.state.link
    for batch in data:
        before = len(link.copies)
        sm(*batch)
        step = link.copies[before:]
        moved = sm.stats["h2d_bytes"] + sm.stats["d2h_bytes"]
        assert moved > 0 and sum(c.nbytes for c in step) == moved
    for c in link.copies:
        assert c.seconds >= c.nbytes / TRAIN_RATE
    sim = sm.simulate(hw)
    sim_copies = [e for e in sim.events if e.stream in ("h2d", "d2h")]
    assert sim_copies and sum(e.end - e.start for e in sim_copies) == pytest.approx(
        (sim.moved["h2d"] + sim.moved["d2h"]) / TRAIN_RATE, rel=0.05)
    sm.close()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name


def test_the_simulator_lets_an_emulated_links_copies_out_run_beside_compute():
    """On a logical device a copy out holds the compute thread (sync_copies); with an emulated link the runtime
    makes it on a thread of its own, and the simulated compute stream does not wait for it."""
    import harmony
    model, data = CASES["gpt"]()
    budget = int(training_state_bytes(model) * 0.25)
    base = Hardware.this_machine()
    sm = harmony.compile(copy.deepcopy(model), example_batch=data[0], memory_budget=budget, microbatches=4,
                         hardware=base.logical([budget]))
    slow = base.logical([budget], link_bandwidth=RATE)
    held = base.logical([budget]).replace(devices=(slow.devices[0].replace(real_link_bandwidth=0.0),))
    on_thread, blocking = sm.simulate(slow), sm.simulate(held)
    sm.close()
    assert on_thread.busy["d2h"] == pytest.approx(blocking.busy["d2h"]) and on_thread.busy["d2h"] > 0
    assert on_thread.step_seconds < blocking.step_seconds


def test_the_hybrid_benchmarks_a100_setting_gives_each_link_the_named_servers_ratio_to_compute():
    """benchmarks/hybrid.py --emulated --link a100: the emulated host link and network are as many bytes per
    emulated FLOP as the 8 x A100 server's PCIe 4 link and 10 Gbit/s are per A100 FLOP; --link none keeps the
    memcpy and the given rate."""
    import dataclasses
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from hybrid_emulated import link_setting
    base = Hardware.this_machine()       # once: another process may cache a new profile meanwhile
    hw = dataclasses.asdict(base)
    named = Hardware.node("8xa100-40gb").devices[0]
    a100 = link_setting(hw, 4.0, "a100", 125e6)
    compute = base.devices[0].effective_flops / 4
    assert a100["compute_flops"] == pytest.approx(compute)
    assert a100["host_link"] / compute == pytest.approx(named.h2d_bandwidth / named.effective_flops)
    assert a100["network"] / compute == pytest.approx(10e9 / 8 / named.effective_flops, rel=1e-3)
    assert a100["tc_rate"].endswith("kbit") and a100["bytes_per_flop"]["host_link"] == pytest.approx(
        a100["named_bytes_per_flop"]["host_link"])
    none = link_setting(hw, 4.0, "none", 125e6)
    assert none["host_link"] == 0 and none["network"] == 125e6 and none["tc_rate"] == "1000000kbit"
