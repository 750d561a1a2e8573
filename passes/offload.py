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
steps on the host: the fp32 masters and optimizer state never come to the device.

Where a host-stepped pack's optimizer state lives between steps (``plan.optim_on``):
``host`` while ``host_memory_budget`` allows, else ``disk`` (a file per pack under
``offload_dir``, read back for the pack's step: runtime/disk.py). The host holds, and the
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
"""
from __future__ import annotations

import time

from harmony.compiler.ir import PassReport, PassResult, Program
from harmony.compiler.verify import memory_curve
from harmony.errors import BudgetError, ConfigError
from harmony.units import fmt_bytes
from harmony.runtime import ops

NAME = "offload"
REQUIRES = {"schedule"}
PROVIDES = {"placement"}
PLACES = ("auto", "device", "host")


def everything_fits(program: Program) -> bool:
    plan = program.plan
    saved = plan.resident
    plan.resident = {(p.index, k) for p in plan.packs for k in ("params", "grads", "optim")}
    try:
        return memory_curve(program, check_residency=False).peak <= program.config.usable_budget
    finally:
        plan.resident = saved


def run(program: Program, ctx) -> PassResult:
    start = time.perf_counter()
    cfg, plan = program.config, program.plan
    if cfg.optimizer_on not in PLACES:
        raise ConfigError(f"optimizer_on={cfg.optimizer_on!r}; choose one of {', '.join(PLACES)}")
    place = cfg.optimizer_on
    reason = f"optimizer_on={place!r}"
    if cfg.precision != "fp32":   # compile() refuses optimizer_on="device" with mixed precision
        place, reason = "host", f"precision={cfg.precision!r}: fp32 master weights and optimizer state stay on the host"
    elif place == "auto":
        fits = everything_fits(program)
        place = "device" if fits or cfg.policy == "ondemand" else "host"
        reason = ("all training state fits the budget" if fits else
                  "the ondemand baseline leaves everything to the runtime" if cfg.policy == "ondemand" else
                  "the training state does not fit the budget: optimizer state stays off the device")
    plan.step_on = {p.index: place for p in plan.packs}
    for n in program.schedule.nodes:
        if n.op == "call_function" and n.target is ops.step:
            n.kwargs = {**n.kwargs, "where": place}
    host = place == "host"
    budget = getattr(cfg, "host_memory_budget", None)
    disk, need = place_optimizer_state(program) if host else (set(), {})
    plan.optim_on = {p.index: "disk" if p.index in disk else place for p in plan.packs}
    rows = []
    for spec in plan.packs:
        where = plan.optim_on[spec.index]
        on_disk = spec.optim_bytes if where == "disk" else 0
        rows.append(dict(pack=spec.index, layers=spec.name, step_on=place,
                         optimizer_state=where if host else "device (streamed or resident)",
                         optim_MiB=spec.optim_bytes / 2**20,
                         grads_out_MiB=(spec.param_bytes if host else 0) / 2**20,
                         disk_read_MiB=on_disk / 2**20, disk_write_MiB=on_disk / 2**20))
    disk_bytes = sum(s.optim_bytes for s in plan.packs if s.index in disk)
    totals = dict(step_on=place, disk_packs=len(disk), step_disk_read_bytes=disk_bytes,
                  step_disk_write_bytes=disk_bytes, seconds=time.perf_counter() - start)
    if host and budget is not None:
        totals.update(host_budget_bytes=budget, host_planned_bytes=need["planned"],
                      host_minimum_bytes=need["minimum"])
    report = PassReport("offload: where the optimizer steps and where its state lives", rows, totals=totals)
    report.notes.append(f"chosen because {reason}")
    if host and budget is None:
        report.notes.append("no host_memory_budget: every pack's optimizer state stays in host memory")
    elif host:
        report.notes.append(
            f"host_memory_budget {fmt_bytes(budget)} holds {fmt_bytes(need['planned'])}: master parameters and "
            f"buffers {fmt_bytes(need['masters'])}, {_grads_held(cfg)} {fmt_bytes(need['grads'])}, optimizer "
            f"state of {len(plan.packs) - len(disk)} host packs {fmt_bytes(need['host_optim'])}"
            + (f", buffers of 2 disk packs in flight {fmt_bytes(need['staging'])}" if disk else ""))
        if disk:
            report.notes.append(
                f"{len(disk)} packs keep their optimizer state on disk ({fmt_bytes(disk_bytes)} read and written per "
                f"step): the first-stepped ones, so their writes overlap the backward of the packs after them "
                f"and each read overlaps the compute before its step")
    elif budget is not None:
        report.notes.append("host_memory_budget is not used: the optimizer steps on the device")
    return PassResult(program, report)


def _grads_held(cfg) -> str:
    """Which gradients the host holds at once: fp16 keeps every pack's until the overflow check."""
    return {"fp32": "gradients of two packs", "bf16": "gradients of two packs (bf16 and fp32)",
            "fp16": "gradients of every pack (fp16 steps after the last is checked for overflow)"}[cfg.precision]


def place_optimizer_state(program: Program) -> tuple[set[int], dict]:
    """(packs whose optimizer state goes to disk, the host bytes planned) under ``host_memory_budget``.

    Walks the packs in step order (the schedule's order of ``step`` ops), moving each to disk
    until the host holds what the budget allows; raises ``BudgetError`` naming the smallest
    host budget if even every pack on disk does not fit.
    """
    cfg, plan = program.config, program.plan
    budget = getattr(cfg, "host_memory_budget", None)
    gm = program.gm
    masters = sum(t.numel() * t.element_size() for t in gm.parameters()) + \
        sum(t.numel() * t.element_size() for t in gm.buffers())
    grads = 2 * max((s.param_bytes for s in plan.packs), default=0)
    if cfg.precision != "fp32":   # a pack's gradients arrive in the compute dtype and step as fp32 copies;
        held = [s.param_bytes + s.master_bytes for s in plan.packs]   # fp16 holds them all until the last
        grads = sum(held) if cfg.precision == "fp16" else 2 * max(held, default=0)   # is checked for overflow
    optim = {s.index: s.optim_bytes for s in plan.packs}
    order = [n.args[0] for n in program.schedule.nodes if n.op == "call_function" and n.target is ops.step]
    order = list(dict.fromkeys(order + [s.index for s in plan.packs]))   # packs without a step op last

    def need(disk: set[int]) -> dict:
        host_optim = sum(b for p, b in optim.items() if p not in disk)
        staging = 2 * max((optim[p] for p in disk), default=0)
        return dict(masters=masters, grads=grads, host_optim=host_optim, staging=staging,
                    planned=masters + grads + host_optim + staging)

    minimum = need(set(optim))["planned"]
    disk: set[int] = set()
    if budget is not None:
        for p in order:
            if need(disk)["planned"] <= budget:
                break
            if optim[p]:
                disk.add(p)
        if need(disk)["planned"] > budget:
            raise BudgetError(
                f"host_memory_budget={fmt_bytes(budget)} cannot hold the host's share of training state: the master "
                f"parameters and buffers ({fmt_bytes(masters)}), {_grads_held(cfg)} ({fmt_bytes(grads)}) and "
                f"two packs' optimizer state in flight to and from disk ({fmt_bytes(need(set(optim))['staging'])}) "
                f"need {fmt_bytes(minimum)} with every pack's optimizer state on disk. Raise host_memory_budget to at "
                f"least {fmt_bytes(minimum)} ({minimum} bytes).",
                min_budget=minimum)
    return disk, dict(need(disk), minimum=minimum)
