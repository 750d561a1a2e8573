"""simulate: a schedule's step time on a hardware description, as a discrete-event simulation over streams.

>>> sim = simulate(sm.graph, sm.plan, Hardware.preset("gtx1080ti"), memory=sm.predicted)
>>> print(sim.summary())              # a 4-layer GPT of width 128, 4 microbatches, 60% of its state
simulated step 0.9851 ms on device 0 (GeForce GTX 1080 Ti)
stream           busy    util
compute     0.2895 ms   29.4%
h2d         0.3528 ms   35.8%
d2h         0.2202 ms   22.4%
disk              0 s    0.0%
network           0 s    0.0%
host        0.5445 ms   55.3%
copied 5.3 MiB in, 3.3 MiB out
peak device bytes 6.4 MiB (predicted by verify)
>>> chrome_trace(sim.events + sm.runtime.events, "both.json")   # prediction beside reality, one viewer

One loop over the schedule in program order and one table of streams. Each device has a
compute stream and one stream per copy engine (h2d, d2h, disk, network: the link to other servers, p2p: to the
server's other devices, a pipeline's messages), and its host a
``host`` stream (optimizer steps on host copies); an op runs on the stream its ``cost``
names, for the seconds it returns, and every stream runs its ops in program order, one
at a time. An op starts when its stream is free and:

- its inputs (the fx nodes it reads) are done: a forward waits for its ``load_batch``,
  an ``unstash`` for its ``stash`` (but the ops reading the stash of a kept forward's
  graph, whose outputs stay on the device, only for the forward);
- given the memory curve, a compute op whose predicted peak leaves less room under the
  step's peak than the copies out still in flight hold waits for enough of them to land:
  the runtime keeps their device bytes until then, and its meter lets an allocation past
  the predicted peak wait for them;
- on the compute stream, a ``wait(h)`` holds everything after it until ``h`` is done;
- a copy out of device memory (d2h, network) also waits for the compute issued before
  it, since it reads what that compute wrote (a CUDA event recorded at issue);
- a ``swap_in`` of some state waits for the ``release`` of the same state before it:
  the write-back must land on the host before the host copy is read again;
- the disk tiers' I/O runs on the ``disk`` stream (``disk_io``): a wholly-disk pack's
  weights are read before their ``swap_in`` copies them; a step whose pack keeps files on
  disk reads them ahead (from the start of the step before it in step order) and writes
  them after it; a wholly-disk pack's step runs inline, holding the compute stream;
- a step on the host waits for its pack's releases (it updates the host copies they
  wrote) and for the compute issued before it; the next ``swap_in`` of that pack's
  weights waits for the step, and so does the thread issuing it: the compute stream
  stalls until the update is done, as the runtime's ``fetch`` does;
- on a device with ``sync_copies`` (the CPU, where one thread runs compute and issues
  copies) a copy starts only after the compute before it, and every copy but a
  ``swap_in`` or an ``unstash`` (copies in, on the copy thread) holds the compute stream
  until it is done; an emulated link's copies out (``Device.link_emulated``) run on a
  thread of their own, as the runtime's do, and hold it no longer.

Each rule reads what the op does from its table entry (runtime/ops/'s ``OpDef``: ``fetches``,
``releases``, ``steps``, ``stashes``, ``copy_thread``, ...), never its name: a ``gather`` is timed
as a fetch because its entry says it is one, as is any new op declared one. Stream names
(``compute``, ``h2d``, ``d2h``, ``disk``, ``network``, ``p2p``, ``host``, and ``codec``: a quantized
all-reduce's quantizing and dequantizing on the host thread, ``codec_seconds`` at ``Hardware.codec_rates``, which
the transfer waits for; on a CPU device the transfer lasts at least gloo's CPU work, ``socket_seconds``) are strings.
The host thread runs all-reduces (codec and transfer) and host steps one at a time in program order, as the
runtime's one host thread does; where state lives
(a step's ``where=``) is a ``Tier``.

A ``swap_in`` or ``release`` moves only the state that is not already where it goes,
as the op's ``effect`` says: a release of clean parameters drops them (no copy), a
swap_in of gradients not yet made fetches nothing. ``Simulation.moved`` adds up the
bytes copied each way.

The ``ondemand`` policy plans no copies: its runtime fetches state when an op touches
it and evicts the least recently used. The simulator replays that at the granularity of
a pack's parameters, gradients or optimizer state (runtime/simulate/ondemand.py), in the room the memory
curve's activations leave under the budget, and puts the fetches and write-backs before
the op that needs them, which waits for them (events ``<op>.fetch``, ``<op>.evict``).

The costs read ``Device`` fields (``harmony.compiler.hardware``), and a host step the
``Hardware``'s host figures; the runtime never imports the compiler, so any object with
those fields works. A device's ``speed_factor`` stretches compute time: emulation, and
the summary says so. The memory curve comes from ``compiler.verify.memory_curve`` run by
the caller.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch.fx

from harmony.base.tiers import Tier
from harmony.runtime.executor import TraceEvent
from harmony.runtime.ops import MemoryModel, moving_names, op_of, ops_of, resident_state
from harmony.runtime.ops.reduce import codec_seconds, socket_seconds
from harmony.runtime.ops.update import device_part_cost, streamed_optim_bytes
from harmony.runtime.plan import Plan
from harmony.runtime.simulate.ondemand import OnDemand

STREAMS = ("compute", "h2d", "d2h", "disk", "network", "p2p")
READS_DEVICE = {"d2h", "network", "p2p"}      # copies out of device memory: after the compute issued before them
NO_DISK = {"read": 0.0, "write": 0.0}


@dataclass
class SimEvent(TraceEvent):
    """A ``TraceEvent`` of the simulator, with the device it ran on (viz/ draws each device apart)."""

    device: str = "device 0"


@dataclass
class Simulation:
    """One simulated step: its time, how busy each stream was, an event per op, device bytes over time."""

    step_seconds: float
    busy: dict[str, float]                 # stream -> seconds it ran ops
    events: list[SimEvent]                 # one per op, in program order
    device: str
    speed_factor: float = 1.0              # the device's; other than 1 means an emulated device
    memory: list[tuple[float, int]] = field(default_factory=list)   # (seconds, device bytes); [] without a curve
    moved: dict[str, int] = field(default_factory=dict)             # bytes copied per direction ("h2d", "d2h")

    @property
    def utilisation(self) -> dict[str, float]:
        """Share of the step each stream was busy, 0..1."""
        return {s: b / self.step_seconds if self.step_seconds else 0.0 for s, b in self.busy.items()}

    @property
    def emulated(self) -> bool:
        return self.speed_factor != 1.0

    @property
    def peak_bytes(self) -> int:
        return max((b for _, b in self.memory), default=0)

    def __repr__(self) -> str:
        """One line: step time, share of it each stream was busy, peak; the ops stay in ``.events``."""
        busy = ", ".join(f"{s} {u:.0%}" for s, u in self.utilisation.items() if u)
        peak = f", peak {self.peak_bytes / 2**20:.1f} MiB" if self.memory else ""
        emu = f", emulated x{self.speed_factor:g}" if self.emulated else ""
        return (f"Simulation(step {fmt_seconds(self.step_seconds)} on {self.device}{emu}; busy {busy or 'nothing'}"
                f"{peak}; {len(self.events)} ops in .events)")

    def summary(self) -> str:
        emu = f", emulated: compute time x{self.speed_factor:g}" if self.emulated else ""
        lines = [f"simulated step {fmt_seconds(self.step_seconds)} on {self.device}{emu}",
                 f"{'stream':<9}{'busy':>12}{'util':>8}"]
        for s, b in self.busy.items():
            lines.append(f"{s:<9}{fmt_seconds(b):>12}{self.utilisation[s]:>8.1%}")
        if self.moved:
            lines.append(f"copied {self.moved.get('h2d', 0) / 2**20:.1f} MiB in, "
                         f"{self.moved.get('d2h', 0) / 2**20:.1f} MiB out")
        if self.memory:
            lines.append(f"peak device bytes {self.peak_bytes / 2**20:.1f} MiB (predicted by verify)")
        return "\n".join(lines)


class _OnePerTensor(dict):
    """State sizes of one per tensor, so the replayed effects count the tensors a copy moves."""

    def __missing__(self, key):
        return 1

    def get(self, key, default=None):
        return 1


def fmt_seconds(t: float) -> str:
    """Seconds for a report: ``1.25 s``, ``3.2 ms``."""
    return f"{t:.4g} s" if t >= 1 or t == 0 else f"{t * 1e3:.4g} ms"


def simulate(graph: torch.fx.Graph, plan: Plan, hw, device: int = 0, memory=None, sizes=None) -> Simulation:
    """Simulate one step of ``graph`` on ``hw.devices[device]`` (``hw`` may also be a single ``Device``).

    ``sizes``: the state's device bytes, ``(kind, name) -> bytes`` (``compiler.verify.state_sizes``): a
    copy of training state then takes exactly the bytes its effect moves over the link; without them,
    the op's cost for the whole pack's state of that kind, scaled by the share of its tensors that move.

    ``memory``: the ``MemoryCurve`` of ``compiler.verify.memory_curve`` for this graph; its
    per-op bytes are placed at the simulated times (events' live/peak bytes, ``.memory``),
    compute waits for copies out in flight where they would take the device past the curve's
    peak, and under the ``ondemand`` policy they are what the state must fit beside.
    """
    dev = OnHost(hw.devices[device], hw) if hasattr(hw, "devices") else hw
    replay = Replay(graph, plan, dev, f"device {device} ({dev.name})", memory, sizes)
    while not replay.finished:
        replay.advance()
    return replay.result()


class Replay:
    """One device's schedule, replayed op by op (``advance``); ``simulate`` runs one to its end, and the node's
    simulator (runtime/simulate/node.py) interleaves several, handing each a ``peers`` object that times the
    messages between them and the host links they share."""

    def __init__(self, graph, plan, dev, label: str, memory=None, sizes=None, peers=None):
        self.plan, self.dev, self.memory, self.sizes, self.peers = plan, dev, memory, sizes, peers
        self.nodes = [n for n in graph.nodes if n.op == "call_function"]
        steps = [n.args[0] for n, op in ops_of(self.nodes) if op.steps]
        self.clock = _Clock(plan, dev, label, steps, peers)
        self.done: dict[torch.fx.Node, float] = {}   # when each op's result is ready
        self.through: dict[torch.fx.Node, float] = {}   # a graph's stash: when the values it passes on are ready
        self.memory_index = {n: i for i, n in enumerate(memory.nodes)} if memory is not None else None
        self.memory_peak = max(memory.peak_at, default=0) if memory is not None else 0
        # The effects, replayed, give the values as costs see them (a stash's bytes) and which state a copy
        # really moves. Tolerant of schedules verify would reject (a release with no swap_in): that is verify's job.
        self.model = MemoryModel(plan, _OnePerTensor() if sizes is None else sizes, refs=defaultdict(int))
        for what, names in resident_state(plan):
            self.model.hold(what, names)
        self.model.carry_in(graph)
        self.values: dict[torch.fx.Node, object] = {}
        self.op_events: list[SimEvent] = []     # one per schedule op, in program order
        self.on_demand = OnDemand(plan, dev, self.nodes, memory) if plan.policy == "ondemand" else None
        self.i = 0
        self.not_before = 0.0      # the next op starts no earlier (a collective's last rank: runtime/simulate/node.py)

    @property
    def finished(self) -> bool:
        return self.i >= len(self.nodes)

    @property
    def next_node(self):
        return None if self.finished else self.nodes[self.i]

    def advance(self) -> SimEvent:
        """Replay the next op: its cost, its effect, and when it runs."""
        i, node = self.i, self.nodes[self.i]
        clock, dev, done, model, values = self.clock, self.dev, self.done, self.model, self.values
        op = op_of(node)
        args = torch.fx.node.map_arg(node.args, values.__getitem__)
        kwargs = torch.fx.node.map_arg(node.kwargs, values.__getitem__)
        stream, seconds = op.cost(self.plan, dev, *args, **kwargs)
        before = sum(model.moved.values())
        values[node], _ = op.effect(model, *args, **kwargs)
        if op.state_copy:
            seconds = _copy_seconds(self.plan, dev, node, stream, seconds, sum(model.moved.values()) - before,
                                    self.sizes)
        if stream in clock.moved:
            clock.moved[stream] += round(seconds * (dev.h2d_bandwidth if stream == "h2d" else dev.d2h_bandwidth))
        if op.steps and node.kwargs.get("stream") and node.kwargs.get("where", Tier.DEVICE) == Tier.DEVICE:
            optim = streamed_optim_bytes(self.plan, node.args[0])
            clock.moved["h2d"] += optim
            clock.moved["d2h"] += optim
        ready = max(self.inputs_ready(node, op), self.not_before)
        self.not_before = 0.0
        if op.stashes and values[node].away:
            # a kept forward's graph going to the host: the forward's outputs stay on the device, and the ops that
            # read them (not its unstash) need not wait for the copy
            self.through[node] = ready
        if stream == "compute" and self.memory_index is not None and node in self.memory_index:
            ready = max(ready, clock.room_for(self.memory_peak - self.memory.peak_at[self.memory_index[node]], ready))
        if op.fetches and node.args[1] == "params" and node.args[0] in clock.host_steps:
            # the runtime waits for the host's update of these weights before it copies them,
            # on the thread that issues the copy: the compute stream stalls until then
            settled = clock.host_steps.pop(node.args[0])
            clock.free["compute"] = max(clock.free["compute"], settled)
            ready = max(ready, settled)
        if self.peers is not None and op.receives:    # its data arrive when the peer's send is done
            ready, seconds = max(ready, self.peers.arrival(node)), 0.0
        if self.on_demand is not None and op.kind == "compute":
            clock.fetch(self.on_demand, i, node, ready)
        ev = clock.wait(node, op, ready) if stream == "sync" else clock.issue(node, op, stream, seconds, ready)
        if op.releases:
            clock.written_back[tuple(node.args[:2])] = ev.end
        if self.peers is not None and op.sends:
            self.peers.sent(node, ev.end)
        done[node] = ev.end
        self.op_events.append(ev)
        self.i += 1
        return ev

    def arrival(self) -> float:
        """When the next op, a collective, would start on its stream were its peers there already: its values ready,
        and what its stream and thread wait for (runtime/simulate/node.py waits for the collective's last rank)."""
        node = self.next_node
        op = op_of(node)
        args = torch.fx.node.map_arg(node.args, self.values.__getitem__)
        kwargs = torch.fx.node.map_arg(node.kwargs, self.values.__getitem__)
        stream, _ = op.cost(self.plan, self.dev, *args, **kwargs)
        return self.clock.entry(op, stream, self.inputs_ready(node, op))

    def inputs_ready(self, node, op) -> float:
        """When the values ``node`` reads are ready."""
        return max((self.done[n] if op.unstashes else self.through.get(n, self.done[n]) for n in node.all_input_nodes),
                   default=0.0)

    def result(self) -> Simulation:
        clock = self.clock
        sim = Simulation(max(clock.free.values()), clock.busy, clock.events, clock.label, self.dev.speed_factor,
                         moved=clock.moved)
        if self.memory is not None:
            _place_memory(sim, self.nodes, self.op_events, self.memory)
        return sim


def _copy_seconds(plan, dev, node, stream: str, seconds: float, moved: float, sizes) -> float:
    """A copy of training state: with ``sizes``, the bytes its effect ``moved`` at the link's rate; without, its
    cost for all the pack's state of that kind times the share of tensors that move (clean parameters are dropped,
    not written back, and gradients not yet made are not fetched)."""
    if sizes is not None:
        return moved / getattr(dev, f"{stream}_bandwidth")
    names = moving_names(plan.packs[node.args[0]], node.args[1], node.kwargs.get("held", ()))
    return seconds * moved / len(names) if names else 0.0


class _Clock:
    """The streams of one simulated step: when each next idles, how long each ran, the events on them, and what
    the ops after an op wait for (host steps, releases written back, disk read-ahead)."""

    def __init__(self, plan, dev, label: str, step_order: list[int], peers=None):
        self.plan, self.dev, self.label, self.step_order, self.peers = plan, dev, label, step_order, peers
        self.free = dict.fromkeys(STREAMS, 0.0)     # when each stream next idles
        self.busy = dict.fromkeys(STREAMS, 0.0)
        self.events: list[SimEvent] = []
        self.moved = {"h2d": 0, "d2h": 0}
        self.written_back: dict[tuple, float] = {}  # (pack, kind) -> end of its last release
        self.host_steps: dict[int, float] = {}      # pack -> end of its optimizer step on the host
        self.disk_after: dict[int, float] = {}      # pack -> when the step before it started (its files' read-ahead)
        self.landing: list[tuple[float, int]] = []  # copies out: (when they land, device bytes held until then)
        self.host_thread = 0.0                      # when the host thread (all-reduces, host steps) is next free

    def run(self, stream: str, start: float, seconds: float, name: str, kind: str, cpu: float = 0.0) -> SimEvent:
        """``seconds`` on ``stream`` from ``start``; on a node, work that shares a switch or its host's cores and memory
        with other devices (runtime/simulate/node.py) may take longer. ``cpu``: seconds of a core's work the op does
        meanwhile (gloo's, beside a transfer): it lasts at least that long, and on a node takes a core of the host."""
        end = start + max(seconds, cpu)
        if self.peers is not None and (seconds or cpu):
            end = self.peers.occupy(stream, start, seconds, cpu)
        self.free.setdefault(stream, 0.0)
        alone = max(seconds, cpu)
        self.busy[stream] = self.busy.get(stream, 0.0) + (alone if end == start + alone else end - start)
        self.free[stream] = end
        self.events.append(SimEvent(name, kind, stream, start, end, 0, 0, self.label))
        return self.events[-1]

    def room_for(self, room: int, ready: float) -> float:
        """When a compute op ``room`` bytes below the step's predicted peak may start, from ``ready``, as the
        runtime's meter lets it: the device bytes copies out still read stay allocated until they land (the memory
        curve counts them gone at the copy's issue), and an allocation that would take the device past the
        predicted peak first waits for them."""
        start = max(ready, self.free["compute"])
        self.landing = [(end, size) for end, size in self.landing if end > start]
        over = sum(size for _, size in self.landing) - room
        if over <= 0:
            return ready
        for end, size in sorted(self.landing):
            over -= size
            if over <= 0:
                return end
        return ready

    def wait(self, node, op, ready: float) -> SimEvent:
        """A wait: the compute stream idles until what it waits for is done."""
        start, end = self.free["compute"], max(self.free["compute"], ready)
        self.events.append(SimEvent(node.name, op.kind, "compute", start, end, 0, 0, self.label))
        self.free["compute"] = end
        return self.events[-1]

    def entry(self, op, stream: str, ready: float) -> float:
        """When a copy that waits for nothing but its inputs (``ready``), its stream and its thread starts (as
        ``issue`` gates it: after the compute issued before it where it reads device memory or copies are
        synchronous, after the host thread's work where it runs there)."""
        if stream in READS_DEVICE or (getattr(self.dev, "sync_copies", False) and op.kind == "copy"):
            ready = max(ready, self.free["compute"])
        if op.reduces:
            ready = max(ready, self.host_thread)
        return max(ready, self.free.get(stream, 0.0))

    def fetch(self, on_demand, i: int, node, ready: float) -> None:
        """The ondemand runtime fetches what an op touches, and evicts to make room, before it runs."""
        fetched, evicted = on_demand.touch(i, node)
        for copy_stream, size, what in (("d2h", evicted, "evict"), ("h2d", fetched, "fetch")):
            if size:
                at = max(self.free["compute"], self.free[copy_stream], ready)
                copy = self.run(copy_stream, at, size / getattr(self.dev, f"{copy_stream}_bandwidth"),
                                f"{node.name}.{what}", "copy")
                self.free["compute"] = copy.end
                self.moved[copy_stream] += size

    def issue(self, node, op, stream: str, seconds: float, ready: float) -> SimEvent:
        """An op on its stream, once its inputs are ``ready`` and what it depends on besides is done."""
        dev, free = self.dev, self.free
        if stream == "compute":
            seconds *= dev.speed_factor
        if stream in READS_DEVICE:
            ready = max(ready, free["compute"])
        if op.fetches:
            ready = max(ready, self.written_back.get(tuple(node.args[:2]), 0.0))
        thread = op.reduces or (op.steps and stream == "host")
        if thread:    # the host thread runs all-reduces and host steps one at a time, in program order
            ready = max(ready, self.host_thread)
        if op.steps and stream == "host":   # it updates the host copies the releases wrote
            first = device_part_cost(self.plan, dev, node.args[0]) * dev.speed_factor
            if first:      # its parameters stepping on the device go first, on the thread that issues it
                free["compute"] = self.run("compute", max(ready, free["compute"]), first, f"{node.name}.device",
                                           "compute").end
            ready = max([ready, free["compute"]] + [t for (p, _), t in self.written_back.items()
                                                    if p == node.args[0]])
        disk = op.disk_io(self.plan, node, dev) if op.disk_io is not None else NO_DISK
        if disk["read"]:               # the read from disk comes first: weights for the device, a step's files
            start = max(free["disk"], self.disk_after.get(node.args[0], 0.0) if op.disk_read_ahead else ready)
            ready = max(ready, self.run("disk", start, disk["read"], f"{node.name}.read", "disk").end)
        sync = getattr(dev, "sync_copies", False) and op.kind == "copy"
        if sync:                       # issued once the compute before it is done
            ready = max(ready, free["compute"])
        cpu = 0.0
        if op.reduces:       # a quantized all-reduce's codec, on the host thread, before the transfers it feeds
            codec = codec_seconds(self.plan, dev, *node.args, **node.kwargs)
            if codec:
                ready = self.run("codec", max(free.get(stream, 0.0), ready), codec, f"{node.name}.codec", "codec").end
            cpu = socket_seconds(self.plan, dev, *node.args, **node.kwargs)
        ev = self.run(stream, max(free.get(stream, 0.0), ready), seconds, node.name, op.kind, cpu)
        if thread:
            self.host_thread = ev.end
        if stream == "d2h" and seconds:     # (its device bytes, for ``room_for``)
            self.landing.append((ev.end, round(seconds * dev.d2h_bandwidth)))
        if sync and not op.copy_thread and not (stream == "d2h" and getattr(dev, "link_emulated", False)):
            # a copy the issuing thread makes itself (an emulated link's copies out run on a thread: CopyEngine)
            free["compute"] = ev.end
        if op.steps and stream == "host":
            self.host_steps[node.args[0]] = ev.end
            if node.kwargs.get("where") == Tier.DISK:   # a disk pack steps inline, group by group
                free["compute"] = max(free["compute"], ev.end)
        if disk["write"]:              # written back once stepped; the next pack's read may start meanwhile
            self.run("disk", max(free["disk"], ev.end), disk["write"], f"{node.name}.write", "disk")
        if op.steps and disk["read"]:
            i = self.step_order.index(node.args[0])
            self.disk_after.update({p: ev.start for p in self.step_order[i + 1:i + 2]})
        return ev


class OnHost:
    """A device as the costs see it, with its host's figures (a step on the host reads the host's bandwidth)."""

    def __init__(self, device, hardware):
        self._device, self._hardware = device, hardware

    def __getattr__(self, name):
        try:
            return getattr(self._device, name)
        except AttributeError:
            return getattr(self._hardware, name)


def _place_memory(sim: Simulation, nodes: list, op_events: list, curve) -> None:
    """Put the curve's per-op bytes on the simulated clock.

    The curve is in program order, so each op's bytes count from the time the schedule
    has reached it (the latest start of it and every op before it); between two ops the
    device holds the earlier op's peak, an upper envelope.
    """
    index = {n: i for i, n in enumerate(curve.nodes)}
    if any(n not in index for n in nodes):
        raise ValueError("the memory curve is of another schedule graph: compute it with "
                         "memory_curve(program, graph) for the graph you simulate")
    reached = 0.0
    for node, ev in zip(nodes, op_events):
        i = index[node]
        reached = max(reached, ev.start)
        ev.peak_bytes = curve.peak_at[i]
        ev.live_bytes = curve.before[i + 1] if i + 1 < len(curve.before) else curve.before[i]
        sim.memory += [(reached, curve.before[i]), (reached, curve.peak_at[i])]
    if sim.memory:
        sim.memory.append((sim.step_seconds, op_events[-1].live_bytes))
