"""The schedule-graph edits the swap pass is made of: swap ops around each visit of a pack, stashes of
activations, graphs kept for the backward, weights held between visits, steps moved to the device,
and ``build``, which applies a whole choice of them to a copy of the unswapped schedule.

Each function edits the graph it is given in place (``build`` copies first); ``passes/swap.py``
decides what to keep, these say how the schedule then reads.
"""
from __future__ import annotations

from typing import NamedTuple

import torch.fx

from harmony.base.tiers import Tier
from harmony.compiler.ir import add_call, calls, copy_graph
from harmony.compiler.meta import SCHEDULE
from harmony.runtime import ops
from harmony.runtime.plan import step_extra


def computes(node) -> bool:
    """Whether ``node`` is a compute op (forward, backward, step): where a memory curve's peaks are read."""
    return ops.op_of(node).kind == "compute"


class Choice(NamedTuple):
    """What the swap pass keeps: the state of its searches, and the arguments of ``build``."""
    resident: set            # (pack, kind) left on the device for the whole run
    stashed: set             # activation groups sent to the host between forward and backward
    kept: frozenset = frozenset()     # packs whose forward's graph is kept (no recompute)
    held: frozenset = frozenset()     # host-stepped packs whose weights stay between visits of an iteration
    device: frozenset = frozenset()   # host-stepped packs moved to a device step, all their state resident
    parts: frozenset = frozenset()    # (pack, param): single weights held between visits, where the whole pack's
                                      # are not
    steps: frozenset = frozenset()    # (pack, param): single parameters of host-stepped packs stepped on the device
    carried: frozenset = frozenset()  # wholly-disk packs whose stepped weights stay for the next iteration's forward
    optim: frozenset = frozenset()    # (pack, param): single parameters' optimizer state kept on the device, where
                                      # the whole pack's is not
    offloaded: frozenset = frozenset()    # kept packs whose graph waits for the backward on the host, not the device
    early: frozenset = frozenset()    # stashed activation groups sent to the host as soon as they are made, not
                                      # after their first use (``stash_value``'s ``early``)


def place(plan, chosen: Choice, sizes: dict, profile: dict) -> None:
    """Write ``chosen`` into the packs' residency records (``plan.residency``): what each keeps on the device,
    holds between visits or carries across steps, and its single parameters kept, held or stepped there.
    ``sizes``: (kind, name) -> bytes (``state_sizes``); ``profile``: the optimizer's (``optimizer_profile``)."""
    kinds, held, kept, steps = ({p: [] for p in plan.residency} for _ in range(4))
    for pack, kind in chosen.resident:
        kinds[pack].append(kind)
    for table, pairs in ((held, chosen.parts), (kept, chosen.optim), (steps, chosen.steps)):
        for pack, name in sorted(pairs):
            table[pack].append(name)
    for pack, record in plan.residency.items():
        record.kept = frozenset(kinds[pack])
        record.held, record.carried = pack in chosen.held, pack in chosen.carried
        record.params_held = {n: sizes[("params", n)] for n in held[pack]}
        record.optim_kept = {n: sizes[("optim", n)] for n in kept[pack]}
        record.device_parts = {n: step_extra(profile, [sizes[("params", n)]]) for n in steps[pack]}
        record.device_part_bytes = {n: sizes[("params", n)] for n in steps[pack]}   # fp32: the device step needs it


def _visits(graph):
    """Runs of consecutive compute ops on the same pack: (pack, first node, last node, kinds needed)."""
    out, cur = [], None
    for n in calls(graph):
        need = ops.op_of(n).needs(n.kwargs)      # (a step on the host copies needs nothing on the device)
        if not need:
            continue
        p = n.args[0]
        if cur and cur[0] == p:
            cur[2] = n
            cur[3].update(need)
        else:
            cur = [p, n, n, set(need)]
            out.append(cur)
    return out


def insert_swaps(graph: torch.fx.Graph, resident: set) -> None:
    """Swap ops around each visit; a step whose optimizer state is not resident streams it in and out."""
    for p, first, last, kinds in _visits(graph):
        for kind in ("params", "grads"):
            if kind not in kinds or (p, kind) in resident:
                continue
            with graph.inserting_before(first):
                h = add_call(graph, ops.swap_in, (p, kind))
                h.name = graph._graph_namespace.create_name(f"{kind}{p}", h)
                w = add_call(graph, ops.wait, (h,))
            with graph.inserting_after(last):
                r = add_call(graph, ops.release, (p, kind))
            for x in (h, w, r):
                x.meta[SCHEDULE] = {"pack": p, "kind": kind}
    mark_streams(graph, resident)


def releases_before_step(graph: torch.fx.Graph, where: Tier, kinds=("grads", "params")) -> dict[int, list]:
    """pack -> its releases of ``kinds`` that its step (``where=``) follows with no compute between."""
    last_release: dict = {}
    out = {}
    for n in calls(graph):
        op = ops.op_of(n)
        if op.releases and n.args[1] in kinds:
            last_release.setdefault(n.args[0], []).append(n)
        elif op.runs_forward or op.runs_backward:    # compute in between: they go to the host as usual
            last_release.clear()
        elif op.steps and n.kwargs.get("where") == where and n.args[0] in last_release:
            out[n.args[0]] = last_release.pop(n.args[0])
    return out


def mark_streams(graph: torch.fx.Graph, resident: set) -> None:
    # a disk step right after its pack's releases takes gradients and weights from the device
    for releases in releases_before_step(graph, Tier.DISK).values():
        for r in releases:
            r.kwargs = {**r.kwargs, "handoff": True}
    for n in calls(graph):
        if ops.op_of(n).steps and n.kwargs.get("where") not in (Tier.HOST, Tier.DISK):
            n.kwargs = {**n.kwargs, "stream": (n.args[0], "optim") not in resident}


def stash_value(graph: torch.fx.Graph, value: torch.fx.Node, order: dict | None = None,
                early: bool = False) -> bool:
    """Send ``value`` to the host and bring it back before its later uses.

    A value used twice (a pack's input: its forward now, its recompute later) stays for
    its first use and is stashed after it; a value used once is stashed at once. ``early``:
    stashed at once and brought back for its first use too. Under the harmony policy a first use
    can be far off (a pack's outputs wait for the pack to run every other microbatch, the next
    pack's input gradients for it to run every other backward), and every microbatch's value
    then waits on the device.
    ``order``: each node's position in the schedule, where the caller stashes many values.
    """
    if order is None:
        order = {n: i for i, n in enumerate(graph.nodes)}
    users = sorted((u for u in value.users if u.op == "call_function"), key=lambda u: order.get(u, len(order)))
    if not users:
        return False
    keep = users[:1] if len(users) >= 2 and not early else []
    with graph.inserting_after(keep[0] if keep else value):
        s = add_call(graph, ops.stash, (value,))
    s.meta[SCHEDULE] = {"pack": None}
    for u in users[len(keep):]:
        with graph.inserting_before(u):
            un = add_call(graph, ops.unstash, (s,))
        un.meta[SCHEDULE] = {"pack": None}
        u.replace_input_with(value, un)
    return True


def stash_groups(graph: torch.fx.Graph) -> dict:
    """Activation handles that could go to the host, grouped by (op, pack) over all microbatches.

    Pack outputs (``forward``, unless the pack's backward reuses its graph at once),
    gradients of pack inputs (``backward``) that a later op reads, and a pipeline's values from
    another rank that a recompute reads again (``recv``).
    """
    groups: dict = {}
    for n in calls(graph):
        op = ops.op_of(n)
        if (op.runs_forward or op.runs_backward) and not n.kwargs.get("keep") and n.users:
            groups.setdefault((n.target.__name__, n.args[0]), []).append(n.name)
        elif op.receives and not n.kwargs.get("grads") and len(n.users) > 1:        # another pipeline rank's
            groups.setdefault(("recv", n.args[0]), []).append(n.name)               # outputs, read again later
    return groups


def _drop_swaps(graph: torch.fx.Graph, resident: set) -> None:
    """The swaps (``swap_in`` and its ``wait``, ``release``) of the ``resident`` (pack, kind) pairs go, in one scan
    (a search's later schedules hold most of a model's state resident)."""
    for n in list(calls(graph)):
        op = ops.op_of(n)
        if op.state_copy and (n.args[0], n.args[1]) in resident:      # a swap_in or a release
            if op.fetches:
                for w in list(n.users):
                    graph.erase_node(w)
            graph.erase_node(n)


def keep_graphs(graph: torch.fx.Graph, packs) -> None:
    """Packs that keep their forward's graph: each backward takes it instead of recomputing from inputs."""
    if not packs:
        return
    fwd = {}
    for n in calls(graph):
        op = ops.op_of(n)
        if op.runs_forward and n.args[0] in packs:
            n.kwargs = {**n.kwargs, "keep": True}
            fwd[(n.args[0], n.args[1])] = n
        elif op.runs_backward and n.args[0] in packs and n.kwargs.get("saved") is None:
            n.args = n.args[:2]
            n.kwargs = {**n.kwargs, "saved": fwd[(n.args[0], n.args[1])]}
    for n in calls(graph):       # the batch a recompute would have loaded
        if ops.op_of(n).loads_batch and not n.users:
            graph.erase_node(n)


def offload_graphs(graph: torch.fx.Graph, packs) -> None:
    """The ``packs``' kept graphs wait for their backward on the host: each forward's goes right after the forward
    (the readers of its outputs take the stash's value, whose outputs stay on the device; under the harmony policy
    they come after the pack's other microbatches), and comes back just before its backward (the prefetch pass
    starts the copy earlier where the budget has room)."""
    for n in list(calls(graph)):
        if not ops.op_of(n).runs_forward or n.args[0] not in packs or not n.kwargs.get("keep"):
            continue
        back = [u for u, op in ops.ops_of(n.users) if op.runs_backward and u.kwargs.get("saved") is n]
        if len(back) != 1:
            continue
        readers = [u for u in n.users if u is not back[0]]
        with graph.inserting_after(n):
            s = add_call(graph, ops.stash, (n,))
        with graph.inserting_before(back[0]):
            un = add_call(graph, ops.unstash, (s,))
        for u in readers:
            u.replace_input_with(n, s)
        back[0].replace_input_with(n, un)
        s.meta[SCHEDULE] = un.meta[SCHEDULE] = {"pack": n.args[0]}


def param_swaps(graph: torch.fx.Graph) -> dict[int, tuple[list, list]]:
    """pack -> (its parameters' ``swap_in`` nodes, their ``release`` nodes), in schedule order: one scan."""
    out: dict = {}
    for n in calls(graph):
        op = ops.op_of(n)
        if op.state_copy and n.args[1] == "params":      # a swap_in, or a release
            out.setdefault(n.args[0], ([], []))[op.releases].append(n)
    return out


def hold_between_visits(graph: torch.fx.Graph, packs, parts=frozenset()) -> None:
    """The ``packs``' weights stay on the device from their first visit of the iteration to their last:
    every ``swap_in`` of their parameters but the first goes, and every ``release`` but the last.
    ``parts`` ((pack, param) pairs) does the same for single weights: the pack's ``swap_in`` but the first
    and ``release`` but the last leave them where they are (``held=``) and move the rest."""
    swaps = param_swaps(graph) if packs or parts else {}
    for pack in packs:
        ins, outs = swaps.get(pack, ([], []))
        for n in ins[1:]:
            for w in list(n.users):
                graph.erase_node(w)
            graph.erase_node(n)
        for n in outs[:-1]:
            graph.erase_node(n)
    by_pack: dict = {}
    for pack, name in parts:
        by_pack.setdefault(pack, set()).add(name)
    for pack, names in by_pack.items():
        ins, outs = swaps.get(pack, ([], []))
        if not ins or not outs:
            continue
        held = tuple(sorted(names))
        for n in ins[1:] + outs[:-1]:
            n.kwargs = {**n.kwargs, "held": held}


def carry_across_steps(graph: torch.fx.Graph, packs) -> None:
    """The ``packs``' weights (wholly on disk, stepped on the host right after their backward) stay on the
    device from their step to the next iteration's forward: the backward's release hands them over
    (``carry=True``) and the forward's first ``swap_in`` takes them instead of reading their files
    (``carried=True``). A pack whose last release of its weights is not a hand-over is left as it is; one
    with a single visit, or held between its visits, keeps its weights on the device for good (its step still
    writes them to its file)."""
    swaps = param_swaps(graph) if packs else {}
    stepped = stepped_after_release(graph) if packs else set()
    for pack in packs:
        ins, outs = swaps.get(pack, ([], []))
        if ins and outs and (outs[-1].kwargs.get("handoff") or pack in stepped):
            ins[0].kwargs = {**ins[0].kwargs, "carried": True}
            outs[-1].kwargs = {**outs[-1].kwargs, "carry": True}


def stepped_after_release(graph: torch.fx.Graph) -> set[int]:
    """Host-stepped packs whose step follows the last release of their weights with no compute between: where a
    partitioned pack (``shard_state="full"``) can carry its weights across the step, since its step all-gathers
    the updated chunks into the device copy the backward leaves (runtime/partitioned/carry.py)."""
    return set(releases_before_step(graph, Tier.HOST, ("params",)))


def step_on_device(graph: torch.fx.Graph, packs) -> None:
    """The ``packs``' optimizer steps run on the device (their state is resident: nothing streams)."""
    for n in calls(graph):
        if ops.op_of(n).steps and n.args[0] in packs:
            n.kwargs = {**n.kwargs, "where": Tier.DEVICE.value, "overlap": False}   # plain: fx prints enums as Tier.X


def build(base: torch.fx.Graph, resident: set, stashed: set, groups: dict, kept: frozenset = frozenset(),
           held: frozenset = frozenset(), device: frozenset = frozenset(), parts: frozenset = frozenset(),
           carried: frozenset = frozenset(), offloaded: frozenset = frozenset(), early: frozenset = frozenset()):
    """The swapped schedule: ``resident`` state left in place, the ``stashed`` groups sent to the host,
    the ``kept`` packs' graphs held for their backward, the ``held`` packs' weights (and the ``parts``,
    single weights) held between visits, the ``device`` packs (host-stepped in ``base``) stepped on the device,
    the ``carried`` packs' stepped weights kept on the device for the next iteration's forward, the ``offloaded``
    (kept) packs' graphs sent to the host until their backward; the ``early`` groups stashed as soon as made."""
    g = copy_graph(base)
    keep_graphs(g, kept)
    step_on_device(g, device)
    _drop_swaps(g, resident)
    hold_between_visits(g, held, parts)
    mark_streams(g, resident)
    carry_across_steps(g, carried)
    by_name = {n.name: n for n in g.nodes}
    order = {n: i for i, n in enumerate(g.nodes)}
    for key in sorted(stashed):     # in one order in every process (a set of strings follows the hash seed)
        if ops.op_named(key[0]).runs_forward and key[1] in kept:
            continue      # a kept forward's outputs carry its graph: they stay on the device
        for name in groups[key]:
            stash_value(g, by_name[name], order, early=key in early)
    offload_graphs(g, offloaded)
    return g
