"""What the compiler hands the runtime: one ``PackSpec`` per layer pack, plain data and callables.

The runtime never imports the compiler; everything it needs to execute or cost a
schedule is here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def optim_state_bytes(profile: dict, nbytes: int) -> int:
    """Optimizer-state bytes of one parameter tensor of ``nbytes`` (see optimizer_profile)."""
    return int(round(profile.get("state_per_byte", 0) * nbytes + profile.get("state_per_tensor", 0)))


# A 10 Gb/s Ethernet link: what a cost assumes of a hardware description that gives no network figures
# (compiler/hardware.NOMINAL holds these). Nominal placeholders, not measurements.
NOMINAL_NETWORK_BANDWIDTH = 1.25e9     # bytes/s per rank
NOMINAL_NETWORK_LATENCY = 50e-6        # seconds per message


def step_traffic(param_bytes: float, optim_bytes: float) -> float:
    """Memory bytes an optimizer step moves: Adam(W) reads parameter, gradient and state and writes parameter
    and state, and its for-loop form makes temporaries of the parameter's size on the way: 4 x (2 P + O)."""
    return 4 * (2 * param_bytes + optim_bytes)


def step_extra(profile: dict, sizes: list[int]) -> int:
    """Transient bytes of one optimizer step over tensors of ``sizes`` bytes (see optimizer_profile)."""
    if not sizes:
        return 0
    if profile["extra_follows"] == "sum":
        return int(profile["extra_first"] * sum(sizes))
    top = sorted(sizes, reverse=True) + [0]
    return int(profile["extra_first"] * top[0] + profile["extra_second"] * top[1])


@dataclass
class PackSpec:
    index: int
    name: str                     # e.g. "blocks.0 .. blocks.3"
    module: torch.fx.GraphModule  # the pack's forward: inputs -> outputs
    inputs: list[str]             # value names the pack reads (model placeholders or other packs' outputs)
    outputs: list[str]            # value names the pack produces for later packs (or "loss")
    params: list[str]             # trainable state the pack reads (canonical names)
    buffers: list[str]            # buffers the pack reads
    owned: list[str]              # params whose gradient is complete after this pack's backward
    mutated: list[str]            # buffers written in forward: restored after a recompute
    random: bool                  # replays the RNG on recompute
    stepped: list[str] = None     # the owned params this rank steps and keeps optimizer state for: all of
                                  # them (None: ``owned``), unless optimizer state is sharded over ranks
    # predicted sizes at the compiled microbatch size (bytes) and work (FLOPs)
    param_bytes: int = 0
    buffer_bytes: int = 0
    optim_bytes: int = 0          # optimizer state of the stepped params
    step_extra: int = 0           # transient bytes of the optimizer step over the whole pack
    stream_step_peak: int = 0     # peak bytes of a step that brings each parameter's optimizer state in turn
    in_bytes: int = 0             # one microbatch's float inputs from other packs (their gradients)
    out_bytes: int = 0            # one microbatch's outputs
    saved_bytes: int = 0          # one microbatch's activations kept for backward
    fwd_peak: int = 0             # bytes a forward without grad allocates at its peak (outputs included)
    fwd_keep_peak: int = 0        # bytes a forward that keeps the graph allocates at its peak
    bwd_peak: int = 0             # bytes a backward of a kept forward allocates at its peak
    bwd_recompute_peak: int = 0   # bytes recompute + backward allocate at their peak
    bwd_peak_accum: int = 0       # the same two once the parameters have gradients to accumulate into
    bwd_recompute_peak_accum: int = 0
    fwd_flops: int = 0
    bwd_flops: int = 0
    master_bytes: int = 0         # the host's fp32 masters of ``params`` (param_bytes is the device copies)

    def __post_init__(self):
        if self.stepped is None:
            self.stepped = list(self.owned)


@dataclass
class Plan:
    """Everything static about a compiled program that the runtime needs."""

    packs: list[PackSpec]
    microbatches: int
    microbatch_size: int
    input_names: list[str]
    batch_bytes: dict[str, int] = field(default_factory=dict)  # one microbatch of each input
    resident: set = field(default_factory=set)   # (pack, what) kept on the device for the whole run
    optim_resident: dict = field(default_factory=dict)  # param -> its optimizer state's bytes, kept on the device
                                                         # alone (its pack's optimizer state is not in resident)
    held: set = field(default_factory=set)       # packs whose weights stay on the device between their visits of
                                                 # an iteration (host-stepped: they come in afresh after the step)
    params_held: dict = field(default_factory=dict)   # param -> its weights' bytes, held between visits alone (its
                                                      # pack's other weights move: ``held=`` of swap_in and release)
    device_parts: dict = field(default_factory=dict)  # param of a host-stepped pack -> the transient bytes of its
                                                      # step on the device, where it steps alone, its weights,
                                                      # gradients and optimizer state resident for good
    device_part_bytes: dict = field(default_factory=dict)  # the same params -> their fp32 bytes (what the host step
                                                           # leaves, and the device steps: ``ops_compute._step_cost``)
    step_on: dict = field(default_factory=dict)  # pack -> "device" | "host": where its optimizer steps
    optim_on: dict = field(default_factory=dict)  # pack -> "device" | "host" | "disk": its optimizer state
    master_on: dict = field(default_factory=dict)  # pack -> "host" | "disk": its fp32 weights between uses
    disk_groups: dict = field(default_factory=dict)  # pack -> [[param names]]: a file each (wholly-disk packs)
    disk_in_memory: dict = field(default_factory=dict)  # pack -> [indices into disk_groups[pack]]: files that
                                                        # stay in host memory (spare host budget), never on disk
    disk_in_memory_share: dict = field(default_factory=dict)  # pack -> the share of its files' bytes they hold
    carried: set = field(default_factory=set)    # wholly-disk packs whose stepped weights stay on the device from
                                                 # their step to the next iteration's forward (``carried_names``)
    policy: str = "harmony"
    precision: str = "fp32"                      # fp32 | bf16 | fp16: dtype of device copies (runtime/precision.py)
    loss_scaling: dict = field(default_factory=dict)   # fp16: LossScaler arguments
    state_owner: dict = field(default_factory=dict)    # param -> rank that steps it (sharded optimizer state)
    state_bytes: dict = field(default_factory=dict)    # param -> its bytes (the broadcast that follows the steps)
    sync_buffers: dict = field(default_factory=dict)   # data parallel: mutated buffer -> bytes, broadcast from rank 0
    rank: int = 0


    comm_groups: dict = field(default_factory=dict)  # pack -> its gradients' all-reduce groups (lists of names)
