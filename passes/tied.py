"""tied: sum the gradient of a weight tied across pipeline ranks over exactly those ranks, before its copies step.

A weight packs on several ranks use (an embedding shared with the output head, ``tie_word_embeddings=True``) is kept
whole on each of those ranks, with its own optimizer state, as Megatron keeps its embedding group: the stage pass
(passes/stage.py) gives it to this rank's earliest pack using it (``own_tied``: its backward completes the rank's
part of the gradient), makes the process group of each set of such ranks on every rank at compile, and starts the
copies equal (``tie_copies``: the set's first rank's weights, broadcast). This pass then inserts, on each such rank,
one ``allreduce_tied`` per set of ranks: it sums the copies' gradients over the set, and it is in before the owning
packs' steps (and before the norms' exchange under ``clip_grad_norm``, which then sees the sum, counted once). Every
copy then steps from the same summed gradient: the copies stay bitwise equal.

Where it runs follows the gradient (``_mode``): every state resident, on the host thread, joined by a ``wait``
before the step; the owning packs stepped on the host, on the host thread on the host copies the swap pass sent
there, ahead of the host step queued behind it (nothing brings them back to the device); swapped but stepped on the
device, synchronously before the step, on the gradients brought back for it.

Neither stage blocks the other's backward: the schedule pass puts the steps of a pack that owns a tied weight after
the rank's last backward (passes/stage_schedule.py), and the sum starts only after the rank's last backward, its last
send and its replica all-reduces, so it waits for its peers only when no other rank needs anything more from it and
nothing a peer waits for is queued behind it on the host thread. A rank's all-reduces over several sets run on its
one host thread in one sorted order on every rank, so two ranks in two sets cannot each wait in the other's.

In a grid (``parallel=("pipeline", "data")``) every rank, whatever its residency, averages its copy's gradient over
its replica group first (the compress pass's all-reduce, compressed as ``compression=`` says) and then sums the
stages' averages in fp32: the sum of two averages each decoded alike on its replicas, so under 4-bit gradients too
every copy in every pipeline steps from the same bits. (The other order, each pipeline's sum then the replica
average, gives each stage its own quantization of the sum: the copies of one pipeline drift apart.) The two run on
the same host thread, in that order. When the sum once went to the device (brought back by the swap pass for it)
while the host thread still averaged the host copies in place, the copy raced the average: the order is now the
host thread's alone.

Under ``shard_state="full"`` (ZeRO-3 over each stage's replica group) the order stays: each stage's reduce-scatter
averages its copy's gradient over its replicas, and the tied sum adds the stages' averaged chunks. The chunks line up
because the tied weight is its own all-reduce group (``tied_apart``: the compress pass's ``plan.comm_groups``), so its
own buffer (runtime/partitioned/layout.py), cut the same on every stage (the same tensor, the same replica count,
codec and state shares), whatever else each stage's pack holds: rank r of every stage holds the same elements of it
(``share:tok.weight[a:b]``), and the sum over the ranks of a pipeline adds chunk to chunk, on the host thread behind
the reduce-scatter and ahead of the host step (runtime/ops/reduce.py takes the pieces this rank holds of the weights
it is given). It is the replicated grid's arithmetic element for element (the replica average first, then the fp32
sum), with 1/R of its bytes; summing the stages first and reduce-scattering the sum would need the stages' buffers cut
alike anyway, and give another order than the replicated grid's (and, under quantized gradients, each stage its own
quantization of the sum). ``clip_grad_norm`` is refused there: the reduce-scatter takes each gradient's norm from the
stage's average, before the tied sum. Numerics: eager adds the head's and the embedding's contributions microbatch by
microbatch in autograd's order, a pipeline each rank's accumulated part, then the sum: allclose to eager, not bitwise
(bitwise to an eager run that keeps the two contributions apart until the end: tests/test_hybrid_tied.py,
tests/test_hybrid_zero3_tied.py).
"""
from __future__ import annotations

import time

from harmony.base.errors import ConfigError
from harmony.base.tiers import Tier
from harmony.base.units import nbytes
from harmony.compiler.ir import PassReport, PassResult, Program, add_call, calls, copy_graph
from harmony.compiler.meta import SCHEDULE
from harmony.passes.broadcast import broadcast_state
from harmony.passes.offload import everything_fits
from harmony.passes.partition import count_state
from harmony.runtime import ops
from harmony.runtime.comm.collectives import ring_bytes
from harmony.runtime.comm.tied import group_of, make_groups
from harmony.runtime.ops.reduce import allreduce_tied
from harmony.runtime.pipeline import share_norms

NAME = "tied"
REQUIRES = {"schedule", "placement"}
PROVIDES = {"tied"}


# -- at the stage pass ---------------------------------------------------------------------------
def own_tied(program: Program) -> None:
    """Each tied weight owned (its gradient complete, stepped) by this rank's earliest pack that uses it."""
    plan = program.plan
    st = plan.stage
    for n in st.tied:
        users = [s for s in plan.packs if n in s.params]
        for s in plan.packs:
            if n in s.owned:
                s.owned = [m for m in s.owned if m != n]
        if users:
            users[0].owned = users[0].owned + [n]
    params = dict(program.gm.named_parameters())
    st.tied_bytes = {n: nbytes(params[n]) for n in st.tied}
    count_state(program)


def tied_apart(owned: dict, tied, partitioned: bool) -> dict[int, list[list[str]]]:
    """A grid's all-reduce groups (``plan.comm_groups``): each pack's gradients (``owned``: pack -> [(name, tensor)])
    one group; ``partitioned`` (``shard_state="full"``), each weight tied across stages one of its own, last, so
    that its chunks are cut alike on every stage (the module's docstring). The replicated grid keeps one group a
    pack: its replica all-reduce meets once per group (runtime/comm/jobwide.py), and a rank whose step failed
    replays those meets only after the pipeline's messages, which the other stage's rank may wait for first."""
    out = {}
    for p, named in owned.items():
        names = [n for n, _ in named]
        apart = [n for n in names if n in tied] if partitioned else []
        out[p] = [g for g in [[n for n in names if n not in apart]] + [[n] for n in apart] if g]
    return out


def all_sets(st) -> list[tuple]:
    """The tied sets of job ranks of every pipeline of the job (one in a pipeline alone)."""
    sets = [tuple(sorted(ranks)) for ranks in {tuple(st.tied[n]) for n in st.tied}]
    if st.grid is None:
        return sorted(sets)
    return sorted(tuple(st.grid.pipeline_ranks(r)[s] for s in ranks) for r in range(st.grid.replicas)
                  for ranks in sets)


def tie_copies(program: Program, live: bool) -> list[str]:
    """Make every tied set's process group (on every rank: a collective call) and start this rank's copies from its
    sets' first ranks' weights; the report's notes on what is tied where."""
    st = program.plan.stage
    if not st.tied:
        return []
    sets = st.tied_sets()
    sent = 0
    if live:
        make_groups(all_sets(st), program.config.comm_timeout)
        me = st.job[0]
        for ranks, names in sets.items():
            if me in ranks:
                sent += broadcast_state(program, set(names), src=ranks[0], group=group_of(ranks))
    notes = []
    for ranks, names in sets.items():
        size = sum(st.tied_bytes[n] for n in names)
        notes.append(f"{', '.join(names)} tied across ranks {_and(ranks)} ({size / 2**20:.3f} MiB): "
                     f"each of those ranks keeps a copy and its optimizer state, and sums the copies' gradients "
                     f"over them once a step before stepping (an fp32 all-reduce: "
                     f"{ring_bytes(size, len(ranks)) / 2**20:.3f} MiB sent per rank per step)")
    if live and sent:
        notes.append(f"the tied copies started from their first rank's weights ({sent / 2**20:.3f} MiB broadcast)")
    return notes


def _and(ranks) -> str:
    return " and ".join([", ".join(map(str, ranks[:-1])), str(ranks[-1])])


# -- the pass --------------------------------------------------------------------------------------
def _emit(graph, anchor, fn, args, kwargs, name, before=False):
    with graph.inserting_before(anchor) if before else graph.inserting_after(anchor):
        node = add_call(graph, fn, args, kwargs)
    node._rename(name)
    node.meta[SCHEDULE] = {"pack": args[0] if args and isinstance(args[0], int) else None}
    return node


def _before_sum(node) -> bool:
    """Whether ``node`` goes before a tied sum: a backward, a send to a peer, a replica all-reduce."""
    op = ops.op_of(node)
    return op.runs_backward or op.sends or (op.reduces and node.target is not allreduce_tied)


def _mode(program: Program, owners: set[int], nodes) -> str:
    """How a set's sum runs on this rank: ``"async"`` (every state resident and the replica all-reduces, if any, on
    the host thread too: there, joined before the step), ``"host"`` (the owning packs step on the host: on the host
    thread, on the gradients the swap pass sent there, ahead of the host step) or ``"sync"`` (the state swaps but
    steps on the device: there, before the step, on the gradients brought back for it)."""
    plan = program.plan
    if all(plan.at(p).step_on == Tier.HOST for p in owners):
        return "host"
    # synchronous replica all-reduces: the compress pass found the state does not fit beside theirs in flight
    if any(ops.op_of(n).reduces and n.kwargs.get("sync") for n in nodes) or not everything_fits(program):
        return "sync"
    return "async"


_OVERLAP = {"async": "host thread from the last backward, joined before the step",
            "host": "host thread, on the host copies, before the host step",
            "sync": "synchronous, before the step"}


def insert(program: Program) -> list[dict]:
    """The all-reduces (and their waits) into ``program.schedule``; a row per set of ranks.

    In a grid each owning pack's replica all-reduce (the compress pass's ``allreduce``, after its last backward) comes
    first and the tied sum after it, on the same host thread, on every rank whatever its residency: the sum adds the
    stages' averages, each decoded alike on every replica (see the module's docstring)."""
    plan = program.plan
    st = plan.stage
    graph = program.schedule = copy_graph(program.schedule)
    me = st.job[0]
    cfg = program.config
    if st.grid is not None and cfg.shard_state == "full" and cfg.clip_grad_norm is not None:   # (st.tied: the job's)
        raise ConfigError(f"parallel=('pipeline', 'data') with shard_state='full', clip_grad_norm= and "
                          f"{', '.join(sorted(st.tied))} tied across stages is not supported yet: each stage's "
                          f"reduce-scatter takes the tied gradient's norm before the stages' sum. Use "
                          f"shard_state=True (ZeRO-1) or shard_state=False with clipping, or untie the weight "
                          f"(GPTConfig(tie=False), tie_word_embeddings=False)")
    owner = {n: s.index for s in plan.packs for n in s.owned if n in st.tied}
    rows, prev = [], None
    for ranks, names in st.tied_sets().items():
        if me not in ranks:
            continue
        mine = [n for n in names if n in owner]
        owners = {owner[m] for m in mine}
        nodes = calls(graph)
        mode = _mode(program, owners, nodes)
        order = {n: i for i, n in enumerate(nodes)}
        steps = [n for n in nodes if ops.op_of(n).steps and n.args[0] in owners]
        # the sum is in before the first of its weights' steps, and before the norms' exchange under clipping
        join = min(steps + [n for n in nodes if n.target is share_norms], key=order.get)
        # and it starts once this rank has nothing more to give: after its last backward, its last send and its
        # replica all-reduces, so nothing a peer waits for queues behind it on the host thread
        last = max((n for n in nodes if _before_sum(n)), key=order.get)
        if order[last] > order[join]:
            raise ConfigError(f"the tied sum of {', '.join(mine)} would come after their step in this rank's "
                              f"schedule (a plan the stage pass should not make): report it with the model")
        kw = dict(names=tuple(mine), ranks=ranks)
        name = f"tied_ar{len(rows)}"
        if mode == "host":      # behind the replica all-reduce on the host thread, ahead of the host step
            node = _emit(graph, join, allreduce_tied, (owner[mine[0]],), dict(kw, where=Tier.HOST.value), name,
                         before=True)
        elif mode == "sync":    # there (after the rank's last backward), in the sets' order
            node = _emit(graph, join, allreduce_tied, (owner[mine[0]],), dict(kw, sync=True), name, before=True)
        else:
            anchor = last if prev is None or order[last] > order[prev] else prev
            node = _emit(graph, anchor, allreduce_tied, (owner[mine[0]],), kw, name)
            _emit(graph, join, ops.wait, (node,), {}, f"join_tied{len(rows)}", before=True)
        prev = node
        size = sum(st.tied_bytes[n] for n in mine)
        rows.append(dict(ranks=",".join(map(str, ranks)), weights=",".join(mine), MiB=size / 2**20,
                         wire_MiB=ring_bytes(size, len(ranks)) / 2**20, pack=owner[mine[0]], overlap=_OVERLAP[mode]))
    return rows


def run(program: Program, ctx) -> PassResult:
    start = time.perf_counter()
    st = getattr(program.plan, "stage", None)
    report = PassReport("tied: gradients of weights tied across pipeline ranks")
    rows = insert(program) if st is not None and st.tied else []
    report.rows = rows
    report.totals = dict(sets=len(rows), wire_bytes_per_step=round(sum(r["wire_MiB"] for r in rows) * 2**20),
                         seconds=time.perf_counter() - start)
    if not rows:
        report.notes.append("no weight of this rank's packs is used on another rank: nothing inserted")
    else:
        report.notes.append("each tied weight's copies sum their gradients over the ranks holding them before "
                            "stepping, so every copy takes the same update (allclose to eager, not bitwise: the "
                            "contributions add in another order than autograd's)")
    return PassResult(program, report)
