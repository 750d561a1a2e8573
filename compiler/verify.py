"""verify: replay a schedule's effects to check residency and predict each device's peak memory.

Runs every op's ``effect`` from the op table in schedule order, freeing each value
after its last use exactly as the executor does, so the predicted curve has the
runtime's shape; the op's transient bytes come from the pack measurements of the
cost model.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx

from harmony.base.errors import BudgetError
from harmony.base.units import nbytes
from harmony.compiler.config_checks import margin_of
from harmony.runtime.executor import last_uses
from harmony.runtime.ops import MemoryModel, Predicted, op_of, resident_state, state_names
from harmony.runtime.plan import optim_state_bytes
from harmony.runtime.precision import device_bytes
from harmony.runtime.tiers.disk import ALIGN, layout


@dataclass
class MemoryCurve:
    nodes: list                     # call_function nodes in order
    before: list                    # device bytes live before each node
    peak_at: list                   # device bytes at the peak of each node
    out: list = field(default_factory=list)       # device bytes of each node's value (0: none, or on the host)
    moves: list = field(default_factory=list)     # (h2d, d2h) bytes each node copies
    after: list = field(default_factory=list)     # device bytes live after each node (its dead values freed)
    moved: dict = field(default_factory=dict)
    missing: list = field(default_factory=list)   # (node, kind, name) used while not resident

    @property
    def peak(self) -> int:
        return max(self.peak_at, default=0)

    def argmax(self) -> int:
        return max(range(len(self.peak_at)), key=self.peak_at.__getitem__)


def state_sizes(program) -> dict:
    gm, prof = program.gm, program.optim_profile
    dtype = program.config.compute_dtype   # mixed precision: device copies and gradients in the compute dtype
    sizes = {}
    owner, rank = getattr(program.config, "state_owner", None), getattr(program.config, "rank", 0)
    for n, t in list(gm.named_parameters()) + list(gm.named_buffers()):
        b = device_bytes(t, dtype)
        sizes[("params", n)] = b
        if isinstance(t, torch.nn.Parameter) and t.requires_grad:
            sizes[("grads", n)] = b
            mine = owner is None or owner.get(n, rank) == rank   # sharded: other ranks keep the rest
            sizes[("optim", n)] = optim_state_bytes(prof, nbytes(t)) if mine else 0
    tensors = dict(gm.named_parameters())
    for record in (program.plan.residency.values() if program.plan is not None else ()):
        for names in record.disk_groups:    # a wholly-disk pack's weights come in as one aligned buffer per file
            _, total = layout([(tensors[n].shape, tensors[n].dtype) for n in names])
            sizes[("params", names[0])] += total + ALIGN - sum(sizes[("params", n)] for n in names)
    return sizes


def memory_curve(program, graph: torch.fx.Graph | None = None, check_residency: bool = True,
                 sizes: dict | None = None) -> MemoryCurve:
    """Predicted device bytes before, at the peak of and after each op of ``graph`` (the program's schedule).
    ``sizes``: ``state_sizes(program)``, where the caller has it (the swap pass prices many schedules)."""
    graph = graph if graph is not None else program.schedule
    plan = program.plan
    model = MemoryModel(plan, sizes if sizes is not None else state_sizes(program))
    for what, names in resident_state(plan):
        model.hold(what, names)
    model.carry_in(graph)
    model.moved = {"h2d": 0, "d2h": 0}
    free_after = last_uses(graph)
    env: dict = {}
    curve = MemoryCurve([], [], [])
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        op = op_of(node)
        kinds = op.needs(node.kwargs) if check_residency else ()
        if kinds:
            spec = plan.packs[node.args[0]]
            for kind in kinds:
                for s in (state_names(spec, kind)):
                    if not model.resident(kind, s):
                        curve.missing.append((node, kind, s))
        args = torch.fx.node.map_arg(node.args, env.__getitem__)
        kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
        before = model.live
        h2d, d2h = model.moved["h2d"], model.moved["d2h"]
        value, transient = op.effect(model, *args, **kwargs)
        curve.moves.append((model.moved["h2d"] - h2d, model.moved["d2h"] - d2h))
        env[node] = value
        curve.nodes.append(node)
        curve.before.append(before)
        out = value.bytes if isinstance(value, Predicted) and value.on_device else 0
        curve.peak_at.append(max(before + transient, model.live + out))
        curve.out.append(out)
        model.live += out
        for dead in free_after[node]:
            v = env.pop(dead, None)
            if isinstance(v, Predicted) and v.on_device:
                model.live -= v.bytes
        curve.after.append(model.live)
    curve.moved = dict(model.moved)
    return curve


def verify(program) -> MemoryCurve:
    """Raise if state is used where it is not resident, or the predicted peak exceeds the budget."""
    curve = memory_curve(program, check_residency=program.config.policy != "ondemand")
    if curve.missing:
        node, kind, s = curve.missing[0]
        raise AssertionError(f"{node.format_node()} uses {kind} of {s!r}, which is not on the device there")
    margin = margin_of(program.config)      # left for what the cost model under-predicts (driver/misses.py)
    budget = program.config.state_budget - margin
    if program.config.policy != "ondemand" and curve.peak > budget:
        at = curve.nodes[curve.argmax()]
        less = f" (less the plan margin of {margin / 2**20:.2f} MiB)" if margin else ""
        raise BudgetError(f"predicted peak {curve.peak / 2**20:.1f} MiB at {at.name} exceeds the budget of "
                          f"{budget / 2**20:.1f} MiB{less}", min_budget=program.config.budget_for(curve.peak))
    program.predicted_peak = curve.peak
    return curve
