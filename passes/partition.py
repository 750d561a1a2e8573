"""partition: cut the model graph into contiguous layer packs, chosen by an exact dynamic program.

Cut points are the narrowest gaps of the graph (the fewest activation bytes cross
them: between transformer blocks, and between a block's two residual halves), so
the unit of choice is a layer. A pack is a contiguous run of layers; its working
set (parameters, gradients, optimizer state for the step, one microbatch's
activations and recompute) must fit the device budget. Among the partitions that
fit, the dynamic program picks the one with the least predicted iteration time:
compute (forward, backward and, for every pack but the last, recompute) plus the
time of swap traffic that compute cannot hide. Among the working-set caps it tries,
the plan cost also credits the recompute the swap pass can avoid by keeping packs'
forward graphs in the room smaller packs leave (``_Need.kept_graphs``).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.fx

from harmony.compiler.pack_cost import measure_pack
from harmony.compiler.ir import PassReport, PassResult, Program
from harmony.compiler.meta import COST, MODULE_PATH, PACK, STATE
from harmony.errors import BudgetError
from harmony.passes.offload import step_place
from harmony.passes.swap import mixed_placement
from harmony.runtime.plan import PackSpec, Plan, optim_state_bytes, step_extra, step_traffic
from harmony.runtime.precision import device_bytes
from harmony.units import fmt_bytes

NAME = "partition"
REQUIRES = {"cost"}
PROVIDES = {"packs"}

COMPUTE_OPS = ("call_function", "call_method", "call_module")
# The planner's fixed cost of one more pack: about ten schedule ops (a swap_in, wait and release of its
# weights per phase, its gradients' release, its step) at a few microseconds of executor loop and copy
# hand-off each. It breaks ties towards fewer packs; it must not outweigh what smaller packs save in
# traffic (their freed room keeps optimizer state resident): at 1e-4 s the swap-volume benchmark's 12-layer
# GPT at half its state picked 3 packs moving 31.2 MiB a step, at 3e-5 s 7 packs moving 26.1 MiB.
PACK_SECONDS = 3e-5


@dataclass
class Unit:
    nodes: list
    params: frozenset        # trainable state names
    buffers: frozenset
    fwd_flops: float
    bwd_flops: float
    kept: float              # activation bytes kept for backward, one microbatch
    peak: float              # transient bytes of its forward, one microbatch
    bwd: float               # transient bytes of its backward, one microbatch
    cross_in: float          # activation bytes entering it


def compute_nodes(gm) -> list:
    return [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]


def storage_root(node):
    """The node whose output owns the storage this node's output lives in (itself unless a view)."""
    while node.op in COMPUTE_OPS and node.meta[COST].alias_of is not None:
        node = node.all_input_nodes[node.meta[COST].alias_of]
    return node


def _crossing(nodes, b) -> tuple[list[float], list[int]]:
    """Bytes and number of tensors crossing each gap (gap g sits before nodes[g]); a view keeps its base alive."""
    index = {n: i for i, n in enumerate(nodes)}
    last_use = {}
    for i, n in enumerate(nodes):
        root = storage_root(n)
        for u in n.users:
            last_use[root] = max(last_use.get(root, i), index.get(u, len(nodes)))
    diff = [0.0] * (len(nodes) + 2)
    count = [0] * (len(nodes) + 2)
    for i, n in enumerate(nodes):
        last = last_use.get(n, i)
        size = n.meta[COST].out_bytes.at(b)
        if last > i and size > 0:   # live across every gap g with i < g <= last
            diff[i + 1] += size
            diff[last + 1] -= size
            count[i + 1] += 1
            count[last + 1] -= 1
    out, num, acc, k = [], [], 0.0, 0
    for g in range(len(nodes)):
        acc += diff[g]
        k += count[g]
        out.append(acc)
        num.append(k)
    return out, num


def find_units(program: Program) -> list[Unit]:
    """Layers: the runs of nodes between the narrowest gaps of the graph.

    A gap is narrow when the fewest tensors cross it (between two layers of an MLP or
    CNN one activation crosses, inside a block several do), or when the bytes crossing
    it are within 1.5x of the least (between transformer blocks the hidden state and
    a mask cross, while the fewest tensors cross where the position ids are made);
    crossings under a quarter of the median (index tensors) do not set the least.
    """
    gm, b = program.gm, program.config.microbatch_size
    nodes = compute_nodes(gm)
    cross, count = _crossing(nodes, b)
    fewest = min((c for c in count[1:] if c > 0), default=0)
    positive = sorted(c for c in cross[1:] if c > 0)
    median = positive[len(positive) // 2] if positive else 0.0
    least = min((c for c in positive if c >= 0.25 * median), default=0.0)   # ignore tiny index tensors
    cuts = [0] + [g for g in range(1, len(nodes)) if count[g] <= fewest or cross[g] <= 1.5 * least] + [len(nodes)]
    names = dict(program.gm.named_parameters())
    units = []
    for s, e in zip(cuts, cuts[1:]):
        if e > s:
            units.append(_summarise(nodes[s:e], cross[s], names, b))
    return units


def _state_of(node):
    names = set(node.meta.get(STATE, ()))
    for a in node.all_input_nodes:
        if a.op == "get_attr":
            names |= set(a.meta.get(STATE, ()))
    return names


def _summarise(nodes, cross_in, trainable, b) -> Unit:
    inside = set(nodes)
    state = set().union(*(_state_of(n) for n in nodes))
    params = frozenset(s for s in state if s in trainable and trainable[s].requires_grad)
    kept = live = peak = bwd = 0.0
    saved_by_user = set()
    for n in nodes:
        c = n.meta[COST]
        kept += c.saved_bytes.at(b)
        for i in c.saved_inputs:
            a = n.all_input_nodes[i]
            if a in inside and a not in saved_by_user and not a.meta[COST].saves_output:
                saved_by_user.add(a)
                kept += a.meta[COST].out_bytes.at(b)
    remaining = {n: sum(1 for u in n.users) for n in nodes}
    for n in nodes:
        c = n.meta[COST]
        live += c.out_bytes.at(b)
        peak = max(peak, live + c.fwd_extra.at(b))
        bwd = max(bwd, c.bwd_peak.at(b))
        for a in n.all_input_nodes:
            if a in remaining:
                remaining[a] -= 1
                if remaining[a] == 0 and a not in saved_by_user:
                    live -= a.meta[COST].out_bytes.at(b)
    return Unit(nodes, params, frozenset(state - params),
                sum(n.meta[COST].fwd_flops.at(b) for n in nodes),
                sum(n.meta[COST].bwd_flops.at(b) for n in nodes), kept, peak, bwd, cross_in)


class _Need:
    """Working set and time of a candidate pack (units s..e-1), from unit summaries; each pack's figures once
    (the cap search and the corrections run the DP a dozen times over mostly the same packs)."""

    def __init__(self, program: Program, units: list[Unit]):
        self.p, self.units = program, units
        self.memo: dict = {}
        self.sizes = device_sizes(program)       # bytes on the device (compute copies under mixed precision)
        self.master = {n: t.numel() * t.element_size() for n, t in program.gm.named_parameters()}
        self.state_per_byte = program.optim_profile["state_per_byte"]   # per byte of fp32 master

    def __call__(self, s: int, e: int, last: bool) -> tuple[float, float]:
        key = (s, e, last)
        if key not in self.memo:
            self.memo[key] = self._figures(s, e, last)
        return self.memo[key]

    def _figures(self, s: int, e: int, last: bool) -> tuple[float, float]:
        us = self.units[s:e]
        params = self.params(s, e)
        bufs = frozenset().union(*(u.buffers for u in us))
        pbytes = sum(self.sizes[n] for n in params)
        bbytes = sum(self.sizes[n] for n in bufs)
        prof = self.p.optim_profile   # the step brings one parameter's optimizer state in at a time
        extra = max((self.state_per_byte * self.master[n] + step_extra(prof, [self.master[n]]) for n in params),
                    default=0)
        kept = sum(u.kept for u in us)
        boundary = us[0].cross_in + (self.units[e].cross_in if e < len(self.units) else 0)
        act = max(max(u.peak for u in us) + boundary, kept + max(u.bwd for u in us) + 2 * boundary)
        if self.p.config.optimizer_on != "device":
            extra = 0          # the optimizer steps on the host (offload pass)
        need = pbytes + bbytes + pbytes + max(extra, act)
        cfg = self.p.config
        m = cfg.microbatches
        flops = sum(u.fwd_flops + u.bwd_flops + (0 if last else u.fwd_flops) for u in us) * m
        traffic = (pbytes + bbytes) * (1 if last else 2) + sum(self.master[n] for n in params) * 2 * self.state_per_byte \
            + self.stash(s)
        seconds = max(flops / cfg.flops, traffic / cfg.copy_bandwidth) + PACK_SECONDS
        return need, seconds

    def traffic(self, s: int, e: int, last: bool, host: bool = False) -> float:
        """Bytes a swapped pack moves per iteration: weights in per phase, out once updated, optimizer state in and out
        (``host``: the optimizer steps on the host, so gradients go out instead of weights and its state never moves),
        and what its input's stashes move (``stash``)."""
        params = self.params(s, e)
        pbytes = sum(self.sizes[n] for n in params)
        optim = 0 if host else sum(self.master[n] for n in params) * 2 * self.state_per_byte
        return pbytes * ((1 if last else 2) + 1) + optim + self.stash(s)

    def stash(self, s: int) -> float:
        """Bytes a cut before unit ``s`` moves per iteration where nothing crossing it stays on the device.

        Under the harmony policy every microbatch's activations crossing the cut wait on the device or
        the host from the forward to the backward, and their gradients from the backward of the pack
        after the cut to the backward of the pack before it: each byte stashed goes out and comes back
        (4 bytes moved per byte crossing, per microbatch). The swap pass keeps them before weights where
        the budget has room (2 bytes saved per byte held); ``plan_cost`` counts that room.
        """
        if s == 0 or self.p.config.policy != "harmony":
            return 0.0
        return 4.0 * self.units[s].cross_in * self.p.config.microbatches

    def plan_cost(self, cuts, budget: float) -> tuple[float, float]:
        """(seconds, bytes moved) of a partition, counting what the swap pass will keep resident.

        As the swap pass does: parameters first (a byte kept saves 3 moved: in for forward and
        backward, out once updated), then optimizer state (2: in and out around the step). A pack's
        need already counts its own parameters, so with every parameter resident the room left is
        ``budget - P - max(need - own parameters)``; smaller packs leave more of it. Under a host
        step (harmony policy) weights are held from a pack's forward to its backward, beside the last
        pack's working set: a smaller last pack leaves more room for them. What crosses the cuts for
        every microbatch (``stash``) is held before weights, as the swap pass ranks it: fewer cuts, or
        cuts where less crosses, leave more room and move less. The host's optimizer steps add what
        they keep the step running after the device's last backward (``host_tail``).
        """
        last = len(cuts) - 1
        own = [self._param_bytes(s, e) for s, e in cuts]
        total = sum(own)
        host_share = 0.0     # of the parameters' bytes, what steps on the host (the tail ``host_tail`` prices)
        # where the offload pass will step the optimizer (it decides after the partition, with the exact curve)
        host = step_place(self.p.config, lambda: (2 + self.state_per_byte) * total <= budget)[0] == "host"
        moved = sum(self.traffic(s, e, i == last, host) for i, (s, e) in enumerate(cuts))
        needs = [self(s, e, i == last)[0] for i, (s, e) in enumerate(cuts)]
        optim = sum(self.master[n] for n in self.params(0, len(self.units))) * self.state_per_byte
        all_params = total + max(n - p for n, p in zip(needs, own))
        if self.p.config.optimizer_on != "device":
            optim = 0.0
        crossing = sum(self.stash(s) for s, _ in cuts) / 4     # activation bytes crossing the cuts, all microbatches
        if host and self.p.config.policy == "harmony" and self.p.config.host_memory_budget is None:
            # the host updates the weights, so none stay for good; but a pack's can stay from its forward to its
            # backward (1 byte saved per byte), all of them beside the last pack's working set at the turn; room
            # left then lets packs step on the device with all their state resident (2 more saved per byte of
            # parameters, for its optimizer state held), where the swap pass may do that (swap.mixed_placement)
            # the cuts' stashes go first: a byte crossing a cut held saves 2, and its gradient as much again
            host_share = 1.0
            room = max(0.0, budget - needs[-1])
            held = min(crossing, room)
            room -= held
            weights = min(total - own[-1], room)
            saved = 4 * held + weights
            if mixed_placement(self.p.config) and self.state_per_byte:
                on_device = min(total, max(0.0, room - weights) / self.state_per_byte)
                saved += 2 * on_device
                host_share = 1.0 - on_device / total if total else 0.0
        elif host:
            # with a host budget, packs may live on disk, whose reads and writes this model does not price (the
            # credit above picked 48 packs for the offload benchmark's 600M GPT where 12 had been chosen, 2.5 s
            # a step slower on this machine); the swap pass still holds weights where its curve finds room
            saved = 0.0
        elif all_params <= budget:
            optim_held = min(optim, budget - all_params)
            saved = 3 * total - own[-1] + 2 * optim_held + 4 * min(crossing, budget - all_params - optim_held)
        else:
            saved = 3 * max(0.0, budget - max(needs))
        left = max(0.0, moved - saved)
        share = left / moved if moved else 0.0     # the traffic residency does not save
        cfg, m = self.p.config, self.p.config.microbatches
        kept = self.kept_graphs(cuts, budget, max(own), needs[-1], saved)
        seconds, backward = 0.0, []
        for i, (s, e) in enumerate(cuts):
            recompute = 0 if i == last or i in kept else 1
            us = self.units[s:e]
            flops = sum(u.fwd_flops * (1 + recompute) + u.bwd_flops for u in us) * m
            pack = max(flops / cfg.flops, share * self.traffic(s, e, i == last, host) / cfg.copy_bandwidth) + PACK_SECONDS
            seconds += pack
            back = sum(u.fwd_flops * recompute + u.bwd_flops + (u.fwd_flops if i == last else 0) for u in us) * m
            backward.append(pack * back / flops if flops else pack)
        return seconds + self.host_tail(cuts, backward, host_share), left

    def host_tail(self, cuts, backward: list[float], host_share: float) -> float:
        """Seconds the step ends after the device's last backward because the host is still stepping.

        Each pack steps on the host once its backward ends, one pack at a time, behind the packs before
        it in backward order; the first pack steps last, and the next forward waits for its weights.
        A step moves ``plan.step_traffic`` bytes of the fp32 masters, gradients and optimizer state at the
        host's memory bandwidth, as the simulator prices it; ``host_share`` of them step on the host.
        """
        if not host_share:
            return 0.0
        t = free = 0.0
        for i in reversed(range(len(cuts))):
            t += backward[i]
            master = sum(self.master[n] for n in self.params(*cuts[i]))
            step = step_traffic(master, master * self.state_per_byte) / self.p.config.host_bandwidth
            free = max(free, t) + host_share * step
        return max(0.0, free - t)

    def kept_graphs(self, cuts, budget: float, largest: float, last_need: float, resident: float) -> set[int]:
        """The packs whose forward's graph the swap pass can keep (no recompute), as it chooses them.

        The binding moment is the turn from forward to backward: the last pack's working set, the
        next pack's weights coming in (where compute outweighs copies the swap pass leaves room for
        that) and every kept graph, for all microbatches under the harmony policy, are on the device
        at once. Graphs go first where recompute outweighs the traffic the same bytes save (the
        swap pass's ranking: recompute time as bytes at the link's speed, per byte held), else into
        what residency leaves. Smaller packs leave more room: this is what lets the cap search see it.
        """
        cfg = self.p.config
        if cfg.recompute != "auto" or cfg.policy == "ondemand" or len(cuts) < 2:
            return set()
        m = cfg.microbatches
        times = cfg.microbatches if cfg.policy == "harmony" else 1
        compute = sum(u.fwd_flops * 2 + u.bwd_flops for u in self.units) * m / cfg.flops
        copies = sum(self.traffic(s, e, i == len(cuts) - 1) for i, (s, e) in enumerate(cuts)) / cfg.copy_bandwidth
        room = budget - last_need - (largest if compute > copies else 0)
        options = []
        for i, (s, e) in enumerate(cuts[:-1]):
            held = sum(u.kept + u.cross_in for u in self.units[s:e]) * times
            gain = sum(u.fwd_flops for u in self.units[s:e]) * m / cfg.flops * cfg.copy_bandwidth / max(held, 1)
            options.append((gain, held, i))
        if compute <= copies:          # graphs only where residency leaves room (it saves 2 to 3 bytes per byte)
            room -= resident / 2
            options = [o for o in options if o[0] > 3]
        out = set()
        for gain, held, i in sorted(options, reverse=True):
            if held <= room:
                out.add(i)
                room -= held
        return out

    def _param_bytes(self, s: int, e: int) -> float:
        return sum(self.sizes[n] for n in self.params(s, e))

    def params(self, s: int, e: int) -> frozenset:
        """The trainable state names of units s..e-1 (a parameter two units share counts once)."""
        return frozenset().union(*(u.params for u in self.units[s:e]))


def plan_packs(need: _Need, budget: float) -> list[tuple[int, int]] | None:
    """Exact DP over contiguous partitions of ``need``'s units: least predicted time, every pack within ``budget``."""
    n = len(need.units)
    best = [math.inf] * (n + 1)
    choice = [0] * (n + 1)
    best[0] = 0.0
    for e in range(1, n + 1):          # prefix [0, e) made of non-last packs
        for s in range(e - 1, -1, -1):
            size, secs = need(s, e, last=False)
            if size > budget:
                break                  # a longer pack only needs more
            if best[s] + secs < best[e]:
                best[e], choice[e] = best[s] + secs, s
    final, start = math.inf, None
    for s in range(n - 1, -1, -1):     # the last pack runs forward and backward without recompute
        size, secs = need(s, n, last=True)
        if size > budget:
            break
        if best[s] + secs < final:
            final, start = best[s] + secs, s
    if start is None:
        return None
    cuts, e = [(start, n)], start
    while e > 0:
        cuts.append((choice[e], e))
        e = choice[e]
    return cuts[::-1]


# -- building the packs ----------------------------------------------------------------------------
def build_packs(program: Program, cuts: list[tuple[int, int]], units: list[Unit]) -> list[PackSpec]:
    gm = program.gm
    pack_of = {}
    for i, (s, e) in enumerate(cuts):
        for u in units[s:e]:
            for node in u.nodes:
                pack_of[node] = i
                node.meta[PACK] = i
    output = next(n for n in gm.graph.nodes if n.op == "output")
    loss_node = output.args[0]
    trainable = dict.fromkeys(n for n, p in gm.named_parameters() if p.requires_grad)   # model order: not a set
    sizes = device_sizes(program)
    master = {n: t.numel() * t.element_size() for n, t in gm.named_parameters()}
    specs = []
    users_of = {}
    for i in range(len(cuts)):
        nodes = [n for n in gm.graph.nodes if pack_of.get(n) == i]
        inputs, seen = [], set()
        for n in nodes:
            for a in n.all_input_nodes:
                if a.op != "get_attr" and pack_of.get(a) != i and a not in seen:
                    seen.add(a)
                    inputs.append(a)
        outputs = [n for n in nodes if n is loss_node or any(pack_of.get(u, len(cuts)) > i for u in n.users
                                                               if u is not output)]
        state = set().union(*(_state_of(n) for n in nodes))
        module = _split(gm, nodes, inputs, outputs)
        specs.append(PackSpec(
            index=i, name=_pack_name(nodes), module=module,
            inputs=[a.name for a in inputs],
            outputs=["loss" if n is loss_node else n.name for n in outputs],
            params=sorted(s for s in state if s in trainable),
            buffers=sorted(s for s in state if s not in trainable),
            owned=[], mutated=sorted({m for n in nodes for m in n.meta[COST].mutates}),
            random=any(n.meta[COST].random for n in nodes)))
        users_of[i] = (inputs, nodes)
    for p in trainable:                # a parameter's gradient is complete after the last backward using it
        users = [s.index for s in specs if p in s.params]
        if users:
            specs[min(users)].owned.append(p)
    prof = program.optim_profile
    owner, rank = program.config.state_owner, program.config.rank
    for spec in specs:
        inputs, nodes = users_of[spec.index]
        # sharded optimizer state: this rank steps (and keeps state for) only the params it owns
        spec.stepped = [n for n in spec.owned if owner is None or owner.get(n, rank) == rank]
        spec.param_bytes = sum(sizes[n] for n in spec.params)
        spec.buffer_bytes = sum(sizes[n] for n in spec.buffers)
        spec.master_bytes = sum(master[n] for n in spec.params)
        owned = [master[n] for n in spec.stepped]   # optimizer state is per fp32 master byte
        spec.optim_bytes = sum(optim_state_bytes(prof, b) for b in owned)
        spec.step_extra = step_extra(prof, owned)
        spec.stream_step_peak = max((optim_state_bytes(prof, b) + step_extra(prof, [b]) for b in owned),
                                    default=0)
        spec.fwd_flops = int(sum(n.meta[COST].fwd_flops.at(program.config.microbatch_size) for n in nodes))
        spec.bwd_flops = int(sum(n.meta[COST].bwd_flops.at(program.config.microbatch_size) for n in nodes))
        key = (tuple(nodes), "loss" in spec.outputs)
        if key not in program.pack_measurements:   # the DP's corrections revisit the same packs
            vals = [program.fake.vals[a] for a in inputs]
            grad_inputs = [a.op != "placeholder" for a in inputs]
            program.pack_measurements[key] = measure_pack(spec.module, vals, grad_inputs, program.fake,
                                                          loss_output="loss" in spec.outputs,
                                                          memo=program.pack_measurements)
        m = program.pack_measurements[key]
        spec.fwd_peak, spec.fwd_keep_peak = m["fwd_peak"], m["fwd_keep_peak"]
        spec.saved_bytes, spec.out_bytes = m["saved_bytes"], m["out_bytes"]
        if not spec.saved_bytes:   # until measure_kept measures it: the estimate
            spec.saved_bytes = int(sum(u.kept for u in units if u.nodes[0] in nodes))
        spec.bwd_peak, spec.bwd_recompute_peak = m["bwd_peak"], m["bwd_recompute_peak"]
        spec.bwd_peak_accum, spec.bwd_recompute_peak_accum = m["bwd_peak_accum"], m["bwd_recompute_peak_accum"]
        spec.in_bytes = sum(_tensor_bytes(program.fake.vals[a]) for a in inputs if a.op != "placeholder")
    return specs


def measure_kept(program: Program, specs: list[PackSpec]) -> None:
    """Measure what every pack but the last needs if it keeps its forward's graph instead of recomputing.

    The swap pass lets a pack keep its graph (its backward then runs without recompute)
    where the budget has room; these are the figures ``verify`` predicts that with. Measured
    for the chosen packs only, after the DP, so its corrections do not pay for it.
    """
    by_name = {n.name: n for n in program.gm.graph.nodes}
    for spec in specs[:-1]:
        key = (tuple(spec.inputs), tuple(spec.outputs), "keep")
        if key not in program.pack_measurements:
            inputs = [by_name[n] for n in spec.inputs]
            program.pack_measurements[key] = measure_pack(
                spec.module, [program.fake.vals[a] for a in inputs], [a.op != "placeholder" for a in inputs],
                program.fake, loss_output=False, keep=True, memo=program.pack_measurements)
        m = program.pack_measurements[key]
        spec.fwd_keep_peak, spec.saved_bytes = m["fwd_keep_peak"], m["saved_bytes"]
        spec.bwd_peak, spec.bwd_peak_accum = m["bwd_peak"], m["bwd_peak_accum"]


def device_sizes(program: Program) -> dict[str, int]:
    """Bytes of each parameter and buffer on the device: in the compute dtype under mixed precision."""
    dtype = program.config.compute_dtype
    return {n: device_bytes(t, dtype) for n, t in
            list(program.gm.named_parameters()) + list(program.gm.named_buffers())}


def _tensor_bytes(v, floating: bool = True) -> int:
    if not isinstance(v, torch.Tensor) or (floating and not v.is_floating_point()):
        return 0
    return v.untyped_storage().nbytes()


def _layers_alone(program: Program, units: list[Unit]):
    """Every layer a pack of its own, the least any plan needs: (cuts, specs, the largest measured need)."""
    n = len(units)
    cuts = [(i, i + 1) for i in range(n)]
    specs = build_packs(program, cuts, units)
    return cuts, specs, max(measured_need(program, s, i == n - 1) for i, s in enumerate(specs))


def _smallest_budget(program: Program, units: list[Unit]) -> int:
    """The budget at which every layer fits alone, measured, with the planner's headroom added back."""
    need = _layers_alone(program, units)[2]
    return int(need / (1 - program.config.headroom) * 1.05) + 1


def _split(gm, nodes, inputs, outputs) -> torch.fx.GraphModule:
    g = torch.fx.Graph()
    env = {a: g.placeholder(a.name) for a in inputs}
    for n in nodes:
        for a in n.all_input_nodes:
            if a.op == "get_attr" and a not in env:
                env[a] = g.node_copy(a)
        env[n] = g.node_copy(n, lambda x: env[x])
    g.output(tuple(env[n] for n in outputs))
    return torch.fx.GraphModule(gm, g)


def _pack_name(nodes) -> str:
    paths = [n.meta.get(MODULE_PATH, "") for n in nodes]
    paths = [p for p in paths if p] or ["(top level)"]
    return paths[0] if paths[0] == paths[-1] else f"{paths[0]} .. {paths[-1]}"


def measured_need(program: Program, spec: PackSpec, last: bool) -> int:
    """Device bytes a pack needs alone, from its measured figures: the most of its phases.

    Everything else (other packs, other microbatches' activations) is assumed swapped
    or stashed out; the swap pass then checks the whole schedule.
    """
    state = spec.param_bytes + spec.buffer_bytes
    grads = spec.param_bytes
    inputs = spec.in_bytes + sum(program.fake_batch_bytes.get(n, 0) for n in spec.inputs)
    step = state + grads + (spec.stream_step_peak if program.config.optimizer_on == "device" else 0)
    if last:
        compute = max(inputs + spec.fwd_keep_peak, inputs + spec.out_bytes + spec.saved_bytes + spec.bwd_peak)
    else:
        compute = max(inputs + spec.fwd_peak,
                      inputs + spec.out_bytes + spec.bwd_recompute_peak + grads)
    return int(max(state + grads + compute, step))


def _working_set_cap(need: _Need, budget: int) -> int:
    """The largest working set a pack may have: smaller packs leave room for resident state.

    Tries caps from the budget down to the largest single layer's need; keeps the one
    with the least predicted time, and among those within 2% of it the least traffic.
    """
    n = len(need.units)
    floor = max([need(i, i + 1, False)[0] for i in range(n - 1)] + [need(n - 1, n, True)[0]])
    if floor >= budget:
        return budget
    plans = []
    for k in range(10):
        cap = budget * (floor / budget) ** (k / 9)
        cuts = plan_packs(need, cap)
        if cuts is not None:
            plans.append((cap, *need.plan_cost(cuts, budget)))
    if not plans:
        return budget
    fastest = min(p[1] for p in plans)
    return int(min((p for p in plans if p[1] <= fastest * 1.02), key=lambda p: p[2])[0])


def _choose(program: Program, units: list[Unit], budget: int):
    """The DP on unit estimates, corrected by measuring the packs it picks until they fit; returns the cuts,
    the packs (None, None where nothing fits) and the estimates (``_Need``, which the report reads again)."""
    need = _Need(program, units)
    target = _working_set_cap(need, budget)
    for attempt in range(24):
        cuts = plan_packs(need, target)
        if cuts is None:   # the estimates say no; measured, every layer alone may still fit
            break
        specs = build_packs(program, cuts, units)
        worst = max(measured_need(program, s, i == len(specs) - 1) for i, s in enumerate(specs))
        if worst <= budget:
            return cuts, specs, need
        # scale the estimates' target by what measuring found; if that does not converge (a pack the
        # estimates under-count stays too big), step down geometrically until the DP gives up
        target = int(target * min(budget / worst * 0.97, 0.8 if attempt >= 8 else 1.0))
    # the corrections did not converge, or the estimates rule every plan out: every layer a pack of
    # its own is the least any plan needs, so it decides (a larger budget must not fail where a
    # smaller one works)
    cuts, specs, least = _layers_alone(program, units)
    return (cuts, specs, need) if least <= budget else (None, None, need)


def run(program: Program, ctx) -> PassResult:
    start = time.perf_counter()
    cfg = program.config
    units = find_units(program)
    program.units = [u.nodes for u in units]
    program.fake_batch_bytes = {ph.name: _tensor_bytes(program.fake.vals[ph], floating=False)
                                for ph in program.gm.graph.nodes if ph.op == "placeholder"}
    cuts, specs, need = _choose(program, units, cfg.usable_budget)
    if cuts is None:
        floor = _smallest_budget(program, units)
        raise BudgetError(
            f"memory_budget={fmt_bytes(cfg.memory_budget)} is below what one layer needs at microbatch size "
            f"{cfg.microbatch_size}: the smallest budget that works is {fmt_bytes(floor)} ({floor} bytes). "
            f"Raise memory_budget, or use more microbatches.", min_budget=floor)
    if cfg.recompute == "auto" and cfg.policy != "ondemand":
        measure_kept(program, specs)
    batch_bytes = dict(program.fake_batch_bytes)
    program.plan = Plan(packs=specs, microbatches=cfg.microbatches, microbatch_size=cfg.microbatch_size,
                        input_names=list(batch_bytes), batch_bytes=batch_bytes, policy=cfg.policy,
                        precision=cfg.precision, loss_scaling=dict(cfg.loss_scaling),
                        state_owner=dict(cfg.state_owner or {}), rank=cfg.rank,
                        state_bytes={n: b for n, b in device_sizes(program).items() if n in (cfg.state_owner or {})})
    rows = [dict(pack=s.index, layers=s.name, units=e - b, params_MiB=s.param_bytes / 2**20,
                 saved_MiB=s.saved_bytes / 2**20,
                 need_MiB=measured_need(program, s, i == len(cuts) - 1) / 2**20,
                 GFLOP=(s.fwd_flops + s.bwd_flops) / 1e9)
            for i, (s, (b, e)) in enumerate(zip(specs, cuts))]
    report = PassReport("partition: layer packs", rows, totals=dict(
        layers=len(units), packs=len(specs), usable_budget_MiB=cfg.usable_budget / 2**20,
        objective_s=sum(need(b, e, i == len(cuts) - 1)[1] for i, (b, e) in enumerate(cuts)),
        solve_s=time.perf_counter() - start))
    report.notes.append(f"cut points: {len(units) - 1} narrowest gaps of the graph; "
                        f"packs chosen by an exact DP over {len(units)} layers")
    return PassResult(program, report)
