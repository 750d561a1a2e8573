"""``harmony.compile``: an ordinary ``nn.Module`` in, a ``ScheduledModule`` that trains it under a budget out."""
from __future__ import annotations

import os
import time

import torch

from harmony.base.errors import BudgetError, ConfigError, HarmonyError, InputError
from harmony.base.process import huge_pages, idle_threads_sleep, peak_rss_bytes
from harmony.base.units import fmt_bytes, nbytes, parse_bytes
from harmony.compiler import cost
from harmony.compiler.ir import CompileConfig, Program
from harmony.compiler.passmanager import DEFAULT_PIPELINE, run_passes, split_choices
from harmony.compiler.printer import schedule_code
from harmony.compiler.trace import trace
from harmony.compiler.verify import memory_curve
from harmony.data import check_world
from harmony.data import resolve as resolve_data_parallel
from harmony.optim import optimizer_kwargs as optimizer_kwargs_for
from harmony.passes.schedule import POLICIES
from harmony.runtime.compression import DEFAULT_MIN_SIZE
from harmony.runtime.executor import Runtime
from harmony.runtime.ondemand import OnDemand
from harmony.runtime.precision import PRECISIONS, SCALING_DEFAULTS

RECOMPUTE = ("auto", "always")


def compile(model: torch.nn.Module, example_batch, *, optimizer=torch.optim.AdamW, optimizer_kwargs=None,
            memory_budget=None, microbatches: int = 1, policy: str = "harmony", loss_fn=None,
            leaf_modules=(), passes=DEFAULT_PIPELINE, device="cpu", hardware=None,
            optimizer_on="auto", host_memory_budget=None, offload_dir=None, weights_on="auto",
            disk_group_bytes="32MiB", data_parallel=None, compression=None, min_size: int = DEFAULT_MIN_SIZE,
            precision: str = "fp32", loss_scaling=None, balance=None, shard_state=None,
            recompute: str = "auto") -> "ScheduledModule":
    """Plan and build a training step for ``model`` that fits ``memory_budget`` per device (default 1 GiB).

    >>> sm = harmony.compile(model, example_batch=(x, y), memory_budget="512MiB", microbatches=8)
    >>> loss = sm(x, y)          # forward, backward and optimizer update of one whole batch

    ``optimizer_kwargs`` go to ``optimizer`` as given, but where they name neither ``fused`` nor
    ``foreach`` and torch has a fused kernel for the optimizer on every device it steps on, Harmony
    adds ``fused=True`` (AdamW on this CPU: 8x faster than torch's default loop, last bit may differ;
    ``sm.optimizer_kwargs`` says what it used, ``fused=False`` keeps torch's default); not under the
    ``ondemand`` policy, which fetches what each op touches and so needs the loop's op per parameter.
    ``optimizer_on``: ``"host"`` steps the optimizer on host copies while the device runs the next
    pack's backward (its state never touches the device), ``"device"`` brings the state to the
    device, ``"auto"`` (default) chooses host when the training state does not fit the budget, except
    for packs the swap pass finds room to keep wholly resident: those step on the device (fp32, one rank),
    as do single parameters of the others where the room left is less than a whole pack's state.
    ``hardware`` (a ``Hardware``, ``Device`` or preset name such as ``"a100-40gb"``) gives the
    planner the device's FLOP/s and host-link bandwidth to weigh compute against traffic;
    by default it plans for this machine's CPU. A device whose ``speed_factor`` is above 1
    (``hw.logical(budgets, speed_factors)``) is EMULATED: the runtime stretches every compute
    op to that many times its measured time.
    ``recompute``: ``"auto"`` (default) lets a pack keep its forward's activations for its backward
    where the budget has room for them, so its backward runs without recomputing the forward (the
    swap pass weighs the compute saved against the traffic the same bytes could save);
    ``"always"`` recomputes every pack but the last from its stashed inputs, the least memory
    (the Harmony paper's schedule).
    ``host_memory_budget`` (e.g. ``"4GiB"``; default no limit) bounds the host's share of training
    state when the optimizer steps on the host: packs whose optimizer state does not fit keep it
    on disk, in a private directory made under ``offload_dir`` (default the temp directory) and
    removed by ``close()`` or at exit; if that is not enough, packs go to disk wholly, fp32
    weights too (what lets a model whose weights exceed host memory train): such a pack's
    weights are read from disk for its forward and backward, and it steps one file of at
    most ``disk_group_bytes`` of weights at a time; whatever room the budget leaves then keeps the
    files of the last-stepped packs in host memory, never written or read. ``weights_on`` (``"auto"``, ``"host"``,
    ``"disk"``) overrides that choice for the fp32 weights of host-stepped packs.
    ``data_parallel``: ``None`` (default) trains data-parallel when this process is one rank of
    several (torchrun; the process group is initialised if it is not), ``True`` requires it,
    ``False`` trains each process alone. Every rank compiles and runs the same plan on its own
    batch (``example_batch`` is one rank's; ``harmony.data.shard`` cuts it), and each pack's
    gradients are averaged across ranks right after its backward. ``compression``: ``None`` (fp32),
    ``"fp16"``, ``"bf16"``, ``"4bit"`` (any of 1..8 bits), ``"adaptive"`` (bits per layer after a
    warm-up) or a ``CompressionSpec``; tensors of dimension <= 1 or fewer than ``min_size``
    elements stay uncompressed.
    ``precision``: ``"fp32"`` (default: everything fp32), ``"bf16"`` or ``"fp16"``: the device holds
    compute copies of the float parameters and buffers in that dtype, runs the packs on float batch
    tensors cast to it (integer ones, such as token ids, are not cast) and accumulates gradients in it;
    the optimizer steps fp32 master weights with fp32 gradients and fp32 state on the host (or disk),
    as ZeRO-Offload does, so ``optimizer_on`` must be ``"auto"`` or ``"host"``. The loss returned is
    fp32. ``loss_scaling`` (fp16 only): ``torch.amp.GradScaler``'s ``init_scale``, ``growth_factor``,
    ``backoff_factor``, ``growth_interval`` (defaults 2**16, 2, 0.5, 2000); a step with an inf or nan
    gradient is skipped and the scale backed off (``sm.loss_scale``).


    ``balance``: data parallelism over mismatched devices (Cephalo). ``hardware`` is then a
    ``Hardware`` with one device per rank, ``example_batch`` the GLOBAL batch, and each rank
    trains on its own share: ``"auto"`` (an integer program chooses every rank's microbatch
    size and count, up to 16 microbatches; ``microbatches`` is not used), ``"uniform"`` (equal
    shares, ``microbatches`` each), or one entry per rank, ``(microbatch size, microbatches)``
    or a sample count (in ``microbatches`` microbatches). Each rank's memory budget is its
    device's ``memory``, and a device's ``speed_factor`` > 1 makes the runtime EMULATE a slower
    device. Gradients are weighted by each rank's share of the samples. ``sm(*global_batch)``
    takes this rank's rows (it also accepts just those rows); ``sm.report()`` shows every rank's
    choice. The balance is a planning step before the passes, not a pass: it sets what every
    pass works with (the rank's batch, microbatches and budget), so it runs first:

    >>> hw = Hardware.this_machine().logical([64 << 20, 128 << 20, 1 << 30], speed_factors=[1, 2, 4])
    >>> sm = harmony.compile(model, (X, Y), hardware=hw, balance="auto")   # on each of 3 ranks
    >>> loss = sm(X, Y)                                                    # this rank's rows of (X, Y)

    ``shard_state``: with data parallelism, each parameter's optimizer state is kept, and the
    parameter stepped, by one rank only, which then broadcasts the updated parameter (ZeRO stage 1;
    runtime/shard.py): ``True`` in equal byte shares, or under ``balance`` in the shares its plan
    chose (Cephalo's uneven shards); ``False`` replicates the state on every rank. Default: on
    under ``balance``, off otherwise. Bitwise the same training as replicated state.
    """
    t0 = time.perf_counter()
    device_type = _check_choices(policy, device, recompute)
    names, batch = _batch_items(example_batch)
    batch_size = _batch_size(batch)
    # torch's fused update where it has one and the caller did not choose (harmony/optim.py); not under
    # ondemand, whose runtime fetches every tensor an op touches: one fused op touches a pack's whole state
    if policy != "ondemand":
        optimizer_kwargs = optimizer_kwargs_for(optimizer, optimizer_kwargs, ("cpu", device_type))
    if balance is not None:
        from harmony.balanced import check_balance
        check_balance(precision, weights_on, data_parallel, memory_budget, hardware, microbatches)
        data_parallel = True if data_parallel is None else data_parallel
        shard_state = True if shard_state is None else shard_state
    else:
        memory_budget = "1GiB" if memory_budget is None else memory_budget
        if not isinstance(microbatches, int) or microbatches < 1 or batch_size % microbatches:
            raise ConfigError(f"microbatches={microbatches!r} must be a positive divisor of the batch size "
                              f"{batch_size}; divisors: "
                              f"{[d for d in range(1, batch_size + 1) if batch_size % d == 0]}")
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        raise ConfigError(f"optimizer must be a torch.optim.Optimizer class, got {optimizer!r}")
    optimizer_on, loss_scaling = _check_precision(precision, loss_scaling, optimizer_on, policy)
    config = CompileConfig(memory_budget=0 if balance is not None else parse_bytes(memory_budget),
                           microbatches=microbatches, batch_size=batch_size, policy=policy, optimizer=optimizer,
                           optimizer_kwargs=dict(optimizer_kwargs or {}), optimizer_on=optimizer_on,
                           host_memory_budget=None if host_memory_budget is None
                           else parse_bytes(host_memory_budget, "host_memory_budget"),
                           offload_dir=None if offload_dir is None else os.fspath(offload_dir),
                           weights_on=weights_on, disk_group_bytes=parse_bytes(disk_group_bytes, "disk_group_bytes"),
                           precision=precision, loss_scaling=loss_scaling, recompute=recompute,
                           **resolve_data_parallel(data_parallel, compression, min_size))
    if config.data_parallel and precision != "fp32":
        raise ConfigError(f"precision={precision!r} is not supported with data-parallel training yet: the gradient "
                          f"all-reduce expects fp32 gradients; use precision='fp32' or train one process")
    if hardware is None and device_type == "cuda":   # plan for the GPU: its cached profile, else its datasheet
        from harmony.compiler.hardware import Hardware
        hardware = Hardware.this_machine()
    gm = trace(model, dict(zip(names, batch)) if names else tuple(batch), loss_fn=loss_fn, leaf_modules=leaf_modules,
               dtype=config.compute_dtype)
    t_trace = time.perf_counter()
    balanced = None
    if balance is not None:      # this rank's share of the global batch, its device's memory and speed
        from harmony.balanced import plan_this_rank
        balanced = plan_this_rank(model, gm, batch, balance, config, hardware, sharded=bool(shard_state))
        batch = balanced.batch
    elif hardware is not None:
        config.plan_for_device(_device_of(hardware), hardware)
    if shard_state:
        if not config.data_parallel or (config.world_size or 1) < 2:
            raise ConfigError("shard_state=True splits optimizer state over data-parallel ranks, but this process "
                              "trains alone: run it under torchrun with data_parallel=None or True, or drop "
                              "shard_state")
        shard_over_ranks(config, gm, balanced.shares if balanced else [1.0] * config.world_size)
    _check_masters(gm, precision)
    if device_type == "cuda":
        _reserve_for_cuda(config, device)
    t_plan = time.perf_counter()
    program = Program(model=model, gm=gm, example_batch=tuple(batch), config=config)
    program.fake = cost.annotate(gm, tuple(batch), config.microbatch_size, dtype=config.compute_dtype)
    program.optim_profile = cost.optimizer_profile(optimizer, config.optimizer_kwargs)
    t_cost = time.perf_counter()
    program = _run_passes(program, passes)
    if balanced is not None:
        program.reports.insert(0, balanced.report)
        program.rows = balanced.rows
    sm = ScheduledModule(program, device)
    if balanced is not None:
        balanced.simulated(sm, hardware)
    sm.compile_seconds = dict(trace=t_trace - t0, **({"balance": t_plan - t_trace} if balanced else {}),
                              cost=t_cost - t_plan, passes=time.perf_counter() - t_cost,
                              total=time.perf_counter() - t0)
    return sm


def _check_choices(policy, device, recompute) -> str:
    """The device's type, once the choices among fixed options are valid."""
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    try:
        device_type = torch.device(device).type
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device={device!r} is not a device torch knows ({str(e).split(':')[0]}); "
                          f"use 'cpu', or 'cuda' / 'cuda:N' where a GPU exists") from None
    if policy == "ondemand" and device_type != "cpu":
        raise ConfigError(f"policy='ondemand' runs on the CPU device only for now: it moves state as each op touches "
                          f"it, below autograd, which on a GPU records the host's device for the weights it brings in. "
                          f"Use policy='harmony' or 'sequential' on {device!r}, or device='cpu'")
    if recompute not in RECOMPUTE:
        raise ConfigError(f"recompute={recompute!r}; choose one of {', '.join(map(repr, RECOMPUTE))}")
    return device_type


def _batch_size(batch) -> int:
    sizes = {t.shape[0] for t in batch if isinstance(t, torch.Tensor) and t.dim() > 0}
    if not batch or len(sizes) != 1:
        raise InputError(f"example_batch must hold tensors whose dimension 0 is the batch and agrees; "
                         f"got batch sizes {sorted(sizes)}")
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


def _disk_stats(state) -> dict:
    """This step's disk traffic of both disk tiers (optimizer state alone; packs wholly on disk), summed."""
    out: dict = {}
    for tier in (getattr(state, "disk", None), getattr(state, "params_disk", None)):
        for k, v in (tier.step_stats() if tier is not None else {}).items():
            out[k] = out[k] + v if isinstance(v, (int, float)) and k in out else out.get(k, v)
    for way in ("read", "write") if out else ():     # GB/s of the I/O that finished in this step, with its seconds
        sec = out[f"disk_{way}_seconds"]
        out[f"disk_{way}_GBps"] = out[f"disk_{way}_done"] / sec / 1e9 if sec else 0.0
    return out


def _check_precision(precision, loss_scaling, optimizer_on, policy):
    """Validated (optimizer_on, loss scaling arguments) for ``precision``; mixed precision steps on the host."""
    if precision not in PRECISIONS:
        raise ConfigError(f"precision={precision!r}; choose one of {', '.join(map(repr, PRECISIONS))}")
    if loss_scaling is not None and precision != "fp16":
        raise ConfigError(f"loss_scaling is for precision='fp16' (got precision={precision!r}): bf16 has fp32's "
                          f"exponent range and needs no scaling; drop loss_scaling or use fp16")
    if precision == "fp32":
        return optimizer_on, {}
    if optimizer_on == "device":
        raise ConfigError(f"precision={precision!r} with optimizer_on='device': mixed precision keeps the fp32 master "
                          f"weights and optimizer state on the host and steps there, so the device never holds "
                          f"them; use optimizer_on='host' (or 'auto'), or precision='fp32' to step on the device")
    if policy == "ondemand":
        raise ConfigError(f"precision={precision!r} needs a planned schedule; the ondemand baseline moves fp32 state "
                          f"as ops touch it. Use policy='harmony' or 'sequential', or precision='fp32'")
    scaling = dict(SCALING_DEFAULTS) if precision == "fp16" else {}
    unknown = set(loss_scaling or {}) - set(SCALING_DEFAULTS)
    if unknown:
        raise ConfigError(f"loss_scaling has unknown keys {sorted(unknown)}; the keys are "
                          f"{', '.join(SCALING_DEFAULTS)} (torch.amp.GradScaler's)")
    scaling.update(loss_scaling or {})
    if scaling and not (scaling["init_scale"] > 0 and scaling["growth_factor"] > 1 and 0 < scaling["backoff_factor"] < 1
                        and int(scaling["growth_interval"]) >= 1):
        raise ConfigError(f"loss_scaling={loss_scaling!r}: need init_scale > 0, growth_factor > 1, "
                          f"0 < backoff_factor < 1 and growth_interval >= 1")
    return ("host" if optimizer_on == "auto" else optimizer_on), scaling


def _run_passes(program: Program, passes) -> Program:
    """``run_passes``; a rank that fails before the compress pass tells the others, which would wait for it there."""
    try:
        return run_passes(program, passes)
    except HarmonyError as e:
        cfg, names = program.config, split_choices(passes)[0]
        # the pass that failed is the first one not in the history; compress itself has met the others already
        if cfg.data_parallel and (cfg.world_size or 1) > 1 and "compress" in names \
                and names.index("compress") > len(program.history):
            from harmony.passes.compress import report_failure
            report_failure(f"{type(e).__name__}: {str(e).splitlines()[0]}")
        raise


def _device_of(hardware):
    from harmony.compiler.hardware import Device, Hardware
    if isinstance(hardware, str):
        return Device.preset(hardware)
    if isinstance(hardware, Hardware):
        return hardware.devices[0]
    if isinstance(hardware, Device):
        return hardware
    raise ConfigError(f"hardware={hardware!r}: give a Hardware, a Device or a preset name such as 'a100-40gb'")


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
        optimizers = {}
        cfg = program.config
        for spec in plan.packs:     # one optimizer per pack; per file for a pack wholly on disk
            for names in plan.disk_groups.get(spec.index) or [spec.stepped]:
                if names:
                    opt = cfg.optimizer([tensors[n] for n in names], **cfg.optimizer_kwargs)
                    optimizers.update(dict.fromkeys(names, opt))
        self.optimizers = list(dict.fromkeys(optimizers.values()))
        self.stats: dict = {}
        self.steps = 0
        self.huge_pages = huge_pages()     # torch's CPU allocations: one page fault per 2 MiB, not per 4 KiB
        self.idle_threads_sleep = idle_threads_sleep()   # OpenMP threads between regions: sleep, or spin on a core
        self.runtime = self.predicted = None
        if torch.device(device).type != "cpu":   # the trace ran on the CPU: its device constants name it
            from harmony.compiler.trace import retarget
            managed = {id(t) for t in [*gm.parameters(), *gm.buffers()]}
            for spec in plan.packs:
                retarget(spec.module, torch.device(device), managed)
        if program.schedule is not None:   # a pipeline cut short (passes=...) can be inspected, not run
            self.runtime = Runtime(plan, program.schedule, tensors, optimizers, cfg.state_budget, device,
                                   on_demand=OnDemand if cfg.policy == "ondemand" else None,
                                   speed_factor=getattr(cfg, "speed_factor", 1.0))
            self.predicted = memory_curve(program, check_residency=False)
            if cfg.host_memory_budget is not None:   # the host's memory is budgeted: freed buffers must go back
                from harmony.base.process import return_freed_memory
                return_freed_memory()
            if "disk" in getattr(plan, "optim_on", {}).values():   # the disk tiers: their directories are made now
                from harmony.runtime.disk import DiskTier
                from harmony.runtime.diskparams import DiskParams
                state = self.runtime.state
                try:
                    state.disk = DiskTier.create(plan, program.schedule, tensors, optimizers, cfg.offload_dir)
                    state.params_disk = DiskParams.create(plan, program.schedule, tensors, optimizers,
                                                          self.runtime.meter, device, cfg.offload_dir)
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

    def forward(self, *batch, **named):
        plan = self.program.plan
        if self.runtime is None:
            raise ConfigError(f"this module was compiled with passes={[h[0] for h in self.history]}, which "
                              f"make no schedule; compile with the default passes to train")
        check_world(self.program.config, self.program.capabilities)   # a plan is for one world size
        if named and not batch:
            batch = tuple(named[n] for n in plan.input_names if n in named)
        rows = getattr(self.program, "rows", None)
        if rows is not None and batch and isinstance(batch[0], torch.Tensor) and batch[0].dim() > 0 \
                and batch[0].shape[0] == self.program.config.global_batch:   # the global batch: this rank's rows
            batch = tuple(x[rows[0]:rows[1]] if isinstance(x, torch.Tensor) and x.dim() > 0 else x for x in batch)
        if len(batch) != len(plan.input_names):
            raise InputError(f"expected {len(plan.input_names)} batch tensors ({', '.join(plan.input_names)}), "
                             f"got {len(batch)}")
        for name, x, ex in zip(plan.input_names, batch, self.program.example_batch):
            if not isinstance(x, torch.Tensor) or x.shape != ex.shape or x.dtype != ex.dtype:
                got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
                raise InputError(f"batch tensor {name!r}: expected shape {tuple(ex.shape)} {ex.dtype} as in "
                                 f"example_batch, got {got}; compile again for other shapes")
        cuda = self.runtime.device.type == "cuda"
        if cuda:     # the allocator's peaks over this step (the report shows them beside the meter's)
            torch.cuda.reset_peak_memory_stats(self.runtime.device)
        t0 = time.perf_counter()
        loss = self.runtime.run(dict(zip(plan.input_names, batch)))
        rt = self.runtime
        self.steps += 1
        self.stats = dict(step_seconds=time.perf_counter() - t0, measured_peak=rt.meter.peak,
                          predicted_peak=self.predicted.peak, budget=rt.meter.budget,
                          h2d_bytes=rt.state.moved["h2d"], d2h_bytes=rt.state.moved["d2h"],
                          predicted_h2d=self.predicted.moved["h2d"], predicted_d2h=self.predicted.moved["d2h"],
                          peak_rss_bytes=peak_rss_bytes(), huge_pages=self.huge_pages,
                          idle_threads_sleep=self.idle_threads_sleep)
        if cuda:
            self.stats.update(expandable_segments=self.program.config.expandable_segments,
                              cuda_allocated_peak=torch.cuda.max_memory_allocated(rt.device),
                              cuda_reserved_peak=torch.cuda.max_memory_reserved(rt.device),
                              device_reserved=self.program.config.device_reserved)
        if getattr(rt.state, "host_idle", None) is not None:     # the CPU device's host thread has run
            self.stats["background_idle_priority"] = rt.state.host_idle
        self.stats.update(_disk_stats(rt.state))
        kinds = {n.name: n.target.__name__ for n in self.graph.nodes if n.op == "call_function"}
        for e in rt.events:          # where the step's time went on the thread that runs the schedule, by op
            key = f"time_{kinds.get(e.name, 'other')}_s"
            self.stats[key] = self.stats.get(key, 0.0) + e.end - e.start
        if rt.scaler is not None:   # the scale the next step uses, and the steps skipped for inf/nan so far
            self.stats.update(loss_scale=self.loss_scale, skipped_steps=rt.scaler.skipped)
        if self.program.config.data_parallel:     # bytes on the wire vs fp32, seconds communicating, bits
            from harmony.passes.compress import step_stats
            self.stats.update(step_stats(self))
        return loss

    @property
    def loss_scale(self) -> float | None:
        """fp16: the loss scale the next step multiplies the loss by; None without loss scaling."""
        scaler = getattr(self.runtime, "scaler", None)
        return None if scaler is None else scaler.scale.item()

    def simulate(self, hardware=None, device: int = 0):
        """One step simulated on ``hardware``: a ``Hardware``, a preset name, or None (this machine under the
        budget, at the speed factor the module was compiled for)."""
        from harmony.compiler.hardware import Hardware
        from harmony.compiler.verify import state_sizes
        from harmony.runtime.simulate import simulate
        if self.predicted is None:
            raise ConfigError("this module has no schedule to simulate; compile with the default passes")
        if hardware is None or isinstance(hardware, str):
            hardware = Hardware.preset(hardware) if hardware else \
                Hardware.this_machine().logical([self.program.config.memory_budget],
                                                [getattr(self.program.config, "speed_factor", 1.0)])
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

    def close(self):
        if self.runtime is not None:
            self.runtime.close()
