"""offload: decide where each pack's optimizer step runs, and so where its optimizer state lives.

``device``: the state comes to the device for the step (streamed one parameter at a
time unless the swap pass finds room to keep it resident). ``host``: gradients leave
the device after the pack's backward, the user's optimizer steps the host copies of
the weights on a host thread while the device runs the next pack's backward, and the
state never touches the device (ZeRO-Offload); the weights' next ``swap_in`` waits for
that step. With ``optimizer_on="auto"`` the step stays on the device when all training
state fits the budget, and goes to the host otherwise: that is when the device has no
room for optimizer state, and the host step moves only gradients (P bytes out) instead
of optimizer state (2 x 2P) and updated weights (P).
"""
from __future__ import annotations

import time

from harmony.compiler.ir import PassReport, PassResult, Program
from harmony.compiler.verify import memory_curve
from harmony.errors import ConfigError
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
    if place == "auto":
        fits = everything_fits(program)
        place = "device" if fits or cfg.policy == "ondemand" else "host"
        reason = ("all training state fits the budget" if fits else
                  "the ondemand baseline leaves everything to the runtime" if cfg.policy == "ondemand" else
                  "the training state does not fit the budget: optimizer state stays off the device")
    plan.step_on = {p.index: place for p in plan.packs}
    for n in program.schedule.nodes:
        if n.op == "call_function" and n.target is ops.step:
            n.kwargs = {**n.kwargs, "where": place}
    rows = []
    for spec in plan.packs:
        host = place == "host"
        rows.append(dict(pack=spec.index, layers=spec.name, step_on=place,
                         optimizer_state="host" if host else "device (streamed or resident)",
                         optim_MiB=spec.optim_bytes / 2**20,
                         grads_out_MiB=(spec.param_bytes if host else 0) / 2**20))
    report = PassReport("offload: where the optimizer steps", rows,
                        totals=dict(step_on=place, seconds=time.perf_counter() - start))
    report.notes.append(f"chosen because {reason}")
    return PassResult(program, report)
