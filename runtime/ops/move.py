"""The ops that move values: ``swap_in`` / ``wait`` / ``release`` of a pack's state, ``load_batch``, ``stash`` and
``unstash`` of activations; each registered in the op table (runtime/ops/) with all it needs.
"""
from __future__ import annotations

import time

import torch
import torch.fx

from harmony.base.tiers import Tier
from harmony.base.units import nbytes
from harmony.runtime.ops import (
    Acts,
    Predicted,
    arrived,
    carried_names,
    label_args,
    load_batch,
    moving_names,
    op_of,
    register,
    release,
    short_label,
    stash,
    swap_in,
    unstash,
    wait,
)
from harmony.runtime.precision import device_dtype


# -- swap_in / wait / release ------------------------------------------------------------------
def _swap_in_execute(rt, pack, what, held=(), carried=False):
    # ``carried``: the disk tier hands over the weights its last step left on the device instead of reading them
    return rt.state.fetch(what, moving_names(rt.plan.packs[pack], what, held))


def swap_in_effect(m, pack, what, held=(), carried=False):
    names = moving_names(m.plan.packs[pack], what, held)
    if carried:     # on the device since the last step: ``memory_curve`` holds them from the start of the step
        carry = set(carried_names(m.plan, pack))
        names = [n for n in names if n not in carry]
    m.hold(what, names)
    return None, 0


def _held_bytes(plan, pack, held) -> int:
    """Bytes of the weights ``held=`` keeps on the device across a swap of ``pack`` (its record's, by name)."""
    sizes = plan.at(pack).params_held
    return sum(sizes.get(n, 0) for n in held)


def _swap_in_cost(plan, hw, pack, what, held=(), carried=False):
    spec = plan.packs[pack]
    size = {"params": spec.param_bytes + spec.buffer_bytes, "grads": spec.param_bytes,
            "optim": spec.optim_bytes}[what]
    if carried:
        size *= plan.at(pack).in_memory_share   # only the files in memory
    return "h2d", max(0, size - _held_bytes(plan, pack, held)) / hw.h2d_bandwidth


def _wait_execute(rt, handle):
    rt.state.wait(handle)


def _release_execute(rt, pack, what, handoff=False, held=(), carry=False):
    keep = ()
    pd = rt.state.params_disk
    shares = rt.state.shares
    if carry and shares is not None and shares.carry is not None and rt.plan.at(pack).shares is not None:
        # partitioned: the step refills the copies with every rank's updated chunks (runtime/partitioned/carry.py)
        own = set(rt.plan.at(pack).shares.names())
        names = moving_names(rt.plan.packs[pack], what, held)
        shares.carry.hand_over(rt.state, pack, [n for n in names if n in own])
        rt.state.release(what, [n for n in names if n not in own])
        return
    if handoff and pd is not None:   # the disk step after it takes this pack's own gradients from the device
        keep = {n for n in rt.plan.packs[pack].owned if pd.holds(n)}
    rt.state.release(what, moving_names(rt.plan.packs[pack], what, held), keep=keep)


def _release_effect(m, pack, what, handoff=False, held=(), carry=False):
    names = moving_names(m.plan.packs[pack], what, held)
    if carry and what == "params":   # stepped where they are and kept there for the next forward: live to the end
        kept = set(carried_names(m.plan, pack))
        m.drop(what, [n for n in names if n in kept], stays=True)
        names = [n for n in names if n not in kept]
    if handoff:    # the pack's own gradients stay on the device until the disk step after it takes them
        owned = [n for n in names if n in set(m.plan.packs[pack].owned)]
        names = [n for n in names if n not in set(owned)]
        m.handed[pack] = m.handed.get(pack, 0) + m.drop(what, owned, stays=True)
    changed = [n for n in names if n in m.dirty]     # only what changed goes back (a shard's params, say)
    m.drop(what, [n for n in names if n not in m.dirty])
    m.drop(what, changed, write_back=True)
    if what == "params":
        m.dirty -= {n for n in names if m.refs.get(("params", n), 0) == 0}
    return None, 0


def _release_cost(plan, hw, pack, what, handoff=False, held=(), carry=False):
    spec = plan.packs[pack]
    # the whole write-back; the simulator scales it by what the effect moves (dirty params, existing grads)
    size = {"params": spec.param_bytes, "grads": spec.param_bytes, "optim": spec.optim_bytes}[what]
    return "d2h", max(0, size - _held_bytes(plan, pack, held)) / hw.d2h_bandwidth


def _no_effect(m, *args, **kwargs):
    return None, 0


def _free(plan, hw, *args, **kwargs):
    return "sync", 0.0


# -- load_batch / stash / unstash ------------------------------------------------------------
def _load_batch_execute(rt, mb, names):
    start, size = sum(rt.rows[:mb]), rt.rows[mb]      # this step's rows (Runtime.run)
    out, began = {}, time.perf_counter()
    for n in names:
        src = rt.batch[n][start:start + size] if rt.batch[n].dim() else rt.batch[n]   # (a 0-dim count: whole)
        dst = torch.empty(src.shape, dtype=device_dtype(src, rt.compute_dtype), device=rt.device)
        rt.meter.track(dst)
        dst.copy_(src)
        rt.state.moved["h2d"] += nbytes(dst)
        out[n] = dst
    if rt.state.link is not None:     # an emulated host link (runtime/tiers/link.py)
        rt.state.link.pace("h2d", sum(nbytes(t) for t in out.values()), began)
    return Acts(out)


def _load_batch_effect(m, mb, names):
    size = sum(m.plan.batch_bytes[n] for n in names)
    m.moved["h2d"] += size
    return Predicted(size), 0


def _load_batch_cost(plan, hw, mb, names):
    return "h2d", sum(plan.batch_bytes[n] for n in names) / hw.h2d_bandwidth


def _stash_execute(rt, acts):
    arrived(rt, acts)
    if acts.graph is not None:      # a kept forward: its graph goes, its values stay
        return _send_graph(rt, acts)
    # the copies land on their own time: ``unstash`` waits for them on the device's stream
    return Acts({k: rt.state.send(v) if isinstance(v, torch.Tensor) else v for k, v in acts.values.items()},
                on_device=False)


def _send_graph(rt, acts):
    """A kept forward's graph to the host: each device storage its saved tensors view, once. The storages of the
    pack's inputs and outputs stay (the values and the graph's roots hold them on the device anyway)."""
    stay = {id(t.untyped_storage()) for t in (*acts.leaves.values(), *acts.outs.values())
            if isinstance(t, torch.Tensor)}
    sent: dict[int, torch.Tensor] = {}
    for held in acts.graph:
        t = held.t
        if t is None or t.layout != torch.strided or not rt.meter.holds(t):
            continue
        storage = t.untyped_storage()
        key = id(storage)
        if key in stay or not storage.nbytes():
            continue
        if key not in sent:
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            sent[key] = rt.state.send(whole)
        held.host, held.view, held.t = sent[key], (t.dtype, t.size(), t.stride(), t.storage_offset()), None
    return Acts(acts.values, acts.leaves, acts.outs, graph=acts.graph)


def _stash_effect(m, value):
    if value.graph:
        # the forward's inputs and outputs stay on the device, now the stash's value's: the forward's keeps the
        # graph's bytes until it dies (after this, its last use)
        m.moved["d2h"] += value.graph
        stays = value.bytes - value.graph
        m.live -= stays
        value.bytes = value.graph
        return Predicted(stays, kept=value.kept, away=value.graph), 0    # (its outputs live until its backward)
    m.moved["d2h"] += value.bytes
    return Predicted(value.bytes, on_device=False), 0


def _unstash_execute(rt, acts):
    """A stashed value back on the copy engine (``TieredState.bring``): device memory reserved now, the copies
    joined by the value's readers (``ops.arrived``)."""
    if acts.graph is not None:
        return _bring_graph(rt, acts)
    keys = [k for k, v in acts.values.items() if isinstance(v, torch.Tensor)]
    back, arriving = rt.state.bring([acts.values[k] for k in keys]) if keys else ([], None)
    return Acts({**acts.values, **dict(zip(keys, back))}, arriving=arriving)


def _bring_graph(rt, acts):
    """A stashed graph back on the copy engine: its storages' device copies are reserved now and its saved tensors'
    views rebuilt on them; the pack's backward waits for the copies (``Acts.arriving``) before it runs."""
    hosts = list({id(h.host): h.host for h in acts.graph if h.host is not None}.values())
    back, arriving = rt.state.bring(hosts) if hosts else ([], None)
    device = dict(zip(map(id, hosts), back))
    for held in acts.graph:
        if held.host is not None:
            dtype, size, stride, offset = held.view
            whole = device[id(held.host)]
            held.t = torch.empty(0, dtype=dtype, device=whole.device).set_(whole.untyped_storage(), offset, size,
                                                                             stride)
            held.host = held.view = None
    return Acts(acts.values, acts.leaves, acts.outs, graph=acts.graph, arriving=arriving)


def _unstash_effect(m, value):
    if value.away:         # the graph back beside the inputs and outputs the stash's value held
        m.moved["h2d"] += value.away
        stays, value.bytes = value.bytes, 0
        m.live -= stays
        return Predicted(stays + value.away, kept=value.kept, graph=value.away), 0
    m.moved["h2d"] += value.bytes
    return Predicted(value.bytes), 0


def _stash_cost(plan, hw, value):
    # one cost for both directions: stash reads a value on the device, unstash one on the host; a kept forward's
    # graph goes out and comes back, its inputs and outputs stay
    if value.graph:
        return "d2h", value.graph / hw.d2h_bandwidth
    if value.away:
        return "h2d", value.away / hw.h2d_bandwidth
    if value.on_device:
        return "d2h", value.bytes / hw.d2h_bandwidth
    return "h2d", value.bytes / hw.h2d_bandwidth


# -- what the simulator and drawings need besides ------------------------------------------------
# Seconds an op reads from and writes to disk around it (runtime/tiers/disk.py, runtime/tiers/params_disk.py, its
# ``disk_io``).
# Files kept in host memory (``Residency.in_memory``) are neither read nor written.
def swap_in_disk_io(plan, node, hw) -> dict:
    """A ``swap_in`` of a wholly-disk pack's weights reads them, unless the last step left them on the device
    (``carried``)."""
    pack = node.args[0]
    record = plan.at(pack)
    read = 0
    if node.args[1] == "params" and record.master_on == Tier.DISK and not node.kwargs.get("carried"):
        read = plan.packs[pack].param_bytes * (1 - record.in_memory_share)
    return _disk_seconds(hw, read, 0)


def step_disk_io(plan, node, hw) -> dict:
    """The step of a wholly-disk pack reads and writes its files (weights and optimizer state), that of a pack with
    optimizer state alone on disk reads and writes that state."""
    pack = node.args[0]
    spec, record = plan.packs[pack], plan.at(pack)
    whole, optim = record.master_on == Tier.DISK, record.optim_on == Tier.DISK
    if not (whole or optim):
        return _disk_seconds(hw, 0, 0)
    # partitioned (runtime/partitioned/disk.py): the record counts this rank's share, its weights as master_bytes
    weights = spec.master_bytes if record.shares is not None else spec.param_bytes
    written = (spec.optim_bytes + (weights if whole else 0)) * (1 - record.in_memory_share)
    read = written if record.shares is None else spec.optim_bytes   # a gather reads the chunks (below)
    return _disk_seconds(hw, read, written)


def gather_disk_io(plan, node, hw) -> dict:
    """A ``gather`` of a partitioned pack on disk reads this rank's chunks; one that takes the copy its last step
    carried reads none, unless the step reads its whole file there (``reads``: runtime/partitioned/)."""
    pack = node.args[0]
    record = plan.at(pack)
    read = 0
    if record.master_on == Tier.DISK and record.shares is not None and node.args[1:2] == ("params",):
        carried = node.kwargs.get("carried") and node.kwargs.get("reads") != "file"
        read = 0 if carried else plan.packs[pack].master_bytes
    return _disk_seconds(hw, read, 0)


def _disk_seconds(hw, read, written) -> dict:
    rbw = getattr(hw, "disk_read_bandwidth", 0) or 1e30
    wbw = getattr(hw, "disk_write_bandwidth", 0) or 1e30
    return {"read": read / rbw, "write": written / wbw}


def pack_what(args, kwargs) -> str:
    return f"pack {args[0]} {args[1]}" if len(args) >= 2 else label_args(args, kwargs)


def _batch_label(args, kwargs) -> str:
    return f"mb {args[0]} {short_label(args[1])}" if len(args) >= 2 else label_args(args, kwargs)


# colours: compute blues, state copies orange, activation copies purple, sync grey, optimizer green, network reds
register(swap_in, _swap_in_execute, swap_in_effect, _swap_in_cost, "copy", state_copy=True,
         disk_io=swap_in_disk_io, colour="#fdae6b", label=pack_what, fetches=True, copy_thread=True)
register(wait, _wait_execute, _no_effect, _free, "sync", colour="#d9d9d9", joins=True)
register(release, _release_execute, _release_effect, _release_cost, "copy", state_copy=True, colour="#fdd0a2",
         label=pack_what, releases=True)
register(load_batch, _load_batch_execute, _load_batch_effect, _load_batch_cost, "copy", colour="#fee6ce",
         label=_batch_label, loads_batch=True)
def _graph_label(args, kwargs) -> str:
    """A kept forward's graph says so, with its pack and microbatch; any other value is named."""
    value = args[0] if args else None
    if getattr(value, "target", None) is stash:     # an unstash's value: what its stash sent
        value = value.args[0]
    op = op_of(value) if isinstance(value, torch.fx.Node) else None
    if op is not None and op.runs_forward and value.kwargs.get("keep"):
        return f"graph of pack {value.args[0]} · mb {value.args[1]}"
    return label_args(args, kwargs)


register(stash, _stash_execute, _stash_effect, _stash_cost, "copy", colour="#bcbddc", label=_graph_label,
         stashes=True)
register(unstash, _unstash_execute, _unstash_effect, _stash_cost, "copy", colour="#9e9ac8", label=_graph_label,
         unstashes=True, copy_thread=True)
