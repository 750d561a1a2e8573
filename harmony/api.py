"""``harmony.compile``: an ordinary ``nn.Module`` in, a ``ScheduledModule`` that trains it under a budget out."""
from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from harmony.base.errors import BudgetError, ConfigError, HarmonyError, InputError
from harmony.base.process import huge_pages, idle_threads_sleep
from harmony.base.units import fmt_bytes, nbytes
from harmony.compiler import cost
from harmony.compiler.config import DEFAULT_MEMORY_BUDGET, CompileConfig, Config
from harmony.compiler.ir import Program
from harmony.compiler.passmanager import run_passes, split_choices
from harmony.compiler.printer import schedule_code
from harmony.compiler.trace import trace
from harmony.compiler.verify import memory_curve
from harmony.data import check_world
from harmony.data import resolve as resolve_data_parallel
from harmony.handshake import CALLS, agree, attach
from harmony.materialize import Filler, is_empty
from harmony.optim import build_optimizers, from_instance
from harmony.optim import optimizer_kwargs as optimizer_kwargs_for
from harmony.passes.compress import parse_compression
from harmony.runtime.executor import Runtime
from harmony.runtime.ondemand import OnDemand
from harmony.runtime.precision import max_over_ranks
from harmony.shapes import ShapeCache
from harmony.stepping import accept_partial_step, batch_of, run_step, step_stats


def compile(model: torch.nn.Module, example_batch, *, memory_budget=None, microbatches: int | None = None,
            optimizer: type | None = None, config: Config | None = None, **options) -> "ScheduledModule":
    """Plan and build a training step for ``model`` that fits ``memory_budget`` per device.

    >>> sm = harmony.compile(model, example_batch=(x, y), memory_budget="512MiB", microbatches=8)
    >>> loss = sm(x, y)          # forward, backward and optimizer update of one whole batch

    ``example_batch``: one batch as the model's forward takes it (a tensor, a tuple or a dict of tensors whose
    dimension 0 is the batch); ``sm`` then trains on batches of the same shapes. ``memory_budget``: bytes per
    device, an int or a string such as ``"512MiB"`` (default 1 GiB). ``microbatches``: how many the batch is cut
    into, a divisor of its size (default 1). ``optimizer``: a ``torch.optim.Optimizer`` class (default AdamW).

    Every other option is a field of ``harmony.Config``, documented in its groups (harmony/compiler/config.py):
    ``TrainConfig`` (optimizer_kwargs, loss_fn), ``MemoryConfig`` (host_memory_budget, optimizer_on, weights_on,
    recompute), ``DiskConfig`` (offload_dir, ...), ``ParallelConfig`` (data_parallel, compression, balance,
    shard_state, ...), ``NumericsConfig`` (precision, loss_scaling) and ``PlanConfig`` (policy, passes, device,
    hardware, ...). Give them as keywords, ``harmony.compile(model, batch, precision="bf16")``, or as one object,
    ``config=harmony.Config(precision="bf16")``; keywords given beside ``config`` replace its fields. A bad value
    is a ``ConfigError`` naming it.
    """
    t0 = time.perf_counter()
    given = dict(memory_budget=memory_budget, microbatches=microbatches, optimizer=optimizer)
    options = Config.of(config, **{k: v for k, v in given.items() if v is not None}, **options)
    if isinstance(options.optimizer, torch.optim.Optimizer):   # its class, defaults and param groups by name
        cls, kwargs, groups = from_instance(model, options.optimizer, options.optimizer_kwargs)
        options = dataclasses.replace(options, optimizer=cls, optimizer_kwargs=kwargs, param_groups=groups)
    names, batch = _batch_items(example_batch)
    cfg = _resolve(options, _batch_size(batch))
    gm = trace(model, dict(zip(names, batch)) if names else tuple(batch), loss_fn=cfg.loss_fn,
               leaf_modules=cfg.leaf_modules, dtype=cfg.compute_dtype)
    _check_groups(cfg.param_groups, gm)
    t_trace = time.perf_counter()
    balanced = _plan_rank(model, gm, batch, cfg)
    batch = balanced.batch if balanced is not None else batch
    t_plan = time.perf_counter()
    program = Program(model=model, gm=gm, example_batch=tuple(batch), config=cfg,
                      batch_keys=tuple(names) if names else None)
    program.fake = cost.annotate(gm, tuple(batch), cfg.microbatch_size, dtype=cfg.compute_dtype)
    program.optim_profile = cost.optimizer_profile(cfg.optimizer, cfg.optimizer_kwargs)
    t_cost = time.perf_counter()
    program = _run_passes(program, cfg.passes)
    if balanced is not None:
        program.reports.insert(0, balanced.report)
        program.rows = balanced.rows
    sm = ScheduledModule(program, cfg.device)
    if balanced is not None:
        balanced.simulated(sm, cfg.hardware)
    fill = sm.filled["seconds"] if sm.filled else 0.0     # an empty model's weights, made as placed
    sm.compile_seconds = dict(trace=t_trace - t0, **({"balance": t_plan - t_trace} if balanced else {}),
                              cost=t_cost - t_plan, passes=time.perf_counter() - t_cost - fill,
                              **({"fill": fill} if sm.filled else {}), total=time.perf_counter() - t0)
    if sm.shapes is not None:
        sm.shapes.example.seconds = sm.compile_seconds["total"]
    return sm


def _check_groups(groups, gm) -> None:
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


def _resolve(options: Config, batch_size: int) -> CompileConfig:
    """``program.config``: the checked options resolved for this process -- its world, its optimizer's arguments,
    the budget in bytes, where a mixed-precision step runs, the device the planner plans for."""
    device_type = torch.device(options.device).type
    balance = options.balance is not None
    if not balance and batch_size % options.microbatches:
        raise ConfigError(f"microbatches={options.microbatches!r} must be a positive divisor of the batch size "
                          f"{batch_size}; divisors: {[d for d in range(1, batch_size + 1) if batch_size % d == 0]}")
    kwargs = options.optimizer_kwargs
    # torch's fused update where it has one and the caller did not choose (harmony/optim.py); not under
    # ondemand, whose runtime fetches every tensor an op touches: one fused op touches a pack's whole state
    if options.policy != "ondemand":
        kwargs = optimizer_kwargs_for(options.optimizer, kwargs, ("cpu", device_type))
    spec, adaptive = parse_compression(options.compression)
    world = resolve_data_parallel(True if balance and options.data_parallel is None else options.data_parallel,
                                  options.comm_timeout)
    pipeline = options.parallel == "pipeline"
    if pipeline:        # one rank of a pipeline: its world, not data parallel, the stage pass (harmony/pipeline.py)
        from harmony.pipeline import resolve as resolve_pipeline
        world = resolve_pipeline(options, world)
    mixed = options.precision != "fp32"
    cfg = CompileConfig(**dict(
        options.items(), batch_size=batch_size, optimizer_kwargs=dict(kwargs or {}),
        memory_budget=0 if balance else options.memory_budget or DEFAULT_MEMORY_BUDGET,
        optimizer_on="host" if mixed and options.optimizer_on == "auto" else options.optimizer_on,
        weigh_device_steps=options.precision == "bf16" and options.optimizer_on == "auto",
        loss_scaling=options.scaling(), compression=spec, adaptive=adaptive,
        shard_state=balance if options.shard_state is None else options.shard_state,
        data_parallel=world["data_parallel"], world_size=world.get("world_size"), rank=world.get("rank", 0),
        **({"passes": world["passes"]} if pipeline else {})))
    if pipeline:
        from harmony.passes.stage import check_config
        check_config(cfg)
    if cfg.shard_state and (not cfg.data_parallel or (cfg.world_size or 1) < 2):
        raise ConfigError(f"shard_state={cfg.shard_state!r} splits training state over data-parallel ranks, but this "
                          f"process trains alone: run it under torchrun with data_parallel=None or True, or drop "
                          f"shard_state")
    if cfg.shard_state == "full":    # ZeRO-3: what it does not do yet is refused here (passes/shard.py)
        from harmony.passes import shard
        shard.check_config(cfg, options.optimizer_kwargs or {})
        if "compress" in split_choices(cfg.passes)[0] and "shard" not in split_choices(cfg.passes)[0]:
            cfg.passes = (*cfg.passes, "shard")
    if cfg.hardware is None and device_type == "cuda":   # plan for the GPU: its cached profile, else its datasheet
        from harmony.compiler.hardware import Hardware
        cfg.hardware = Hardware.this_machine(cache_dir=cfg.cache_dir)
    return cfg


def _plan_rank(model, gm, batch, cfg: CompileConfig):
    """Set ``cfg`` to what this rank plans for: its share of the batch under ``balance`` (returned), its device's
    speed, its share of the optimizer state, the memory the device's libraries hold."""
    balanced = None
    if cfg.balance is not None:      # this rank's share of the global batch, its device's memory and speed
        from harmony.balanced import plan_this_rank
        balanced = plan_this_rank(model, gm, batch, cfg.balance, cfg, cfg.hardware, sharded=cfg.shard_state)
    elif cfg.hardware is not None:
        from harmony.compiler.hardware import Hardware
        cfg.hardware = Hardware.of(cfg.hardware).computing_in(cfg.precision, cfg.accounting)
        cfg.plan_for_device(_device_of(cfg.hardware), cfg.hardware)
    if cfg.shard_state is True:
        shard_over_ranks(cfg, gm, balanced.shares if balanced else [1.0] * cfg.world_size)
    elif cfg.shard_state == "full" and balanced is not None:     # the partition's chunks: the plan's uneven shares
        cfg.state_shares = list(balanced.shares)
    _check_masters(gm, cfg.precision)
    if torch.device(cfg.device).type == "cuda":
        _reserve_for_cuda(cfg, cfg.device)
    return balanced


def _batch_size(batch) -> int:
    sizes = {t.shape[0] for t in batch if isinstance(t, torch.Tensor) and t.dim() > 0}
    if not batch or len(sizes) != 1:
        raise InputError(f"example_batch must hold tensors whose dimension 0 is the batch and agrees; "
                         f"got batch sizes {sorted(sizes)}")
    if 0 in sizes:
        raise InputError("example_batch has 0 rows: give at least one sample (as many as one training step "
                         "takes), with the shapes and dtypes the batches will have")
    return sizes.pop()


def _check_masters(gm, precision) -> None:
    if precision == "fp32":
        return
    # the host's masters are the model's own tensors: they must be the fp32 ones
    low = [(n, p.dtype) for n, p in gm.named_parameters() if p.is_floating_point() and p.dtype != torch.float32]
    if low:
        raise ConfigError(f"precision={precision!r} keeps the model's parameters as fp32 master weights, but "
                          f"{len(low)} are not fp32 (first: {low[0][0]} is {low[0][1]}); pass the model in fp32 "
                          f"(model.float()) and let Harmony make the {precision} copies")


def _reserve_for_cuda(config: CompileConfig, device) -> None:
    """The CUDA libraries' own device memory comes out of the budget first (config.device_reserved)."""
    from harmony.base.process import cuda_expandable_segments
    from harmony.compiler.machine import cuda_library_bytes
    config.expandable_segments = cuda_expandable_segments()
    config.device_reserved = cuda_library_bytes(device, config.compute_dtype)
    if config.device_reserved >= config.memory_budget:
        raise BudgetError(f"memory_budget={fmt_bytes(config.memory_budget)} does not cover the "
                          f"{fmt_bytes(config.device_reserved)} the CUDA libraries take on {device} (cuBLAS "
                          f"workspaces, one per thread that multiplies matrices; CUBLAS_WORKSPACE_CONFIG sets "
                          f"their size): raise memory_budget above that", min_budget=2 * config.device_reserved)


def shard_over_ranks(config: CompileConfig, gm, shares: list[float]) -> None:
    """Sharded optimizer state: each parameter's owning rank, from byte ``shares`` (runtime/shard.py)."""
    from harmony.runtime.shard import owners
    config.state_owner = owners([(n, nbytes(p)) for n, p in gm.named_parameters()
                                 if p.requires_grad], shares)


def _run_passes(program: Program, passes) -> Program:
    """``run_passes``; a rank that fails before the compress pass tells the others, which would wait for it there."""
    cfg, names = program.config, split_choices(passes)[0]
    if cfg.parallel == "pipeline" and "stage" in names:   # the ranks meet in the stage pass and once compiled
        from harmony.pipeline import run_pipeline_passes
        return run_pipeline_passes(program, passes)
    try:
        from harmony import mixed_steps
        if mixed_steps.wanted(cfg):
            cfg.device_steps, cfg.steps_predicted = mixed_steps.choose(program, passes)
        return run_passes(program, passes)
    except HarmonyError as e:
        # the pass that failed is the first one not in the history; compress itself has met the others already
        if cfg.data_parallel and (cfg.world_size or 1) > 1 and "compress" in names \
                and names.index("compress") > len(program.history):
            from harmony.passes.compress import report_failure
            report_failure(f"{type(e).__name__}: {str(e).splitlines()[0]}")
        raise


def _device_of(hardware):
    from harmony.compiler.hardware import Hardware
    return Hardware.of(hardware).devices[0]


def _batch_items(batch):
    if isinstance(batch, dict):
        return list(batch), list(batch.values())
    if isinstance(batch, torch.Tensor):
        return None, [batch]
    if isinstance(batch, (tuple, list)):
        return None, list(batch)
    raise InputError(f"example_batch must be a tuple of tensors or a dict of them, got {type(batch).__name__}")


class ScheduledModule(torch.nn.Module):
    """A compiled training step: ``sm(*batch)`` runs forward, backward and the optimizer update.

    ``.code`` is the schedule as Python, ``.report()`` what every pass did, ``.history``
    the schedule after each pass, ``.stats`` the last step's measured memory and traffic.
    """

    def __init__(self, program: Program, device="cpu"):
        super().__init__()
        self.program = program
        self.model = program.model
        plan = program.plan
        gm = program.gm
        tensors = dict(gm.named_parameters())
        tensors.update(dict(gm.named_buffers()))
        cfg = program.config
        if plan is not None and plan.stage is not None:   # a pipeline rank keeps its packs' state only
            from harmony.pipeline import local_tensors
            tensors = local_tensors(plan, tensors)
        shares = None
        simulated = torch.device(device).type == "meta"    # a plan to simulate: never run, no collective
        filler = None
        if not simulated and is_empty(self.model):   # built under empty_weights(): filled as the plan places it
            filler = self._fill_host(tensors)
        if any(r.shares is not None for r in plan.residency.values()) and not simulated:   # ZeRO-3: this rank's chunks
            from harmony.runtime.partitioned import Shares
            shares = Shares(plan, tensors, cfg.comm_timeout, fill=filler and filler.fill)
        # one optimizer per pack (per file for a pack wholly on disk); sm.optimizer holds their groups' settings
        optimizers, self.optimizer = build_optimizers(cfg, plan, tensors)
        self.optimizers = list(dict.fromkeys(optimizers.values()))
        self.schedulers: list = []     # saved and restored with the module (add_scheduler)
        self.stats: dict = {}
        self.eval_stats: dict = {}     # the last evaluation's (harmony/evaluating.py)
        self._evaluation = None        # its schedule, built by the first sm.evaluate(...)
        self.steps = 0
        self.huge_pages = huge_pages()     # torch's CPU allocations: one page fault per 2 MiB, not per 4 KiB
        self.idle_threads_sleep = idle_threads_sleep()   # OpenMP threads between regions: sleep, or spin on a core
        self.runtime = self.predicted = self.shapes = None
        self.filled = None     # {"bytes", "seconds"}: the weights compile made for a model built without them
        if torch.device(device).type != "cpu":   # the trace ran on the CPU: its device constants name it
            from harmony.compiler.trace import retarget
            managed = {id(t) for t in [*gm.parameters(), *gm.buffers()]}
            for spec in plan.packs:
                retarget(spec.module, torch.device(device), managed)
        if program.schedule is not None:   # a pipeline cut short (passes=...) can be inspected, not run
            self.runtime = Runtime(plan, program.schedule, tensors, optimizers, cfg.state_budget, device,
                                   on_demand=OnDemand if cfg.policy == "ondemand" else None,
                                   speed_factor=getattr(cfg, "speed_factor", 1.0), accounting=cfg.accounting)
            self.runtime.state.shares = shares
            if shares is not None and self.runtime.scaler is not None:   # fp16: one overflow skips every rank's step
                self.runtime.scaler.agree = max_over_ranks
            if shares is not None or plan.stage is not None:   # the model refuses to be read while weights are in
                # other ranks' shares or stages
                from harmony.usermodel import guard
                guard(self)
            self.predicted = memory_curve(program, check_residency=False)
            if not simulated:
                attach(self)      # the ranks' calls that use collectives are checked alike (harmony/handshake.py)
            self.shapes = ShapeCache(self)     # a plan per batch shape, this one the example's (harmony/shapes.py)
            if cfg.host_memory_budget is not None:   # the host's memory is budgeted: freed buffers must go back
                from harmony.base.process import return_freed_memory
                return_freed_memory()
            if "disk" in plan.by_pack("optim_on").values() and not simulated:   # the disk tiers: made now
                self._disk_tiers(tensors, optimizers, shares, device, filler)
        if filler is not None:      # whatever no disk tier took (none is made without a schedule)
            try:
                filler.fill(tensors.values())
            except BaseException:
                self.close()
                raise
            self.filled = dict(bytes=filler.filled, seconds=filler.seconds)

    def _fill_host(self, tensors: dict):
        """An empty model's parameters that stay in host memory, filled now; those of packs wholly on disk are
        filled group by group as their files are written, and those partitioned over the ranks a pack at a time
        as this rank cuts its chunks of them (harmony/materialize.py)."""
        from harmony.runtime.diskparams import written_names
        from harmony.runtime.ops import resident_state
        plan = self.program.plan
        filler = Filler(self.model, self.program.config.init)
        partitioned = {n for r in plan.residency.values() if r.shares is not None for n in r.shares.names()}
        later = partitioned or written_names(plan) - {n for what, names in resident_state(plan) if what == "params"
                                                      for n in names}   # (resident weights are read at start)
        filler.fill(t for n, t in tensors.items() if n not in later)
        return filler

    def _disk_tiers(self, tensors: dict, optimizers: dict, shares, device, filler=None) -> None:
        """The disk tiers' stores, their directories made now (after checking the disk has room for the plan)."""
        from harmony.runtime.diskparams import DiskParams
        from harmony.runtime.disktier import DiskTier
        from harmony.runtime.offload_dirs import check_room
        from harmony.viz.report import tiers_of
        program, plan, cfg = self.program, self.program.plan, self.program.config
        state = self.runtime.state
        try:
            check_room(cfg.offload_dir, tiers_of(program)["disk_bytes"])
            state.disk = DiskTier.create(plan, program.schedule, tensors, optimizers, cfg.offload_dir,
                                         **cfg.disk_io())
            if shares is not None:    # this rank's shares of the partitioned packs on disk
                from harmony.runtime.partitioned_disk import ShareTier
                state.disk = ShareTier.create(plan, program.schedule, tensors, optimizers, shares,
                                              cfg.offload_dir, **cfg.disk_io())
                for n in getattr(state.disk, "piece_pack", ()):   # the chunks are in their files
                    state.master[n] = tensors[n].data
            state.params_disk = DiskParams.create(plan, program.schedule, tensors, optimizers,
                                                  self.runtime.meter, device, cfg.offload_dir,
                                                  fill=filler and filler.fill, **cfg.disk_io())
            if state.params_disk is not None:   # the weights are in their files: no host copy stays
                state.params_disk.parked = state.parked
                for n in state.params_disk.pack_of:
                    state.master[n] = tensors[n].data
            if torch.device(device).type == "cpu":     # their free I/O buffers: within the device's room
                for tier in (state.disk, state.params_disk):
                    if tier is not None:
                        tier.store.buffers.share_room(self.runtime.meter)
        except BaseException:
            self.runtime.close()
            raise
        from harmony.usermodel import guard
        guard(self)     # the user's model refuses to be read while weights of it are on disk only

    @property
    def code(self) -> str:
        return schedule_code(self.program)

    @property
    def graph(self):
        return self.program.schedule

    @property
    def history(self):
        return self.program.history

    @property
    def plan(self):
        return self.program.plan

    @property
    def optimizer_kwargs(self) -> dict:
        """The arguments every optimizer was built with (``fused=True`` added where torch has it: harmony/optim.py)."""
        return dict(self.program.config.optimizer_kwargs)

    def train(self, mode: bool = True) -> "ScheduledModule":
        """``sm.eval()`` / ``sm.train()``: in eval mode ``sm(...)`` evaluates (``evaluate``). Only this module's
        flag changes: the model passed to compile keeps its own modes (a step runs it in training mode)."""
        self.training = bool(mode)
        return self

    def evaluate(self, *batch, **named) -> torch.Tensor:
        """The batch's loss as ``model.eval()`` under ``torch.no_grad()`` computes it, forward only, within the same
        memory budget, on the weights as training left them; the mean over microbatches, in fp32. Takes the batch
        as ``sm(...)`` does. No gradient, step, buffer update or RNG draw that training would see; an error is
        rolled back. The evaluation schedule is built on the first call and kept (harmony/evaluating.py)."""
        from harmony.evaluating import evaluate
        return evaluate(self, batch, named)

    def forward(self, *batch, **named):
        """One training step on the batch; it evaluates instead (``evaluate``) in eval mode (``sm.eval()``) or where
        gradients are off (``torch.no_grad()``, ``torch.inference_mode()``)."""
        if not self.training or not torch.is_grad_enabled():
            return self.evaluate(*batch, **named)
        if self.runtime is None:
            raise ConfigError(f"this module was compiled with passes={[h[0] for h in self.history]}, which "
                              f"make no schedule; compile with the default passes to train")
        check_world(self.program.config, self.program.capabilities)   # a plan is for one world size
        agree(self, CALLS[0])      # every rank steps now (not one saving): else an error on every rank at once
        batch = batch_of(self, batch, named, same_shape=False)
        shape = self.shapes.plan_for(batch)     # another shape: its plan, made once (harmony/shapes.py)
        cuda = self.runtime.device.type == "cuda"
        if cuda:     # the allocator's peaks over this step (the report shows them beside the meter's)
            torch.cuda.reset_peak_memory_stats(self.runtime.device)
        t0 = time.perf_counter()
        self.optimizer.step()      # the param groups' settings (a scheduler's lr) into every pack's optimizer
        self.runtime.meter.settle_above = shape.predicted.peak    # copies in flight use no more than the plan's
        with self.runtime.running(shape.program.plan, shape.program.schedule) \
                if shape is not self.shapes.example else contextlib.nullcontext():
            loss = run_step(self, batch)     # a transaction: rolled back if it raises (harmony/stepping.py)
        shape.steps += 1
        self.stats = step_stats(self, shape, time.perf_counter() - t0)
        return loss

    @property
    def loss_scale(self) -> float | None:
        """fp16: the loss scale the next step multiplies the loss by; None without loss scaling."""
        scaler = getattr(self.runtime, "scaler", None)
        return None if scaler is None else scaler.scale.item()

    def simulate(self, hardware=None, device: int = 0):
        """One step simulated on ``hardware``: a ``Hardware``, a preset name, or None (this machine under the
        budget, at the speed factor the module was compiled for). A pipeline rank simulates its whole node
        (harmony/pipeline_plan.py ``simulate_rank_node``): a ``NodeSimulation`` with a row per device."""
        from harmony.compiler.hardware import Hardware
        from harmony.compiler.verify import state_sizes
        from harmony.runtime.simulate import simulate
        if self.predicted is None:
            raise ConfigError("this module has no schedule to simulate; compile with the default passes")
        if self.plan.stage is not None:     # a pipeline rank: the whole node, a row per device (NodeSimulation)
            from harmony.pipeline_plan import simulate_rank_node
            return simulate_rank_node(self, hardware)
        if hardware is None or isinstance(hardware, str):
            cfg = self.program.config
            hardware = Hardware.preset(hardware) if hardware else \
                Hardware.this_machine(cache_dir=cfg.cache_dir).logical([cfg.memory_budget], [cfg.speed_factor])
        return simulate(self.graph, self.plan, hardware, device, memory=self.predicted,
                        sizes=state_sizes(self.program))

    def state_dict(self) -> dict:
        """The training state (parameters, optimizer state, hyperparameters, step, RNG), referencing live tensors."""
        from harmony.checkpoint import state_dict
        return state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the training state from ``state_dict()`` in place; a mismatch raises ``CheckpointError``."""
        from harmony.checkpoint import load_state_dict
        load_state_dict(self, state_dict)

    def report(self, fmt: str = "text") -> str:
        from harmony.viz.report import render
        return render(self, fmt)

    def add_scheduler(self, scheduler):
        """Register a scheduler built on ``sm.optimizer`` (``torch.optim.lr_scheduler``): ``harmony.save`` and
        ``harmony.load`` keep its state with the module's. Returns it."""
        if getattr(scheduler, "optimizer", None) is not self.optimizer:
            raise ConfigError(f"{type(scheduler).__name__} is not built on this module's optimizer: make it with "
                              f"sm.optimizer, e.g. torch.optim.lr_scheduler.LambdaLR(sm.optimizer, f)")
        self.schedulers.append(scheduler)
        return scheduler

    def sync_model(self) -> list[str]:
        """Read weights that live on disk between steps (``weights_on="disk"``) into the model passed to compile,
        whose forward and state_dict refuse until then (harmony/usermodel.py); returns their names."""
        from harmony.usermodel import sync_model
        if getattr(getattr(self.runtime, "state", None), "shares", None) is not None:   # it gathers the shares
            agree(self, CALLS[3])
        return sync_model(self)

    def accept_partial_step(self) -> dict | None:
        """After a step that failed once some packs had stepped (``TornStepError``): train on with those updates
        kept. Returns {"stepped": packs, "not_stepped": packs, "params": names}, or None if there was none."""
        return accept_partial_step(self)

    def close(self):
        if self.runtime is not None:
            self.runtime.close()
