"""The runtime a compiled program runs on, assembled onto the module: tensors, optimizers, tiers, shapes, checks.

``assemble(sm, program, device)`` is the body of ``ScheduledModule.__init__``: it takes this rank's tensors
(its mode's: a pipeline rank keeps its packs'), partitions them where the mode does (ZeRO-3's shares), builds
one optimizer per pack, the ``Runtime`` over the schedule, the disk tiers the plan places state on (after
checking the disk has room), the shape cache and the ranks' handshake, and fills a model built without its
weights as the plan places them. Whatever it made is closed again if a later part fails.
"""
from __future__ import annotations

import torch

from harmony.base.process import huge_pages, idle_threads_sleep, return_freed_memory
from harmony.base.tiers import Tier
from harmony.compiler.trace import retarget
from harmony.compiler.verify import memory_curve
from harmony.driver import agree, modes
from harmony.driver.handshake import attach
from harmony.driver.materialize import Filler, is_empty
from harmony.driver.shapes import ShapeCache
from harmony.driver.tokens import weighting_of
from harmony.driver.usermodel import guard
from harmony.runtime.executor import Runtime
from harmony.runtime.ondemand import OnDemand
from harmony.runtime.ops import resident_state
from harmony.runtime.optim import build_optimizers
from harmony.runtime.partitioned.disk import ShareTier
from harmony.runtime.precision import overflow_agreement
from harmony.runtime.tiers.dirs import check_room
from harmony.runtime.tiers.optim_disk import DiskTier
from harmony.runtime.tiers.params_disk import DiskParams, written_names


def assemble(sm, program, device) -> None:
    """Set ``sm``'s runtime state for ``program`` on ``device`` (see the module's docstring)."""
    sm.program = program
    sm.model = program.model
    plan, gm, cfg = program.plan, program.gm, program.config
    sm.mode = mode = modes.of_config(cfg)
    tensors = dict(gm.named_parameters())
    tensors.update(dict(gm.named_buffers()))
    if plan is not None:
        tensors = mode.local_tensors(plan, tensors)
    simulated = torch.device(device).type == "meta"    # a plan to simulate: never run, no collective
    filler = None
    if not simulated and is_empty(sm.model):   # built under empty_weights(): filled as the plan places it
        filler = fill_host(sm, tensors)
    shares = None if simulated else mode.shares(plan, tensors, cfg, fill=filler and filler.fill)
    # one optimizer per pack (per file for a pack wholly on disk); sm.optimizer holds their groups' settings
    optimizers, sm.optimizer = build_optimizers(cfg, plan, tensors)
    sm.optimizers = list(dict.fromkeys(optimizers.values()))
    sm.schedulers = []     # saved and restored with the module (add_scheduler)
    sm.stats, sm.eval_stats = {}, {}     # the last step's, the last evaluation's (driver/evaluate.py)
    sm._evaluation = None      # its schedule, built by the first sm.evaluate(...)
    sm.steps = 0
    sm.huge_pages = huge_pages()     # torch's CPU allocations: one page fault per 2 MiB, not per 4 KiB
    sm.idle_threads_sleep = idle_threads_sleep()   # OpenMP threads between regions: sleep, or spin on a core
    sm.runtime = sm.predicted = sm.shapes = None
    sm.filled = None     # {"bytes", "seconds"}: the weights compile made for a model built without them
    if torch.device(device).type != "cpu":   # the trace ran on the CPU: its device constants name it
        managed = {id(t) for t in [*gm.parameters(), *gm.buffers()]}
        for spec in plan.packs:
            retarget(spec.module, torch.device(device), managed)
    if program.schedule is not None:   # a pipeline cut short (passes=...) can be inspected, not run
        _runtime(sm, tensors, optimizers, shares, device, simulated, filler)
    if filler is not None:      # whatever no disk tier took (none is made without a schedule)
        try:
            filler.fill(tensors.values())
        except BaseException:
            sm.close()
            raise
        sm.filled = dict(bytes=filler.filled, seconds=filler.seconds)


def _runtime(sm, tensors, optimizers, shares, device, simulated, filler) -> None:
    program, plan, cfg = sm.program, sm.program.plan, sm.program.config
    sm.runtime = Runtime(plan, program.schedule, tensors, optimizers, cfg.state_budget, device,
                         on_demand=OnDemand if cfg.policy == "ondemand" else None,
                         speed_factor=getattr(cfg, "speed_factor", 1.0), accounting=cfg.accounting,
                         link_bandwidth=getattr(cfg, "link_bandwidth", 0.0))
    sm.runtime.state.shares = shares
    weighting = weighting_of(program)      # tokens: each seed is its loss times the scale (driver/tokens.py)
    sm.runtime.token_scale = weighting.scale if weighting.tokens else None
    # fp16: one overflow skips every rank's step (ranks that each check only their shares, or their stages' packs)
    if (shares is not None or plan.stage is not None) and sm.runtime.scaler is not None:
        sm.runtime.scaler.agree = overflow_agreement(sm.runtime)
    if shares is not None or sm.mode.guards_model(plan):
        guard(sm)     # the model refuses to be read while weights are in other ranks' shares or stages
    sm.predicted = memory_curve(program, check_residency=False)
    if not simulated:
        try:     # every rank's compile got this far, or none builds a module (driver/agree.py)
            agree.point(agree.POINTS[2])
        except BaseException:
            sm.close()
            raise
    try:     # a failure from here on is met at the end of compile (driver/agree.py): close what was built
        if not simulated:
            attach(sm)      # the ranks' calls that use collectives are checked alike (driver/handshake.py)
        sm.shapes = ShapeCache(sm)     # a plan per batch shape, this one the example's (driver/shapes.py)
        if cfg.host_memory_budget is not None:   # the host's memory is budgeted: freed buffers must go back
            return_freed_memory()
        if Tier.DISK in plan.by_pack("optim_on").values() and not simulated:   # the disk tiers: made now
            disk_tiers(sm, tensors, optimizers, shares, device, filler)
    except BaseException:
        sm.close()
        raise


def fill_host(sm, tensors: dict):
    """An empty model's parameters that stay in host memory, filled now; those of packs wholly on disk are
    filled group by group as their files are written, and those partitioned over the ranks a pack at a time
    as this rank cuts its chunks of them (driver/materialize.py)."""
    plan = sm.program.plan
    filler = Filler(sm.model, sm.program.config.init)
    partitioned = {n for r in plan.residency.values() if r.shares is not None for n in r.shares.names()}
    later = partitioned or written_names(plan) - {n for what, names in resident_state(plan) if what == "params"
                                                  for n in names}   # (resident weights are read at start)
    filler.fill(t for n, t in tensors.items() if n not in later)
    return filler


def disk_tiers(sm, tensors: dict, optimizers: dict, shares, device, filler=None) -> None:
    """The disk tiers' stores, their directories made now (after checking the disk has room for the plan)."""
    from harmony.viz.report import tiers_of  # deferred: harmony.viz loads on first use (harmony/__init__.py)
    program, plan, cfg = sm.program, sm.program.plan, sm.program.config
    state = sm.runtime.state
    try:
        check_room(cfg.offload_dir, tiers_of(program)["disk_bytes"])
        state.disk = DiskTier.create(plan, program.schedule, tensors, optimizers, cfg.offload_dir,
                                     **cfg.disk_io())
        if shares is not None:    # this rank's shares of the partitioned packs on disk
            state.disk = ShareTier.create(plan, program.schedule, tensors, optimizers, shares,
                                          cfg.offload_dir, **cfg.disk_io())
            for n in getattr(state.disk, "piece_pack", ()):   # the chunks are in their files
                state.master[n] = tensors[n].data
        state.params_disk = DiskParams.create(plan, program.schedule, tensors, optimizers,
                                              sm.runtime.meter, device, cfg.offload_dir,
                                              fill=filler and filler.fill, **cfg.disk_io())
        if state.params_disk is not None:   # the weights are in their files: no host copy stays
            state.params_disk.parked = state.parked
            for n in state.params_disk.pack_of:
                state.master[n] = tensors[n].data
        if torch.device(device).type == "cpu":     # their free I/O buffers: within the device's room
            for tier in (state.disk, state.params_disk):
                if tier is not None:
                    tier.store.buffers.share_room(sm.runtime.meter)
    except BaseException:
        sm.runtime.close()
        raise
    guard(sm)     # the user's model refuses to be read while weights of it are on disk only
