"""A runtime's data-parallel state, behind the ``allreduce`` op (``runtime/ops/``): the compression
spec, adaptive bits chosen after a warm-up, error-feedback residuals, and what was sent.
"""
from __future__ import annotations

import threading
import weakref

import torch
import torch.distributed as dist

from harmony.runtime.comm.adaptive_bits import ErrorMeter, choose_bits_across_ranks, specs_for_bits
from harmony.runtime.comm.collectives import allreduce as reduce_all
from harmony.runtime.comm.compression import NO_COMPRESSION, CompressionSpec, spec_for
from harmony.runtime.comm.jobwide import STEP_KEY, Words


class Communicator:
    """One runtime's data-parallel state: compression, adaptive bits, error feedback, measured totals.

    Every all-reduce runs on the state's one host thread (``TieredState.host_pool``), in
    schedule order, so every rank issues the same collectives in the same order; a host
    optimizer step queued behind a pack's all-reduce on that thread sees averaged gradients.
    """

    def __init__(self, first: int | None, kind, world, min_size, warmup, spec, weight=None, key=STEP_KEY,
                 group=None):
        self.base = CompressionSpec(kind, **spec)
        self.key, self.group = key, group                # the meets' key and the ranks' group (``scope``)
        self.world, self.min_size, self.warmup, self.weight = world, min_size, warmup, weight
        self.first = first                               # the pack whose all-reduce comes first in a step
        self.step = -1                                   # steps begun (the first pack's all-reduce begins one)
        self.meter = ErrorMeter(bucket_size=self.base.bucket_size, rounding=self.base.rounding) if warmup else None
        self.bits: dict | None = None
        self.bits_report: dict | None = None
        self.ef: dict = {}                               # communication group -> error-feedback residuals
        self.owned: dict = {}                            # pack -> its communication groups (lists of names)
        self.generator = torch.Generator().manual_seed(0x5EED + dist.get_rank())   # never the global RNG
        self.lock = threading.Lock()
        self.totals: dict = {}
        self.began = None                                # (step, generator state, residuals) as the step began

    def reduce(self, rt, pack: int, meet: bool = True) -> None:
        """Average the pack's owned gradients over ranks, in place (runs on the host thread).

        One collective per communication group of the pack (``Plan.comm_groups``, set by the
        compress pass): groups are the same on every rank even where ranks cut the model into
        different packs, so every rank issues the same collectives over the same tensors. Each starts with the
        ranks' word on the step (runtime/comm/jobwide.py; ``meet=False``: the caller's op met already).
        """
        groups = self.owned.get(pack)
        if groups is None:
            groups = self.owned[pack] = comm_groups(rt, pack)
        if pack == self.first:
            self.step += 1
            self.began = self.step, self.generator.get_state(), dict(self.ef)    # what an aborted step undoes
        status = rt.status if meet else None
        for names in groups:
            words = None
            if status is not None and self.rides():     # the words ride at the end of the buffer
                words = Words(status, STEP_KEY, None)
            elif status is not None:
                status.go(self.key, self.group, f"the all-reduce of pack {pack}'s gradients")
            self._reduce(rt, names, words)
            if words is not None:
                words.settle(raises=True)

    def reduce_names(self, rt, names: list[str], words=None) -> None:
        """The gradients of ``names`` over the ranks, in place, as one communication group (a weight tied across
        pipeline ranks, runtime/comm/tied.py); ``words``: the step's, made by the caller."""
        self._reduce(rt, names, words)

    def rides(self) -> bool:
        """Whether the ranks' words on a step ride on each all-reduce (fp32, no adaptive bits: a replay sends the same
        collectives on zeros), else a meet comes first; the same on every rank."""
        return self.meter is None and self.base.kind == "none" and self.group is None   # a grid's replica group meets

    def undo_step(self) -> None:
        """A step every rank rolled back: its count, stochastic rounding's draws and error feedback as before it."""
        if self.began is not None:
            self.step, state, ef = self.began
            self.generator.set_state(state)
            self.ef.clear()
            self.ef.update(ef)
            self.began = None

    def _reduce(self, rt, owned: list[str], words=None) -> None:
        st = rt.state
        found = [(n, st.grad(n)) for n in owned]
        names, grads = [n for n, g in found if g is not None], [g for _, g in found if g is not None]
        # mixed precision: the gradients reach the host in the compute dtype (parked beside the fp32 masters); they
        # are averaged as fp32 copies, which become the masters' gradients (what the step converts them to anyway)
        mixed = [i for i, g in enumerate(grads) if g.dtype != torch.float32]
        for i in mixed:
            grads[i] = grads[i].float()
        specs = self.base
        if self.meter is not None:
            if self.step < self.warmup:                  # warm-up: measure on real gradients, send fp32
                self.meter.update({n: g for n, g in zip(names, grads)
                                   if spec_for(g, self.base, self.min_size).kind == "quantized"})
                specs = NO_COMPRESSION
            else:
                if self.bits is None:                    # once, on every rank at the same point
                    self.bits, self.bits_report = choose_bits_across_ranks(     # a grid: the stage's replicas
                        self.meter.errors(), self.meter.sizes, self.base.bits, group=self.group,
                        bucket_size=self.base.bucket_size, meta_dtype=self.base.meta_dtype)
                specs = specs_for_bits(names, self.bits, self.base)
        ef = self.ef.setdefault(tuple(owned), {}) if self.base.error_feedback else None
        stats = reduce_all(grads, specs, error_feedback_state=ef, min_size=self.min_size, generator=self.generator,
                           weight=self.weight, release=rt.meter.forget, words=words, group=self.group)
        for i in mixed:
            st.set_grad(names[i], grads[i])
        with self.lock:
            t = self.totals
            for k in ("wire_bytes", "fp32_bytes", "seconds", "calls"):
                t[k] = t.get(k, 0) + getattr(stats, k)

    def pop(self) -> dict:
        with self.lock:
            out, self.totals = dict(self.totals), {}
        for k in ("wire_bytes", "fp32_bytes", "seconds", "calls"):
            out.setdefault(k, 0)
        if self.bits_report is not None:
            out["bits"] = self.bits_report
        return out


def comm_groups(rt, pack: int) -> list[list[str]]:
    """The pack's communication groups: the compress pass's, else its owned gradients as one."""
    groups = getattr(rt.plan, "comm_groups", {}).get(pack)
    if groups is None:   # the state's order (the model's), the same on every rank; a pack's own lists
        mine = set(rt.plan.packs[pack].owned)               # come from sets, whose order varies by process
        groups = [[n for n in rt.state.tensors if n in mine]]
    return groups


_COMMS = weakref.WeakKeyDictionary()   # Runtime -> its Communicator, made by its first all-reduce


def communicator(rt, op, kind, world, min_size, warmup, spec, weight=None) -> Communicator:
    """The runtime's ``Communicator``, made at its first all-reduce: a step begins at the first ``op`` of the
    runtime's schedule (the op that averages gradients through it: ``allreduce``, or under ``shard_state="full"``
    ``reduce_scatter``), looked up once, here."""
    comm = _COMMS.get(rt)
    if comm is None:
        first = next((n.args[0] for n in rt.graph.nodes if n.op == "call_function" and n.target is op), None)
        key, group = scope(rt)
        comm = _COMMS[rt] = Communicator(first, kind, world, min_size, warmup, spec, weight, key, group)
    return comm


REPLICA_KEY = "replica group"      # the meets of a grid's gradient all-reduces (runtime/comm/jobwide.py ``done``)


def scope(rt) -> tuple:
    """(meet key, process group) of the runtime's gradient all-reduces: the default group's; in a grid
    (``parallel=("pipeline", "data")``) this rank's replica group, the ranks that hold the same packs."""
    grid = getattr(getattr(rt.plan, "stage", None), "grid", None)
    if grid is None:
        return STEP_KEY, None
    from harmony.runtime.comm.grid import replica_group
    return REPLICA_KEY, replica_group(grid)


def existing(rt) -> Communicator | None:
    """The runtime's ``Communicator`` if its first all-reduce has made it."""
    return _COMMS.get(rt)


def comm_stats(rt) -> dict | None:
    """What the runtime's all-reduces sent and took since the last call (None: it has none)."""
    comm = _COMMS.get(rt)
    return comm.pop() if comm is not None else None
