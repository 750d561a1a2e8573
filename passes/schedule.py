"""schedule: lower the packs to a schedule graph of runtime ops, in the order a policy dictates.

``harmony``: every microbatch runs through a pack before the next pack starts, so a
pack's weights are needed once per phase; backward runs in reverse pack order,
recomputing each pack from its stashed inputs; the last pack runs forward and
backward per microbatch without recompute; each pack's optimizer step follows its
backward at once, while its gradients are still on the device (with ``clip_grad_norm``, after the last
backward: the global norm needs every gradient).

``sequential`` and ``ondemand``: forward then backward of one microbatch at a time
(gradient accumulation), the optimizer steps after the last microbatch. This is the
order a virtualized-memory system sees; ``ondemand`` leaves all movement to the runtime.

No data movement is planned here: the swap pass inserts it.
"""
from __future__ import annotations

import time

import torch.fx

from harmony.base.errors import ConfigError
from harmony.compiler.config import POLICIES
from harmony.compiler.ir import PassReport, PassResult, Program, emit
from harmony.passes.stage_schedule import lower_stages
from harmony.runtime import ops

NAME = "schedule"
REQUIRES = {"packs"}
PROVIDES = {"schedule"}


class Builder:
    """Emits ops into a graph and tracks which value holds each pack's inputs per microbatch."""

    def __init__(self, program: Program):
        self.g = torch.fx.Graph()
        self.plan = program.plan
        self.producer = {}           # value name -> pack producing it
        for spec in self.plan.packs:
            for o in spec.outputs:
                self.producer[o] = spec.index
        self.readers: dict = {}      # value name -> the packs that read it (a value, not a batch tensor)
        for spec in self.plan.packs:
            for n in spec.inputs:
                if n in self.producer:
                    self.readers.setdefault(n, []).append(spec.index)
        self.acts = {}               # (pack, mb) -> node holding the pack's outputs
        self.grads = {}              # (pack, mb) -> node holding grads of the pack's inputs

    def emit(self, fn, *args, name=None, **kwargs):
        return emit(self.g, fn, *args, name=name, **kwargs)

    def inputs_of(self, p: int, mb: int):
        """The values a pack reads: batch tensors (loaded here) and earlier packs' outputs."""
        spec = self.plan.packs[p]
        batch = tuple(n for n in spec.inputs if n in self.plan.input_names)
        handles = []
        if batch:
            handles.append(self.emit(ops.load_batch, mb, batch, name=f"batch{mb}_p{p}"))
        for src in dict.fromkeys(self.producer[n] for n in spec.inputs if n not in self.plan.input_names):
            handles.append(self.acts[(src, mb)])
        return handles

    def forward(self, p: int, mb: int, keep: bool):
        node = self.emit(ops.forward, p, mb, *self.inputs_of(p, mb), keep=keep, name=f"act{p}_{mb}")
        self.acts[(p, mb)] = node
        return node

    def backward(self, p: int, mb: int, kept):
        consumers = [s.index for s in self.plan.packs
                     if any(self.producer.get(n) == p for n in s.inputs)]
        grads = tuple(self.grads[(c, mb)] for c in consumers if (c, mb) in self.grads)
        inputs = () if kept is not None else tuple(self.inputs_of(p, mb))
        node = self.emit(ops.backward, p, mb, *inputs, saved=kept, grads=grads, name=f"grad{p}_{mb}",
                         **self.folds(p, mb))
        self.grads[(p, mb)] = node
        return node

    def folds(self, p: int, mb: int) -> dict:
        """A value that several packs read gets its gradient summed as eager's backward sums it: one contribution
        at a time, the last reader's first. So each reader's backward starts from the sum the reader after it
        left (``chain``: the value's name and that reader's backward, None for the last reader), and the
        producer's backward takes the first reader's sum whole (``totals``), not the readers' sums added up."""
        spec = self.plan.packs[p]
        chain = []
        for n in spec.inputs:
            readers = self.readers.get(n, ())
            if len(readers) > 1:
                later = [c for c in readers if c > p and (c, mb) in self.grads]
                chain.append((n, self.grads[(min(later), mb)] if later else None))
        totals = tuple(o for o in spec.outputs if len(self.readers.get(o, ())) > 1)
        return {**({"chain": tuple(chain)} if chain else {}), **({"totals": totals} if totals else {})}


def lower(program: Program) -> torch.fx.Graph:
    if program.plan.stage is not None:     # one rank of a pipeline: its packs, and messages to the others
        return lower_stages(program)
    b = Builder(program)
    n_packs, m = len(program.plan.packs), program.plan.microbatches
    last = n_packs - 1
    # clipping by the global norm: no update may start before the last gradient exists, so under harmony too
    # every step follows the last backward (the host steps would wait for it anyway, as fp16's do)
    steps_at_end = program.config.clip_grad_norm is not None
    if program.config.policy == "harmony":
        for p in range(last):
            for mb in range(m):
                b.forward(p, mb, keep=False)
        for mb in range(m):
            b.backward(last, mb, b.forward(last, mb, keep=True))
        if not steps_at_end:
            b.emit(ops.step, last)
        for p in reversed(range(last)):
            for mb in range(m):
                b.backward(p, mb, None)
            if not steps_at_end:
                b.emit(ops.step, p)
        for p in reversed(range(n_packs)) if steps_at_end else ():
            b.emit(ops.step, p)
    else:
        for mb in range(m):
            for p in range(last):
                b.forward(p, mb, keep=False)
            b.backward(last, mb, b.forward(last, mb, keep=True))
            for p in reversed(range(last)):
                b.backward(p, mb, None)
        for p in reversed(range(n_packs)):
            b.emit(ops.step, p)
    b.g.output(None)
    return b.g


def run(program: Program, ctx) -> PassResult:
    start = time.perf_counter()
    if program.config.policy not in POLICIES:
        raise ConfigError(f"unknown policy {program.config.policy!r}; choose one of {', '.join(POLICIES)}")
    program.schedule = lower(program)
    counts = {}
    for n in program.schedule.nodes:
        if n.op == "call_function":
            counts[n.target.__name__] = counts.get(n.target.__name__, 0) + 1
    report = PassReport(f"schedule: policy {program.config.policy}",
                        [dict(op=k, count=v) for k, v in counts.items()],
                        totals=dict(ops=sum(counts.values()), seconds=time.perf_counter() - start))
    clip = program.config.clip_grad_norm
    if clip is not None:
        report.notes.append(
            f"clip_grad_norm={clip:g} (norm type {program.config.clip_norm_type:g}): every pack steps after the last "
            f"backward, once the global norm is known" + (
                "; under harmony a pack's step would otherwise follow its own backward, so the device steps lose "
                "that overlap and the host holds every pack's gradients until then (offload's host bytes count them)"
                if program.config.policy == "harmony" else ""))
    return PassResult(program, report)
