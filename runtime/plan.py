"""What the compiler hands the runtime: one ``PackSpec`` per layer pack, plain data and callables.

The runtime never imports the compiler; everything it needs to execute or cost a
schedule is here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harmony.base.tiers import Tier


def optim_state_bytes(profile: dict, nbytes: int) -> int:
    """Optimizer-state bytes of one parameter tensor of ``nbytes`` (see optimizer_profile)."""
    return int(round(profile.get("state_per_byte", 0) * nbytes + profile.get("state_per_tensor", 0)))


# A 10 Gb/s Ethernet link: what a cost assumes of a hardware description that gives no network figures
# (compiler/hardware.NOMINAL holds these). Nominal placeholders, not measurements.
NOMINAL_NETWORK_BANDWIDTH = 1.25e9     # bytes/s per rank
NOMINAL_NETWORK_LATENCY = 50e-6        # seconds per message
# fp32 gradient bytes per second one core quantizes and dequantizes once (CGX's codec, runtime/comm/compression.py),
# by bits: a rough figure (one AMD EPYC core's, in its CPU time, once), not this machine's; Hardware.profile measures.
NOMINAL_CODEC_RATES = ((1, 0.5e9), (4, 0.75e9), (8, 0.85e9))
# Bytes/s of an all-reduce's TCP traffic (sent and received, each byte counted once) one core's gloo carries, its
# sums included, where the device is the CPU: a rough figure of one AMD EPYC core's, measured once with two ranks
# on loopback (process CPU time, kernel's included, of fp32 all-reduces less their fused-buffer copies), not this
# machine's. A description may carry its own as ``socket_rate``.
NOMINAL_SOCKET_RATE = 2.5e9


def codec_rate(hw, bits: int) -> float:
    """Bytes/s per core of the codec at ``bits``: ``hw.codec_rates``' figure for the nearest bits measured (nominal
    where the description gives none)."""
    rates = getattr(hw, "codec_rates", ()) or NOMINAL_CODEC_RATES
    return min(rates, key=lambda r: (abs(r[0] - bits), r[0]))[1]


def socket_rate(hw) -> float:
    """Bytes/s per core of gloo's TCP traffic: ``hw.socket_rate`` where the description gives one, else nominal."""
    return getattr(hw, "socket_rate", 0.0) or NOMINAL_SOCKET_RATE


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


STATE_KINDS = ("params", "grads", "optim")


@dataclass
class Residency:
    """Where one pack's training state lives between its uses, and what of it stays on the device.

    The passes fill it in (offload: where the pack steps and the tiers of its state; swap: what stays on the
    device); the ops read it through ``plan.residency[pack]``: a ``swap_in`` moves what is neither kept nor
    held, a ``step`` reads and writes the tiers its optimizer state and masters are on. A new tier or placement
    is a field here and the ops that read it. The defaults are a pack that the device steps and that keeps
    nothing on the device: every use swaps its state in.
    """

    kept: frozenset = frozenset()   # state kinds (STATE_KINDS) on the device for the whole run
    held: bool = False              # its weights stay on the device between its visits of one iteration (stepped
                                    # on the host, they come in afresh after the step)
    carried: bool = False           # wholly on disk: its stepped weights stay on the device from its step to the
                                    # next iteration's forward (``carried_names``)
    step_on: Tier = Tier.DEVICE     # where its optimizer steps: Tier.DEVICE | Tier.HOST
    optim_on: Tier = Tier.DEVICE    # its optimizer state between steps: Tier.DEVICE | Tier.HOST | Tier.DISK
    master_on: Tier = Tier.HOST     # its fp32 weights between uses: Tier.HOST | Tier.DISK
    # single parameters, where the pack's other state moves: param name -> bytes
    params_held: dict = field(default_factory=dict)   # weights held between visits (``held=`` of swap_in/release)
    optim_kept: dict = field(default_factory=dict)    # optimizer state kept on the device (the pack's is not kept)
    device_parts: dict = field(default_factory=dict)  # of a host-stepped pack: parameters that step alone on the
                                                      # device, all their state kept there -> the step's transient
                                                      # bytes (what the host step leaves them)
    device_part_bytes: dict = field(default_factory=dict)  # the same parameters -> their fp32 bytes
    # wholly on disk (master_on == Tier.DISK): its files
    disk_groups: list = field(default_factory=list)   # [[param names]]: a file each
    in_memory: tuple = ()           # indices into disk_groups of files kept in host memory, never written or read
    in_memory_share: float = 0.0    # the share of its files' bytes those hold
    # partitioned over data-parallel ranks (shard_state="full"): runtime/partitioned.PackShares, else None
    shares: object = None

    def has(self, kind: str) -> bool:
        """Whether the pack's state of ``kind`` is on the device for the whole run."""
        return kind in self.kept


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
                                  # (mixed precision: with its fp32 master and gradient)
    in_bytes: int = 0             # one microbatch's float inputs from other packs (their gradients)
    out_bytes: int = 0            # one microbatch's outputs
    saved_bytes: int = 0          # one microbatch's activations kept for backward
    held_in_bytes: int = 0        # one microbatch's inputs a kept graph saves (held until its backward)
    fwd_peak: int = 0             # bytes a forward without grad allocates at its peak (outputs included)
    fwd_keep_peak: int = 0        # bytes a forward that keeps the graph allocates at its peak
    bwd_peak: int = 0             # bytes a backward of a kept forward allocates at its peak
    bwd_recompute_peak: int = 0   # bytes recompute + backward allocate at their peak
    bwd_peak_accum: int = 0       # the same two once the parameters have gradients to accumulate into
    bwd_recompute_peak_accum: int = 0
    fwd_flops: int = 0
    bwd_flops: int = 0
    master_bytes: int = 0         # the host's fp32 masters of ``params`` (param_bytes is the device copies)
    stepped_master_bytes: int = 0   # those of ``stepped``: what a mixed-precision device step brings in

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
    residency: dict = field(default_factory=dict)   # pack -> its Residency (every pack has one)
    policy: str = "harmony"
    precision: str = "fp32"                      # fp32 | bf16 | fp16: dtype of device copies (runtime/precision.py)
    loss_scaling: dict = field(default_factory=dict)   # fp16: LossScaler arguments
    clip_grad_norm: float | None = None          # clip by the global gradient norm (runtime/precision.py GradClip)
    clip_norm_type: float = 2.0
    param_order: list = field(default_factory=list)    # the model's parameter names in model.parameters() order
    state_owner: dict = field(default_factory=dict)    # param -> rank that steps it (sharded optimizer state)
    state_bytes: dict = field(default_factory=dict)    # param -> its bytes (the broadcast that follows the steps)
    sync_buffers: dict = field(default_factory=dict)   # data parallel: mutated buffer -> bytes, broadcast from rank 0
    rank: int = 0
    comm_groups: dict = field(default_factory=dict)  # pack -> its gradients' all-reduce groups (lists of names)
    stage: object = None           # pipeline (runtime/pipeline.Stages): the whole model's packs and their ranks;
                                   # ``packs`` are then this rank's only
    rows: tuple = ()      # rows of each microbatch where they differ (the last one smaller: driver/shapes.py);
                          # () where every microbatch has ``microbatch_size`` rows

    def microbatch_rows(self) -> tuple[int, ...]:
        """The rows of each microbatch of the batch this plan was made for."""
        return self.rows or (self.microbatch_size,) * self.microbatches

    def __post_init__(self):
        for spec in self.packs:
            self.residency.setdefault(spec.index, Residency())

    @property
    def sharded(self) -> bool:
        """Whether ranks hold different training state: optimizer state (ZeRO-1), all of it partitioned, or each
        rank its pipeline stage's packs."""
        return bool(self.state_owner) or any(r.shares is not None for r in self.residency.values()) \
            or self.stage is not None

    def at(self, pack: int) -> Residency:
        """The residency record of ``pack``."""
        return self.residency[pack]

    def kept(self) -> list[tuple[int, str]]:
        """(pack, kind) of every pack's state kept on the device for the whole run, sorted."""
        return [(p, k) for p, r in sorted(self.residency.items()) for k in sorted(r.kept)]

    def by_pack(self, what: str) -> dict:
        """One field of every pack's record: pack -> value (``plan.by_pack("step_on")``: where each steps)."""
        return {p: getattr(r, what) for p, r in sorted(self.residency.items())}

    def packs_with(self, what: str) -> set[int]:
        """The packs whose record's ``what`` is set (``plan.packs_with("held")``: those holding their weights)."""
        return {p for p, r in self.residency.items() if getattr(r, what)}

    def per_param(self, what: str) -> dict:
        """One of the records' per-parameter tables (``params_held``, ``optim_kept``, ``device_parts``,
        ``device_part_bytes``) over all packs: param name -> bytes."""
        return {n: b for _, r in sorted(self.residency.items()) for n, b in getattr(r, what).items()}


def even_rows(rows: int, parts: int) -> tuple[int, ...]:
    """``rows`` cut into ``parts`` microbatches as equal as possible, the larger ones first (30 into 4: 8, 8, 7, 7):
    a smaller batch run by a plan made for a larger one keeps its microbatch count (driver/shapes.py)."""
    whole, extra = divmod(rows, parts)
    return tuple(whole + (i < extra) for i in range(parts))


def loss_weight(rows: tuple[int, ...], mb: int) -> float | None:
    """What microbatch ``mb``'s mean loss counts for in the batch's mean: its rows over the batch's; None where the
    microbatches are alike (each counts ``1 / microbatches``)."""
    return rows[mb] / sum(rows) if len(set(rows)) > 1 else None


def loss_seed(loss: torch.Tensor, rows: tuple[int, ...], mb: int, token_scale: float | None = None):
    """Microbatch ``mb``'s gradient seed (fp32): its mean loss weighted by rows (``loss_weight``); or, where the loss
    is its sum over the whole batch's token count (``token_scale`` given: compiler/loss_weighting.py), the loss
    itself times ``token_scale`` (the data-parallel ranks, whose gradients the all-reduce averages)."""
    loss = loss.float()
    if token_scale is not None:
        return loss if token_scale == 1 else loss * token_scale
    weight = loss_weight(rows, mb)
    return loss / len(rows) if weight is None else loss * weight


def mean_loss(losses: list, rows: tuple[int, ...], token_scale: float | None = None):
    """The batch's mean loss from its microbatches' mean losses (fp32 whatever the compute dtype), weighted by rows
    where they differ; with ``token_scale``, from their terms of the batch's token mean: their sum, times it."""
    stacked = torch.stack([loss.float() for loss in losses])
    if token_scale is not None:
        return stacked.sum() if token_scale == 1 else stacked.sum() * token_scale
    if len(set(rows)) > 1:
        return (stacked * stacked.new_tensor(rows)).sum() / sum(rows)
    return stacked.mean()
