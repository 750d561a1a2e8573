"""The program a pass receives and returns: the model graph, its packs, the schedule graph, reports."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from harmony.base.errors import ConfigError
from harmony.compiler.hardware import NOMINAL
from harmony.runtime.compression import DEFAULT_MIN_SIZE
from harmony.runtime.plan import Plan
from harmony.runtime.precision import compute_dtype


@dataclass
class CompileConfig:
    memory_budget: int                 # bytes per device
    microbatches: int
    batch_size: int
    policy: str = "harmony"            # harmony | sequential | ondemand
    optimizer: type = torch.optim.AdamW
    optimizer_kwargs: dict = field(default_factory=dict)
    copy_bandwidth: float = 8e9        # bytes/s host<->device, for the planner's time model
    flops: float = 60e9                # FLOP/s of the device, for the planner's time model
    host_bandwidth: float = NOMINAL["host_memory_bandwidth"]   # bytes/s of host memory: the planner's host steps
    headroom: float = 0.05             # share of the budget the planner leaves for its prediction error
    device_reserved: int = 0           # bytes of the budget the device's libraries hold (CUDA: cuBLAS workspaces)
    expandable_segments: bool | None = None   # CUDA: whether torch's allocator grows segments in place
    recompute: str = "auto"            # auto: a pack keeps its forward's graph where the budget has room (swap
                                       # pass); always: every pack but the last recomputes (Harmony's paper)
    optimizer_on: str = "auto"         # where the optimizer steps: auto | device | host (offload pass)
    data_parallel: bool = False        # average gradients over the ranks of torch.distributed (compress pass)
    world_size: int | None = 1         # ranks the plan runs on; None: not checked (data_parallel=False)
    compression: Any = None            # CompressionSpec of the gradient all-reduce (None: fp32)
    adaptive: bool = False             # per-layer bits chosen after adaptive_warmup steps (CGX)
    adaptive_warmup: int = 3
    min_size: int = DEFAULT_MIN_SIZE   # tensors with fewer elements (or dim <= 1) travel uncompressed
    host_memory_budget: int | None = None   # bytes of host memory for training state; None: no limit (offload pass)
    offload_dir: str | None = None     # where the disk tier makes its private directory; None: the temp directory
    weights_on: str = "auto"           # fp32 weights between uses: auto | host | disk (offload pass)
    disk_group_bytes: int = 32 << 20   # weights per file of a pack wholly on disk (it steps a file at a time)
    precision: str = "fp32"            # fp32 | bf16 | fp16: dtype of the device's copies (runtime/precision.py)
    loss_scaling: dict = field(default_factory=dict)   # fp16: LossScaler arguments (GradScaler's)

    @property
    def compute_dtype(self):
        """The dtype of float state and activations on the device; None for fp32 (nothing is cast)."""
        return compute_dtype(self.precision)

    global_batch: int | None = None    # samples of one step over all ranks (balance); None: batch_size x world
    sample_weight: float | None = None  # this rank's share b_r / B of the gradient average (balance); None: 1/world
    speed_factor: float = 1.0          # emulation: the runtime stretches compute ops' time by this (>= 1)
    state_owner: dict | None = None    # param -> the rank that steps it and keeps its optimizer state (sharded
                                       # optimizer state, runtime/shard.py); None: every rank steps every param
    rank: int = 0                      # this process's rank among the data-parallel ranks

    @property
    def usable_budget(self) -> int:
        """The bytes the planner may fill: the budget less what the device's libraries hold and the headroom for
        prediction error."""
        return int(self.state_budget * (1 - self.headroom))

    def plan_for_device(self, dev, hardware=None) -> None:
        """What the planner weighs, from the device it plans for (a ``compiler.hardware.Device``): its FLOP/s (an
        emulated slower device's, slowed), its host link, and its host's memory bandwidth; the runtime stretches
        compute by an emulated device's ``speed_factor``."""
        if dev.speed_factor < 1:
            raise ConfigError(f"device {dev.name!r} has speed_factor {dev.speed_factor:g} < 1: emulation can only "
                              f"slow a device down; divide every factor by the smallest so the fastest device is 1")
        self.flops, self.copy_bandwidth = dev.flops / dev.speed_factor, dev.h2d_bandwidth
        self.host_bandwidth = getattr(hardware, "host_memory_bandwidth", self.host_bandwidth)
        self.speed_factor = float(dev.speed_factor)

    def budget_for(self, peak: int) -> int:
        """The memory_budget an error suggests for a plan whose device peak is ``peak``: the planner's headroom
        added back, 5% more for the prediction's error, and what the device's libraries hold."""
        return int(peak / (1 - self.headroom) * 1.05) + 1 + self.device_reserved

    @property
    def state_budget(self) -> int:
        """The budget less ``device_reserved``: what the runtime's own tensors may take, and its meter enforces."""
        return self.memory_budget - self.device_reserved

    @property
    def microbatch_size(self) -> int:
        return self.batch_size // self.microbatches


@dataclass
class PassReport:
    """What one pass did, in numbers: ``rows`` is a table (list of dicts), ``totals`` a dict."""

    title: str
    rows: list[dict] = field(default_factory=list)
    totals: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class PassResult:
    program: "Program"
    report: PassReport


@dataclass
class Program:
    model: torch.nn.Module
    gm: torch.fx.GraphModule           # the model graph (trace), annotated by cost
    example_batch: tuple
    config: CompileConfig
    fake: Any = None                   # FakeRun of the cost analysis (fake values at the microbatch size)
    fake_batch_bytes: dict = field(default_factory=dict)  # one microbatch of each model input
    pack_measurements: dict = field(default_factory=dict)  # (pack nodes, last) and pack_signature -> figures
    optim_profile: dict = field(default_factory=dict)   # bytes of optimizer state per parameter byte, ...
    units: list[list[torch.fx.Node]] = field(default_factory=list)  # narrowest-cut layers, in order
    plan: Plan | None = None           # packs (partition), residency (swap)
    schedule: torch.fx.Graph | None = None
    capabilities: set[str] = field(default_factory=set)
    reports: list[PassReport] = field(default_factory=list)
    history: list[tuple[str, str]] = field(default_factory=list)  # (pass name, schedule code after it)
    predicted_peak: int = 0
    rows: tuple | None = None          # this rank's rows [start, stop) of the global batch (balance)
    swap_choice: Any = None            # what the swap pass kept on the device (passes.swap.graph.Choice): plain data,
                                       # which passes=(..., ("swap", choice), ...) applies again without searching
    step_hooks: list = field(default_factory=list)   # fn(sm) -> stats a pass adds to ``sm.stats`` after each step
                                                     # (module-level functions: a checkpoint pickles them by name)


def calls(graph: torch.fx.Graph) -> list:
    """The schedule's op nodes (``call_function``), in order."""
    return [n for n in graph.nodes if n.op == "call_function"]


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of ``graph`` whose nodes keep their names and (shallow copies of) their meta."""
    g = torch.fx.Graph()
    env: dict = {}
    for n in graph.nodes:
        env[n] = g.node_copy(n, lambda x: env[x])
        env[n].name = n.name
        env[n].meta = dict(n.meta)
    return g
