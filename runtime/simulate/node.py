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

What is not modelled: the host's CPU and memory bandwidth shared by the devices' optimizer steps (each device's
host steps run as if it had the host alone), P2P traffic contending with swaps on a device's own link, and the
receiver's link (a message takes only the sender's). With one device the result is ``simulate``'s, op for op.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from harmony.base.errors import ConfigError
from harmony.runtime.ops import op_of
from harmony.runtime.pipeline import message_bytes
from harmony.runtime.simulate import OnHost, Replay, SimEvent, Simulation, fmt_seconds

MiB = 2**20


@dataclass
class NodeSimulation:
    """One simulated step of a node: each device's ``Simulation`` and what it sent to its peers."""

    devices: list[Simulation]
    sent: list[int] = field(default_factory=list)          # bytes each device sent to its peers
    messages: list[int] = field(default_factory=list)      # messages each device sent

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
                            sent_MiB=(self.sent[i] if self.sent else 0) / MiB, peak_MiB=d.peak_bytes / MiB))
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
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"NodeSimulation(step {fmt_seconds(self.step_seconds)} on {len(self.devices)} devices; "
                f"{len(self.events)} ops in .events, a row per device in .rows())")


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


class _Links:
    """What the devices share: the messages sent so far, and the bookings of each shared host link."""

    def __init__(self, hw, plans):
        self.hw, self.plans = hw, plans
        self.group = {d: k for k, g in enumerate(getattr(hw, "switches", ())) if len(g) > 1 for d in g}
        self.booked: dict[tuple, list[tuple[float, float, float]]] = {}   # (group, stream) -> (t0, t1, bytes/s)
        self.arrivals: dict[tuple, float] = {}                           # (src, dst, tag) -> when the send ends
        self.sent = [0] * len(plans)
        self.messages = [0] * len(plans)

    def book(self, rank: int, stream: str, start: float, seconds: float) -> float:
        """When a host copy of ``seconds`` (at the device's own rate) that starts at ``start`` ends."""
        if rank not in self.group:
            return start + seconds
        rate = getattr(self.hw.devices[rank], f"{stream}_bandwidth")
        room = self.hw.switch_bandwidth
        booked = self.booked.setdefault((self.group[rank], stream), [])
        live = [b for b in booked if b[1] > start]
        edges = sorted({t for b in live for t in b[:2] if t > start})
        t, left = start, seconds          # seconds still to copy at the device's own rate
        for nxt in edges + [float("inf")]:
            share = min(rate, room - sum(r for t0, t1, r in live if t0 <= t < t1)) / rate
            if share > 0:
                need = left if share == 1 else left / share
                if t + need <= nxt:
                    booked.append((t, t + need, share * rate))
                    return t + need
                booked.append((t, nxt, share * rate))
                left -= (nxt - t) * share
            t = nxt
        raise AssertionError("unreachable: the last interval is unbounded")


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

    def host_copy(self, label: str, stream: str, start: float, seconds: float) -> float:
        return self.links.book(self.rank, stream, start, seconds)


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
    while True:
        active = [r for r in replays if not r.finished]
        if not active:
            break
        free = [r for r in active if not r.peers.waiting(r.next_node)]
        if not free:
            stuck = ", ".join(f"device {r.peers.rank} at {r.next_node.name}" for r in active)
            raise ConfigError(f"the ranks' schedules deadlock: every device waits for a message never sent "
                              f"({stuck}); each rank's schedule must be the single-device order restricted to "
                              f"its packs (passes/stage_schedule.py)")
        min(free, key=lambda r: r.clock.free["compute"]).advance()
    return NodeSimulation([r.result() for r in replays], sent=links.sent, messages=links.messages)
