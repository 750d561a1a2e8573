"""tied: sum the gradient of a weight tied across pipeline ranks over exactly those ranks, before its copies step.

A weight packs on several ranks use (an embedding shared with the output head, ``tie_word_embeddings=True``) is kept
whole on each of those ranks, with its own optimizer state, as Megatron keeps its embedding group: the stage pass
(passes/stage.py) gives it to this rank's earliest pack using it (``own_tied``: its backward completes the rank's
part of the gradient), makes the process group of each set of such ranks on every rank at compile, and starts the
copies equal (``tie_copies``: the set's first rank's weights, broadcast). This pass then inserts, on each such rank,
one ``allreduce_tied`` per set of ranks, right after the rank's last backward of its weights: it sums the copies'
gradients over the set, asynchronously on the host thread, and a ``wait`` joins it before the owning packs' steps
(and before the norms' exchange under ``clip_grad_norm``, which then sees the sum, counted once). Every copy then
steps from the same summed gradient: the copies stay bitwise equal.

Neither stage blocks the other's backward: the schedule pass puts the steps of a pack that owns a tied weight after
the rank's last backward (passes/stage_schedule.py), so a rank waits for the sum only when no other rank needs
anything more from it (its sends are posted and never wait for their receiver), and every rank of a set reaches its
launch, whatever the others do. A rank's all-reduces over several sets run on its one host thread in one sorted
order on every rank, so two ranks in two sets cannot each wait in the other's. Where the packs' state is swapped or
steps on the host, the all-reduce is synchronous, just before the first step of its weights (the same point of no
further backward). In a grid (``parallel=("pipeline", "data")``) each pipeline sums its copies first, then the
replica all-reduce averages the sums over the replica groups, both on the host thread in that order; a grid whose
packs swap or step on the host is refused for now. Numerics: eager adds the head's and the embedding's
contributions microbatch by microbatch in autograd's order, a pipeline each rank's accumulated part, then the sum:
allclose to eager, not bitwise.
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


def insert(program: Program) -> list[dict]:
    """The all-reduces (and their waits) into ``program.schedule``; a row per set of ranks."""
    plan = program.plan
    st = plan.stage
    graph = program.schedule = copy_graph(program.schedule)
    me = st.job[0]
    owner = {n: s.index for s in plan.packs for n in s.owned if n in st.tied}
    users = {n: {s.index for s in plan.packs if n in s.params} for n in owner}
    sync = not everything_fits(program) or any(plan.at(p).step_on == Tier.HOST for p in set(owner.values()))
    if sync and st.grid is not None:
        # the replica all-reduce of a host-stepped pack reduces the gradients the swap pass sends to the host, which
        # the tied sum would have to follow there: not built yet
        raise ConfigError(f"parallel=('pipeline', 'data') with {', '.join(sorted(owner))} tied across stages needs "
                          f"this rank's packs' training state to fit its memory_budget (here it is swapped or "
                          f"stepped on the host): give a larger memory_budget, untie the weight (GPTConfig(tie=False), "
                          f"tie_word_embeddings=False), or use parallel='pipeline'")
    rows, prev = [], None
    for ranks, names in st.tied_sets().items():
        if me not in ranks:
            continue
        mine = [n for n in names if n in owner]
        nodes = calls(graph)
        order = {n: i for i, n in enumerate(nodes)}
        packs = {p for n in mine for p in users[n]}
        last = max((n for n in nodes if ops.op_of(n).runs_backward and n.args[0] in packs), key=order.get)
        steps = [n for n in nodes if ops.op_of(n).steps and n.args[0] in {owner[m] for m in mine}]
        # the sum is in before the first of its weights' steps, and before the norms' exchange under clipping
        join = min(steps + [n for n in nodes if n.target is share_norms], key=order.get)
        kw = dict(names=tuple(mine), ranks=ranks)
        if sync:      # there (after the rank's last backward), in the sets' order
            node = _emit(graph, join, allreduce_tied, (owner[mine[0]],), dict(kw, sync=True),
                         f"tied_ar{len(rows)}", before=True)
        else:
            anchor = last if prev is None or order[last] > order[prev] else prev
            node = _emit(graph, anchor, allreduce_tied, (owner[mine[0]],), kw, f"tied_ar{len(rows)}")
            _emit(graph, join, ops.wait, (node,), {}, f"join_tied{len(rows)}", before=True)
        prev = node
        size = sum(st.tied_bytes[n] for n in mine)
        rows.append(dict(ranks=",".join(map(str, ranks)), weights=",".join(mine), MiB=size / 2**20,
                         wire_MiB=ring_bytes(size, len(ranks)) / 2**20, pack=owner[mine[0]],
                         overlap="synchronous, before the step" if sync else
                         "host thread from the last backward, joined before the step"))
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
