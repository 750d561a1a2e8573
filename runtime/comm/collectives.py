"""Gradient all-reduce across ranks, plain or compressed (CGX-style), on ``torch.distributed``.

Every rank calls ``allreduce(tensors, spec)`` with the same list of tensors (same shapes,
same order); afterwards each tensor holds the **average** over ranks, like DDP. Kinds:

* ``none``      -- fp32 ``all_reduce``.
* ``fp16/bf16`` -- divide by world size, cast, ``all_reduce``, cast back (DDP's fp16 hook).
* ``quantized`` -- bucketed max-min quantization with levels packed densely into bytes, run
  as scatter-reduce then all-gather: each rank owns one chunk of the fused buffer, receives
  that chunk quantized from every peer (``all_to_all_single``), reduces in fp32, quantizes
  the result once and all-gathers the packed bytes. Every rank decodes the same bytes, so the
  result is bitwise identical on every rank.

Tensors with dimension <= 1 or fewer than ``min_size`` elements (biases, norms) are reduced
uncompressed -- CGX's rule. Tensors sharing a spec are fused into buffers of up to
``fusion_bytes``; in a quantized buffer every tensor starts on a bucket boundary, so no bucket
mixes two tensors' ranges. Each call returns ``CommStats``: bytes this rank sent, what fp32
would have sent, seconds.

``reduce_scatter`` runs the same buffers through the first half only (``shard_state="full"``: each owner keeps
its chunk of the average; runtime/partitioned/).

The codec (``CompressionSpec``, ``quantize``, ``dequantize``) is ``runtime/comm/compression.py``.

Only ``torch.distributed`` moves bytes (gloo on the CPU; the same calls run on NCCL).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from harmony.base.errors import ConfigError
from harmony.runtime.comm.compression import (
    DEFAULT_MIN_SIZE,
    NO_COMPRESSION,
    CompressionSpec,
    Packed,
    dequantize,
    quantize,
    spec_for,
    wire_bytes,
)
from harmony.runtime.comm.failures import comm_error, exchange, guarded, launch, wait_work  # noqa: F401

DEFAULT_FUSION_BYTES = 64 << 20  # fp32 bytes per fused buffer
WORDS_PAD = 32                   # elements a step's words take at the end of a buffer (``allreduce``'s ``words``)


def words_pad(world: int) -> int:
    """The elements a step's words add at the end of the fp32 buffer they ride on (``allreduce``'s ``words``)."""
    return WORDS_PAD * -(-world // WORDS_PAD)


# -- byte and time accounting ---------------------------------------------------------------------
@dataclass
class CommStats:
    """What one or more ``allreduce`` calls cost this rank.

    ``wire_bytes`` is what this rank sends (ring all-reduce for none/fp16/bf16; the two
    phases of scatter-reduce-allgather for quantized); ``fp32_bytes`` is what a ring fp32
    all-reduce of the same tensors would send.
    """

    wire_bytes: int = 0
    fp32_bytes: int = 0
    seconds: float = 0.0
    calls: int = 0
    tensors: int = 0
    compressed: int = 0      # tensors that travelled quantized or in half precision

    @property
    def ratio(self) -> float:
        """fp32 bytes / wire bytes (how much less this sends than fp32)."""
        return self.fp32_bytes / self.wire_bytes if self.wire_bytes else float("inf")

    def __add__(self, other: "CommStats") -> "CommStats":
        return CommStats(self.wire_bytes + other.wire_bytes, self.fp32_bytes + other.fp32_bytes,
                         self.seconds + other.seconds, self.calls + other.calls,
                         self.tensors + other.tensors, self.compressed + other.compressed)


def ring_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes``."""
    return 2 * (world - 1) * nbytes // world if world > 1 else 0


# -- buffers kept between calls -------------------------------------------------------------------
class Workspace:
    """The fused buffers and wire messages of ``allreduce``, kept from one call to the next.

    Fresh memory is not free: the kernel faults in and zeroes every page the first time it is written, and on
    this project's machines that costs about as much as the 4-bit codec itself. A training loop that syncs the
    same gradients every step can pass one ``Workspace`` to every call (as DDP keeps its buckets): from the
    second call on nothing is allocated. It holds what one call needs at once (the gradients in fp32 plus their
    messages); ``nbytes`` says how much, ``clear()`` gives it back. One workspace serves one thread at a time.
    """

    def __init__(self):
        self._free: dict[tuple, list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        """A tensor of ``numel`` elements: a kept one of that size if there is one (its contents are stale)."""
        kept = self._free.get((numel, dtype, torch.device(device)))
        return kept.pop() if kept else torch.empty(numel, dtype=dtype, device=device)

    def give(self, t: torch.Tensor) -> None:
        """Keep ``t`` (from ``take``, its work done) for a later ``take`` of the same size."""
        self._free.setdefault((t.numel(), t.dtype, t.device), []).append(t)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for kept in self._free.values() for t in kept)

    def clear(self) -> None:
        self._free.clear()


# -- allreduce ------------------------------------------------------------------------------------
def allreduce(tensors: Sequence[torch.Tensor], spec: CompressionSpec | Sequence[CompressionSpec] = NO_COMPRESSION,
              group=None, error_feedback_state: dict | None = None, *, min_size: int = DEFAULT_MIN_SIZE,
              timeout: float | None = None, generator: torch.Generator | None = None,
              fusion_bytes: int = DEFAULT_FUSION_BYTES, weight: float | None = None,
              release: Callable[[torch.Tensor], None] | None = None,
              workspace: Workspace | None = None, words=None) -> CommStats:
    """Average ``tensors`` over the ranks of ``group``, in place; returns what it cost.

    ``weight``: this rank's weight in a weighted average, ``sum_r weight_r * t_r`` (the weights of
    all ranks should sum to 1). Ranks that trained on different numbers of samples pass their share
    of the global batch, ``b_r / B``, so the average of their mean gradients is the mean gradient of
    the whole batch. ``None`` (default): the plain average, weight ``1 / world`` on every rank.
    It is applied by scaling this rank's tensors by ``weight * world`` before the plain average, in
    every kind (fp32, half, quantized, with or without error feedback, whose residuals live in that
    scaled domain), so a weight of exactly ``1 / world`` changes nothing, bitwise.

    ``spec`` is one ``CompressionSpec`` for all tensors or one per tensor (layer-wise bits);
    ``spec_for`` keeps small and 1-d tensors uncompressed. With ``error_feedback`` the caller
    passes the same dict as ``error_feedback_state`` on every call (residuals are keyed by the
    tensor's position in ``tensors``). ``timeout`` (seconds) bounds each wait (the process
    group's own timeout, see ``process_group.init_process_group``, bounds the transfers too); a dead or
    stalled peer raises ``CommunicationError``. ``generator`` drives stochastic rounding.
    ``release`` is called with each internal buffer once its collective is done and nothing here uses it any
    more: the backend's worker thread may still hold a reference to it for a while (gloo drops its own a moment
    after the wait returns), so a caller that accounts device memory (the runtime's meter) stops counting it
    there instead of waiting for the backend.
    ``workspace``: a ``Workspace`` to take the fused buffers and messages from and give them back to, so that
    repeated calls over the same tensors allocate nothing (``None``: fresh buffers, freed on return).
    ``words``: the ranks' words on a training step (runtime/comm/jobwide.py ``Words``): they ride at the end of the
    first fp32 buffer, padded by ``words_pad(world)`` (no gradient element moves; gloo's ring sums an element in an
    order set by where it sits and the buffer's length, so over three ranks or more a step's buffers are summed as
    padded: ``shard_state="full"`` pads the same buffers alike, runtime/partitioned/reduce.py); with no fp32 buffer,
    in an all-reduce of their own launched beside the buffers'.
    With one rank there is nothing to average: tensors are left as they are.

    Typical use, after ``loss.backward()`` on every rank (under torchrun):

        stats = allreduce([p.grad for p in model.parameters()], CompressionSpec(bits=4), timeout=60)
        print(stats.wire_bytes, stats.ratio, stats.seconds)
    """
    start = time.perf_counter()
    tensors = list(tensors)
    specs = _settle_specs(tensors, spec, min_size, error_feedback_state)
    world = dist.get_world_size(group)
    stats = CommStats(tensors=len(tensors), compressed=sum(s.lossy for s in specs), calls=1)
    if world == 1:
        stats.compressed = 0
        stats.seconds = time.perf_counter() - start
        return stats
    scale = _weight_scale(weight, world)
    jobs = [_Job(idx, tensors, s, group, world, error_feedback_state, timeout, generator, scale, release,
                 workspace=workspace) for s, idx in fuse(tensors, specs, fusion_bytes)]
    carrier = next((j for j in jobs if j.spec.kind == "none"), None) if words is not None else None
    if carrier is not None:
        carrier.words = words
    elif words is not None:      # no fp32 buffer: beside the buffers, not in one (``Words.launch``)
        words.launch(world, dist.get_rank(group), timeout)
        if release is not None:      # a few bytes, not the gradients': never part of a device's peak
            release(words.pending)
    _sweep(jobs, stats, world)
    if words is not None and carrier is None:
        words.join(timeout)
    stats.seconds = time.perf_counter() - start
    return stats


def _settle_specs(tensors: list, spec: CompressionSpec | Sequence[CompressionSpec], min_size: int,
                  error_feedback_state: dict | None) -> list[CompressionSpec]:
    """The spec each tensor travels with (``spec``: one for all or one each, through ``spec_for``); refuses a count
    that does not match and error feedback without a state to keep residuals in."""
    specs = list(spec) if isinstance(spec, (list, tuple)) else [spec] * len(tensors)
    if len(specs) != len(tensors):
        raise ConfigError(f"allreduce got {len(specs)} specs for {len(tensors)} tensors; pass one spec or one per "
                          f"tensor")
    specs = [spec_for(t, s, min_size) for t, s in zip(tensors, specs)]
    if any(s.error_feedback for s in specs) and error_feedback_state is None:
        raise ConfigError("a spec has error_feedback=True but allreduce got no error_feedback_state; "
                          "pass the same dict (e.g. {}) on every call")
    return specs


def _weight_scale(weight: float | None, world: int) -> float:
    """What this rank's tensors are scaled by so that the plain average is the ``weight``ed one (1: no weight)."""
    scale = 1.0 if weight is None else float(weight) * world
    if not math.isfinite(scale) or scale < 0:
        raise ConfigError(f"allreduce weight={weight!r}: give this rank's share of the average, a number >= 0")
    return scale


def _sweep(jobs: list[_Job], stats: CommStats, world: int) -> None:
    """Run every fused buffer's all-reduce, adding its bytes to ``stats``: three sweeps, so each buffer's
    compression overlaps the previous buffer's transfer."""
    for job in jobs:
        job.launch()
    for job in jobs:
        job.reduce()
    for job in jobs:
        job.finish()
        stats.wire_bytes += job.wire_bytes
        stats.fp32_bytes += ring_bytes(4 * job.numel, world)


def reduce_scatter(tensors: Sequence[torch.Tensor], specs: Sequence[CompressionSpec], group=None, *,
                   timeout: float | None = None, generator: torch.Generator | None = None,
                   fusion_bytes: int = DEFAULT_FUSION_BYTES, error_feedback_state: dict | None = None,
                   weight: float | None = None) -> tuple[list, CommStats]:
    """The reduce-scatter half of ``allreduce`` (the same fused buffers, the same quantization in the same order,
    the same generator draws), for ranks that keep only their chunk of the average (``shard_state="full"``).

    ``specs``: one per tensor, as ``spec_for`` settled them. Returns, per fused buffer in ``allreduce``'s order,
    ``(indices, offsets, chunk, out)``: a quantized buffer's ``out`` is this rank's chunk (``chunk`` elements from
    ``rank * chunk`` of the padded buffer), decoded from the bytes ``allreduce`` would all-gather, so it is bitwise
    what ``allreduce`` leaves there; an uncompressed one's ``out`` is the whole average (``chunk`` is 0). With error
    feedback the residuals (``error_feedback_state``, as ``allreduce`` takes it) are ``allreduce``'s: what this rank's
    quantization of the other ranks' chunks lost, and what re-quantizing its own chunk's sum lost. ``weight``: as
    ``allreduce``'s (a balanced rank's share of the average)."""
    start = time.perf_counter()
    tensors, world = list(tensors), dist.get_world_size(group)
    stats = CommStats(tensors=len(tensors), compressed=sum(s.lossy for s in specs), calls=1)
    if any(s.error_feedback for s in specs) and error_feedback_state is None:
        raise ConfigError("a spec has error_feedback=True but reduce_scatter got no error_feedback_state")
    scale = 1.0 if weight is None else float(weight) * world
    jobs = [_Job(idx, tensors, s, group, world, error_feedback_state, timeout, generator, scale, scatter=True)
            for s, idx in fuse(tensors, specs, fusion_bytes)]
    for job in jobs:
        job.launch()
    for job in jobs:
        job.reduce()
    out = []
    for job in jobs:
        chunk = job.state.get("chunk", 0) if job.spec.kind == "quantized" else 0
        out.append((job.idx, list(job.offsets), chunk, job.finish()))
        stats.wire_bytes += job.wire_bytes
        stats.fp32_bytes += ring_bytes(4 * job.numel, world)
    stats.seconds = time.perf_counter() - start
    return out, stats


def fuse(tensors, specs, fusion_bytes):
    """Group tensor indices by spec (first-seen order), then cut each group into fused buffers."""
    groups: dict[CompressionSpec, list[int]] = {}
    for i, s in enumerate(specs):
        groups.setdefault(s, []).append(i)
    for s, idx in groups.items():
        cur, size = [], 0
        for i in idx:
            n = tensors[i].numel() * 4
            if cur and size + n > fusion_bytes:
                yield s, cur
                cur, size = [], 0
            cur.append(i)
            size += n
        if cur:
            yield s, cur


@dataclass
class _Job:
    """One fused buffer travelling through launch -> reduce -> finish."""

    idx: list[int]
    tensors: list
    spec: CompressionSpec
    group: object
    world: int
    ef: dict | None
    timeout: float | None
    generator: torch.Generator | None
    scale: float = 1.0           # weight * world: the plain average of the scaled tensors is the weighted one
    release: Callable | None = None   # called with each buffer once done (allreduce's ``release``)
    scatter: bool = False             # the reduce-scatter half only (``reduce_scatter``): no all-gather
    workspace: Workspace | None = None  # where buffers come from and go back to (allreduce's ``workspace``)
    words: object = None              # the ranks' words on a step, after the tensors (an fp32 buffer's only)
    wire_bytes: int = 0
    numel: int = 0
    offsets: list = field(default_factory=list)   # where each tensor starts in the fused buffer
    work: object = None
    buf: torch.Tensor | None = None
    state: dict = field(default_factory=dict)

    def launch(self):
        ts = [self.tensors[i] for i in self.idx]
        self.numel = n = sum(t.numel() for t in ts)
        s, w = self.spec, self.world
        # Quantized: each tensor starts on a bucket boundary, so no bucket mixes two tensors' ranges
        # (that is also what adaptive bits measured), and chunks are whole buckets.
        align = s.bucket_size if s.kind == "quantized" else 1
        self.offsets, off = [], 0
        for t in ts:
            self.offsets.append(off)
            off += -(-t.numel() // align) * align
        size = off
        extra = self.words.vector(w, dist.get_rank(self.group)) if self.words is not None else None
        if extra is not None:   # (padded: the ranks' halves of the buffer stay as aligned as without it)
            size += words_pad(w)
        if s.kind == "quantized":
            chunk = -(-off // (w * align)) * align if off >= w * align else -(-off // w)
            self.state["chunk"] = chunk
            size = chunk * w
        self.buf = self._empty(size, torch.float32, ts[0].device)
        ends = self.offsets[1:] + [size if extra is None else off]     # (a quantized buffer: padded to its end)
        if extra is not None:
            self.buf[off:].zero_()
            self.buf[off: off + w].copy_(extra)
            self.state["words_at"] = off
        for i, t, start, end in zip(self.idx, ts, self.offsets, ends):
            piece = self.buf[start: start + t.numel()]
            piece.copy_(t.detach().reshape(-1))
            if self.scale != 1.0:
                piece.mul_(self.scale)
            if s.error_feedback and i in self.ef:
                r = self.ef[i]
                if r.shape != t.shape:
                    raise ConfigError(f"error_feedback_state[{i}] has shape {tuple(r.shape)} but tensor {i} "
                                      f"has shape {tuple(t.shape)}; pass tensors in the same order every call")
                piece.add_(r.reshape(-1))
            if end > start + t.numel():   # pad with the tensor's last value: its last bucket's range is unchanged
                self.buf[start + t.numel(): end] = self.buf[start + t.numel() - 1]
        if s.kind == "none":
            self.wire_bytes = ring_bytes(4 * n, w)
            self.work = launch("all_reduce(fp32)", self.timeout, self.group, dist.all_reduce, self.buf)
        elif s.kind in ("fp16", "bf16"):
            dt = torch.float16 if s.kind == "fp16" else torch.bfloat16
            half = (self.buf / w).to(dt)
            if s.error_feedback:
                self._keep_residual(self.buf - half.float() * w)
            self.state["half"] = half
            self.wire_bytes = ring_bytes(2 * n, w)
            self.work = launch(f"all_reduce({s.kind})", self.timeout, self.group, dist.all_reduce, half)
        else:
            self._launch_quantized()

    def _launch_quantized(self):
        s, w, rank, chunk = self.spec, self.world, dist.get_rank(self.group), self.state["chunk"]
        chunks = self.buf.view(w, chunk)
        wb = wire_bytes(chunk, s.bits, s.bucket_size, s.meta_dtype)
        send = self._empty(w * wb, torch.uint8, self.buf.device)
        residual = torch.zeros_like(self.buf) if s.error_feedback else None
        for j in range(w):
            if j == rank:          # our own chunk stays fp32 on this rank (its slot is not sent)
                continue
            p = self._quantize(chunks[j], send[j * wb: (j + 1) * wb])
            if residual is not None:
                dequantize(p, out=residual[j * chunk: (j + 1) * chunk])
                torch.sub(chunks[j], residual[j * chunk: (j + 1) * chunk], out=residual[j * chunk: (j + 1) * chunk])
        recv = self._empty(w * wb, torch.uint8, self.buf.device)
        self.state.update(wb=wb, recv=recv, send=send, residual=residual, rank=rank)   # keep buffers alive in flight
        self.wire_bytes = 2 * (w - 1) * wb
        self.work = launch("all_to_all_single(quantized)", self.timeout, self.group,
                         dist.all_to_all_single, recv, send)

    def reduce(self):
        if self.spec.kind != "quantized":
            return
        wait_work(self.work, "all_to_all_single(quantized)", self.timeout, self.group)
        s, w, st = self.spec, self.world, self.state
        chunk, wb, rank, recv = st["chunk"], st["wb"], st["rank"], st.pop("recv")
        self._give(st.pop("send"))
        acc = self.buf[rank * chunk: (rank + 1) * chunk]     # reduce in place in our own chunk
        for j in range(w):
            if j != rank:
                dequantize(Packed.from_wire(recv[j * wb: (j + 1) * wb], chunk, s.bits, s.bucket_size, s.meta_dtype),
                           out=acc, accumulate=True)
        self._give(recv)
        acc /= w
        sent = self._empty(wb, torch.uint8, acc.device)
        mine = self._quantize(acc, sent)
        if st["residual"] is not None:   # the owner also keeps what re-quantization lost (x w: it is averaged)
            r = st["residual"][rank * chunk: (rank + 1) * chunk]
            dequantize(mine, out=r)
            torch.sub(acc, r, out=r).mul_(w)
        if self.scatter:        # this rank's chunk, decoded from the bytes the all-gather would send
            dequantize(Packed.from_wire(sent, chunk, s.bits, s.bucket_size, s.meta_dtype), out=acc)
            self.wire_bytes = (w - 1) * wb
            return
        st["gathered"] = self._empty(w * wb, torch.uint8, acc.device)
        st["sent"] = sent
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.work = launch("all_gather(quantized)", self.timeout, self.group, all_gather, st["gathered"], st["sent"])

    def finish(self):
        kind, st = self.spec.kind, self.state
        if self.scatter:
            return self._finish_scatter()
        wait_work(self.work, f"collective({kind})", self.timeout, self.group)
        if kind == "none":
            if self.words is not None:
                at = self.state["words_at"]
                self.words.read(self.buf[at: at + self.world])
            out = self.buf.div_(self.world)
        elif kind in ("fp16", "bf16"):
            out = st["half"].float()
        else:
            s, chunk, wb = self.spec, st["chunk"], st["wb"]
            out = self.buf                 # every rank decodes the same bytes into its own buffer
            for j in range(self.world):
                p = Packed.from_wire(st["gathered"][j * wb: (j + 1) * wb], chunk, s.bits, s.bucket_size, s.meta_dtype)
                dequantize(p, out=out[j * chunk: (j + 1) * chunk])
            if st["residual"] is not None:
                self._keep_residual(st["residual"])
        for i, off in zip(self.idx, self.offsets):
            t = self.tensors[i]
            with torch.no_grad():
                t.copy_(out[off: off + t.numel()].view_as(t))
        if self.release is not None:
            for b in [self.buf, out] + [v for v in self.state.values() if isinstance(v, torch.Tensor)]:
                if b is not None:
                    self.release(b)
        self._give(self.buf)
        if kind == "quantized":
            self._give(st["gathered"])
            self._give(st["sent"])
        self.buf = self.work = out = None
        self.state.clear()

    def _finish_scatter(self) -> torch.Tensor:
        if self.spec.kind == "quantized":
            out = self.buf[self.state["rank"] * self.state["chunk"]: (self.state["rank"] + 1) * self.state["chunk"]]
            if self.state.get("residual") is not None:
                self._keep_residual(self.state["residual"])
        else:
            wait_work(self.work, "all_reduce(fp32)", self.timeout, self.group)
            out = self.buf.div_(self.world)
        self.buf = self.work = None
        self.state.clear()
        return out

    def _empty(self, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        if self.workspace is None:
            return torch.empty(numel, dtype=dtype, device=device)
        return self.workspace.take(numel, dtype, device)

    def _give(self, t: torch.Tensor) -> None:
        """Back to the workspace, once no collective reads or writes ``t`` (the reduce-scatter hands its buffer
        out: it never gives it back)."""
        if self.workspace is not None:
            self.workspace.give(t)

    def _quantize(self, x: torch.Tensor, message: torch.Tensor) -> Packed:
        """Quantize ``x`` straight into wire message ``message`` (levels in place, then mins and scales)."""
        s = self.spec
        p = quantize(x, s.bits, s.bucket_size, s.rounding, self.generator, s.meta_dtype,
                     out=Packed.wire_levels(message, x.numel(), s.bits, s.bucket_size, s.meta_dtype))
        p.write_meta(message)
        return p

    def _keep_residual(self, flat):
        for i, off in zip(self.idx, self.offsets):
            t = self.tensors[i]
            self.ef[i] = flat[off: off + t.numel()].reshape(t.shape).clone()
