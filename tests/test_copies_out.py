"""Copies out of device memory land on their own time (TieredState.send): on a GPU, on the copy engine of that
direction while the compute goes on. Every reader of what they write waits for them, and the device tensors they
read stay counted until they land. ``CopyEngine.late_out`` makes them land late on the CPU device too (and poisons
new host copies until they do), so that the tests here and a whole training run catch a reader that does not wait.
Copies back in (``TieredState.bring``: stashed activations, graphs, masters) are joined by their readers alike;
``CopyEngine.late_in`` makes them late and poisoned until then."""
import copy
import threading

import pytest
import torch

from harmony.runtime.tiers.memory import MemoryMeter
from harmony.runtime.tiers.state import CopyEngine, TieredState
from models import CASES, eager_accumulate, run_compiled, training_state_bytes
from test_precision import train_bf16_as_eager


@pytest.fixture
def late(monkeypatch):
    monkeypatch.setattr(CopyEngine, "late_out", 0.002)


@pytest.fixture
def late_both(late, monkeypatch):
    monkeypatch.setattr(CopyEngine, "late_in", 0.002)


@pytest.fixture
def held(late):
    """A state whose copies out wait behind a gate the test opens (``gate.set()``)."""
    meter = MemoryMeter("cpu:logical")
    w = torch.nn.Parameter(torch.arange(1000.0))
    st = TieredState({"w": w}, {}, meter, torch.device("cpu"))
    gate = threading.Event()
    st.copier.out_pool.submit(gate.wait)
    yield st, meter, gate, w
    gate.set()
    st.close()


def test_a_host_copy_is_poisoned_until_it_lands_and_its_source_counted_until_then(held):
    st, meter, gate, _ = held
    src = torch.full((256,), 3.0)
    meter.track(src)
    dst = st.send(src)
    del src                                   # the copy in flight still holds it, on the meter too
    assert torch.isnan(dst).all() and meter.live == 1024 and st.moved["d2h"] == 1024
    gate.set()
    st.landed(dst)
    assert torch.equal(dst, torch.full((256,), 3.0))
    st.land()
    assert meter.live == 0 and not st.outgoing and not st.landing and st.last_out is None


def test_a_copy_in_and_the_host_thread_wait_for_the_copy_out_before_them(held):
    """Weights changed on the device go back into their host master; bringing them in again, and a host job
    submitted after, read what the device wrote, not the master as it was."""
    st, meter, gate, w = held
    st.wait(st.fetch("params", ["w"]))
    assert meter.holds(w.data)
    w.data.mul_(2)
    st.dirty.add("w")
    st.release("params", ["w"])              # the write-back waits behind the gate
    master = st.master["w"]
    assert w.data is not None and torch.equal(master, torch.arange(1000.0))   # not there yet
    seen = st.host_pool.submit(lambda: master.clone())
    fetched = st.fetch("params", ["w"])
    threading.Timer(0.05, gate.set).start()
    st.wait(fetched)
    assert torch.equal(w.data, 2 * torch.arange(1000.0))
    assert torch.equal(seen.result(), 2 * torch.arange(1000.0))


def test_a_copy_in_is_poisoned_until_its_reader_joins_it(late_both):
    """``bring`` hands out its device tensors at once, reserved on the meter; what they hold is the host's only
    once the copy is joined (``ops.arrived``, as every op reading a value does)."""
    from harmony.runtime.ops import Acts, arrived
    st = TieredState({}, {}, MemoryMeter("cpu:logical"), torch.device("cpu"))
    host = torch.arange(256.0)
    (dst,), fut = st.bring([host])
    assert torch.isnan(dst).all() and st.meter.live == 1024 and st.moved["h2d"] == 1024
    acts = Acts({"x": dst}, arriving=fut)
    rt = type("Runtime", (), {"state": st})()
    assert arrived(rt, acts) is acts and acts.arriving is None
    assert torch.equal(dst, host)
    st.close()


@pytest.mark.parametrize("limit", ["settle_above", "budget"])
def test_memory_past_the_limit_waits_for_the_copies_in_flight(held, limit):
    """Past ``settle_above`` (the step's predicted peak), or the budget where there is none, an allocation first
    lets the copies out land, so the device tensors they held go and the peak stays where the plan put it (and
    nothing is over the budget)."""
    st, meter, gate, _ = held
    src = torch.ones(256)
    meter.track(src)
    st.send(src)
    del src
    setattr(meter, limit, 1500)
    threading.Timer(0.05, gate.set).start()
    new = torch.ones(256)
    meter.track(new)                          # 2048 bytes with the one in flight: it lands first
    assert meter.live == 1024 and meter.peak <= 1500 and not st.outgoing


@pytest.mark.parametrize("policy,frac", [("harmony", 0.25), ("sequential", 0.5)])
def test_training_with_late_copies_is_bitwise_eager(late_both, policy, frac):
    """Gradients to the host steps, stashed activations, optimizer state and weights written back all land late,
    and so do weights and stashed activations coming back; the run is still eager gradient accumulation's, bit for
    bit, within its predicted peak."""
    model, data = CASES["gpt"]()
    ref, _ = eager_accumulate(model, data, 4)
    ours = copy.deepcopy(model)
    budget = int(training_state_bytes(model) * frac)
    sm, stats, _ = run_compiled(ours, data, 4, budget, policy)
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name
    ops = {n.target.__name__ for n in sm.graph.nodes if n.op == "call_function"}
    assert stats[-1]["d2h_bytes"] > 0 and ("stash" in ops or policy == "sequential")
    assert "host" in set(sm.plan.by_pack("step_on").values())
    for s in stats:
        assert s["measured_peak"] <= s["predicted_peak"] <= budget


def test_bf16_device_steps_with_late_copies_out_are_bitwise_eager(late):
    """Each fp32 master and its optimizer state go back while the next parameter steps."""
    sm, _ = train_bf16_as_eager("gpt", "harmony", optimizer_on="device")
    assert set(sm.plan.by_pack("step_on").values()) == {"device"}


def test_allocator_accounting_is_refused_where_there_is_no_cuda_allocator():
    import harmony
    from harmony.errors import ConfigError
    for kw in (dict(), dict(device="cuda", policy="ondemand")):
        with pytest.raises(ConfigError, match="accounting='allocator'.*use accounting='ops'"):
            harmony.Config(accounting="allocator", **kw)


class FakeAllocator:
    """torch.cuda's counters, as AllocatorMeter reads them."""

    def __init__(self, allocated=0):
        self.allocated, self.max = allocated, allocated

    def alloc(self, n):
        self.allocated += n
        self.max = max(self.max, self.allocated)

    def stats(self):
        return (lambda: self.allocated, lambda: self.max, lambda: setattr(self, "max", self.allocated))


def test_the_allocator_meter_counts_from_where_the_runtime_started():
    """live and peak leave out what was allocated before (the user's tensors, the libraries' workspaces); an op
    over the budget is found after it; past the plan's peak the copies in flight land first."""
    from harmony.errors import DeviceOutOfMemory
    from harmony.runtime.tiers.memory import AllocatorMeter
    fake = FakeAllocator(allocated=700)
    fake.max = 5000                     # a peak from before the runtime started is not its own
    meter = AllocatorMeter("cuda:0", 1000, torch.device("cpu"), stats=fake.stats())
    assert (meter.live, meter.peak) == (0, 0) and meter.holds(torch.ones(1))
    assert not meter.holds(torch.ones(1, device="meta"))
    fake.alloc(900)
    fake.alloc(-400)
    meter.observe()
    meter.peak = meter.live             # (the executor's per-op peak: the allocator's is the step's, not reset)
    assert (meter.live, meter.peak) == (500, 900)
    meter.reset_peak()
    assert meter.peak == 500
    settled = []
    meter.settle = lambda limit: (settled.append(limit), fake.alloc(-200))
    meter.settle_above = 600
    fake.alloc(300)                     # 800 live: past the plan's 600, the copies in flight land
    meter.track(torch.ones(1))
    assert settled == [600] and meter.live == 600
    fake.alloc(500)
    with pytest.raises(DeviceOutOfMemory, match="allocator's peak.*over the budget"):
        meter.observe()


def test_copies_in_flight_land_oldest_first_down_to_the_slack(held):
    """What the allocator meter's runtime does before each op: the copies out in flight hold at most the room the
    budget leaves above the plan's peak."""
    st, meter, gate, _ = held
    for n in (100, 200, 300):
        src = torch.ones(n)
        meter.track(src)
        st.send(src)
    del src
    assert st.inflight == 2400
    threading.Timer(0.05, gate.set).start()
    st.land_beyond(1500)
    assert st.inflight <= 1500 and meter.live == st.inflight
    st.land_beyond(0)
    assert st.inflight == 0 and meter.live == 0 and not st.outgoing


def test_allocator_accounting_plans_with_the_ops_latency_without_the_hook():
    """Hardware.computing_in(precision, "allocator"): each tensor op costs the profile's plain_kernel_latency
    (measured on CUDA without the runtime's accounting), where there is one."""
    from harmony.compiler.hardware import Hardware
    card = Hardware.preset("h100-sxm")
    measured = card.replace(devices=(card.devices[0].replace(kernel_latency=4e-5, plain_kernel_latency=1e-5),))
    assert measured.computing_in("bf16", "allocator").devices[0].kernel_latency == 1e-5
    assert measured.computing_in("bf16").devices[0].kernel_latency == 4e-5
    assert measured.computing_in("bf16").devices[0].dtype == "bf16"
    assert card.computing_in("fp32", "allocator").devices[0].kernel_latency == card.devices[0].kernel_latency
