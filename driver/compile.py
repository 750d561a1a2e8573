"""The compile driver: trace -> cost -> plan this rank (its mode, balance, placement) -> passes -> the module.

``harmony.compile`` checks its options into a ``Config`` and calls ``compile``; so does every other way into a
plan that starts from a model (``plan_node`` in driver/modes/pipeline_plan.py resolves through ``resolve``).
The phases are logged on the ``"harmony"`` logger at INFO with their seconds (each pass's line, with what it
chose, comes from the pass manager), and kept in ``sm.compile_seconds``.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping

import torch
from torch._C._dynamo.eval_frame import get_eval_frame_callback as eval_frame_callback

from harmony.base.errors import BudgetError, ConfigError, InputError
from harmony.base.process import cuda_expandable_segments
from harmony.base.tiers import Tier
from harmony.base.units import fmt_bytes
from harmony.compiler import cost
from harmony.compiler.config import DEFAULT_MEMORY_BUDGET, CompileConfig, Config
from harmony.compiler.config_checks import check_optimizer
from harmony.compiler.hardware import Hardware
from harmony.compiler.hardware.machine import cuda_library_bytes
from harmony.compiler.ir import Program
from harmony.compiler.trace import trace
from harmony.driver import agree, min_budget, misses, modes, tokens
from harmony.driver.modes.data import shard_state
from harmony.runtime.comm.compression import parse_compression
from harmony.runtime.comm.world import resolve as resolve_world
from harmony.runtime.optim import from_instance
from harmony.runtime.optim import optimizer_kwargs as optimizer_kwargs_for
from harmony.runtime.precision import frozen_to

log = logging.getLogger("harmony")


def compile(model: torch.nn.Module, example_batch, options: Config, module: type):
    """``module(program, device)`` (the face's ``ScheduledModule``) for ``model`` planned under ``options``. Over
    several ranks, a rank whose compile fails fails every rank's, alike (driver/agree.py)."""
    t0 = time.perf_counter()
    if isinstance(options.optimizer, torch.optim.Optimizer):   # its class, defaults and param groups by name
        cls, kwargs, groups = from_instance(model, options.optimizer, options.optimizer_kwargs)
        options = dataclasses.replace(options, optimizer=cls, optimizer_kwargs=kwargs, param_groups=groups)
    names, batch = batch_items(example_batch)
    cfg, mode = resolve(options, batch_size(batch))
    with agree.compiling(cfg):
        return _compile(model, names, batch, cfg, mode, module, t0)


def _compile(model, names, batch, cfg: CompileConfig, mode: modes.Mode, module: type, t0: float):
    if cfg.compute_dtype is not None:     # frozen weights: in the compute dtype on the host, no fp32 master
        frozen_to(model, cfg.compute_dtype)
    log.info("harmony: compiling %s as %s: %d microbatches of %d rows, memory budget %s", type(model).__name__,
             mode.name, cfg.microbatches, cfg.microbatch_size, fmt_bytes(cfg.memory_budget))
    example = dict(zip(names, batch)) if names else tuple(batch)
    weighting, items = tokens.prepare(cfg, model, example)     # the batch's token count: the step's last input
    gm = trace(model, example, loss_fn=cfg.loss_fn, leaf_modules=cfg.leaf_modules, dtype=cfg.compute_dtype,
               items=items)
    check_groups(cfg.param_groups, gm)
    batch = tensors_of(batch)       # the graph's inputs; the other items are constants of the trace
    t_trace = time.perf_counter()
    log.info("harmony: traced %d nodes in %.2f s", len(gm.graph.nodes), t_trace - t0)
    agree.point(agree.POINTS[0])        # before balance='s plan from rank 0
    balanced = plan_rank(mode, model, gm, batch, cfg)
    batch = balanced.batch if balanced is not None else batch
    cfg.plan_key = misses.fingerprint(gm, batch, cfg)
    misses.resolve(cfg)      # plan_margin="auto": what earlier plan misses of this model taught
    t_plan = time.perf_counter()
    program = Program(model=model, gm=gm, example_batch=tuple(batch), config=cfg,
                      batch_keys=tuple(names) if names else None)
    program.fake = cost.annotate(gm, tokens.traced(batch, items), cfg.microbatch_size, dtype=cfg.compute_dtype)
    program.optim_profile = cost.optimizer_profile(cfg.optimizer, cfg.optimizer_kwargs)
    t_cost = time.perf_counter()
    log.info("harmony: costed the graph in %.2f s", t_cost - t_plan)
    agree.point(agree.POINTS[1])        # before the passes' plan checks and broadcasts
    program = run_passes(mode, program, cfg.passes)
    tokens.settle(program, weighting, items)
    # the balance's section first, then the mode's (a grid's under balance=: both)
    for report in (mode.report(program), balanced.report if balanced is not None else None):
        if report is not None:
            program.reports.insert(0, report)
    if balanced is not None:
        program.rows = balanced.rows
    t_passes = time.perf_counter()
    sm = module(program, cfg.device)
    if balanced is not None:
        balanced.simulated(sm, cfg.hardware)
    try:      # every rank built its module, or none keeps one (driver/agree.py)
        agree.point(agree.POINTS[3])
    except BaseException:
        sm.close()
        raise
    fill = sm.filled["seconds"] if sm.filled else 0.0     # an empty model's weights, made as placed
    sm.compile_seconds = dict(trace=t_trace - t0, **({"balance": t_plan - t_trace} if balanced else {}),
                              cost=t_cost - t_plan, passes=time.perf_counter() - t_cost - fill,
                              **({"fill": fill} if sm.filled else {}), total=time.perf_counter() - t0)
    log.info("harmony: built the runtime in %.2f s; compiled in %.2f s", time.perf_counter() - t_passes,
             sm.compile_seconds["total"])
    if sm.shapes is not None:
        sm.shapes.example.seconds = sm.compile_seconds["total"]
    return sm


def run_passes(mode: modes.Mode, program: Program, passes) -> Program:
    """``mode.run_passes``, or with every layer a pack of its own where the partition's packs do not plan; the budget a
    ``BudgetError`` of theirs names is the smallest that plans, found by planning again from the same trace
    (driver/min_budget.py), with the pass's explanation."""
    try:
        return min_budget.run_or_layers_alone(mode, program, passes)
    except BudgetError as e:
        if not min_budget.searchable(program, e):
            raise
        search = min_budget.smallest_budget(program, mode, passes, e)
        log.info("harmony: the smallest %s that plans: %s, in %d tries (%.2f s)", e.option,
                 fmt_bytes(search.smallest) if search.smallest else "none found", search.tries, search.seconds)
        if search.smallest is None:
            raise
        raise min_budget.named(e, search) from None


def refuse_torch_compile(how: str = "torch.compile(sm)") -> None:
    """``torch.compile`` of a ``ScheduledModule`` is refused: a step is a schedule of packs the runtime runs op by
    op (swaps, host steps, copies between tiers), not one graph dynamo could capture. The model goes in compiled."""
    raise ConfigError(f"{how}: a ScheduledModule runs a planned schedule of swaps and optimizer steps that "
                      f"torch.compile cannot capture; compile the model instead and hand it to Harmony: "
                      f"harmony.compile(torch.compile(model), example_batch, ...)")


def refuse_under_torch_compile() -> None:
    """Raise ``refuse_torch_compile``'s error where a step is called inside ``torch.compile``: while dynamo traces
    it, and in the frame it then runs eagerly (its eval-frame callback is still set)."""
    if torch.compiler.is_compiling() or eval_frame_callback() not in (None, False):
        refuse_torch_compile()


def resolve(options: Config, batch_size: int) -> tuple[CompileConfig, modes.Mode]:
    """``program.config`` and the mode: the checked options resolved for this process -- its world, its optimizer's
    arguments, the budget in bytes, where a mixed-precision step runs, the device the planner plans for."""
    device_type = torch.device(options.device).type
    balance = options.balance is not None
    if not balance and batch_size % options.microbatches:
        raise ConfigError(f"microbatches={options.microbatches!r} must be a positive divisor of the batch size "
                          f"{batch_size}; divisors: {[d for d in range(1, batch_size + 1) if batch_size % d == 0]}")
    kwargs = options.optimizer_kwargs
    check_optimizer(options.optimizer, kwargs, options.param_groups)     # before the model is traced
    # torch's fused update where it has one and the caller did not choose (runtime/optim.py); not under
    # ondemand, whose runtime fetches every tensor an op touches: one fused op touches a pack's whole state
    if options.policy != "ondemand":
        kwargs = optimizer_kwargs_for(options.optimizer, kwargs, ("cpu", device_type))
    spec, adaptive = parse_compression(options.compression)
    world = resolve_world(True if balance and options.data_parallel is None else options.data_parallel,
                          options.comm_timeout)
    mode = modes.of(options, world)
    mixed = options.precision != "fp32"
    cfg = CompileConfig(**dict(
        options.items(), batch_size=batch_size, optimizer_kwargs=dict(kwargs or {}),
        memory_budget=0 if balance else options.memory_budget or DEFAULT_MEMORY_BUDGET,
        optimizer_on=Tier.HOST if mixed and options.optimizer_on == "auto" else options.optimizer_on,
        weigh_device_steps=options.precision == "bf16" and options.optimizer_on == "auto",
        loss_scaling=options.scaling(), compression=spec, adaptive=adaptive,
        shard_state=shard_state(options),
        **mode.resolve(options, world)))
    mode.check(cfg, options)
    if cfg.hardware is None and device_type == "cuda":   # plan for the GPU: its cached profile, else its datasheet
        cfg.hardware = Hardware.this_machine(cache_dir=cfg.cache_dir)
    return cfg, mode


def plan_rank(mode: modes.Mode, model, gm, batch, cfg: CompileConfig):
    """Set ``cfg`` to what this rank plans for (its mode's share, its device's speed, the memory the device's
    libraries hold); the ``Balanced`` share under ``balance=``, else None."""
    balanced = mode.plan_rank(model, gm, batch, cfg)
    check_masters(gm, cfg.precision)
    if torch.device(cfg.device).type == "cuda":
        reserve_for_cuda(cfg, cfg.device)
    return balanced


def check_groups(groups, gm) -> None:
    """Every name a param group lists is one of the traced model's parameters, in one group only."""
    known, seen = {n for n, _ in gm.named_parameters()}, set()
    for i, group in enumerate(groups or ()):
        bad = [n for n in group["params"] if n not in known]
        twice = [n for n in group["params"] if n in seen]
        seen.update(group["params"])
        if bad or twice:
            raise ConfigError(f"param_groups[{i}] names {', '.join(map(repr, (bad or twice)[:3]))}, "
                              + ("not a parameter of the model" if bad else "already in an earlier group")
                              + f"; the names are those of model.named_parameters(), e.g. {sorted(known)[:2]}")


def batch_items(batch) -> tuple[list | None, list]:
    """(names or None, items) of an example batch: a Mapping's keys and values (a dict, a Hugging Face
    ``BatchEncoding``), a tuple's items, one tensor. Items that are not tensors are the trace's constants."""
    if isinstance(batch, Mapping):
        return list(batch), list(batch.values())
    if isinstance(batch, torch.Tensor):
        return None, [batch]
    if isinstance(batch, (tuple, list)):
        return None, list(batch)
    raise InputError(f"example_batch must be a tuple of tensors or a dict (any Mapping, such as a Hugging Face "
                     f"BatchEncoding) of argument name -> tensor, got {type(batch).__name__}")


def tensors_of(items: list) -> list:
    """The tensors of a batch's items, in order: the graph's inputs."""
    return [x for x in items if isinstance(x, torch.Tensor)]


def batch_size(batch) -> int:
    sizes = {t.shape[0] for t in batch if isinstance(t, torch.Tensor) and t.dim() > 0}
    if not batch or len(sizes) != 1:
        raise InputError(f"example_batch must hold tensors whose dimension 0 is the batch and agrees; "
                         f"got batch sizes {sorted(sizes)}")
    if 0 in sizes:
        raise InputError("example_batch has 0 rows: give at least one sample (as many as one training step "
                         "takes), with the shapes and dtypes the batches will have")
    return sizes.pop()


def check_masters(gm, precision) -> None:
    if precision == "fp32":
        return
    # the host's masters are the model's own trainable tensors: they must be the fp32 ones (frozen ones have none)
    low = [(n, p.dtype) for n, p in gm.named_parameters()
           if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32]
    if low:
        raise ConfigError(f"precision={precision!r} keeps the model's parameters as fp32 master weights, but "
                          f"{len(low)} are not fp32 (first: {low[0][0]} is {low[0][1]}); pass the model in fp32 "
                          f"(model.float()) and let Harmony make the {precision} copies")


def reserve_for_cuda(config: CompileConfig, device) -> None:
    """The CUDA libraries' own device memory comes out of the budget first (config.device_reserved)."""
    config.expandable_segments = cuda_expandable_segments()
    config.device_reserved = cuda_library_bytes(device, config.compute_dtype)
    if config.device_reserved >= config.memory_budget:
        raise BudgetError(f"memory_budget={fmt_bytes(config.memory_budget)} does not cover the "
                          f"{fmt_bytes(config.device_reserved)} the CUDA libraries take on {device} (cuBLAS "
                          f"workspaces, one per thread that multiplies matrices; CUBLAS_WORKSPACE_CONFIG sets "
                          f"their size): raise memory_budget above that", min_budget=2 * config.device_reserved)
