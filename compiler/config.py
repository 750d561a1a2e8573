"""What ``harmony.compile`` can be told, in documented groups, each checked where it is defined.

>>> cfg = harmony.Config(memory_budget="2GiB", microbatches=8, optimizer_on="host", precision="bf16")
>>> sm = harmony.compile(model, (x, y), config=cfg)          # the same as passing those fields as keywords

``Config`` is every option: the fields of ``TrainConfig``, ``LossConfig``, ``MemoryConfig``, ``DiskConfig``,
``ParallelConfig``, ``NumericsConfig`` and ``PlanConfig`` together. Each group checks its own fields in its
``__post_init__`` (a ``ConfigError`` naming the field and the values it takes) and turns sizes such as ``"512MiB"``
into bytes; ``Config`` then checks the options that constrain each other. A group can be made on its own to check
its fields; ``compile`` takes a whole ``Config`` or its fields by keyword.

Fields marked *env* take their default from a ``HARMONY_*`` environment variable when it is set
(base/env.py): the field given explicitly wins, and a bad value is a ``ConfigError`` naming the variable.

``CompileConfig`` is what the passes and the runtime read (``program.config``): the same fields as compile resolved
them for this process (the budget in bytes, ``data_parallel`` a bool, ``compression`` a ``CompressionSpec``,
``shard_state`` a bool), and what the planner knows of the batch, the ranks and the device.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from harmony.base import env
from harmony.base.errors import ConfigError
from harmony.base.tiers import Tier
from harmony.base.units import parse_bytes
from harmony.compiler import config_checks as checks
from harmony.compiler.config_checks import Group, check_parallel, choice, count, env_field, positive, tier
from harmony.compiler.hardware import NOMINAL, Device, Hardware
from harmony.compiler.loss_weighting import LossConfig
from harmony.runtime.comm.compression import DEFAULT_MIN_SIZE
from harmony.runtime.precision import PRECISIONS, SCALING_DEFAULTS, compute_dtype

# the values the options take, which the passes that act on them read from here
PLACES = ("auto", Tier.DEVICE, Tier.HOST)    # optimizer_on
WEIGHTS = ("auto", Tier.HOST, Tier.DISK)     # weights_on: where a host-stepped pack's fp32 weights live between uses
RECOMPUTE = ("auto", Tier.DEVICE, "always")
POLICIES, SHAPE_PLANS = ("harmony", "sequential", "ondemand"), ("compiled", "each")   # policy, shape_plans
DEFAULT_PIPELINE = ("partition", "schedule", "offload", "compress", "swap", "prefetch")
DEFAULT_MEMORY_BUDGET = 1 << 30        # bytes per device when memory_budget is not given (and balance= is not)


@dataclass(kw_only=True)
class TrainConfig(Group):
    """What one training step does."""

    microbatches: int = 1
    """Microbatches the batch is cut into; a divisor of the batch size. Activations of one microbatch are live at
    a time; each pack runs every microbatch before the next pack (the Harmony paper's grouping)."""
    optimizer: type | torch.optim.Optimizer = torch.optim.AdamW
    """A ``torch.optim.Optimizer`` class, or an optimizer built on the model's parameters, whose class, defaults and
    param groups are taken (per-group hyperparameters such as no weight decay on norms and biases; its state is
    not). Harmony steps one instance per pack (per file for a pack wholly on disk); ``sm.optimizer`` is one
    optimizer over all of them, for ``torch.optim.lr_scheduler`` and the user."""
    optimizer_kwargs: dict | None = None
    """Arguments of ``optimizer``, as given; where they name neither ``fused`` nor ``foreach`` and torch has a
    fused kernel for every device the optimizer steps on, Harmony adds ``fused=True`` (not under the ``ondemand``
    policy); ``sm.optimizer_kwargs`` says what it used, ``fused=False`` keeps torch's default loop."""
    param_groups: list | None = None
    """The optimizer's param groups by parameter name, ``[{"params": [names], "weight_decay": 0.0}, ...]``: each
    group's hyperparameters replace ``optimizer_kwargs`` for its parameters; the parameters no group names form a
    first group of their own. None: one group (an optimizer instance given as ``optimizer`` sets it)."""
    loss_fn: Any = None
    """``loss_fn(output, *batch)`` -> scalar loss when the model's forward returns an output, not a loss."""
    clip_grad_norm: float | None = None
    """Clip the gradients by their global norm before the update, as ``torch.nn.utils.clip_grad_norm_(
    model.parameters(), clip_grad_norm)`` does between backward and ``optimizer.step()``: the norm is over every
    parameter's gradient wherever it lives (device, host, every data-parallel rank's reduced gradient, fp16's
    unscaled ones). No update can start before the last gradient exists, so every pack steps after the last
    backward (the report's schedule section says what that costs); ``sm.stats["grad_norm"]`` is the norm before
    clipping, as ``clip_grad_norm_`` returns it. None: no clipping."""
    clip_norm_type: float = 2.0
    """The p of the clipping norm (``clip_grad_norm_``'s ``norm_type``); ``float("inf")`` clips by the largest
    absolute gradient."""

    def __post_init__(self):
        super().__post_init__()
        count("microbatches", self.microbatches, "how many microbatches the batch is cut into")
        if not (isinstance(self.optimizer, torch.optim.Optimizer)
                or isinstance(self.optimizer, type) and issubclass(self.optimizer, torch.optim.Optimizer)):
            raise ConfigError(f"optimizer must be a torch.optim.Optimizer class or instance, got {self.optimizer!r}")
        if self.param_groups is not None and not (
                isinstance(self.param_groups, (list, tuple)) and all(
                    isinstance(g, Mapping) and isinstance(g.get("params"), (list, tuple))
                    and all(isinstance(n, str) for n in g["params"]) for g in self.param_groups)):
            raise ConfigError(f"param_groups={self.param_groups!r}: give a list of dicts, each with 'params' (a list "
                              f"of parameter names) and the hyperparameters that differ for them")
        if self.optimizer_kwargs is not None and not isinstance(self.optimizer_kwargs, Mapping):
            raise ConfigError(f"optimizer_kwargs={self.optimizer_kwargs!r}: give a dict of the optimizer's arguments")
        self.optimizer_kwargs = dict(self.optimizer_kwargs or {})
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise ConfigError(f"loss_fn={self.loss_fn!r} is not callable: give loss_fn(output, *batch) -> loss")
        if self.clip_grad_norm is not None and not positive(self.clip_grad_norm, finite=True):
            raise ConfigError(f"clip_grad_norm={self.clip_grad_norm!r} must be a positive finite number (the largest "
                              f"global gradient norm an update may use, e.g. 1.0), or None for no clipping")
        if not positive(self.clip_norm_type, finite=False):
            raise ConfigError(f"clip_norm_type={self.clip_norm_type!r} must be a positive number or float('inf') "
                              f"(the p of the norm; 2.0 is the usual)")
        if self.clip_grad_norm is not None:
            self.clip_grad_norm, self.clip_norm_type = float(self.clip_grad_norm), float(self.clip_norm_type)


@dataclass(kw_only=True)
class MemoryConfig(Group):
    """Where training state lives between uses, and what the planner may spend to fit the budget."""

    memory_budget: int | str | None = None
    """Bytes per device: an int, or a string such as ``"512MiB"``. None: 1 GiB; under ``balance=``, each device's
    ``memory`` in ``hardware=``."""
    host_memory_budget: int | str | None = None
    """Bytes of host memory for training state when the optimizer steps on the host; None: no limit. Packs whose
    optimizer state does not fit keep it on disk (``DiskConfig``); if that is not enough, packs go to disk wholly,
    fp32 weights too (what lets a model whose weights exceed host memory train)."""
    optimizer_on: str = "auto"
    """``"host"`` steps the optimizer on host copies while the device runs the next pack's backward (its state never
    touches the device); ``"device"`` brings the state to the device (under bf16: each fp32 master with it, one
    parameter at a time); ``"auto"`` steps on the host when the training state does not fit the budget, except packs
    the swap pass finds room to keep wholly resident (fp32, one rank), and under bf16 on a GPU the packs that step
    last, as many as the simulator finds fastest (driver/mixed_steps.py)."""
    weights_on: str = "auto"
    """Where a host-stepped pack's fp32 weights live between uses: ``"auto"`` (the host, or disk when the host budget
    forces it), ``"host"`` or ``"disk"``."""
    recompute: str = "auto"
    """``"auto"``: a pack keeps its forward's activations for its backward where the budget has room, on the device or
    sent to the host and back (the swap pass weighs the compute saved against the traffic); ``"device"``: the same, on
    the device only; ``"always"``: every pack but the last recomputes its forward from its stashed inputs."""
    plan_margin: int | str = "auto"
    """Bytes of the budget the planner leaves unplanned, for what the cost model under-predicts: an int or a string
    such as ``"4MiB"``. ``"auto"``: none, until a step of this model at this budget in this process goes over the
    budget (a plan miss, which the runtime's safety net absorbs, runtime/safety.py); the next compile of it then
    leaves the largest miss measured (``harmony.driver.misses``)."""
    init: Any = None
    """For a model built without its weights (under ``harmony.empty_weights()``: parameters on the meta device):
    ``init(module)`` fills a module's own parameters as compile places them, a pack at a time (driver/materialize.py).
    None: the model's ``_init_weights(module)`` where it has one (Hugging Face models, the built-in GPT), else each
    module's ``reset_parameters()``. Ignored for a model whose parameters are real."""

    def __post_init__(self):
        super().__post_init__()
        if self.init is not None and not callable(self.init):
            raise ConfigError(f"init={self.init!r} is not callable: give init(module), which fills the module's own "
                              f"parameters (e.g. with torch.nn.init), or None")
        if self.memory_budget is not None:
            self.memory_budget = parse_bytes(self.memory_budget, "memory_budget")
        if self.host_memory_budget is not None:
            self.host_memory_budget = parse_bytes(self.host_memory_budget, "host_memory_budget")
        self.optimizer_on = tier("optimizer_on", self.optimizer_on, PLACES)   # a tier named: its Tier
        self.weights_on = tier("weights_on", self.weights_on, WEIGHTS)
        self.recompute = tier("recompute", self.recompute, RECOMPUTE)
        self.plan_margin = checks.margin_bytes(self.plan_margin)


@dataclass(kw_only=True)
class DiskConfig(Group):
    """The disk tier: files of training state in a private directory, removed by ``sm.close()`` or at exit."""

    offload_dir: str | os.PathLike | None = None
    """Where the disk tier makes its private directory; None: the system's temp directory."""
    disk_group_bytes: int | str = "32MiB"
    """Weights per file of a pack wholly on disk; such a pack steps one file at a time."""
    direct_io: bool | None = env_field("direct_io")
    """*env* ``HARMONY_DIRECT_IO``. None: direct I/O where the file system takes it (probed once), buffered
    elsewhere; False: buffered; True: direct, or an error."""
    read_depth: int = env_field("read_depth")
    """*env* ``HARMONY_READ_DEPTH``. Concurrent ``preadv`` calls of one file read (default 4; 1: one at a time)."""
    keep_free: int | None = env_field("keep_free")
    """*env* ``HARMONY_KEEP_FREE``. Free I/O buffer bytes a store keeps for reuse; None: what keeps the buffers
    mapped within the most ever in use at once."""

    def __post_init__(self):
        super().__post_init__()
        if self.offload_dir is not None:
            if not isinstance(self.offload_dir, (str, os.PathLike)):
                raise ConfigError(f"offload_dir={self.offload_dir!r}: give a directory path, or None for the temp "
                                  f"directory")
            self.offload_dir = os.fspath(self.offload_dir)
        self.disk_group_bytes = parse_bytes(self.disk_group_bytes, "disk_group_bytes")
        for name in ("direct_io", "read_depth", "keep_free"):
            setattr(self, name, env.check(name, getattr(self, name)))

    def disk_io(self) -> dict:
        """The disk store's I/O settings, as ``runtime.disk.DiskStore`` takes them."""
        return dict(direct=self.direct_io, read_depth=self.read_depth, keep_free=self.keep_free)


@dataclass(kw_only=True)
class ParallelConfig(Group):
    """Several processes (torchrun): data parallelism, its compressed all-reduce, uneven shares, sharded state."""

    data_parallel: bool | None = None
    """None: data parallel when this process is one rank of several (torchrun; the process group is initialised if
    it is not); True: requires it; False: each process trains alone. Every rank runs the same plan on its own
    batch (``harmony.data.shard`` cuts it) and each pack's gradients are averaged right after its backward."""
    compression: Any = None
    """The gradient all-reduce's compression (CGX): None (fp32), ``"fp16"``, ``"bf16"``, ``"4bit"`` (any of 1..8
    bits), ``"adaptive"`` (bits per layer after a warm-up) or a ``runtime.compression.CompressionSpec``."""
    min_size: int = DEFAULT_MIN_SIZE
    """Tensors with fewer elements than this (or of dimension <= 1) travel uncompressed."""
    balance: Any = None
    """Data parallelism over mismatched devices (Cephalo): ``hardware`` is a ``Hardware`` with one device per rank,
    ``example_batch`` the global batch. ``"auto"``: an integer program chooses each rank's microbatch size and
    count; ``"uniform"``: equal shares of ``microbatches`` each; or one entry per rank, ``(microbatch size,
    microbatches)`` or a sample count. Each rank's budget is its device's ``memory``; a ``speed_factor`` > 1
    makes the runtime emulate a slower device. ``sm(*global_batch)`` takes this rank's rows. Under
    ``parallel=("pipeline", "data")`` the share is a pipeline's (every rank of a pipeline trains on its rows): an
    entry per pipeline, or one per rank where each pipeline's ranks agree; ``"auto"`` weighs each pipeline's
    predicted step (compiler/grid_balance.py), and every rank plans under the smallest device's memory."""
    shard_state: bool | str | None = None
    """True (or ``"optimizer"``): each parameter's optimizer state is kept, and the parameter stepped, by one rank,
    which broadcasts it (ZeRO stage 1; runtime/shard.py), in equal byte shares or under ``balance`` the shares its
    plan chose; under ``parallel=("pipeline", "data")`` each stage's over its replica group; False:
    every rank keeps all of it. None: True under ``balance``, False otherwise. ``"full"``: parameters, gradients and
    optimizer state partitioned (ZeRO stage 3; passes/shard.py): each rank keeps an equal chunk (under ``balance``,
    its planned share) of every pack's fp32 weights and its optimizer state on its host, weights are all-gathered for
    use and gradients reduce-scattered to their owners (host-stepped packs, fp32; quantized under ``compression``;
    ``clip_grad_norm`` too). Bitwise the same training as the replicated run with the same settings."""
    comm_timeout: float = env_field("comm_timeout")
    """*env* ``HARMONY_COMM_TIMEOUT``. Seconds a collective waits for its peers, also when compile initialises the
    process group (default 300)."""
    parallel: str | tuple | None = None
    """None or ``"data"``: as ``data_parallel`` says. ``("pipeline", "data")`` (or ``"pipeline"`` with
    ``data_parallel=True``): a pipeline inside each server, data parallelism across servers (``pipeline_size``).
    ``"pipeline"``: Harmony's vPP under torchrun, one process per device of one node: the packs are placed across
    the ranks (``placement``); each rank holds, steps and saves only its packs' state; a microbatch's activations at
    a pack boundary go to the next rank by send/recv and their gradients come back (passes/stage.py). Every rank is
    given the whole batch (the first rank reads the inputs, the last the labels); ``sm(*batch)`` returns the same
    mean loss on every rank."""
    placement: str = "contiguous"
    """Under ``parallel="pipeline"``: ``"contiguous"`` stages that balance the predicted compute per rank (the fewest
    rank-to-rank transfers), or ``"round_robin"`` (pack p on rank p mod N, the Harmony paper's: every pack boundary
    crosses ranks, and consecutive packs run on different ranks at once), or ``"layers"`` (contiguous stages that
    balance the compute layer by layer, cutting the packs where a stage ends: best with a small ``pipeline_group``)."""
    pipeline_group: int | str | None = None
    """Under ``parallel="pipeline"`` (policy "harmony"): how many microbatches go through a rank's packs together
    (default all: each pack swapped in once per forward and once per backward). Fewer let the next rank start
    sooner (a finer pipeline) at the cost of more swaps of packs that do not stay resident on the device; each
    pack still accumulates the microbatches in order, so the bits do not change. ``"auto"``: the size (M, M/2,
    ..., 1) whose node step the simulator predicts shortest, every rank planning the whole node for each."""

    pipeline_size: int | None = None
    """Under ``parallel=("pipeline", "data")``: ranks per pipeline (one server's devices; default torchrun's
    ``LOCAL_WORLD_SIZE``). The world's ranks form pipelines of ``pipeline_size`` consecutive ranks, and the pipelines
    are data-parallel replicas of each other (driver/modes/grid.py)."""

    def __post_init__(self):
        super().__post_init__()
        check_parallel(self)      # compiler/config_checks.py


@dataclass(kw_only=True)
class NumericsConfig(Group):
    """The dtypes of the device's copies and of the loss scale."""

    precision: str = "fp32"
    """``"fp32"``: everything fp32. ``"bf16"`` / ``"fp16"``: the device holds compute copies of the float parameters
    and buffers in that dtype, runs the packs on float batch tensors cast to it (integer ones, such as token ids,
    are not) and accumulates gradients in it; the optimizer steps fp32 master weights with fp32 gradients and
    state on the host (or disk), as ZeRO-Offload does. The loss returned is fp32."""
    loss_scaling: dict | None = None
    """fp16 only: ``torch.amp.GradScaler``'s ``init_scale``, ``growth_factor``, ``backoff_factor``,
    ``growth_interval`` (defaults 2**16, 2, 0.5, 2000); a step with an inf or nan gradient is skipped and the scale
    backed off (``sm.loss_scale``)."""

    def __post_init__(self):
        super().__post_init__()
        choice("precision", self.precision, tuple(PRECISIONS))
        if self.loss_scaling is None:
            return
        if self.precision != "fp16":
            raise ConfigError(f"loss_scaling is for precision='fp16' (got precision={self.precision!r}): bf16 has "
                              f"fp32's exponent range and needs no scaling; drop loss_scaling or use fp16")
        if not isinstance(self.loss_scaling, Mapping):
            raise ConfigError(f"loss_scaling={self.loss_scaling!r}: give a dict of torch.amp.GradScaler's arguments")
        unknown = set(self.loss_scaling) - set(SCALING_DEFAULTS)
        if unknown:
            raise ConfigError(f"loss_scaling has unknown keys {sorted(unknown)}; the keys are "
                              f"{', '.join(SCALING_DEFAULTS)} (torch.amp.GradScaler's)")
        s = {**SCALING_DEFAULTS, **self.loss_scaling}
        if not (s["init_scale"] > 0 and s["growth_factor"] > 1 and 0 < s["backoff_factor"] < 1
                and int(s["growth_interval"]) >= 1):
            raise ConfigError(f"loss_scaling={self.loss_scaling!r}: need init_scale > 0, growth_factor > 1, "
                              f"0 < backoff_factor < 1 and growth_interval >= 1")

    def scaling(self) -> dict:
        """The loss scaler's arguments (fp16: GradScaler's defaults updated by ``loss_scaling``); {} without one."""
        return {**SCALING_DEFAULTS, **(self.loss_scaling or {})} if self.precision == "fp16" else {}


@dataclass(kw_only=True)
class PlanConfig(Group):
    """How the model is traced and planned, and for which device."""

    policy: str = "harmony"
    """``"harmony"``: packs of layers, each swapped in once for all microbatches; ``"sequential"``: every
    microbatch through the whole model in turn; ``"ondemand"``: no plan, each tensor fetched as an op touches it
    (a baseline; CPU only)."""
    passes: Any = None
    """The passes to run, in order: names, or ``(name, choice)`` to hand a pass the choice its search would have
    made (the partition's: the names of its packs' first nodes, ``passes.partition.first_nodes(sm.program)`` lists
    where a pack can start; the swap pass's: a ``Choice``, ``sm.program.swap_choice``). A bare string is one name.
    None: the whole pipeline (``compiler.passmanager.DEFAULT_PIPELINE``); a pipeline cut short gives a module that
    can be inspected, not run."""
    leaf_modules: Any = ()
    """Module classes, class names or module paths the trace keeps as single opaque calls."""
    shape_plans: str = "compiled"
    """``"compiled"``: batches up to the example's shapes run its plan; ``"each"``: a plan per shape (docs/shapes)."""
    device: Any = "cpu"
    """Where the step runs: ``"cpu"`` (a logical device whose memory the runtime accounts and enforces), or
    ``"cuda"`` / ``"cuda:N"``."""
    hardware: Any = None
    """A ``Hardware``, ``Device`` or preset name such as ``"a100-40gb"``: the FLOP/s and host link the planner weighs
    compute against traffic with. None: this machine (its cached profile on CUDA). A device whose ``speed_factor``
    is above 1 (``hw.logical(budgets, speed_factors)``) is emulated: the runtime stretches every compute op; one with
    an emulated link (``hw.logical(budgets, speed_factors, link_bandwidth=)``) has every copy paced to its rate."""
    accounting: str = "ops"
    """How the runtime counts the device's bytes: ``"ops"``, each tensor every op allocates, exactly (a Python hook
    around each tensor op); ``"allocator"`` (CUDA, not ondemand): torch's caching allocator's counters, read between
    ops, which spares the host that hook's cost per op and finds an op over the budget after it, not at the
    allocation. Not yet measured on a card."""
    cache_dir: str | None = env_field("cache_dir")
    """*env* ``HARMONY_CACHE_DIR``. Where the hardware profile is cached; None: ``~/.cache/harmony``."""

    def __post_init__(self):
        super().__post_init__()
        choice("policy", self.policy, POLICIES)
        choice("shape_plans", self.shape_plans, SHAPE_PLANS)
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise ConfigError(f"device={self.device!r} is not a device torch knows ({str(e).split(':')[0]}); "
                              f"use 'cpu', or 'cuda' / 'cuda:N' where a GPU exists") from None
        if self.hardware is not None and not isinstance(self.hardware, (str, Device, Hardware)):
            raise ConfigError(f"hardware={self.hardware!r}: give a Hardware, a Device or a preset name such as "
                              f"'a100-40gb'")
        self.passes = checks.pass_list(self.passes, DEFAULT_PIPELINE)
        choice("accounting", self.accounting, ("ops", "allocator"))
        if self.accounting == "allocator" and (torch.device(self.device).type != "cuda" or self.policy == "ondemand"):
            raise ConfigError(f"accounting='allocator' reads torch's CUDA allocator, and ondemand fetches at each op: "
                              f"it needs device='cuda' and policy 'harmony' or 'sequential' (here device="
                              f"{self.device!r}, policy={self.policy!r}); use accounting='ops'")
        if isinstance(self.leaf_modules, (str, type)):
            self.leaf_modules = (self.leaf_modules,)
        self.cache_dir = env.check("cache_dir", self.cache_dir)


@dataclass(kw_only=True)
class Config(TrainConfig, LossConfig, MemoryConfig, DiskConfig, ParallelConfig, NumericsConfig, PlanConfig):
    """Every option of ``harmony.compile``; the fields are documented on the groups it is made of."""

    def __post_init__(self):
        super().__post_init__()
        if self.precision == "fp16" and self.optimizer_on == Tier.DEVICE:
            raise ConfigError(f"precision='fp16' with optimizer_on={Tier.DEVICE!r}: fp16's overflow check must see "
                              f"every gradient before any update, and device steps follow each pack's backward; use "
                              f"optimizer_on={Tier.HOST!r} (or 'auto'), or precision='bf16'")
        if self.precision == "bf16" and self.optimizer_on == Tier.DEVICE and self.clip_grad_norm is not None:
            raise ConfigError(f"precision='bf16' with optimizer_on={Tier.DEVICE!r} and clip_grad_norm: the global norm "
                              f"is taken over fp32 gradients, which a device step makes one parameter at a time; use "
                              f"optimizer_on={Tier.HOST!r} (or 'auto') to clip, or no clip_grad_norm")
        if self.precision != "fp32" and self.policy == "ondemand":
            raise ConfigError(f"precision={self.precision!r} needs a planned schedule; the ondemand baseline moves "
                              f"fp32 state as ops touch it. Use policy='harmony' or 'sequential', or precision='fp32'")
        if self.balance is not None:
            self._check_balance()
        if self.clip_grad_norm is not None and self.weights_on == Tier.DISK and self.shard_state != "full":
            raise ConfigError(f"clip_grad_norm with weights_on={Tier.DISK!r}: a pack wholly on disk steps file by file "
                              f"while its gradients leave the device, before the global norm can be known; use "
                              f"weights_on='auto' or {Tier.HOST!r} (optimizer state may still go to disk under "
                              "host_memory_budget), shard_state='full' under torchrun (its shares on disk step as "
                              "host packs do), or clip_grad_norm=None")

    def _check_balance(self) -> None:
        if self.precision != "fp32" or self.weights_on == Tier.DISK:
            raise ConfigError(f"balance= trains data-parallel, which runs in fp32 with weights on the host for now "
                              f"(got precision={self.precision!r}, weights_on={self.weights_on!r}); drop those or "
                              f"balance=")
        if self.data_parallel is False:
            raise ConfigError("balance= splits a global batch over data-parallel ranks: it needs data_parallel=None "
                              "or True under torchrun, not False")
        if self.memory_budget is not None:
            raise ConfigError("with balance=, each rank's memory budget is its device's memory in hardware=: leave "
                              "memory_budget unset and give Hardware(devices=[...]) (hw.logical(budgets) on the CPU)")
        if not isinstance(self.hardware, Hardware):
            raise ConfigError(f"balance= needs hardware=Hardware(devices=[one per rank]) (on the CPU: "
                              f"Hardware.this_machine().logical(budgets, speed_factors)), got {self.hardware!r}")

    @classmethod
    def of(cls, config: "Config | None" = None, **fields) -> "Config":
        """``config`` (default: every field's default) with ``fields`` replaced: ``compile``'s keywords."""
        names = {f.name for f in dataclasses.fields(cls)}
        for name in fields:
            if name not in names:
                near = difflib.get_close_matches(name, names, n=1)
                raise ConfigError(f"harmony.compile got an unknown option {name}=" +
                                  (f"; did you mean {near[0]}=?" if near else "") +
                                  " The options are the fields of harmony.Config (harmony/compiler/config.py)")
        if config is None:
            return cls(**fields)
        if not isinstance(config, Config):
            raise ConfigError(f"config={config!r}: give a harmony.Config (its fields can also be keywords)")
        return dataclasses.replace(config, **fields)

    def items(self) -> dict:
        """The fields by name (not copied: ``dataclasses.asdict`` would copy the optimizer class and the hardware)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(Config)}


@dataclass(kw_only=True)
class CompileConfig(Config):
    """``program.config``: the options as compile resolved them for this process, and what the planner knows.

    Made by ``harmony.compile`` from a checked ``Config`` (tests make one by hand): it checks nothing again.
    """

    batch_size: int                    # samples of this rank's batch
    loss_scaling: dict = field(default_factory=dict)   # fp16: the LossScaler's arguments (GradScaler's); {}: none
    copy_bandwidth: float = 8e9        # bytes/s host<->device, for the planner's time model
    flops: float = 60e9                # FLOP/s of the device, for the planner's time model
    host_bandwidth: float = NOMINAL["host_memory_bandwidth"]   # bytes/s of host memory: the planner's host steps
    copies_block: bool = True          # the device's copies hold its compute up (sync_copies; assumed unless planned)
    headroom: float = 0.05             # share of the budget the planner leaves for its prediction error
    device_reserved: int = 0           # bytes of the budget the device's libraries hold (CUDA: cuBLAS workspaces)
    expandable_segments: bool | None = None   # CUDA: whether torch's allocator grows segments in place
    world_size: int | None = 1         # ranks the plan runs on; None: not checked (data_parallel=False)
    rank: int = 0                      # this process's rank among the data-parallel ranks
    adaptive: bool = False             # per-layer bits chosen after adaptive_warmup steps (CGX; compression="adaptive")
    adaptive_warmup: int = 3
    global_batch: int | None = None    # samples of one step over all ranks (balance); None: batch_size x world
    sample_weight: float | None = None  # this rank's share b_r / B of the gradient average (balance); None: 1/world
    state_shares: list | None = None   # shard_state="full" under balance: each rank's share of every pack's parameters
    speed_factor: float = 1.0          # emulation: the runtime stretches compute ops' time by this (>= 1)
    link_bandwidth: float = 0.0        # emulation: the runtime paces host-link copies to this bytes/s (0: a real link)
    state_owner: dict | None = None    # param -> the rank stepping it (runtime/shard.py); None: each rank steps all
    offline: bool = False              # planned in this process for another rank or a choice: meets no rank
    group_predicted: dict | None = None   # pipeline_group="auto": each candidate's predicted node step (s)
    weigh_device_steps: bool = False  # bf16 under optimizer_on="auto" (which mixed precision resolves to Tier.HOST):
    device_steps: int = 0             # compile weighs stepping the last packs on the device, this many chosen
    steps_predicted: dict | None = None   # (driver/mixed_steps.py); each count tried: its predicted step (s)
    plan_key: str | None = None       # the fingerprint plan misses are learned under (driver/misses.py)
    margin_learned: bool = False      # plan_margin is what earlier plan misses of this model taught (not the user's)

    def __post_init__(self):
        pass

    @property
    def compute_dtype(self):
        """The dtype of float state and activations on the device; None for fp32 (nothing is cast)."""
        return compute_dtype(self.precision)

    @property
    def usable_budget(self) -> int:
        """The bytes the planner may fill: the budget less what the device's libraries hold, the plan margin and the
        headroom for prediction error."""
        return int((self.state_budget - checks.margin_of(self)) * (1 - self.headroom))

    def plan_for_device(self, dev, hardware=None) -> None:
        """What the planner weighs, from the device it plans for (a ``compiler.hardware.Device``): its FLOP/s (an
        emulated slower device's, slowed), its host link, and its host's memory bandwidth; the runtime stretches
        compute by an emulated device's ``speed_factor``, and paces copies to an emulated link's rate
        (``Device.link_emulated``: ``Hardware.logical(..., link_bandwidth=)``)."""
        if dev.speed_factor < 1:
            raise ConfigError(f"device {dev.name!r} has speed_factor {dev.speed_factor:g} < 1: emulation can only "
                              f"slow a device down; divide every factor by the smallest so the fastest device is 1")
        self.flops, self.copy_bandwidth = dev.flops / dev.speed_factor, dev.h2d_bandwidth
        self.copies_block = dev.sync_copies
        self.host_bandwidth = getattr(hardware, "host_memory_bandwidth", self.host_bandwidth)
        self.speed_factor = float(dev.speed_factor)
        self.link_bandwidth = float(dev.h2d_bandwidth) if getattr(dev, "link_emulated", False) else 0.0

    def budget_for(self, peak: int) -> int:
        """The memory_budget an error suggests for a plan whose device peak is ``peak``: the planner's headroom
        added back, 5% more for the prediction's error, and what the device's libraries hold."""
        return int(peak / (1 - self.headroom) * 1.05) + 1 + self.device_reserved + checks.margin_of(self)

    @property
    def state_budget(self) -> int:
        """The budget less ``device_reserved``: what the runtime's own tensors may take, and its meter enforces."""
        return self.memory_budget - self.device_reserved

    @property
    def microbatch_size(self) -> int:
        """Rows of the largest microbatch: the last is smaller where ``microbatches`` does not divide the batch (a
        batch of another shape than the example's, driver/shapes.py)."""
        return -(-self.batch_size // self.microbatches)
