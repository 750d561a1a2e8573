"""``sm(*batch)``: the call's arguments checked, one step run as a transaction, and ``sm.steps`` kept truthful.

The runtime rolls a failed step back (runtime/transaction.py); here the module counts a step only when every
pack's optimizer update was applied, and refuses to train on a step that updated some packs only until the
user loads a checkpoint or accepts the mix (``ScheduledModule.accept_partial_step``).
"""
from __future__ import annotations

import contextlib
import time

import torch

from harmony.base.errors import ConfigError, DeviceOutOfMemory, InputError, TornStepError
from harmony.base.process import peak_rss_bytes
from harmony.base.units import fmt_bytes
from harmony.driver import misses
from harmony.driver.constants import split_call
from harmony.driver.handshake import CALLS, agree, planned
from harmony.driver.shapes import describe
from harmony.driver.tokens import user_names, with_count
from harmony.driver.usermodel import withhold_synced
from harmony.runtime.comm.world import check_world
from harmony.runtime.executor import module_modes
from harmony.runtime.transaction import describe_torn


def batch_of(sm, batch: tuple, named: dict) -> tuple:
    """The call's batch tensors in the plan's order, each a tensor with values; shapes are the shape cache's to
    check (driver/shapes.py), except under ``balance=``, whose ranks' shares of one global batch cannot change."""
    cfg = sm.program.config
    names = user_names(sm.program)      # (not the token count, driver/tokens.py)
    if named:
        unknown = [k for k in named if k not in names]
        if unknown:
            raise InputError(f"sm(...) got unknown keyword argument{'s' if len(unknown) > 1 else ''} "
                             f"{', '.join(map(repr, unknown))}; the batch's names are {', '.join(names)}")
        given = set(names[:len(batch)])
        twice = [k for k in named if k in given]
        if twice:
            raise InputError(f"sm(...) got {', '.join(map(repr, twice))} both by position and by keyword")
        missing = [n for n in names[len(batch):] if n not in named]
        if missing:
            raise InputError(f"sm(...) is missing batch tensor{'s' if len(missing) > 1 else ''} "
                             f"{', '.join(map(repr, missing))}; it takes {', '.join(names)}")
        batch = tuple(batch) + tuple(named[n] for n in names[len(batch):])
    rows = getattr(sm.program, "rows", None)
    if rows is not None and batch and isinstance(batch[0], torch.Tensor) and batch[0].dim() > 0 \
            and batch[0].shape[0] == cfg.global_batch:   # the global batch: this rank's rows
        batch = tuple(x[rows[0]:rows[1]] if isinstance(x, torch.Tensor) and x.dim() > 0 else x for x in batch)
    if len(batch) != len(names):
        raise InputError(f"expected {len(names)} batch tensors ({', '.join(names)}), got {len(batch)}")
    for name, x, ex in zip(names, batch, sm.program.example_batch):
        if not isinstance(x, torch.Tensor) or (rows is not None and (x.shape != ex.shape or x.dtype != ex.dtype)):
            got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
            why = ("balance= plans each rank's share of one global batch, which cannot change shape"
                   if rows is not None else "give a tensor")
            raise InputError(f"batch tensor {name!r}: expected shape {tuple(ex.shape)} {ex.dtype} as in "
                             f"example_batch, got {got}; {why}")
        if x.is_meta:
            raise InputError(f"batch tensor {name!r} is on the meta device: it has no values to train on")
    return batch


def train_step(sm, batch: tuple, named: dict) -> torch.Tensor:
    """``sm(*batch, **named)`` in training mode: the call's batch checked, its shape's plan found (made once for a
    new shape), the step run as a transaction and ``sm.stats`` set from what it measured."""
    if sm.runtime is None:
        raise ConfigError(f"this module was compiled with passes={[h[0] for h in sm.history]}, which "
                          f"make no schedule; compile with the default passes to train")
    check_world(sm.program.config, sm.program.capabilities)   # a plan is for one world size
    withhold_synced(sm)     # a pipeline rank's copies of others' weights (sm.sync_model) are stale after this step
    error = route = None
    plans = False
    try:
        batch, named, constants = split_call(sm.program, batch, named)    # its constants apart (driver/constants.py)
        batch = batch_of(sm, batch, named)
        route = sm.shapes.route(batch, constants)     # the compiled plan, or one for this shape (driver/shapes.py)
        plans = route.plan is None
    except InputError as e:
        error = e
    # every rank steps now (not one saving), each with a batch it can train and all by the same kind of plan (new
    # plans of one shape): else an error on every rank at once, before any collective of the step
    agree(sm, CALLS[0], error, plans, shape_digest(route.key) if route is not None else 0)
    if error is not None:
        raise error
    try:
        shape, rows = sm.shapes.plan_for(batch, route)   # (a new shape's planning makes collectives of its own)
    except InputError as e:
        planned(sm, e)      # a rank that could not plan it: every rank refuses, before any collective of the step
        raise
    if plans:
        planned(sm, None)
    counted = with_count(sm, batch, across_ranks=True)     # the token count last, where the step takes it
    cuda = sm.runtime.device.type == "cuda"
    if cuda:     # the allocator's peaks over this step (the report shows them beside the meter's)
        torch.cuda.reset_peak_memory_stats(sm.runtime.device)
    t0 = time.perf_counter()
    sm.optimizer.step()      # the param groups' settings (a scheduler's lr) into every pack's optimizer
    sm.runtime.meter.settle_above = shape.predicted.peak    # copies in flight use no more than the plan's
    with sm.runtime.running(shape.program.plan, shape.program.schedule) \
            if shape is not sm.shapes.example else contextlib.nullcontext():
        try:
            loss = run_step(sm, counted, rows)     # a transaction: rolled back if it raises
        except DeviceOutOfMemory as e:      # more than the safety net could absorb: the next compile plans for it
            learn_misses(sm, shape, e)
            raise
    sm.shapes.ran(route.key, shape)
    sm.stats = step_stats(sm, shape, time.perf_counter() - t0, route.key)
    if sm.stats.get("plan_misses"):     # the next compile of this model plans around them (driver/misses.py)
        learn_misses(sm, shape)
    return loss


def learn_misses(sm, shape, error: BaseException | None = None) -> None:
    """The step's plan misses, learned for the next compile of the model (driver/misses.py); a note on ``error``
    (a miss the net could not absorb) says how much of the budget that compile will leave unplanned."""
    rt = sm.runtime
    if rt.safety is None or not rt.safety.misses:
        return
    margin = misses.learn(shape.program.config.plan_key, rt.safety.misses, shape.predicted, rt.events)
    if error is not None and margin:
        error.add_note(f"harmony: the next harmony.compile of this model with plan_margin='auto' in this process "
                       f"leaves {fmt_bytes(margin)} of the budget unplanned for what this plan under-predicted")


def shape_digest(key: tuple) -> int:
    """A number for a batch's shapes and constants, the same in every process (the ranks compare them)."""
    import zlib
    return zlib.crc32(repr(key).encode())


def run_step(sm, batch: tuple, rows: tuple[int, ...] | None = None) -> torch.Tensor:
    """One training step: refused after a torn one; counted when every update was applied, even if it raised."""
    rt = sm.runtime
    if rt.torn is not None:
        raise TornStepError(f"step {sm.steps + 1} refused: {describe_torn(rt.torn)}")
    # sm(...) under torch.no_grad() evaluates (ScheduledModule.forward); whoever calls a step otherwise, its
    # backward needs a graph. The model's leaf modules run in training mode whatever mode the user left them in.
    try:
        with torch.inference_mode(False), torch.enable_grad(), module_modes(train_modules(sm), True):
            loss = rt.run(dict(zip(sm.program.plan.input_names, batch)), rows)
    except BaseException:
        if rt.transaction is not None and rt.transaction.outcome == "committed":
            sm.steps += 1
        raise
    sm.steps += 1
    return loss


def train_modules(sm) -> list:
    """The modules the packs' graphs call (the fx front end's leaf modules), which read their training flag."""
    if getattr(sm, "_train_modules", None) is None:
        sm._train_modules = leaf_modules(sm.program.plan.packs)
    return sm._train_modules


def leaf_modules(packs) -> list:
    """The modules the packs' graphs call whole (the fx front end's leaf modules: ``nn.Dropout``, ``nn.BatchNorm2d``,
    the user's ``leaf_modules``) with everything inside them: they read their own ``training`` flag as they run."""
    out: dict = {}
    for spec in packs:
        for node in spec.module.graph.nodes:
            if node.op == "call_module":
                out.update(dict.fromkeys(spec.module.get_submodule(node.target).modules()))
    return list(out)


def accept_partial_step(sm) -> dict | None:
    """Keep the weights of a step that updated some packs only, and train on; returns what it updated."""
    rt = sm.runtime
    torn, rt.torn = (rt.torn, None) if rt is not None else (None, None)
    return torn


def disk_stats(state) -> dict:
    """This step's disk traffic of both disk tiers (optimizer state alone; packs wholly on disk), summed."""
    out: dict = {}
    for tier in (getattr(state, "disk", None), getattr(state, "params_disk", None)):
        for k, v in (tier.step_stats() if tier is not None else {}).items():
            out[k] = out[k] + v if isinstance(v, (int, float)) and k in out else out.get(k, v)
    for way in ("read", "write") if out else ():     # GB/s of the I/O that finished in this step, with its seconds
        sec = out[f"disk_{way}_seconds"]
        out[f"disk_{way}_GBps"] = out[f"disk_{way}_done"] / sec / 1e9 if sec else 0.0
    return out


def step_stats(sm, shape, seconds: float, key: tuple | None = None) -> dict:
    """``sm.stats``: the step's measured memory, traffic and time beside what the plan that ran predicted."""
    rt, predicted = sm.runtime, shape.predicted
    stats = dict(step_seconds=seconds, measured_peak=rt.meter.peak,
                 predicted_peak=predicted.peak, budget=rt.meter.budget,
                 h2d_bytes=rt.state.moved["h2d"], d2h_bytes=rt.state.moved["d2h"],
                 host_step_seconds=rt.state.host_step_seconds,
                 predicted_h2d=predicted.moved["h2d"], predicted_d2h=predicted.moved["d2h"],
                 peak_rss_bytes=peak_rss_bytes(), huge_pages=sm.huge_pages,
                 idle_threads_sleep=sm.idle_threads_sleep)
    key = key or shape.key       # the batch's (the route's: the compiled plan runs smaller shapes too)
    if key != sm.shapes.example.key:     # another shape than the example batch's: the plan that ran, its rows
        stats.update(batch_shape=describe(key, sm.shapes.names), microbatch_rows=list(rt.rows),
                     plan="compiled" if shape is sm.shapes.example else "made for this shape")
    if rt.device.type == "cuda":
        stats.update(expandable_segments=sm.program.config.expandable_segments,
                     cuda_allocated_peak=torch.cuda.max_memory_allocated(rt.device),
                     cuda_reserved_peak=torch.cuda.max_memory_reserved(rt.device),
                     device_reserved=sm.program.config.device_reserved)
    if getattr(rt.state, "host_idle", None) is not None:     # the CPU device's host thread has run
        stats["background_idle_priority"] = rt.state.host_idle
    stats.update(disk_stats(rt.state))
    if rt.on_demand is not None:
        stats.update(rt.on_demand.stats())
    if rt.safety is not None:     # the allocations that crossed the budget, and what the net moved to make room
        stats.update(rt.safety.stats())
    kinds = {n.name: n.target.__name__ for n in shape.program.schedule.nodes if n.op == "call_function"}
    for e in rt.events:          # where the step's time went on the thread that runs the schedule, by op
        key = f"time_{kinds.get(e.name, 'other')}_s"
        stats[key] = stats.get(key, 0.0) + e.end - e.start
    if rt.scaler is not None:   # the scale the next step uses, and the steps skipped for inf/nan so far
        stats.update(loss_scale=sm.loss_scale, skipped_steps=rt.scaler.skipped)
    if rt.gate is not None and rt.gate.clipper is not None:   # the norm before clipping (clip_grad_norm_'s)
        stats["grad_norm"] = rt.gate.grad_norm()
    stats.update(sm.mode.step_stats(sm))     # a pipeline rank: the training state it holds
    for hook in sm.program.step_hooks:     # what the passes measure per step (compress: the wire's bytes)
        stats.update(hook(sm))
    return stats
