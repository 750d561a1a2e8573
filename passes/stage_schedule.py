"""The schedule of one pipeline rank: the single-device order of the policy, restricted to this rank's packs,
with a ``recv`` before the first use of each value another rank makes and a ``send`` after each value another
rank reads (passes/stage.py places the packs; runtime/pipeline.py runs the messages).

Every rank runs the whole model's order (harmony: every pack's forward for microbatches 0..M-1, pack after pack;
the last pack's forward and backward per microbatch; then backward in reverse pack order, each pack's optimizer
step after its last backward) keeping only its packs' ops: its forwards of all microbatches, then its
backwards (GPipe's fill and drain, with Harmony's grouping inside a rank). With ``pipeline_group=G`` the
microbatches go through in groups of G (``global_order``), so a rank with several packs hands a group on to the
next rank after its packs ran that group, not after they ran every microbatch. A send never waits for its receiver,
and every recv comes after its send in that one order, so no rank waits on a rank that waits on it.

A pack's backward adds its consumers' gradients in the order one device would (consumers in pack order, local
ones from their backward, remote ones from a recv of that consumer's message): the same sums, the same bits.
"""
from __future__ import annotations

import torch.fx

from harmony.compiler.ir import Program, emit
from harmony.runtime import ops
from harmony.runtime.pipeline import recv, send, share_loss, share_norms


def global_order(n_packs: int, microbatches: int, policy: str, group: int | None = None,
                 rank_of: list[int] | None = None) -> list[tuple]:
    """The single-device order: ("F", pack, mb), ("FB", last, mb) (kept forward, then backward), ("B", pack, mb),
    ("S", pack) (the optimizer step).

    Under "harmony" the microbatches go through the packs in groups of ``group`` (default all of them: each pack
    is swapped in once per pass, Harmony's grouping): every forward first, then every backward, each pack's step
    after its last group. A smaller group lets the next rank start on a group while this one runs the next (a
    finer pipeline) for more swaps of packs that do not stay resident; each pack still accumulates its
    microbatches in order 0..M-1, the same bits.

    The forwards go as a wavefront over (pipeline position, group): a pack's position is the number of rank
    changes before it along the packs (``rank_of``; none on one device), and pack p's forward of group g comes
    at ``position(p) + g`` (the earlier group first there, then packs in order); the backwards alike from the last
    pack. On one device, and on each rank where a rank's packs are contiguous, that is every group's forwards
    pack after pack, then every group's backwards in reverse pack order. Where a rank's packs are not contiguous
    (``round_robin``), a rank runs its next pack on the first group while the other ranks run the packs between
    (the interleaved pipeline); ordering by group alone made each group go through every pack of the node before
    the next group started anywhere."""
    last, out = n_packs - 1, []
    if policy == "harmony":
        size = group or microbatches
        at = [0] * n_packs
        for p in range(1, n_packs):
            at[p] = at[p - 1] + (rank_of is not None and rank_of[p] != rank_of[p - 1])
        # at one point of the wavefront the earlier group first (it is further along), then packs in order
        forwards = sorted((at[p] + mb // size, mb // size, p, mb) for p in range(n_packs) for mb in range(microbatches))
        out += [("FB" if p == last else "F", p, mb) for _, _, p, mb in forwards]
        out.append(("S", last))
        backwards = sorted((at[last] - at[p] + mb // size, mb // size, -p, mb)
                           for p in range(last) for mb in range(microbatches))
        for _, _, p, mb in backwards:
            out.append(("B", -p, mb))
            if mb == microbatches - 1:
                out.append(("S", -p))
        return out
    for mb in range(microbatches):
        out += [("F", p, mb) for p in range(last)] + [("FB", last, mb)]
        out += [("B", p, mb) for p in reversed(range(last))]
    return out + [("S", p) for p in reversed(range(n_packs))]


class StageBuilder:
    """Emits this rank's ops; values of other ranks' packs come from ``recv`` nodes, each made once."""

    def __init__(self, program: Program):
        self.g = torch.fx.Graph()
        self.plan = program.plan
        st = self.st = self.plan.stage
        self.mine = {g: i for i, g in enumerate(st.local)}
        self.producer = {o: g for g, outs in enumerate(st.outputs) for o in outs}
        self.consumers = [[c for c in range(len(st.inputs)) if any(self.producer.get(n) == g for n in st.inputs[c])]
                          for g in range(len(st.inputs))]
        self.acts: dict = {}       # (global pack, mb) -> node with its outputs (a forward here, or a recv)
        self.grads: dict = {}      # (global pack, mb) -> node with the gradients of its inputs (a backward, or a recv)
        self.n, self.m = len(st.inputs), self.plan.microbatches

    def emit(self, fn, *args, name=None, **kwargs):
        return emit(self.g, fn, *args, name=name, **kwargs)

    def tag(self, grads: bool, pack: int, dst: int, mb: int) -> int:
        """One tag per message: both ends compute it from the same plan."""
        return ((int(grads) * self.n + pack) * self.st.world + dst) * self.m + mb

    def fwd_names(self, g: int, dst: int) -> tuple:
        """The outputs of global pack ``g`` that packs on rank ``dst`` read."""
        readers = [c for c in self.consumers[g] if self.st.rank_of[c] == dst]
        return tuple(o for o in self.st.outputs[g] if any(o in self.st.inputs[c] for c in readers))

    def bwd_names(self, c: int, dst: int) -> tuple:
        """The inputs of global pack ``c`` that packs on rank ``dst`` make (their gradients go back there)."""
        return tuple(n for n in self.st.inputs[c] if n in self.producer and self.st.rank_of[self.producer[n]] == dst)

    def inputs_of(self, g: int, mb: int) -> list:
        st, plan = self.st, self.plan
        batch = tuple(n for n in st.inputs[g] if n in plan.input_names)
        handles = [self.emit(ops.load_batch, mb, batch, name=f"batch{mb}_p{self.mine[g]}")] if batch else []
        for src in dict.fromkeys(self.producer[n] for n in st.inputs[g] if n not in plan.input_names):
            if (src, mb) not in self.acts:       # another rank's pack: its message, received once
                self.acts[(src, mb)] = self.emit(
                    recv, self.mine[g], mb, src=st.rank_of[src], tag=self.tag(False, src, st.rank, mb),
                    names=self.fwd_names(src, st.rank), name=f"recv{src}_{mb}")
            handles.append(self.acts[(src, mb)])
        return handles

    def forward(self, g: int, mb: int, keep: bool):
        p = self.mine[g]
        node = self.emit(ops.forward, p, mb, *self.inputs_of(g, mb), keep=keep, name=f"act{p}_{mb}")
        self.acts[(g, mb)] = node
        for dst in sorted({self.st.rank_of[c] for c in self.consumers[g]} - {self.st.rank}):
            self.emit(send, node, p, mb, dst=dst, tag=self.tag(False, g, dst, mb), names=self.fwd_names(g, dst))
        return node

    def backward(self, g: int, mb: int, kept):
        st, p = self.st, self.mine[g]
        grads = []
        for c in self.consumers[g]:
            if (c, mb) not in self.grads:        # another rank's pack: the gradients its backward sent
                self.grads[(c, mb)] = self.emit(recv, p, mb, src=st.rank_of[c], tag=self.tag(True, c, st.rank, mb),
                                                names=self.bwd_names(c, st.rank), grads=True, name=f"grecv{c}_{mb}")
            grads.append(self.grads[(c, mb)])
        inputs = () if kept is not None else tuple(self.inputs_of(g, mb))
        node = self.emit(ops.backward, p, mb, *inputs, saved=kept, grads=tuple(grads), name=f"grad{p}_{mb}")
        self.grads[(g, mb)] = node
        makers = {st.rank_of[self.producer[n]] for n in st.inputs[g] if n in self.producer}
        for dst in sorted(makers - {st.rank}):
            self.emit(send, node, p, mb, dst=dst, tag=self.tag(True, g, dst, mb), names=self.bwd_names(g, dst),
                      grads=True)
        return node


def lower_stages(program: Program) -> torch.fx.Graph:
    """This rank's schedule graph (see the module's docstring)."""
    b = StageBuilder(program)
    clipping = program.config.clip_grad_norm is not None
    steps = []        # under clipping: after the last backward and the norms' exchange (runtime/pipeline.py)
    tied = [b.mine[g] for g in b.st.local if set(b.plan.packs[b.mine[g]].owned) & set(b.st.tied)]
    late = []         # a pack owning a tied weight: after the last backward, once the sum is in (passes/tied.py)
    for event in global_order(b.n, b.m, program.config.policy, program.config.pipeline_group, b.st.rank_of):
        g = event[1]
        if g not in b.mine:
            continue
        if event[0] == "F":
            b.forward(g, event[2], keep=False)
        elif event[0] == "FB":
            b.backward(g, event[2], b.forward(g, event[2], keep=True))
        elif event[0] == "B":
            b.backward(g, event[2], None)
        elif clipping:
            steps.append(b.mine[g])
        elif b.mine[g] in tied:
            late.append(b.mine[g])
        else:
            b.emit(ops.step, b.mine[g])
    if clipping:
        b.emit(share_norms)
    for p in steps + late:
        b.emit(ops.step, p)
    b.emit(share_loss, b.st.loss_rank, **({} if b.st.weight is None else {"weight": b.st.weight}))
    b.g.output(None)
    return b.g
