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
forward graphs in the room smaller packs leave (``PackCost.kept_graphs``). Where the copies outlast
the compute and the host's optimizer steps (a slow host link), the traffic decides the step: every
candidate is then priced with the linear program of what can stay on the device (``PackCost.residency``,
what the swap pass's integer program realises), and a second search joins the DP, the partition that
leaves the least traffic (``least_traffic``: a large first pack, few cuts, small last packs). That cost
model is ``partition.cost``, the searches and the cap search ``partition.search``; this module makes the
layers, measures the packs the search picks and corrects its target until they fit, and builds them.
"""
from __future__ import annotations

import time

import torch
import torch.fx

from harmony.base.errors import BudgetError, ConfigError
from harmony.base.tiers import Tier
from harmony.base.units import fmt_bytes, nbytes
from harmony.compiler.ir import PassReport, PassResult, Program
from harmony.compiler.meta import COST, MODULE_PATH, PACK
from harmony.compiler.pack_cost import measure_pack
from harmony.passes.partition.cost import PackCost, device_sizes
from harmony.passes.partition.search import plan_packs, working_set_cap
from harmony.passes.partition.units import COMPUTE_OPS, Unit, compute_nodes, find_units, state_of, storage_root  # noqa: F401
from harmony.runtime.comm.compression import NO_COMPRESSION
from harmony.runtime.ops.reduce import comm_buffer_bytes
from harmony.runtime.plan import PackSpec, Plan, optim_state_bytes, step_extra

NAME = "partition"
REQUIRES = {"cost"}
PROVIDES = {"packs"}

# -- building the packs ----------------------------------------------------------------------------
def build_packs(program: Program, cuts: list[tuple[int, int]], units: list[Unit]) -> list[PackSpec]:
    """The packs of ``cuts`` (runs of ``units``): each one's graph module and its inputs, outputs and state, the
    parameters it owns and steps, its bytes and flops, and its measured peaks."""
    gm = program.gm
    pack_of = _mark_packs(cuts, units)
    trainable = dict.fromkeys(n for n, p in gm.named_parameters() if p.requires_grad)   # model order: not a set
    sizes = device_sizes(program)
    master = {n: nbytes(t) for n, t in gm.named_parameters()}
    specs, users_of = [], {}
    for i in range(len(cuts)):
        spec, inputs, nodes = _pack_spec(gm, i, len(cuts), pack_of, trainable)
        specs.append(spec)
        users_of[i] = (inputs, nodes)
    for p in trainable:                # a parameter's gradient is complete after the last backward using it
        users = [s.index for s in specs if p in s.params]
        if users:
            specs[min(users)].owned.append(p)
    mb = program.config.microbatch_size
    for spec in specs:
        inputs, nodes = users_of[spec.index]
        _count_state(program, spec, sizes, master)
        spec.fwd_flops = int(sum(n.meta[COST].fwd_flops.at(mb) for n in nodes))
        spec.bwd_flops = int(sum(n.meta[COST].bwd_flops.at(mb) for n in nodes))
        _measure_peaks(program, spec, inputs, nodes, units)
    return specs


def _mark_packs(cuts: list[tuple[int, int]], units: list[Unit]) -> dict:
    """Node -> the index of its pack, also written into each node's ``meta[PACK]``."""
    pack_of = {}
    for i, (s, e) in enumerate(cuts):
        for u in units[s:e]:
            for node in u.nodes:
                pack_of[node] = i
                node.meta[PACK] = i
    return pack_of


def _pack_spec(gm, i: int, packs: int, pack_of: dict, trainable: dict) -> tuple[PackSpec, list, list]:
    """Pack ``i``'s spec (its module cut from ``gm``, inputs, outputs, parameters and buffers; none owned yet), with
    the nodes feeding it from outside and its own nodes."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    loss_node = output.args[0]
    nodes = [n for n in gm.graph.nodes if pack_of.get(n) == i]
    inputs, seen = [], set()
    for n in nodes:
        for a in n.all_input_nodes:
            if a.op != "get_attr" and pack_of.get(a) != i and a not in seen:
                seen.add(a)
                inputs.append(a)
    outputs = [n for n in nodes if n is loss_node or any(pack_of.get(u, packs) > i for u in n.users
                                                           if u is not output)]
    state = set().union(*(state_of(n) for n in nodes))
    module = _split(gm, nodes, inputs, outputs)
    spec = PackSpec(
        index=i, name=_pack_name(nodes), module=module,
        inputs=[a.name for a in inputs],
        outputs=["loss" if n is loss_node else n.name for n in outputs],
        params=sorted(s for s in state if s in trainable),
        buffers=sorted(s for s in state if s not in trainable),
        owned=[], mutated=sorted({m for n in nodes for m in n.meta[COST].mutates}),
        random=any(n.meta[COST].random for n in nodes))
    return spec, inputs, nodes


def _count_state(program: Program, spec: PackSpec, sizes: dict, master: dict) -> None:
    """The parameters ``spec`` steps and the bytes of its weights, buffers, fp32 masters and optimizer state."""
    prof = program.optim_profile
    owner, rank = program.config.state_owner, program.config.rank
    # sharded optimizer state: this rank steps (and keeps state for) only the params it owns
    spec.stepped = [n for n in spec.owned if owner is None or owner.get(n, rank) == rank]
    spec.param_bytes = sum(sizes[n] for n in spec.params)
    spec.buffer_bytes = sum(sizes[n] for n in spec.buffers)
    spec.master_bytes = sum(master[n] for n in spec.params)
    owned = [master[n] for n in spec.stepped]   # optimizer state is per fp32 master byte
    spec.optim_bytes = sum(optim_state_bytes(prof, b) for b in owned)
    spec.stepped_master_bytes = sum(owned)
    spec.step_extra = step_extra(prof, owned)
    spec.stream_step_peak = _stream_step_peak(prof, owned, program.config.precision != "fp32",
                                              late=not program.config.copies_block)


def own_state(program: Program, owner: dict[str, int]) -> None:
    """``program``'s packs step, and keep optimizer state for, only the parameters ``owner`` gives this rank: ZeRO
    stage 1 where the owners are known only once the packs are placed (a grid's stage over its replica group,
    passes/stage.py); the plan's ``state_owner`` and ``state_bytes`` say so, as when the partition planned them."""
    program.config.state_owner = dict(owner)
    sizes = count_state(program)
    program.plan.state_owner = dict(owner)
    program.plan.state_bytes = {n: sizes[n] for n in owner}


def count_state(program: Program) -> dict:
    """Each pack's stepped parameters and state bytes, counted again after what packs own changed (ZeRO-1's owners,
    a weight tied across pipeline ranks: passes/tied.py)."""
    sizes, master = device_sizes(program), {n: nbytes(t) for n, t in program.gm.named_parameters()}
    for spec in program.plan.packs:
        _count_state(program, spec, sizes, master)
    return sizes


def _measure_peaks(program: Program, spec: PackSpec, inputs: list, nodes: list, units: list[Unit]) -> None:
    """``spec``'s forward and backward peaks, measured on fake tensors once per pack (the DP's corrections revisit
    the same packs), and the bytes it saves, takes in and gives out."""
    key = (tuple(nodes), "loss" in spec.outputs)
    if key not in program.pack_measurements:
        vals = [program.fake.vals[a] for a in inputs]
        grad_inputs = [a.op != "placeholder" for a in inputs]
        program.pack_measurements[key] = measure_pack(spec.module, vals, grad_inputs, program.fake,
                                                      loss_output="loss" in spec.outputs)
    m = program.pack_measurements[key]
    spec.fwd_peak, spec.fwd_keep_peak = m["fwd_peak"], m["fwd_keep_peak"]
    spec.saved_bytes, spec.out_bytes, spec.held_in_bytes = m["saved_bytes"], m["out_bytes"], m["held_in_bytes"]
    if not spec.saved_bytes:   # until measure_kept measures it: the estimate
        spec.saved_bytes = int(sum(u.kept for u in units if u.nodes[0] in nodes))
    spec.bwd_peak, spec.bwd_recompute_peak = m["bwd_peak"], m["bwd_recompute_peak"]
    spec.bwd_peak_accum, spec.bwd_recompute_peak_accum = m["bwd_peak_accum"], m["bwd_recompute_peak_accum"]
    spec.in_bytes = sum(tensor_bytes(program.fake.vals[a]) for a in inputs if a.op != "placeholder")


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
                program.fake, loss_output=False, keep=True)
        m = program.pack_measurements[key]
        spec.fwd_keep_peak, spec.saved_bytes = m["fwd_keep_peak"], m["saved_bytes"]
        spec.bwd_peak, spec.bwd_peak_accum, spec.held_in_bytes = m["bwd_peak"], m["bwd_peak_accum"], m["held_in_bytes"]


def param_order(program: Program) -> list[str]:
    """The traced parameters' names in ``model.parameters()`` order (clipping's norm stacks per-tensor norms in
    it, as ``clip_grad_norm_`` does); any the model does not name by the same path follow in the trace's order."""
    traced = [n for n, p in program.gm.named_parameters() if p.requires_grad]
    known = set(traced)
    order = [n for n, _ in program.model.named_parameters() if n in known]
    return order + [n for n in traced if n not in set(order)]


def tensor_bytes(v, floating: bool = True) -> int:
    if not isinstance(v, torch.Tensor) or (floating and not v.is_floating_point()):
        return 0
    return v.untyped_storage().nbytes()


def _layers_alone(program: Program, units: list[Unit]):
    """Every layer a pack of its own, the least any plan needs: (cuts, specs, the largest measured need)."""
    n = len(units)
    cuts = [(i, i + 1) for i in range(n)]
    specs = build_packs(program, cuts, units)
    return cuts, specs, max(measured_need(program, s, i == n - 1) for i, s in enumerate(specs))


def smallest_budget(program: Program, units: list[Unit]) -> int:
    """The budget at which every layer fits alone, measured, with the planner's headroom added back."""
    return program.config.budget_for(_layers_alone(program, units)[2])


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
    or stashed out; the swap pass then checks the whole schedule. A backward's measured
    peak counts the gradients it allocates where none exist yet (the first microbatch),
    and only its own transients where it accumulates into them (``_accum``), as the
    runtime's effects do; a forward may run beside accumulated gradients (the sequential
    policy interleaves microbatches). Under data parallelism the all-reduce after its last backward holds
    its fused (and, compressed, encoded) buffers beside its weights and gradients.
    """
    state = spec.param_bytes + spec.buffer_bytes
    grads = spec.param_bytes
    inputs = spec.in_bytes + sum(program.fake_batch_bytes.get(n, 0) for n in spec.inputs)
    step = state + grads + (spec.stream_step_peak if program.config.optimizer_on == Tier.DEVICE else 0)
    forward = state + grads + inputs + (spec.fwd_keep_peak if last else spec.fwd_peak)
    if last:
        backward = inputs + spec.out_bytes + spec.saved_bytes + max(spec.bwd_peak, grads + spec.bwd_peak_accum)
    else:
        backward = inputs + spec.out_bytes + max(spec.bwd_recompute_peak, grads + spec.bwd_recompute_peak_accum)
    return int(max(forward, state + backward, step, state + grads + _comm_bytes(program.config, grads)))


def _comm_bytes(cfg, grads: int) -> int:
    """Device bytes of a pack's gradient all-reduce at its peak (data parallel), beside its weights and gradients."""
    if not cfg.data_parallel or (cfg.world_size or 1) < 2:
        return 0
    c = cfg.compression or NO_COMPRESSION
    return comm_buffer_bytes(grads, c.kind, cfg.world_size, c.bits, c.error_feedback)


def _choose(program: Program, units: list[Unit], budget: int):
    """The DP on unit estimates, corrected by measuring the packs it picks until they fit; returns the cuts,
    the packs (None, None where nothing fits), the estimates (``PackCost``, which the report reads again) and
    whether the plan came from the least-traffic search (the report says)."""
    need = PackCost(program, units)
    target, search = working_set_cap(need, budget)
    for attempt in range(24):
        cuts = search(need, target)
        if cuts is None:   # the estimates say no; measured, every layer alone may still fit
            break
        specs = build_packs(program, cuts, units)
        worst = max(measured_need(program, s, i == len(specs) - 1) for i, s in enumerate(specs))
        if worst <= budget:
            return cuts, specs, need, search is not plan_packs
        # scale the estimates' target by what measuring found; if that does not converge (a pack the
        # estimates under-count stays too big), step down geometrically until the DP gives up
        target = int(target * min(budget / worst * 0.97, 0.8 if attempt >= 8 else 1.0))
    # the corrections did not converge, or the estimates rule every plan out: every layer a pack of
    # its own is the least any plan needs, so it decides (a larger budget must not fail where a
    # smaller one works)
    cuts, specs, least = _layers_alone(program, units)
    return (cuts, specs, need, False) if least <= budget else (None, None, need, False)


def first_nodes(program: Program) -> list[str]:
    """The names of the nodes a pack may start at: the first node of each layer (a cut point), in order. A
    partition handed to the pass (``passes=(("partition", names), ...)``) names its packs' first nodes from these."""
    return [u.nodes[0].name for u in find_units(program)]


def _given(program: Program, units: list[Unit], starts):
    """The packs that start at the nodes named ``starts`` (the first pack starts at the first layer)."""
    index = {u.nodes[0].name: i for i, u in enumerate(units)}
    if isinstance(starts, str) or not all(isinstance(s, str) for s in starts):
        raise ConfigError(f"the partition's choice is a list of node names where packs start, got {starts!r}")
    unknown = [s for s in starts if s not in index]
    if unknown:
        valid = list(index)
        raise ConfigError(f"the partition's choice names {unknown[:3]}, which are not cut points of this graph; a pack "
                          f"can start at the first node of a layer: {valid[:8]}{' ...' if len(valid) > 8 else ''} "
                          f"({len(valid)} in all; harmony.passes.partition.first_nodes lists them)")
    at = sorted({0} | {index[s] for s in starts})
    cuts = list(zip(at, at[1:] + [len(units)]))
    specs = build_packs(program, cuts, units)
    worst = max(measured_need(program, s, i == len(specs) - 1) for i, s in enumerate(specs))
    if worst > program.config.usable_budget:
        need = program.config.budget_for(worst)
        raise BudgetError(f"the partition given needs {fmt_bytes(worst)} for its largest pack, over the "
                          f"{fmt_bytes(program.config.usable_budget)} the planner may fill: raise memory_budget to "
                          f"about {fmt_bytes(need)}, or cut that pack smaller", min_budget=need)
    return cuts, specs, PackCost(program, units), False


def run(program: Program, ctx) -> PassResult:
    """Cut the graph into packs; ``ctx``, where given, is the packs' first nodes' names (``first_nodes``)."""
    start = time.perf_counter()
    cfg = program.config
    units = find_units(program)
    program.units = [u.nodes for u in units]
    program.fake_batch_bytes = {ph.name: tensor_bytes(program.fake.vals[ph], floating=False)
                                for ph in program.gm.graph.nodes if ph.op == "placeholder"}
    if ctx is not None:       # handed its choice: the packs as given
        cuts, specs, need, least_traffic = _given(program, units, ctx)
    else:
        cuts, specs, need, least_traffic = _choose(program, units, cfg.usable_budget)
    if cuts is None:
        floor = smallest_budget(program, units)
        raise BudgetError(
            f"memory_budget={fmt_bytes(cfg.memory_budget)} is below what one layer needs at microbatch size "
            f"{cfg.microbatch_size}: the smallest budget that works is {fmt_bytes(floor)} ({floor} bytes). "
            f"Raise memory_budget, or use more microbatches.", min_budget=floor)
    program.partition_choice = [units[b].nodes[0].name for b, _ in cuts]   # what ctx would hand back
    if cfg.recompute != "always" and cfg.policy != "ondemand":
        measure_kept(program, specs)
    batch_bytes = dict(program.fake_batch_bytes)
    program.plan = Plan(packs=specs, microbatches=cfg.microbatches, microbatch_size=cfg.microbatch_size,
                        input_names=list(batch_bytes), batch_bytes=batch_bytes, policy=cfg.policy,
                        precision=cfg.precision, loss_scaling=dict(cfg.loss_scaling),
                        clip_grad_norm=cfg.clip_grad_norm, clip_norm_type=cfg.clip_norm_type,
                        param_order=param_order(program),
                        state_owner=dict(cfg.state_owner or {}), rank=cfg.rank,
                        state_bytes={n: b for n, b in device_sizes(program).items() if n in (cfg.state_owner or {})})
    rows = [dict(pack=s.index, layers=s.name, units=e - b, params_MiB=s.param_bytes / 2**20,
                 saved_MiB=s.saved_bytes / 2**20,
                 need_MiB=measured_need(program, s, i == len(cuts) - 1) / 2**20,
                 GFLOP=(s.fwd_flops + s.bwd_flops) / 1e9)
            for i, (s, (b, e)) in enumerate(zip(specs, cuts))]
    seconds, moved = need.plan_cost(cuts, cfg.usable_budget)[:2]
    compute, copies = need.compute_and_copies(cuts, host=need.traffic_model(cfg.usable_budget) != Tier.DEVICE)
    # where copies hold the compute up (the CPU device), a byte not moved saves its time as surely as a recompute does
    program.compute_to_copies = compute / copies if copies and not cfg.copies_block else 1.0
    report = PassReport("partition: layer packs", rows, totals=dict(
        layers=len(units), packs=len(specs), usable_budget_MiB=cfg.usable_budget / 2**20,
        objective_s=sum(need(b, e, i == len(cuts) - 1)[1] for i, (b, e) in enumerate(cuts)),
        predicted_step_s=seconds, predicted_moved_bytes=moved, solve_s=time.perf_counter() - start))
    report.notes.append(f"cut points: {len(units) - 1} narrowest gaps of the graph; "
                        + ("packs as given: passes=(('partition', [first nodes of packs]), ...)" if ctx is not None
                           else f"packs chosen by an exact DP over {len(units)} layers"))
    if least_traffic:
        report.notes.append("the copies outlast the compute and the host's steps: the partition that leaves the least "
                            "traffic (a large first pack, few cuts, small last packs) was predicted fastest")
    return PassResult(program, report)


def _stream_step_peak(prof: dict, owned: list[int], mixed: bool, late: bool = False) -> int:
    """Peak bytes of a step that brings each parameter's optimizer state in turn (``owned``: their fp32 bytes, in
    step order). Mixed precision's brings its fp32 master too and makes its gradient fp32, while the next
    parameter's master and state come in (runtime/ops/update.py). ``late``: copies out do not hold the compute up
    (a GPU), so the parameter before is still going out (``TieredState.send``)."""
    sent = [b + optim_state_bytes(prof, b) if mixed else optim_state_bytes(prof, b) for b in owned]
    going = [0] + sent[:-1] if late else [0] * len(owned)
    if not mixed:
        return max((optim_state_bytes(prof, b) + step_extra(prof, [b]) + g for b, g in zip(owned, going)), default=0)
    full = [optim_state_bytes(prof, b) + step_extra(prof, [b]) + 2 * b for b in owned]
    coming = sent[1:] + [0]
    return max((a + c + g for a, c, g in zip(full, coming, going)), default=0)
