"""offload: decide where each pack's optimizer step runs, and so where its optimizer state lives.

``device``: the state comes to the device for the step (streamed one parameter at a
time unless the swap pass finds room to keep it resident). ``host``: gradients leave
the device after the pack's backward, the user's optimizer steps the host copies of
the weights on a host thread while the device runs the next pack's backward, and the
state never touches the device (ZeRO-Offload); the weights' next ``swap_in`` waits for
that step. With ``optimizer_on="auto"`` the step stays on the device when all training
state fits the budget, and goes to the host otherwise: that is when the device has no
room for optimizer state, and the host step moves only gradients (P bytes out) instead
of optimizer state (2 x 2P) and updated weights (P). Mixed precision (``precision=``) always
steps on the host: the fp32 masters and optimizer state never come to the device. Under
``auto`` the swap pass, which knows what room is left, may move some host-placed packs back
to a device step with all their state resident (``swap.may_step_on_device``): mixed placement.

Where a host-stepped pack's optimizer state lives between steps (``Residency.optim_on``):
``host`` while ``host_memory_budget`` allows, else ``disk`` (a file per pack under
``offload_dir``, read back for the pack's step: runtime/tiers/disk.py). The host holds, and the
budget counts: the fp32 master copy of every parameter and buffer; the gradients of the two
packs between their release and their step (the one stepping, the one released behind
it); the optimizer state of the host-placed packs; and, once any pack is on disk, two
disk packs' state (one stepping, one read ahead or being written).

Packs go to disk first-stepped first (under the harmony policy packs step last to first,
so the disk holds the last packs and the host the first ones). The runtime reads each
disk pack's state ahead while the pack before it in step order steps and the device runs
its backward, and the first disk pack's state at the end of the previous step's last
disk step, across the forward pass: every read has about one pack's backward to hide in
wherever the pack sits in the order, so what the order decides is where the writes fall.
A pack's step is complete when its state is on disk; a disk pack stepped first is written
while the device runs the backward of the packs after it, whereas one stepped last would
put its write on the critical path at the end of every iteration. (Taking the packs that
step later, which seem to have "more time to be read", is right only without read-ahead
across iterations; largest-first moves fewer packs for the same bytes but can put the
last-stepped pack on disk.) Every disk pack's state is read once and written once per
step.

If the host cannot hold the fp32 weights either (a model bigger than host memory), packs
go to disk *wholly* (``Residency.master_on``), again first-stepped first: their weights and
optimizer state live in files of at most ``disk_group_bytes`` of weights
(runtime/tiers/params_disk.py), the weights are read from disk for each phase that needs them,
and the pack steps after its backward a file at a time, so the host holds three files and
one file's gradients, never a whole pack. The room the host budget leaves after that keeps
whole files in host memory (``Residency.in_memory``), those of the last-stepped packs first:
such a file is never written or read, so each byte held saves a write and a read of the step
(under the backward, where the disk is busiest) and the weights' reads. That step runs on the host thread, overlapping
the next pack's backward, while the pack's gradients wait on the device (the swap pass
makes it inline where the device cannot hold them that long). ``weights_on`` overrides the choice.
Under data parallelism replicated ranks each keep their own files; ``shard_state=True`` (ZeRO-1) refuses wholly-disk
packs (its owners broadcast stepped weights). Under ``shard_state="full"`` the pass plans this rank's share (1/N of
each pack's weights and optimizer state, and the whole gradients and gathered weights its host holds for a moment),
and a pack on disk is one file of that share, stepped on the host (runtime/partitioned/disk.py), not groups.
"""
from __future__ import annotations

import time

from harmony.base.errors import BudgetError, ConfigError
from harmony.base.tiers import Tier
from harmony.base.units import fmt_bytes
from harmony.compiler.config import PLACES, WEIGHTS
from harmony.compiler.config_checks import HYBRID
from harmony.compiler.ir import PassReport, PassResult, Program
from harmony.compiler.verify import memory_curve
from harmony.passes.host_budget import HostBytes, files_in_memory, least_host_bytes, packs_to_disk
from harmony.runtime import ops
from harmony.runtime.plan import STATE_KINDS

NAME = "offload"
REQUIRES = {"schedule"}
PROVIDES = {"placement"}


def everything_fits(program: Program) -> bool:
    records = program.plan.residency
    saved = {p: r.kept for p, r in records.items()}
    for r in records.values():
        r.kept = frozenset(STATE_KINDS)
    try:
        return memory_curve(program, check_residency=False).peak <= program.config.usable_budget
    finally:
        for p, r in records.items():
            r.kept = saved[p]


def step_place(cfg, fits) -> tuple[Tier, str]:
    """Where the optimizer steps (``Tier.DEVICE`` or ``Tier.HOST``) and why; ``fits()`` says whether all training
    state fits the device, asked only under ``optimizer_on="auto"`` (the partition asks before packs exist, with an
    estimate)."""
    if cfg.precision != "fp32" and cfg.optimizer_on != Tier.DEVICE:   # (compile() refuses fp16 on the device)
        return Tier.HOST, f"precision={cfg.precision!r}: fp32 master weights and optimizer state stay on the host"
    if cfg.precision != "fp32":
        if (cfg.world_size or 1) > 1:
            raise ConfigError(f"precision={cfg.precision!r} with optimizer_on={Tier.DEVICE!r} runs on one rank for "
                              f"now (world size {cfg.world_size}); use optimizer_on={Tier.HOST!r} (or 'auto') with "
                              f"several")
        return Tier.DEVICE, (f"optimizer_on={Tier.DEVICE!r}: each fp32 master comes to the device with its optimizer "
                             f"state for the step, one parameter at a time")
    if cfg.optimizer_on != "auto":
        return Tier(cfg.optimizer_on), f"optimizer_on={cfg.optimizer_on!r}"
    if fits():
        return Tier.DEVICE, "all training state fits the budget"
    if cfg.policy == "ondemand":
        return Tier.DEVICE, "the ondemand baseline leaves everything to the runtime"
    return Tier.HOST, "the training state does not fit the budget: optimizer state stays off the device"


def run(program: Program, ctx) -> PassResult:
    start = time.perf_counter()
    cfg, plan = program.config, program.plan
    if cfg.optimizer_on not in PLACES:
        raise ConfigError(f"optimizer_on={cfg.optimizer_on!r}; choose one of {', '.join(PLACES)}")
    place, reason = step_place(cfg, lambda: everything_fits(program))
    host = place == Tier.HOST
    disk, whole, need = place_state(program) if host else (set(), set(), {})
    _refuse_zero1_on_disk(cfg, whole)
    _place(program, place, disk, whole, need)
    on_device = _device_steps(program, disk | whole) if host else []
    in_memory = sorted(plan.packs_with("in_memory"))
    rows = _rows(program, place, whole, need, in_memory)
    report = PassReport("offload: where the optimizer steps and where weights and its state live", rows,
                        totals=_totals(cfg, place, rows, disk, whole, need, start))
    report.notes.append(f"chosen because {reason}")
    if on_device:
        report.notes.append(_device_steps_note(cfg, on_device))
    report.notes += _host_notes(program, host, disk, whole, need, in_memory)
    return PassResult(program, report)


def _refuse_zero1_on_disk(cfg, whole: set) -> None:
    """ZeRO stage 1's owners broadcast stepped weights, which a pack wholly on disk keeps in its files."""
    if whole and cfg.data_parallel and (cfg.world_size or 1) > 1 and cfg.shard_state is True:
        raise ConfigError(f"packs {sorted(whole)} would keep their weights on disk, which shard_state=True (ZeRO "
                          f"stage 1) does not support: its owners broadcast stepped weights that a pack on disk keeps "
                          f"in its files. Use shard_state='full' (each rank keeps and reads its share of every pack "
                          f"on its own disk), no shard_state, a larger host_memory_budget, or weights_on={Tier.HOST!r}")


def _totals(cfg, place: Tier, rows: list[dict], disk: set, whole: set, need: dict, start: float) -> dict:
    """The report's totals: where the step runs, the disk's bytes per step and, under a host budget, the host's."""
    budget = getattr(cfg, "host_memory_budget", None)
    disk_read = sum(r["disk_read_MiB"] for r in rows) * 2**20
    disk_write = sum(r["disk_write_MiB"] for r in rows) * 2**20
    totals = dict(step_on=place, disk_packs=len(disk), disk_weight_packs=len(whole),
                  step_disk_read_bytes=int(disk_read), step_disk_write_bytes=int(disk_write),
                  seconds=time.perf_counter() - start)
    if place == Tier.HOST and budget is not None:
        totals.update(host_budget_bytes=budget, host_planned_bytes=need["planned"],
                      host_minimum_bytes=need["minimum"])
    return totals


def _device_steps_note(cfg, on_device: list[int]) -> str:
    """Which packs step on the device beside the host's steps, and the simulated steps that chose how many."""
    tried = getattr(cfg, "steps_predicted", None) or {}
    return (f"packs {', '.join(map(str, sorted(on_device)))} (the last to step) step on the device, each fp32 master "
            f"and its optimizer state brought in for it, beside the host's steps of the others"
            + (": chosen by compile, the simulator's step for each count of such packs "
               + ", ".join(f"{k}: {t * 1e3:.1f} ms" if t is not None else f"{k}: does not fit"
                           for k, t in tried.items()) if tried else ""))


def _host_notes(program: Program, host: bool, disk: set, whole: set, need: dict, in_memory: list) -> list[str]:
    """What the host budget holds, and which packs keep their optimizer state, weights or files where."""
    cfg, plan = program.config, program.plan
    budget = getattr(cfg, "host_memory_budget", None)
    if host and budget is None:
        return ["no host_memory_budget: every pack's weights and optimizer state stay in host memory"]
    if not host:
        return ["host_memory_budget is not used: the optimizer steps on the device"] if budget is not None else []
    notes = [
        f"host_memory_budget {fmt_bytes(budget)} holds {fmt_bytes(need['planned'])}: master parameters and "
        f"buffers {fmt_bytes(need['masters'])}, {_grads_held(cfg)} {fmt_bytes(need['grads'])}, optimizer "
        f"state of {len(plan.packs) - len(disk) - len(whole)} host packs {fmt_bytes(need['host_optim'])}"
        + (f", disk buffers in flight {fmt_bytes(need['staging'])}" if disk or whole else "")
        + (f", files kept in memory {fmt_bytes(need['in_memory'])}" if need.get("in_memory") else "")]
    if disk:
        notes.append(
            f"{len(disk)} packs keep their optimizer state on disk: the first-stepped ones, so their writes "
            f"overlap the backward of the packs after them and each read overlaps the compute before its step")
    if whole:
        groups = sum(len(plan.at(p).disk_groups) for p in whole)
        notes.append(
            f"{len(whole)} packs keep their fp32 weights on disk too ({groups} files of at most "
            f"{fmt_bytes(cfg.disk_group_bytes)} of weights): weights are read from disk for the forward and "
            f"for the backward, and the pack steps a file at a time on the host right after its backward, so "
            f"the host never holds a whole pack (the host could not hold these weights)")
        if in_memory:
            files = sum(len(plan.at(p).in_memory) for p in in_memory)
            notes.append(
                f"{files} of those files ({fmt_bytes(need['in_memory'])}, packs "
                f"{', '.join(map(str, in_memory))}) stay in host memory in the room the host "
                f"budget leaves: never written or read, the last-stepped first (in_memory_MiB)")
    return notes


def _rows(program: Program, place: Tier, whole: set, need: dict, in_memory: list) -> list[dict]:
    """The report's row per pack: where it steps, where its weights and optimizer state live, its disk bytes."""
    cfg, plan = program.config, program.plan
    # weights are read for the forward and the backward; under harmony the step takes the backward's
    # (runtime/tiers/params_disk.py)
    weight_reads = 2 if cfg.policy == "harmony" else 3
    world = sharing_world(cfg)
    gathers = [n.args[0] for n, op in ops.ops_of(program.schedule.nodes) if op.fetches and op.state_copy
               and n.args[1] == "params"] if world > 1 else []
    rows = []
    for spec in plan.packs:
        where = plan.at(spec.index).optim_on
        weights = spec.index in whole
        owned = need.get("owned", {}).get(spec.index, 0)
        if world > 1:   # partitioned: one file of the share, read by the last gather before the step, the other
            # gathers reading its weights (an estimate before the swap pass settles the gathers: the shard report's
            # disk_*_bytes_per_step are the plan's)
            on_disk = spec.optim_bytes // world + (owned if weights else 0) if where == Tier.DISK else 0
            reads = on_disk + (max(gathers.count(spec.index) - 1, 0) * owned if weights else 0)
            rows.append(dict(pack=spec.index, layers=spec.name, step_on=place,
                             weights="disk (this rank's share)" if weights else "host (this rank's share)",
                             optimizer_state=where, optim_MiB=spec.optim_bytes / world / 2**20,
                             grads_out_MiB=spec.param_bytes / 2**20, disk_read_MiB=reads / 2**20,
                             disk_write_MiB=on_disk / 2**20))
            continue
        on_disk = spec.optim_bytes if where == Tier.DISK else 0
        share = plan.at(spec.index).in_memory_share     # of its files, kept in host memory
        kept = share * owned
        on_disk *= 1 - share
        here = plan.at(spec.index).step_on == Tier.HOST     # (mixed precision: some packs may step on the device)
        rows.append(dict(pack=spec.index, layers=spec.name,
                         step_on="host (inline, by file)" if weights else plan.at(spec.index).step_on,
                         weights=Tier.DISK if weights else Tier.HOST,
                         optimizer_state=where if here else "device (streamed or resident)",
                         optim_MiB=spec.optim_bytes / 2**20,
                         grads_out_MiB=(spec.param_bytes if here else 0) / 2**20,
                         disk_read_MiB=(on_disk + (weight_reads * (owned - kept) if weights else 0)) / 2**20,
                         disk_write_MiB=(on_disk + (owned - kept if weights else 0)) / 2**20,
                         **({"in_memory_MiB": share * (owned + spec.optim_bytes) / 2**20}
                            if in_memory else {})))
    return rows


def _weights_on(cfg) -> Tier | str:
    """Where host-stepped packs' fp32 weights may go: ``weights_on``, but never disk under mixed precision."""
    weights_on = getattr(cfg, "weights_on", "auto")
    if weights_on not in WEIGHTS:
        raise ConfigError(f"weights_on={weights_on!r}; choose one of {', '.join(WEIGHTS)}")
    clip = getattr(cfg, "clip_grad_norm", None) is not None
    if cfg.precision == "fp32" and not clip or full_sharding(cfg):   # partitioned files step as host packs do
        return weights_on
    if weights_on == Tier.DISK:          # the disk step neither casts weights and gradients nor waits for the norm
        what = f"precision={cfg.precision!r}" if cfg.precision != "fp32" else "clip_grad_norm"
        raise ConfigError(f"weights_on={Tier.DISK!r} with {what}: packs wholly on disk step file by file as their "
                          f"gradients leave the device, in fp32 and unclipped only for now; use "
                          f"weights_on={Tier.HOST!r} with a host_memory_budget that holds the fp32 weights")
    return Tier.HOST


def _device_steps(program: Program, off_host: set) -> list[int]:
    """Mixed precision under ``optimizer_on="auto"``: the last ``config.device_steps`` packs to step (of those whose
    state stays in host memory) step on the device instead, each fp32 master and its state brought in for it, so
    the host's steps and the device's share the work (compile chooses how many by simulation:
    driver/mixed_steps.py)."""
    k = getattr(program.config, "device_steps", 0)
    if not k or program.config.precision == "fp32":
        return []
    steps = [n for n, op in ops.ops_of(program.schedule.nodes) if op.steps]
    packs = [p for p in dict.fromkeys(n.args[0] for n in steps) if p not in off_host][-k:]
    for n in steps:
        if n.args[0] in packs:
            n.kwargs = {**n.kwargs, "where": Tier.DEVICE.value}   # the plain name: fx prints an enum as Tier.X
    for p in packs:
        program.plan.at(p).step_on = program.plan.at(p).optim_on = Tier.DEVICE
    return packs


def full_sharding(cfg) -> bool:
    """Whether each rank keeps only its share of every pack (``shard_state="full"`` over several ranks)."""
    return getattr(cfg, "shard_state", None) == "full" and (cfg.world_size or 1) > 1


def sharing_world(cfg) -> int:
    """The ranks each pack's state is partitioned over: the job's under ``shard_state="full"`` (a grid's: its
    stage's replica group, one rank per pipeline); 1 where each rank keeps its packs whole."""
    if not full_sharding(cfg):
        return 1
    size = getattr(cfg, "pipeline_size", None) if getattr(cfg, "parallel", None) == HYBRID else None
    return cfg.world_size if not size else cfg.world_size // size


def _place(program: Program, place: Tier, disk: set, whole: set, need: dict) -> None:
    """Write where each pack steps and where its optimizer state and fp32 weights live into its residency record
    and its ``step`` op: ``disk`` packs keep their optimizer state on disk, ``whole`` ones their weights too
    (``need``: their files)."""
    if full_sharding(program.config):    # a partitioned pack on disk steps its share from one file on the host
        whole_steps = set()
    else:
        whole_steps = whole
    # a wholly-disk pack's step overlaps the next backward (swap may inline it)
    for n, op in ops.ops_of(program.schedule.nodes):
        if op.steps:
            n.kwargs = {**n.kwargs, "where": place.value} if n.args[0] not in whole_steps else \
                {**n.kwargs, "where": Tier.DISK.value, "overlap": True}
    for p, record in program.plan.residency.items():
        record.step_on = place
        record.optim_on = Tier.DISK if p in disk | whole else place
        record.master_on = Tier.DISK if p in whole else Tier.HOST
        record.disk_groups = need["groups"][p] if p in whole else []
        record.in_memory = tuple(need.get("memory", {}).get(p, ())) if p in whole else ()
        record.in_memory_share = need.get("memory_share", {}).get(p, 0.0) if p in whole else 0.0


def _grads_held(cfg) -> str:
    """Which gradients the host holds at once: fp16 and clipping keep every pack's until the last is in."""
    if getattr(cfg, "clip_grad_norm", None) is not None:
        return "gradients of every pack (clipping: the steps wait for the global norm over the last gradient)"
    return {"fp32": "gradients of two packs", "bf16": "gradients of two packs (bf16 and fp32)",
            "fp16": "gradients of every pack (fp16 steps after the last is checked for overflow)"}[cfg.precision]


def holds_every_gradient(cfg) -> bool:
    """Whether the updates wait for the last gradient (fp16's overflow check, clipping's global norm), so the host
    holds every host-stepped pack's gradients at once."""
    return cfg.precision == "fp16" or getattr(cfg, "clip_grad_norm", None) is not None


def place_state(program: Program) -> tuple[set[int], set[int], dict]:
    """(packs with optimizer state on disk, packs wholly on disk, the host bytes planned) under ``host_memory_budget``.

    Walks the packs in step order (the schedule's order of ``step`` ops), moving each one's
    optimizer state to disk until the host holds what the budget allows; if that is not
    enough, moves packs wholly (weights too, runtime/tiers/params_disk.py) to disk in the same order.
    Raises ``BudgetError`` naming the smallest host budget if even every pack on disk does not fit.
    """
    cfg, plan = program.config, program.plan
    budget = getattr(cfg, "host_memory_budget", None)
    host = HostBytes.of(program, sharing_world(cfg), holds_every_gradient(cfg))
    order = [n.args[0] for n, op in ops.ops_of(program.schedule.nodes) if op.steps]
    order = list(dict.fromkeys(order + [s.index for s in plan.packs]))   # packs without a step op last
    weights_on = _weights_on(cfg)
    packs = {p for p in host.optim if host.owned[p]}
    minimum = least_host_bytes(host, weights_on, packs)
    disk, whole = packs_to_disk(host, budget, weights_on, packs, order)
    planned = host.need(disk, whole)
    if budget is not None and planned["planned"] > budget:
        masters = host.need(set(host.optim), set())["masters"]
        _refuse(cfg, budget, minimum, weights_on, host.world, host.buffers, masters)
    memory, memory_share, kept = files_in_memory(budget - planned["planned"] if budget is not None else 0,
                                                 [p for p in reversed(order) if p in whole], host.groups, host.sizes,
                                                 {p: host.optim[p] / max(host.owned[p], 1) for p in whole})
    planned.update(in_memory=kept, planned=planned["planned"] + kept)
    return disk, whole, dict(planned, minimum=minimum, groups={p: host.groups[p] for p in whole}, owned=host.owned,
                             memory=memory, memory_share=memory_share)


def _refuse(cfg, budget: int, minimum: int, weights_on: Tier | str, world: int, buffers: int, masters: int) -> None:
    """Raise the ``BudgetError`` of a host budget below ``minimum``, saying what the host still holds."""
    what = ("with every pack's optimizer state on disk the host still needs the fp32 weights "
            f"({fmt_bytes(masters)}), {_grads_held(cfg)} and two packs' "
            f"optimizer state in flight" if weights_on == Tier.HOST else
            f"with every pack's weights and optimizer state on disk the host still needs buffers "
            f"({fmt_bytes(buffers)}), a file's gradients and three files of weights and optimizer state in "
            f"flight" if world == 1 else
            f"with this rank's share of every pack on disk the host still needs buffers ({fmt_bytes(buffers)}), "
            f"{_grads_held(cfg)} (whole, for their reduce-scatter), three files of its share in flight and the "
            f"largest pack's gathered weights")
    todo = ("weights_on='auto' to let weights go to disk too, or "
            if weights_on == Tier.HOST and getattr(cfg, "weights_on", "auto") == Tier.HOST else "")
    raise BudgetError(
        f"host_memory_budget={fmt_bytes(budget)} cannot hold the host's share of training state: {what}, "
        f"{fmt_bytes(minimum)}. Raise host_memory_budget to at least {fmt_bytes(minimum)} ({minimum} bytes), "
        f"or compile with {todo}{'a smaller disk_group_bytes' if world == 1 else 'more ranks or smaller packs'}.",
        min_budget=minimum, option="host_memory_budget")
