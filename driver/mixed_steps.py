"""bf16 under ``optimizer_on="auto"``: how many packs step on the device beside the host's steps, chosen by simulation.

Mixed precision steps every pack on the host by default (ZeRO-Offload): its fp32 masters and optimizer state never
come to the device. Where the device computes much faster than the host updates (bf16 on a recent GPU) the host's
steps outlast the backward they overlap, and the next step waits for them. A pack can step on the device instead
(passes/offload.py ``_device_steps``, runtime/ops/update.py): its masters and optimizer state come in one parameter at
a time, which costs the compute stream the copies' time but takes the pack's update off the host. The packs that
step last go first: their host steps are the ones left when the backward ends. compile plans the step with 0, 1, 2,
... such packs, simulates each on the plan's hardware and keeps the fastest, stopping at the first count that is
no faster than the one before it or does not fit. The offload pass's report lists what each count predicted.
"""
from __future__ import annotations

import dataclasses
import itertools

from harmony.base.errors import HarmonyError
from harmony.base.tiers import Tier
from harmony.compiler.passmanager import run_passes
from harmony.compiler.verify import memory_curve, state_sizes
from harmony.driver.replan import another_rank
from harmony.passes.swap import compare
from harmony.runtime.simulate import simulate


def wanted(cfg) -> bool:
    """Whether compile weighs device steps: bf16 left to the compiler, one rank, no clipping, a planned policy, and
    hardware whose copies run beside its compute (not the CPU device, whose host and device share the cores)."""
    return (cfg.weigh_device_steps and (cfg.world_size or 1) <= 1
            and cfg.clip_grad_norm is None and cfg.policy != "ondemand" and not cfg.copies_block
            and cfg.parallel != "pipeline" and not cfg.shard_state and compare.hardware(cfg) is not None)


def choose(program, passes) -> tuple[int, dict]:
    """(how many of the last-stepped packs step on the device, {count: predicted step in seconds, None: does not
    fit}) for ``program``, each count planned from its trace as another rank's plan is
    (driver/replan.py)."""
    cfg = program.config
    hw = compare.hardware(cfg)
    predicted: dict = {}
    best = 0
    for k in itertools.count():
        try:
            p = run_passes(another_rank(program, dataclasses.replace(cfg, device_steps=k, offline=True)), passes)
        except HarmonyError:
            predicted[k] = None
            break
        if sum(r.step_on == Tier.DEVICE for r in p.plan.residency.values()) < k:   # no more packs could move
            break
        predicted[k] = simulate(p.schedule, p.plan, hw, memory=memory_curve(p, check_residency=False),
                                sizes=state_sizes(p)).step_seconds
        if predicted[k] >= predicted[best] and k:
            break
        best = k
    return best, predicted
