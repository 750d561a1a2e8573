"""simulate_node: one step of N devices of one server, each running its own schedule, simulated together.

>>> node = simulate_node([(g0, plan0, curve0, sizes0), (g1, plan1, curve1, sizes1)], Hardware.node("4x1080ti"))
>>> print(node.summary())
simulated step 1.203 s on 2 devices (step = the slowest device)
device                        busy compute  idle compute  h2d ...  sent MiB  peak MiB
...

Each device replays its schedule as ``simulate`` does (runtime/simulate/'s ``Replay``: its streams, its
copies, its host steps); the devices are tied together in two ways:

- **messages**: a pipeline rank's ``recv`` cannot finish before the matching ``send`` (same source, destination
  and tag) is done on the sender: the send takes the message's bytes over the sender's peer-to-peer link
  (``Device.p2p_bandwidth``, on its ``p2p`` stream, after the compute that made the values; a grid's replica
  all-reduces run on the ``network`` stream, the link between servers, beside them), and the recv
  ends when it ends. The values go device to device (NCCL's P2P), not through the host.
- **a shared host link**: devices of one group of ``Hardware.switches`` copy to and from the host through one
  upstream link of ``Hardware.switch_bandwidth`` per direction. A copy runs at its device's own rate where the
  link has room, and gets what the copies already running there leave (the ones booked first keep their rate:
  first come, first served, not a fair share); so N devices swapping at once through a link no faster than one
  device's take about N times as long, and the bytes over the link never exceed its rate.

The devices are replayed one op at a time, always the one whose compute stream is earliest among those not
waiting for a message, so the copies are booked on a shared link roughly in time order. A device whose next op
is a ``recv`` not yet sent waits; if every device waits, the schedules deadlock and that is an error.

- **a shared host** (``Hardware.hosts``, ``Hardware.host_cores``): the devices of one server share its cores and
  its memory bus. A host step takes a core and the bus; on a device that is the host's CPU (a logical device,
  ``sync_copies``) compute takes a core (an emulated one only for its own time: the rest is slept), and a copy a
  core and twice its bytes of the bus (a memcpy reads and writes them); a GPU's copy takes its bytes of the bus.
  Booked as the links are (runtime/simulate/shared.py), so three ranks computing on two cores take half as long
  again as on three, and the summary says, per host, which devices shared it and how long their work waited.
- **a pooled link between servers** (``Hardware.network_shared``): each device's ``network_bandwidth`` is its share
  of its server's link, and the server's devices pool them: a transfer alone takes the whole link (its device's
  rate times the server's devices), and transfers that meet there go one after the other. Without it each device
  has its share alone, also when the others' transfers are done (a pipeline's stages reduce at different times).

A quantized all-reduce's codec (the ``codec`` stream) takes a core of the host too, so it contends with the
host steps and a CPU device's compute there, and so does gloo's CPU work beside a CPU device's transfer (its socket
copies and sums, the fused buffer's copies: runtime/ops/reduce.socket_seconds).

- **collectives**: a data-parallel all-reduce of a communication group starts when the last of its ranks reaches
  it (ranks of unequal speed, under ``balance=``, wait for one another there), where all its ranks are simulated
  together (``_Meets``).

What is not modelled: the codec of a quantized all-reduce on the ranks that waited (it runs after the last arrival,
not before), a partitioned pack's gathers and reduce-scatters waiting for one another, fp16 / bf16 conversions, gloo's
work in a tied weight's all-reduce, P2P
traffic contending with swaps on a device's own link, the receiver's link (a message takes only the sender's), and
the host work of a rank alone on its host or of a host without ``host_cores`` (each as if it had the host alone).
With one device the result is ``simulate``'s, op for op.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from harmony.base.errors import ConfigError
from harmony.runtime.ops import allreduce, op_of
from harmony.runtime.pipeline import message_bytes
from harmony.runtime.simulate import OnHost, Replay, SimEvent, Simulation, fmt_seconds
from harmony.runtime.simulate.shared import Shared

MiB = 2**20


@dataclass
class NodeSimulation:
    """One simulated step of a node: each device's ``Simulation`` and what it sent to its peers."""

    devices: list[Simulation]
    sent: list[int] = field(default_factory=list)          # bytes each device sent to its peers
    messages: list[int] = field(default_factory=list)      # messages each device sent
    waited: list[float] = field(default_factory=list)      # seconds each device's work took longer for what it shares
    sharing: list[str] = field(default_factory=list)       # a line per host whose devices share its cores

    @property
    def step_seconds(self) -> float:
        """The node's step: the slowest device's (every device starts together and the step ends when all have)."""
        return max(d.step_seconds for d in self.devices)

    @property
    def events(self) -> list[SimEvent]:
        """Every device's events; each names its device, so a timeline draws one row (process) per device."""
        return [e for d in self.devices for e in d.events]

    @property
    def peak_bytes(self) -> int:
        return max(d.peak_bytes for d in self.devices)

    @property
    def moved(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for d in self.devices:
            for k, v in d.moved.items():
                out[k] = out.get(k, 0) + v
        return out

    def rows(self) -> list[dict]:
        """One row per device: compute busy and idle over the node's step, copies, what it sent, its peak."""
        step, out = self.step_seconds, []
        for i, d in enumerate(self.devices):
            busy = d.busy.get("compute", 0.0)
            out.append(dict(device=d.device, busy_compute_s=busy, idle_compute_s=step - busy,
                            compute_util=busy / step if step else 0.0, h2d_s=d.busy.get("h2d", 0.0),
                            d2h_s=d.busy.get("d2h", 0.0), swapped_in_MiB=d.moved.get("h2d", 0) / MiB,
                            swapped_out_MiB=d.moved.get("d2h", 0) / MiB,
                            sends=self.messages[i] if self.messages else 0,
                            sent_MiB=(self.sent[i] if self.sent else 0) / MiB, peak_MiB=d.peak_bytes / MiB,
                            shared_wait_s=self.waited[i] if self.waited else 0.0))
        return out

    def summary(self) -> str:
        lines = [f"simulated step {fmt_seconds(self.step_seconds)} on {len(self.devices)} devices "
                 f"(step = the slowest device)"]
        rows = self.rows()
        cols = list(rows[0])
        cells = [[_cell(r[c]) for c in cols] for r in rows]
        widths = [max(len(c), *(len(row[k]) for row in cells)) for k, c in enumerate(cols)]
        lines.append("  ".join(c.rjust(w) if k else c.ljust(w) for k, (c, w) in enumerate(zip(cols, widths))))
        lines += ["  ".join(v.rjust(w) if k else v.ljust(w) for k, (v, w) in enumerate(zip(row, widths)))
                  for row in cells]
        return "\n".join(lines + self.sharing)

    def __repr__(self) -> str:
        return (f"NodeSimulation(step {fmt_seconds(self.step_seconds)} on {len(self.devices)} devices; "
                f"{len(self.events)} ops in .events, a row per device in .rows())")


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


class _Links:
    """What the devices share: the messages sent so far, and the bookings of each shared resource (``Shared``): a
    switch's upstream link per direction, and each host's cores and memory bus."""

    def __init__(self, hw, plans):
        self.hw, self.plans = hw, plans
        self.group = {d: k for k, g in enumerate(getattr(hw, "switches", ())) if len(g) > 1 for d in g}
        self.host = shared_hosts(hw, len(plans))                       # device -> its host, where shared
        self.pooled = pooled_links(hw, len(plans))          # device -> (its host, devices pooling its host's link)
        self.shared = Shared()
        self.arrivals: dict[tuple, float] = {}                           # (src, dst, tag) -> when the send ends
        self.sent = [0] * len(plans)
        self.messages = [0] * len(plans)
        self.waited = [0.0] * len(plans)           # seconds each device's work took longer for what it shares

    def needs(self, rank: int, stream: str) -> dict:
        """What work on ``stream`` of device ``rank`` asks of the resources it shares: ``key -> (demand, capacity)``.

        A copy through a switch: its link's rate of the switch's. On a host whose cores its ranks share: a host
        step, a quantized all-reduce's codec, and on a device that is the host's CPU (``sync_copies``) its compute
        and its copies (memcpy), a core each; a step and a copy, the bytes per second they move of the host's memory
        bus (a copy the CPU makes reads and writes each byte, a GPU's DMA writes or reads it once; a host step is
        costed at the whole bus)."""
        dev, hw, out = self.hw.devices[rank], self.hw, {}
        copy = stream in ("h2d", "d2h")
        if copy and rank in self.group:
            out[("switch", self.group[rank], stream)] = (getattr(dev, f"{stream}_bandwidth"), hw.switch_bandwidth)
        host = self.host.get(rank)
        if host is None:
            return out
        cpu, bus = getattr(dev, "sync_copies", False), hw.host_memory_bandwidth
        if stream in ("host", "codec") or (cpu and (copy or stream == "compute")):
            out[("cores", host)] = (1.0, hw.host_cores)
        if stream == "host":
            out[("memory", host)] = (bus, bus)
        elif copy:
            out[("memory", host)] = (min(bus, getattr(dev, f"{stream}_bandwidth") * (2 if cpu else 1)), bus)
        return out

    def occupy(self, rank: int, stream: str, start: float, seconds: float, cpu: float = 0.0) -> float:
        """When work of ``seconds`` (at the device's own rate, alone) on ``stream`` that starts at ``start`` ends.

        An emulated device's compute (``speed_factor`` > 1) needs a core for only its own time (the runtime sleeps
        the rest out, runtime/executor.emulation_pause): it ends at the later of its stretched time and its core
        work done. ``cpu``: a transfer's seconds of a core's work beside it (gloo's): it ends at the later of its
        own time and that work done on a core of the host."""
        if cpu or (stream == "network" and rank in self.pooled):
            end = start + seconds
            if stream == "network" and rank in self.pooled:     # one transfer at a time, at the pool's rate
                host, count = self.pooled[rank]
                end = self.shared.book({("network", host): (1.0, 1.0)}, start, seconds / count)
            host = self.host.get(rank)
            if cpu:
                end = max(end, start + cpu if host is None else
                          self.shared.book({("cores", host): (1.0, self.hw.host_cores)}, start, cpu))
            self.waited[rank] += max(0.0, end - start - max(seconds, cpu))
            return end
        needs = self.needs(rank, stream)
        if not needs:
            return start + seconds
        dev = self.hw.devices[rank]       # compute slept out to its speed factor, an emulated link's copies to its rate
        factor = dev.stretch(stream) if hasattr(dev, "stretch") else \
            getattr(dev, "speed_factor", 1.0) if stream == "compute" else 1.0
        end = max(start + seconds, self.shared.book(needs, start, seconds / factor))
        self.waited[rank] += end - start - seconds
        return end

    def sharing(self) -> list[str]:
        """A line per host whose devices shared its cores: which, how many cores, how busy they kept them."""
        out = []
        for host in sorted(set(self.host.values())):
            devices = [d for d, h in self.host.items() if h == host]
            out.append(f"host {host}: devices {', '.join(map(str, devices))} share {self.hw.host_cores:g} cores "
                       f"({self.shared.used(('cores', host)):.3g} core-seconds of work) and "
                       f"{self.hw.host_memory_bandwidth / 1e9:.3g} GB/s of memory; their work waited "
                       f"{sum(self.waited[d] for d in devices):.3g} s for them in all")
        return out

    def book(self, rank: int, stream: str, start: float, seconds: float) -> float:
        """When a host copy of ``seconds`` (at the device's own rate) that starts at ``start`` ends."""
        return self.occupy(rank, stream, start, seconds)


def pooled_links(hw, count: int) -> dict[int, tuple[int, int]]:
    """Device -> (host, devices of the host), for the first ``count`` devices on hosts of more than one whose
    ``Hardware.network_shared`` pools their links to other servers."""
    if not getattr(hw, "network_shared", False):
        return {}
    groups = getattr(hw, "hosts", ()) or (tuple(range(len(hw.devices))),)
    return {d: (k, n) for k, g in enumerate(groups) for n in [sum(x < count for x in g)] if n > 1 for d in g
            if d < count}


def shared_hosts(hw, count: int) -> dict[int, int]:
    """Device -> host, for the first ``count`` devices on hosts with cores given and more than one of them."""
    if not getattr(hw, "host_cores", 0):
        return {}
    groups = getattr(hw, "hosts", ()) or (tuple(range(len(hw.devices))),)
    return {d: k for k, g in enumerate(groups) if sum(x < count for x in g) > 1 for d in g if d < count}


class _Port:
    """One device's view of the links: the ``peers`` object a ``Replay`` calls."""

    def __init__(self, links: _Links, rank: int):
        self.links, self.rank = links, rank

    def key_of_recv(self, node) -> tuple:
        return node.kwargs["src"], self.rank, node.kwargs["tag"]

    def waiting(self, node) -> bool:
        """Whether ``node`` is a recv whose send the peer has not replayed yet."""
        return op_of(node).receives and self.key_of_recv(node) not in self.links.arrivals

    def arrival(self, node) -> float:
        return self.links.arrivals[self.key_of_recv(node)]

    def sent(self, node, end: float) -> None:
        self.links.arrivals[(self.rank, node.kwargs["dst"], node.kwargs["tag"])] = end
        self.links.sent[self.rank] += message_bytes(self.links.plans[self.rank], node.kwargs["names"])
        self.links.messages[self.rank] += 1

    def occupy(self, stream: str, start: float, seconds: float, cpu: float = 0.0) -> float:
        return self.links.occupy(self.rank, stream, start, seconds, cpu)


class _Meets:
    """The data-parallel all-reduces of the node's ranks, matched: one of a communication group's collectives
    (``Plan.comm_groups``, the same on every rank whatever its packs) starts when the last of its ranks reaches it,
    as gloo's does. Matched only where every rank of the collective (its ``world``) is simulated here; a rank whose
    partners are elsewhere (a grid's replicas on other servers, ``sm.simulate`` of one rank) starts it alone."""

    def __init__(self, replays):
        self.keys: dict[tuple, list] = {}           # (rank, node) -> the collectives it runs: (group, occurrence)
        holders: dict[tuple, set] = {}
        for rank, r in enumerate(replays):
            seen: dict[frozenset, int] = {}
            for node in r.nodes:
                if node.target is not allreduce or (node.kwargs.get("world") or 1) < 2:
                    continue
                pack = node.args[0]
                keys = []
                for group in r.plan.comm_groups.get(pack) or [r.plan.packs[pack].owned]:
                    g = frozenset(group)
                    keys.append((g, seen.get(g, 0)))
                    seen[g] = seen.get(g, 0) + 1
                    holders.setdefault(keys[-1], set()).add(rank)
                self.keys[(rank, node)] = keys
        self.holders = {k: ranks for k, ranks in holders.items() if len(ranks) > 1}
        self.keys = {at: keys for at, keys in self.keys.items()
                     if all(len(holders[k]) >= (at[1].kwargs.get("world") or 1) for k in keys)}
        self.arrived: dict[tuple, float] = {}       # (collective, rank) -> when the rank reached it

    def reach(self, rank: int, replay) -> None:
        """Where ``replay``'s next op is a collective, note when the rank reaches it (once)."""
        keys = self.keys.get((rank, replay.next_node))
        if keys is not None and (keys[0], rank) not in self.arrived:
            at = replay.arrival()
            self.arrived.update({(k, rank): at for k in keys})

    def waiting(self, rank: int, replay) -> bool:
        """Whether ``replay``'s next op is a collective some of whose ranks have not reached it (``reach``); once all
        have, the op may start no earlier than the last's arrival (``Replay.not_before``)."""
        keys = self.keys.get((rank, replay.next_node))
        if keys is None:
            return False
        every = [(k, q) for k in keys for q in self.holders[k]]
        if any(x not in self.arrived for x in every):
            return True
        replay.not_before = max(self.arrived[x] for x in every)
        return False


def simulate_node(ranks, hw) -> NodeSimulation:
    """Simulate one step of ``len(ranks)`` devices of ``hw`` together; ``ranks[r]`` is device r's schedule as
    ``(graph, plan, memory, sizes)`` (``simulate``'s arguments: the memory curve and state sizes may be None).

    The pipeline ranks of one node (``plan_node`` in driver/node.py), or N data-parallel replicas of
    one schedule sharing the node's host links.
    """
    if len(ranks) > len(hw.devices):
        raise ConfigError(f"{len(ranks)} schedules but the hardware has {len(hw.devices)} devices: give a Hardware "
                          f"with a device per rank (Hardware.node(...), or Hardware.preset(name, count=N))")
    links = _Links(hw, [r[1] for r in ranks])
    replays = []
    for i, (graph, plan, memory, sizes) in enumerate(ranks):
        dev = OnHost(hw.devices[i], hw)
        replays.append(Replay(graph, plan, dev, f"device {i} ({dev.name})", memory, sizes, peers=_Port(links, i)))
    meets = _Meets(replays)
    while True:
        active = [r for r in replays if not r.finished]
        if not active:
            break
        for r in active:
            meets.reach(r.peers.rank, r)
        free = [r for r in active if not r.peers.waiting(r.next_node) and not meets.waiting(r.peers.rank, r)]
        if not free:
            stuck = ", ".join(f"device {r.peers.rank} at {r.next_node.name}" for r in active)
            raise ConfigError(f"the ranks' schedules deadlock: every device waits for a message never sent or a "
                              f"collective its peers never reach ({stuck}); each rank's schedule must be the "
                              f"single-device order restricted to its packs (passes/stage_schedule.py), and every "
                              f"rank's all-reduces the same groups in one order (Plan.comm_groups)")
        min(free, key=lambda r: r.clock.free["compute"]).advance()
    return NodeSimulation([r.result() for r in replays], sent=links.sent, messages=links.messages,
                          waited=links.waited, sharing=links.sharing())
