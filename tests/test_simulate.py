"""The simulator on hand-built schedules with exactly known times, and the hardware descriptions.

Every hand-built case runs on a unit device: 1e9 FLOP/s and 1e9 bytes/s on every link,
so a pack of 1e9 FLOPs or 1e9 bytes takes exactly one second. Times are sums of exact
binary fractions, so they are compared with ``==``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from types import SimpleNamespace

import pytest
import torch
import torch.fx

import harmony
from harmony.compiler.hardware import PCIE, PRESETS, Device, Hardware
from harmony.compiler.verify import memory_curve
from harmony.errors import ConfigError
from harmony.models import GPT, GPTConfig, copy_task
from harmony.runtime import ops
from harmony.runtime.ops import update as ops_step
from harmony.runtime.plan import PackSpec, Plan
from harmony.runtime.simulate import simulate
from harmony.viz import timeline

G = 10**9
UNIT = Device(name="unit", memory=100 * G, peak_flops={"fp32": 1e9}, h2d_bandwidth=1e9, d2h_bandwidth=1e9,
              memory_bandwidth=1e9)
FAST_MEMORY = UNIT.replace(memory_bandwidth=8e9)     # an optimizer step of a 1e9-byte pack: 4 * 2e9 / 8e9 = 1 s


def pack(i, fwd=G, bwd=2 * G, param_bytes=G, out_bytes=0) -> PackSpec:
    return PackSpec(index=i, name=f"p{i}", module=None, inputs=[], outputs=[], params=[f"w{i}"], buffers=[],
                    owned=[f"w{i}"], mutated=[], random=False, param_bytes=param_bytes, out_bytes=out_bytes,
                    fwd_flops=fwd, bwd_flops=bwd)


def plan(*packs, batch_bytes=None) -> Plan:
    return Plan(packs=list(packs), microbatches=1, microbatch_size=1, input_names=["x"],
                batch_bytes=batch_bytes or {})


class Schedule:
    """Builds a schedule graph call by call: ``s.forward(0, 0)`` appends ``forward(0, 0)``."""

    def __init__(self):
        self.g = torch.fx.Graph()

    def __getattr__(self, name):
        fn = getattr(ops, name)
        return lambda *args, **kwargs: self.g.call_function(fn, args, kwargs)

    def done(self) -> torch.fx.Graph:
        self.g.output(None)
        return self.g


def spans(sim):
    return [(e.name, e.stream, e.start, e.end) for e in sim.events]


# -- exactly known times ---------------------------------------------------------------------------
def test_two_independent_computes_serialise_on_one_stream():
    s = Schedule()
    s.forward(0, 0)
    s.forward(1, 0)
    sim = simulate(s.done(), plan(pack(0), pack(1)), UNIT)
    assert sim.step_seconds == 2.0
    assert [(e.stream, e.start, e.end) for e in sim.events] == [("compute", 0.0, 1.0), ("compute", 1.0, 2.0)]
    assert sim.busy["compute"] == 2.0 and sim.utilisation["compute"] == 1.0
    assert sim.utilisation["h2d"] == sim.utilisation["d2h"] == 0.0


def test_swap_in_overlaps_compute_max_not_sum():
    s = Schedule()
    s.forward(0, 0)
    s.swap_in(1, "params")          # issued after the forward, runs beside it on h2d
    sim = simulate(s.done(), plan(pack(0), pack(1)), UNIT)
    assert sim.step_seconds == 1.0
    assert spans(sim)[1][1:] == ("h2d", 0.0, 1.0)
    assert sim.utilisation == {"compute": 1.0, "h2d": 1.0, "d2h": 0.0, "disk": 0.0, "network": 0.0, "p2p": 0.0}


def test_wait_blocks_compute_until_the_copy_finishes():
    s = Schedule()
    h = s.swap_in(1, "params")      # 2 s on h2d
    s.forward(0, 0)                 # 0..1 on compute, beside the copy
    s.wait(h)                       # compute idles 1..2
    s.forward(1, 0)                 # 2..3, not 1..2
    sim = simulate(s.done(), plan(pack(0), pack(1, param_bytes=2 * G)), UNIT)
    assert [e[1:] for e in spans(sim)] == [("h2d", 0.0, 2.0), ("compute", 0.0, 1.0), ("compute", 1.0, 2.0),
                                           ("compute", 2.0, 3.0)]
    assert sim.events[2].kind == "sync"
    assert sim.step_seconds == 3.0
    assert sim.busy == {"compute": 2.0, "h2d": 2.0, "d2h": 0.0, "disk": 0.0, "network": 0.0, "p2p": 0.0}
    assert sim.utilisation["compute"] == sim.utilisation["h2d"] == pytest.approx(2 / 3)


def test_wait_on_a_finished_copy_costs_nothing():
    s = Schedule()
    h = s.swap_in(1, "params")
    s.forward(0, 0)
    s.forward(0, 1)                 # the copy (1 s) is done by now
    s.wait(h)
    s.forward(1, 0)
    sim = simulate(s.done(), plan(pack(0), pack(1)), UNIT)
    assert sim.step_seconds == 3.0
    assert spans(sim)[3][2:] == (2.0, 2.0)


def test_release_starts_after_the_compute_before_it():
    s = Schedule()
    h = s.swap_in(0, "params")      # 0..1
    s.wait(h)
    s.step(0)                       # 1..2: 4 * 2e9 bytes at 8e9 bytes/s; the parameters are now dirty
    s.release(0, "params")          # no fx input, but it reads what the step wrote: 2..3 on d2h
    sim = simulate(s.done(), plan(pack(0)), FAST_MEMORY)
    assert spans(sim)[-1][1:] == ("d2h", 2.0, 3.0)
    assert sim.step_seconds == 3.0
    assert sim.utilisation["compute"] == sim.utilisation["h2d"] == sim.utilisation["d2h"] == pytest.approx(1 / 3)


def test_release_is_asynchronous_to_later_compute():
    s = Schedule()
    h = s.swap_in(0, "params")      # 0..2
    s.wait(h)
    s.step(0)                       # 2..4
    s.release(0, "params")          # 4..6 on d2h
    s.forward(1, 0)                 # 4..5: does not wait for the write-back
    sim = simulate(s.done(), plan(pack(0, param_bytes=2 * G), pack(1)), FAST_MEMORY)
    assert [e[2:] for e in spans(sim)] == [(0.0, 2.0), (0.0, 2.0), (2.0, 4.0), (4.0, 6.0), (4.0, 5.0)]
    assert sim.step_seconds == 6.0


def test_swap_in_waits_for_the_write_back_of_the_same_state():
    s = Schedule()
    h = s.swap_in(0, "params")      # 0..1
    s.wait(h)
    s.step(0)                       # 1..2
    s.release(0, "params")          # 2..3 on d2h
    s.swap_in(1, "params")          # other state: 1..2 on h2d
    s.swap_in(0, "params")          # same state: after its write-back, 3..4
    sim = simulate(s.done(), plan(pack(0), pack(1)), FAST_MEMORY)
    assert [e[2:] for e in spans(sim)][-3:] == [(2.0, 3.0), (1.0, 2.0), (3.0, 4.0)]


def test_copies_move_only_what_is_not_already_there():
    s = Schedule()
    p = s.swap_in(0, "params")      # 0..1
    g = s.swap_in(0, "grads")       # no gradients exist yet: nothing to fetch, 0 s
    s.wait(p)
    s.wait(g)
    s.backward(0, 0)                # recompute: 1..4
    s.release(0, "grads")           # the gradients now exist: 4..5 on d2h
    s.release(0, "params")          # clean: dropped, not written back, 0 s
    sim = simulate(s.done(), plan(pack(0)), UNIT)
    assert [e[1:] for e in spans(sim)] == [("h2d", 0.0, 1.0), ("h2d", 1.0, 1.0), ("compute", 0.0, 1.0),
                                           ("compute", 1.0, 1.0), ("compute", 1.0, 4.0), ("d2h", 4.0, 5.0),
                                           ("d2h", 5.0, 5.0)]
    assert sim.busy["h2d"] == sim.busy["d2h"] == 1.0


def test_copy_stream_runs_in_program_order():
    s = Schedule()
    s.swap_in(0, "params")
    s.swap_in(1, "params")
    sim = simulate(s.done(), plan(pack(0), pack(1)), UNIT)
    assert [e[2:] for e in spans(sim)] == [(0.0, 1.0), (1.0, 2.0)]
    assert sim.utilisation["h2d"] == 1.0 and sim.utilisation["compute"] == 0.0


def test_compute_waits_for_its_inputs_load_batch_and_unstash():
    s = Schedule()
    b = s.load_batch(0, ("x",))     # 0..1 on h2d
    a = s.forward(0, 0, b)          # 1..2: needs the batch
    st = s.stash(a)                 # 2..4 on d2h (2e9 bytes of output)
    u = s.unstash(st)               # 4..6 on h2d
    s.forward(1, 0, u)              # 6..7
    sim = simulate(s.done(), plan(pack(0, out_bytes=2 * G), pack(1), batch_bytes={"x": G}), UNIT)
    assert [e[1:] for e in spans(sim)] == [("h2d", 0.0, 1.0), ("compute", 1.0, 2.0), ("d2h", 2.0, 4.0),
                                           ("h2d", 4.0, 6.0), ("compute", 6.0, 7.0)]
    assert sim.busy == {"compute": 2.0, "h2d": 3.0, "d2h": 2.0, "disk": 0.0, "network": 0.0, "p2p": 0.0}


def test_backward_recompute_and_step_costs():
    s = Schedule()
    a = s.forward(0, 0, keep=True)                  # 1 s
    s.backward(0, 0, saved=a)                       # kept: bwd only, 2 s
    s.backward(0, 0)                                # recompute: fwd + bwd, 3 s
    s.step(0)                                       # 4 * (2 * 1e9 param bytes + 0) / 1e9 = 8 s
    sim = simulate(s.done(), plan(pack(0)), UNIT)
    assert [e.end - e.start for e in sim.events] == [1.0, 2.0, 3.0, 8.0]
    assert sim.step_seconds == 14.0


def test_disk_reads_come_before_their_copy_and_step_and_writes_after():
    """A pack wholly on disk: its weights are read before they are copied in, its files read ahead of its
    inline step (which holds the compute stream) and written after it, one disk stream in program order."""
    p = pack(0)
    p.optim_bytes = 2 * G
    pl = plan(p)
    pl.at(0).master_on = pl.at(0).optim_on = "disk"
    hw = Hardware((UNIT,), host_memory_bandwidth=16e9, disk_read_bandwidth=1e9, disk_write_bandwidth=0.5e9)
    s = Schedule()
    h = s.swap_in(0, "params")                      # disk read 1e9 B: 0-1 s; then the copy in: 1-2 s
    s.wait(h)
    s.forward(0, 0)                                 # 2-3 s
    s.release(0, "params")                          # clean weights: dropped, nothing moves
    s.step(0, where="disk")                         # files read 1-4 s (read ahead); step 4-5 s; written 5-11 s
    s.forward(0, 1)                                 # the inline step held the compute stream: 5-6 s
    sim = simulate(s.done(), pl, hw)
    got = {(name, stream): (start, end) for name, stream, start, end in spans(sim)}
    assert got[("swap_in.read", "disk")] == (0.0, 1.0) and got[("swap_in", "h2d")] == (1.0, 2.0)
    assert got[("forward", "compute")] == (2.0, 3.0)
    assert got[("step.read", "disk")] == (1.0, 4.0) and got[("step", "host")] == (4.0, 5.0)
    assert got[("step.write", "disk")] == (5.0, 11.0) and got[("forward_1", "compute")] == (5.0, 6.0)
    assert sim.step_seconds == 11.0 and sim.busy["disk"] == 10.0


def test_speed_factor_stretches_compute_only_and_says_emulated():
    s = Schedule()
    s.swap_in(1, "params")
    s.forward(0, 0)
    sim = simulate(s.done(), plan(pack(0), pack(1)), UNIT.replace(speed_factor=2.0))
    assert sim.busy["compute"] == 2.0 and sim.busy["h2d"] == 1.0
    assert sim.step_seconds == 2.0 and sim.emulated
    assert "emulated" in sim.summary()
    assert "emulated" not in simulate(s.g, plan(pack(0), pack(1)), UNIT).summary()


def test_a_simulation_prints_as_one_short_line_with_its_events_behind_an_attribute():
    s = Schedule()
    s.swap_in(1, "params")
    s.forward(0, 0)
    sim = simulate(s.done(), plan(pack(0), pack(1)), UNIT.replace(speed_factor=2.0))
    text = repr(sim)
    assert "\n" not in text and len(text) < 200, text
    assert text.startswith("Simulation(step 2 s") and "compute 100%" in text and "h2d 50%" in text
    assert "emulated x2" in text and f"{len(sim.events)} ops in .events" in text
    assert "SimEvent" not in text and len(sim.events) == 2


def test_op_latency_is_paid_per_compute_op():
    s = Schedule()
    s.forward(0, 0)
    s.forward(1, 0)
    sim = simulate(s.done(), plan(pack(0), pack(1)), UNIT.replace(op_latency=0.25))
    assert sim.step_seconds == 2.5


def test_device_index_picks_the_device_and_labels_events():
    s = Schedule()
    s.forward(0, 0)
    hw = Hardware((UNIT, UNIT.replace(name="half", peak_flops={"fp32": 5e8})))
    sim = simulate(s.done(), plan(pack(0)), hw, device=1)
    assert sim.step_seconds == 2.0
    assert sim.events[0].device == "device 1 (half)"


# -- memory over time ------------------------------------------------------------------------------
def _two_op_schedule():
    s = Schedule()
    h = s.swap_in(1, "params")      # 0..2
    s.forward(0, 0)                 # 0..1
    s.wait(h)                       # 1..2
    s.forward(1, 0)                 # 2..3
    g = s.done()
    nodes = [n for n in g.nodes if n.op == "call_function"]
    curve = SimpleNamespace(nodes=nodes, before=[10, 30, 30, 30], peak_at=[30, 35, 30, 50])
    return g, plan(pack(0), pack(1, param_bytes=2 * G)), curve


def test_memory_curve_is_placed_on_the_simulated_clock():
    g, p, curve = _two_op_schedule()
    sim = simulate(g, p, UNIT, memory=curve)
    assert [e.peak_bytes for e in sim.events] == [30, 35, 30, 50]
    assert [e.live_bytes for e in sim.events] == [30, 30, 30, 30]
    assert sim.memory == [(0.0, 10), (0.0, 30), (0.0, 30), (0.0, 35), (1.0, 30), (1.0, 30), (2.0, 30), (2.0, 50),
                          (3.0, 30)]
    assert sim.peak_bytes == 50
    assert "peak device bytes" in sim.summary()


def test_memory_curve_of_another_graph_is_an_error():
    g, p, curve = _two_op_schedule()
    other, _, _ = _two_op_schedule()
    with pytest.raises(ValueError, match="another schedule graph"):
        simulate(other, p, UNIT, memory=curve)


def test_memory_plot_writes_an_svg_step_line(tmp_path):
    g, p, curve = _two_op_schedule()
    sim = simulate(g, p, UNIT, memory=curve)
    path = timeline.memory_plot(sim, tmp_path / "mem.svg", budget=60, title="a <small> test")
    svg = path.read_text()
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    assert "a &lt;small&gt; test" in svg and "budget" in svg and "time (s)" in svg
    xs = [float(p.split(",")[0]) for p in re.search(r'polyline[^>]*points="([^"]+)"', svg).group(1).split()]
    assert xs == sorted(xs)         # a step line never goes back in time
    with pytest.raises(ConfigError, match="memory"):
        timeline.memory_plot(simulate(g, p, UNIT), tmp_path / "none.svg")


def test_memory_plot_of_trace_events(tmp_path):
    events = [dict(name="a", start=0.0, end=1.0, live_bytes=5, peak_bytes=8),
              dict(name="b", start=1.0, end=2.0, live_bytes=3, peak_bytes=9)]
    assert timeline.memory_points(events) == [(0.0, 8), (1.0, 8), (1.0, 5), (1.0, 9), (2.0, 9), (2.0, 3)]
    assert timeline.memory_plot(events, tmp_path / "m.svg").exists()


# -- a compiled program, end to end ----------------------------------------------------------------
def test_simulate_a_compiled_schedule(tmp_path):
    torch.manual_seed(0)
    c = GPTConfig(layers=2, width=64)
    model = GPT(c)
    x, y = next(copy_task(c, 8, 1))
    state = sum(p.numel() for p in model.parameters()) * 16
    sm = harmony.compile(model, (x, y), memory_budget=state, microbatches=4)
    try:
        hw = Hardware.preset("gtx1080ti")
        curve = memory_curve(sm.program, sm.graph, check_residency=False)
        sim = simulate(sm.graph, sm.plan, hw, memory=curve)
        nodes = [n for n in sm.graph.nodes if n.op == "call_function"]
        # one event per op, and before a host step the device steps of its single parameters (``step.device``)
        host = [n for n in nodes if n.target is ops.step and n.kwargs.get("where") == "host"]
        first = [n for n in host if ops_step.device_part_cost(sm.plan, hw.devices[0], n.args[0])]
        assert [e.name for e in sim.events if not e.name.endswith(".device")] == [n.name for n in nodes]
        assert [e.name for e in sim.events if e.name.endswith(".device")] == [f"{n.name}.device" for n in first]
        dev = hw.devices[0]
        # forward/backward/step costs read only the pack and whether a backward has saved activations;
        # a step on the host (offload) runs on the host stream
        costs = [ops.op_of(n).cost(sm.plan, dev, *n.args, **n.kwargs) for n in nodes
                 if n.target in (ops.forward, ops.backward, ops.step)]
        device_first = sum(ops_step.device_part_cost(sm.plan, dev, n.args[0]) for n in host)
        assert sim.busy["compute"] == pytest.approx(sum(t for stream, t in costs if stream == "compute")
                                                    + device_first)
        # the host step reads the host's memory bandwidth, which the simulator takes from the Hardware, for what
        # is not stepped on the device first
        rest = {n: sm.plan.packs[n.args[0]].param_bytes
                - sum(ops_step.device_part_bytes(sm.plan, sm.plan.packs[n.args[0]]).values()) for n in host}
        assert sim.busy.get("host", 0.0) == pytest.approx(sum(
            4 * (2 * rest[n] + sm.plan.packs[n.args[0]].optim_bytes * rest[n] / sm.plan.packs[n.args[0]].param_bytes)
            / hw.host_memory_bandwidth for n in host))
        assert sim.step_seconds >= max(sim.busy.values())
        assert all(0.0 <= u <= 1.0 + 1e-9 for u in sim.utilisation.values())
        assert sim.peak_bytes == curve.peak
        trace = json.loads(timeline.chrome_trace(sim.events, tmp_path / "sim.json").read_text())["traceEvents"]
        names = {e["args"]["name"] for e in trace if e["name"] == "process_name"}
        assert names == {"harmony device 0 (GeForce GTX 1080 Ti)"}
        assert timeline.memory_plot(sim, tmp_path / "mem.svg", budget=state).exists()
    finally:
        sm.close()


# -- hardware descriptions -------------------------------------------------------------------------
def test_every_preset_loads_with_positive_figures_and_a_source():
    assert {"v10016gb", "v10032gb", "a10040gb", "a10080gb", "h100sxm", "rtx3090", "gtx1080ti", "l4", "t4",
            "a6000", "p40"} <= set(PRESETS)
    for name, dev in PRESETS.items():
        hw = Hardware.preset(name)
        d = hw.devices[0]
        assert d.memory >= 11 * 2**30 and d.flops > 1e12 and d.memory_bandwidth > 1e11
        assert d.h2d_bandwidth in PCIE.values() and d.d2h_bandwidth == d.h2d_bandwidth
        assert "datasheet" in d.source or "specifications" in d.source or "whitepaper" in d.source
        assert all(v > 0 for v in d.peak_flops.values())


def test_presets_are_found_as_written_or_squeezed_and_errors_list_them_as_written():
    from harmony.compiler.hardware import PRESET_NAMES
    assert "a100-40gb" in PRESET_NAMES and "h100-sxm" in PRESET_NAMES
    for name in ("a100-40gb", "a10040gb", "A100 40GB", "A100_40GB"):
        assert Hardware.preset(name).devices[0].name == "A100 SXM4 40GB"
    with pytest.raises(ConfigError) as e:
        Hardware.preset("b200")
    assert "a100-40gb" in str(e.value) and "a10040gb" not in str(e.value)


def test_preset_figures_are_the_datasheets():
    a100 = Device.preset("A100-40GB")
    assert (a100.memory, a100.flops, a100.peak_flops["bf16"], a100.memory_bandwidth) == \
        (40 * 2**30, 19.5e12, 312e12, 1555e9)
    assert Device.preset("h100").peak_flops["bf16"] == 989.5e12           # dense: half the sparsity figure
    assert Device.preset("l4").peak_flops["fp16"] == 121e12
    assert Device.preset("p40").memory_bandwidth == 346e9


def test_preset_count_link_and_mixed_clusters():
    hw = Hardware.preset("a100-40gb", count=4, link="pcie4")
    assert len(hw.devices) == 4 and hw.devices[3].h2d_bandwidth == 31.5e9
    assert Hardware.preset("gtx1080ti", link=11.5e9).devices[0].h2d_bandwidth == 11.5e9
    mixed = Hardware.preset(["l4", "l4", "a6000", "p40"], network_bandwidth=3e9)
    assert [d.name for d in mixed.devices] == ["L4", "L4", "RTX A6000", "Tesla P40"]
    assert mixed.network_bandwidth == 3e9 and "nominal" in mixed.notes[0]
    with pytest.raises(ConfigError, match="no hardware preset"):
        Hardware.preset("a100-96gb")
    with pytest.raises(ConfigError, match="unknown link"):
        Hardware.preset("t4", link="pcie9")
    with pytest.raises(ConfigError, match="no bf16"):
        Device.preset("p40").replace(dtype="bf16")
    assert Device.preset("a100-40gb").replace(dtype="bf16").flops == 312e12


def test_logical_devices_with_budgets_and_emulated_speed():
    hw = Hardware.preset("t4").logical([1 * 2**30, 2 * 2**30], speed_factors=[1, 3])
    assert [d.memory for d in hw.devices] == [2**30, 2 * 2**30]
    assert hw.emulated and "emulated" in hw.devices[1].name and "emulated" in hw.describe()
    with pytest.raises(ConfigError):
        hw.logical([1, 2], speed_factors=[1])


def test_detect_reads_this_machine_without_measuring():
    hw = Hardware.detect()
    dev = hw.devices[0]
    assert dev.memory == hw.host_memory > 0 and dev.flops > 0 and hw.disk_free > 0
    assert "not measured" in hw.notes[0]


def test_profile_measures_and_this_machine_uses_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HARMONY_CACHE_DIR", str(tmp_path / "cache"))
    assert "not measured" in Hardware.this_machine().notes[0]          # no cache yet: detect()
    hw = Hardware.profile(seconds=1, path=tmp_path, block=(64, 128))
    dev = hw.devices[0]
    for v in (dev.flops, dev.h2d_bandwidth, dev.memory_bandwidth, hw.disk_read_bandwidth,
              hw.disk_write_bandwidth, dev.kernel_latency):
        assert v > 0 and math.isfinite(v)
    assert 0 < dev.efficiency <= 1 and dev.sync_copies
    assert all(v >= 0 and math.isfinite(v) for v in (dev.ondemand_call_latency, dev.ondemand_op_latency))
    assert "per tensor op" in hw.describe()
    assert "measured" in hw.notes[0]
    assert [b for b, _ in hw.codec_rates] == [1, 4, 8] and all(r > 0 and math.isfinite(r) for _, r in hw.codec_rates)
    assert "gradient codec per core" in hw.describe()
    assert list(tmp_path.glob("harmony-disk-*")) == []                  # the temp file is gone
    cached = Hardware.this_machine()
    assert cached.devices[0] == dev and cached.disk_read_bandwidth == hw.disk_read_bandwidth
    assert cached.codec_rates == hw.codec_rates
    budgeted = cached.logical([512 * 2**20])                              # a logical CPU device with a budget
    assert budgeted.devices[0].memory == 512 * 2**20 and budgeted.devices[0].h2d_bandwidth == dev.h2d_bandwidth


def test_a_cached_profile_of_an_older_version_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("HARMONY_CACHE_DIR", str(tmp_path))
    old = dataclasses.asdict(Hardware.detect().replace(notes=("measured, long ago",)))
    (tmp_path / "hardware.json").write_text(json.dumps(old))          # no profile_version: before latencies
    assert "not measured" in Hardware.this_machine().notes[0]


def test_efficiency_must_be_a_share():
    with pytest.raises(ConfigError, match="efficiency"):
        UNIT.replace(efficiency=1.5)
    assert UNIT.replace(efficiency=0.25).effective_flops == 2.5e8


# -- the costs of this machine: efficiency, per-op latency, blocking copies, host steps, ondemand ----------
def test_efficiency_and_kernel_latency_in_compute_costs():
    s = Schedule()
    s.forward(0, 0)                 # 1e9 FLOPs at 0.5 x 1e9 FLOP/s = 2 s, plus 2.7 ops per parameter tensor
    s.backward(0, 0)                # recompute: 3e9 FLOPs = 6 s, plus (2.7 + 5.8) ops per tensor
    s.step(0)                       # 8 s of memory traffic, plus 21 ops per tensor
    p = plan(pack(0))               # one parameter tensor
    sim = simulate(s.done(), p, UNIT.replace(efficiency=0.5, kernel_latency=0.5))
    assert [e.end - e.start for e in sim.events] == pytest.approx([2 + 2.7 * 0.5, 6 + 8.5 * 0.5, 8 + 21 * 0.5])


def test_ondemand_fetch_checks_are_charged_per_op_under_that_policy_only():
    """The ondemand runtime's modes cost the host time per tensor op: ops called from Python (forward, the
    recompute, the step) pay ``ondemand_call_latency``, autograd's backward ops ``ondemand_op_latency``."""
    s = Schedule()
    s.forward(0, 0)                 # 1 s of FLOPs, 2.7 ops per parameter tensor
    s.backward(0, 0)                # recompute: 3 s, 2.7 ops called from Python and 5.8 backward
    s.step(0)                       # 8 s of memory traffic, 21 ops
    hw = UNIT.replace(ondemand_call_latency=0.25, ondemand_op_latency=0.125)
    p = plan(pack(0))
    assert [e.end - e.start for e in simulate(s.done(), p, hw).events] == pytest.approx([1, 3, 8])
    p.policy = "ondemand"
    assert [e.end - e.start for e in simulate(s.done(), p, hw).events] == pytest.approx(
        [1 + 2.7 * 0.25, 3 + 2.7 * 0.25 + 5.8 * 0.125, 8 + 21 * 0.25])


def test_a_queued_device_overlaps_launches_with_kernels():
    """On a GPU the host queues ops while earlier kernels run: a pack's compute is the longer of its kernels and
    its launches, not their sum."""
    s = Schedule()
    s.forward(0, 0)                 # 2 s of FLOPs; 2.7 launches at 0.5 s (1.35 s) hide behind them
    s.backward(0, 0)                # 6 s of FLOPs; 8.5 launches at 1 s (8.5 s) do not
    p = plan(pack(0))
    sim = simulate(s.done(), p, UNIT.replace(efficiency=0.5, kernel_latency=0.5, queued=True))
    assert [e.end - e.start for e in sim.events] == pytest.approx([2, 6])
    sim = simulate(s.done(), p, UNIT.replace(efficiency=0.5, kernel_latency=1.0, queued=True))
    assert [e.end - e.start for e in sim.events] == pytest.approx([2.7, 8.5])


def test_a_streamed_step_pays_for_its_copies():
    s = Schedule()
    s.step(0, stream=True)          # 8 s of traffic, and 2e9 bytes of optimizer state in and out
    p = plan(PackSpec(**{**vars(pack(0)), "optim_bytes": 2 * G}))
    sim = simulate(s.done(), p, FAST_MEMORY)        # traffic 4 * (2e9 + 2e9) / 8e9 = 2 s
    assert sim.step_seconds == 2.0 + 2.0            # the copies in; those out land beside the next ones'
    assert simulate(s.g, p, FAST_MEMORY.replace(sync_copies=True)).step_seconds == 2.0 + 2.0 + 2.0
    assert sim.moved == {"h2d": 2 * G, "d2h": 2 * G}


def test_sync_copies_block_compute_but_swap_in_does_not():
    s = Schedule()
    h = s.swap_in(1, "params")      # 0..1 on h2d, beside compute
    a = s.forward(0, 0)             # 0..1
    s.stash(a)                      # 1..2 on d2h; blocks compute on a synchronous runtime
    s.forward(0, 1)                 # 2..3, not 1..2
    s.wait(h)
    p = plan(pack(0, out_bytes=G), pack(1))
    sim = simulate(s.done(), p, UNIT.replace(sync_copies=True))
    assert [e[2:] for e in spans(sim)] == [(0.0, 1.0), (0.0, 1.0), (1.0, 2.0), (2.0, 3.0), (3.0, 3.0)]
    async_sim = simulate(s.g, p, UNIT)
    assert spans(async_sim)[3][2:] == (1.0, 2.0) and async_sim.step_seconds == 2.0
    assert sim.moved == {"h2d": G, "d2h": G}


def test_a_host_step_follows_the_write_back_and_the_next_swap_in_waits_for_it():
    s = Schedule()
    s.swap_in(0, "grads")           # no gradients yet: nothing to fetch, 0 s
    s.backward(0, 0)                # 0..1: makes them
    s.release(0, "grads")           # 1..2 on d2h, after the backward
    s.step(0, where="host")         # 4 * (2e9 + 0) / 8e9 = 1 s on the host stream, after the write-back: 2..3
    s.forward(1, 0)                 # compute goes on beside the host step: 1..2
    s.swap_in(0, "params")          # the issuing thread waits for the host update: compute stalls to 3
    s.forward(1, 1)                 # 3..4
    hw = Hardware((UNIT,), host_memory_bandwidth=8e9)
    sim = simulate(s.done(), plan(pack(0, bwd=G, fwd=0), pack(1)), hw)
    assert [e[1:] for e in spans(sim)] == [("h2d", 0.0, 0.0), ("compute", 0.0, 1.0), ("d2h", 1.0, 2.0),
                                           ("host", 2.0, 3.0), ("compute", 1.0, 2.0), ("h2d", 3.0, 4.0),
                                           ("compute", 3.0, 4.0)]
    assert sim.busy["host"] == 1.0 and sim.step_seconds == 4.0


def test_a_host_steps_parameters_stepped_on_the_device_go_first_on_the_compute_stream():
    """A host-stepped pack whose ``device_parts`` step on the device: they go first, on the compute stream, without
    waiting for the write-back of the rest (their traffic at the device's memory bandwidth), and the host steps only
    the rest, once it is written back."""
    s = Schedule()
    s.swap_in(0, "grads")
    s.backward(0, 0)                # 0..1
    s.release(0, "grads")           # 1..1.5 on d2h: v0's gradient, one of the pack's two
    s.step(0, where="host")         # w0 (a quarter) on the device: 4 * (2 * 0.25e9) / 8e9 = 0.25 s from 1; the rest,
    s.forward(1, 0)                 # 4 * (2 * 0.75e9) / 8e9 = 0.75 s on the host after the write-back
    p = plan(pack(0, bwd=G, fwd=0), pack(1))
    p.packs[0].params = p.packs[0].owned = p.packs[0].stepped = ["w0", "v0"]
    p.packs[0].master_bytes = G
    p.at(0).device_parts, p.at(0).device_part_bytes = {"w0": 0}, {"w0": G // 4}
    sim = simulate(s.done(), p, Hardware((FAST_MEMORY,), host_memory_bandwidth=8e9))
    assert [e[:4] for e in spans(sim)][2:] == [("release", "d2h", 1.0, 1.5), ("step.device", "compute", 1.0, 1.25),
                                               ("step", "host", 1.5, 2.25), ("forward", "compute", 1.25, 2.25)]


def _ondemand_plan(*packs):
    p = plan(*packs)
    p.policy = "ondemand"
    return p


def test_ondemand_fetches_on_the_compute_stream_and_evicts_least_recently_used():
    s = Schedule()
    for mb in range(2):             # sequential order: each microbatch through both packs
        a = s.forward(0, mb)
        s.forward(1, mb, a)
    g = s.done()
    # room for one pack's parameters (1e9 bytes): every forward fetches, nothing is dirty to write back
    p = _ondemand_plan(pack(0), pack(1))
    sim = simulate(g, p, UNIT.replace(memory=int(1.5 * G)))
    names = [e.name for e in sim.events]
    assert names == ["forward.fetch", "forward", "forward_1.fetch", "forward_1",
                     "forward_2.fetch", "forward_2", "forward_3.fetch", "forward_3"]
    assert [e[1:] for e in spans(sim)][:4] == [("h2d", 0.0, 1.0), ("compute", 1.0, 2.0), ("h2d", 2.0, 3.0),
                                               ("compute", 3.0, 4.0)]
    assert sim.step_seconds == 8.0 and sim.moved == {"h2d": 4 * G, "d2h": 0}
    # room for both: after the previous step left them on the device, nothing moves
    roomy = simulate(g, p, UNIT.replace(memory=3 * G))
    assert roomy.step_seconds == 4.0 and roomy.moved == {"h2d": 0, "d2h": 0}


def test_ondemand_writes_back_changed_state_and_leaves_room_for_activations():
    s = Schedule()
    s.backward(0, 0)                # makes gradients (1e9 bytes) beside the parameters
    s.step(0)                       # needs optimizer state too: 3e9 bytes of state
    g = s.done()
    nodes = [n for n in g.nodes if n.op == "call_function"]
    p = _ondemand_plan(pack(0, fwd=0, bwd=G))
    p.packs[0].optim_bytes = G
    curve = SimpleNamespace(nodes=nodes, before=[0, 0], peak_at=[G, 0])   # the backward's activations
    sim = simulate(g, p, UNIT.replace(memory=3 * G, memory_bandwidth=8e9), memory=curve)
    # the previous step left parameters (changed) and optimizer state on the device; the backward
    # needs room for its activations and new gradients: the optimizer state (written back) goes
    assert [(e.name, e.stream, e.start, e.end) for e in sim.events] == [
        ("backward.evict", "d2h", 0.0, 1.0), ("backward", "compute", 1.0, 2.0),
        ("step.fetch", "h2d", 2.0, 3.0), ("step", "compute", 3.0, 4.5)]     # 4 * (2e9 + 1e9) / 8e9 = 1.5 s
    assert sim.moved == {"h2d": G, "d2h": G}


def test_a_streamed_steps_copies_out_hold_the_compute_only_where_copies_block():
    """A streamed step's copies out land on the other copy engine while the next parameters come in and step
    (TieredState.send); on a device whose copies hold the compute (the CPU) they add to the step."""
    p = pack(0)
    p.optim_bytes = 2 * G                 # in and out: 2 s each; the step's traffic 4 * (2 + 2) G: 16 s
    blocking = UNIT.replace(sync_copies=True)
    assert ops_step._step_cost(plan(p), UNIT, 0, stream=True) == ("compute", 16.0 + 2.0)
    assert ops_step._step_cost(plan(p), blocking, 0, stream=True) == ("compute", 16.0 + 2.0 + 2.0)
    p.stepped_master_bytes = G            # bf16: the fp32 master comes in and goes back too, 1 s each way; the
    mixed = plan(p)                       # step's traffic 4 * (2 + 2) G plus the casts' 3 G: 19 s
    mixed.precision = "bf16"
    assert ops_step._step_cost(mixed, UNIT, 0) == ("compute", 19.0)       # copies in and out beside the step
    assert ops_step._step_cost(mixed, blocking, 0) == ("compute", 19.0 + 1.0)
