"""Packs wholly on disk: their fp32 master weights and optimizer state live in files, not in host memory.

The offload pass places a pack here (``plan.at(pack).master_on == Tier.DISK``) when even with
its optimizer state on disk the host cannot hold its fp32 weights: this is what lets a
model whose weights exceed host memory train (ZeRO-Infinity's parameter offload).

The pack's trainable parameters are cut into *groups* of at most ``plan.disk_group_bytes``
of weights (``passes.host_budget.groups_of``; parameters read by the same packs go together, so a tied
parameter gets its own group). Each group is one file of the ``DiskStore``: the weights
first, then the optimizer state once the first step made it. Between uses a parameter's
``.data`` is a placeholder of the right shape and dtype (one NaN broadcast to it: no
memory, and any use of it outside a swap_in shows as NaN), and its optimizer state holds
``meta`` tensors, as ``runtime/tiers/disk.py`` does for optimizer state alone.

* ``swap_in(pack, "params")`` reads the weights of the pack's groups (a prefix of each
  file) straight into device memory on the CPU device, which the ``MemoryMeter`` counts
  like any copy; on an accelerator into a host buffer, then copied. The copy thread waits
  for the read, so the prefetch pass's hoisting overlaps disk reads with compute too.
  ``release`` drops the device copy: weights of a disk pack are never dirty there.
* ``release(pack, "grads")`` leaves the gradients on the device and ``step(pack,
  where="disk")`` consumes them group by group, inline: it takes the group's file (read
  ahead while the group before it stepped), moves the group's gradients to the host
  (freeing them on the device; on the CPU device the step reads them where they are, no
  copy), runs the user's optimizer on the host weights, and writes
  weights and state back in the background. The host holds three groups' files at a time
  (one stepping, one read ahead, one being written) and one group's gradients, never a
  whole pack. With ``overlap`` (the offload pass's default) the step runs on the host
  thread while the device runs the next pack's backward; the pack's gradients wait on the
  device, not the host, until the step takes them group by group, and the next pack's
  step first waits for it (``join``), so one step is under way at a time and the device
  holds at most one pack's gradients beyond the pack computing.
* Every group's file is written once per step and read for the step, and the weights'
  prefix is read for each phase that needs them on the device (forward and backward). Where
  the step follows the pack's backward at once (``release(..., handoff=True)`` of the
  weights, as under the harmony policy), the step takes the weights the backward used from
  the device and reads only the optimizer state: 12 bytes read per parameter, not 16. The
  state is read into a buffer of its own that starts at the 4 KiB page holding its first
  byte, and on the CPU device the optimizer updates the backward's copy of the weights where
  it is (it was read in file layout): the file is written from both buffers (``write_parts``),
  the weights' last bytes on the shared page copied into the state's buffer first. No group
  copies its weights (2.2 GB per step in the offload benchmark), and from ``join`` on that
  copy counts as the write's host buffer, not device memory (``sm.stats['disk_steps_in_place']``).

* ``carry`` (the swap pass's ``Residency.carried``, where the device has room at the end of the
  backward): a handed group's stepped weights stay on the device, still counted by the meter
  (on the CPU device they are the backward's own copy, stepped in place; elsewhere the update
  is copied back into it), and the next iteration's forward ``swap_in`` takes them instead of
  reading the file. The file is written all the same (checkpoints, the backward's read).

Files the offload pass keeps in host memory (``Residency.in_memory``: the room the host budget
leaves) are held in ``_kept`` for good: read for the device by a copy, stepped in place, never
written or read. A step that fails midway leaves such a file as the step left it (there is no
file on disk to fall back on); every other file keeps its state from before the step.

A failed write raises ``OffloadError`` at the end of the step; the group's buffer is kept
in host memory (no partial file), so the next step and checkpoints still see its state.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_all

import torch

from harmony.base.errors import OffloadError
from harmony.base.tiers import Tier
from harmony.runtime.ops import ops_of
from harmony.runtime.placeholders import placeholder, withhold
from harmony.runtime.tiers.disk import DiskStore, step_order
from harmony.runtime.tiers.optim_disk import step_stats, take
from harmony.runtime.tiers.params_groups import PARAM, WholeGroups


def _records(plan) -> dict:
    return {p: r for p, r in plan.residency.items() if r.master_on == Tier.DISK and r.disk_groups}


def written_names(plan) -> set[str]:
    """The parameters whose weights live in files between steps (those ``DiskParams.create`` writes)."""
    return {n for r in _records(plan).values() for group in r.disk_groups for n in group}


class DiskParams(WholeGroups):
    """Weights and optimizer state of the disk-placed packs, a file per group; see the module docstring."""

    def __init__(self, store, pack_groups: dict[int, list[list[str]]], tensors: dict, optimizers: dict,
                 order: list[int], meter, device: torch.device, in_memory: dict[int, list[int]] | None = None):
        self.store = store
        self.tensors, self.optimizers = tensors, optimizers
        self.meter, self.device = meter, torch.device(device)
        self.parked: dict = {}           # the runtime's gradients parked off their weights' device (TieredState)
        self.groups: list[list[str]] = []
        self.pack_groups: dict[int, list[int]] = {}
        for pack, groups in pack_groups.items():
            self.pack_groups[pack] = []
            for names in groups:
                self.pack_groups[pack].append(len(self.groups))
                self.groups.append(list(names))
        self.pack_of = {n: g for g, names in enumerate(self.groups) for n in names}   # name -> group (file)
        self.group_pack = {g: p for p, gs in self.pack_groups.items() for g in gs}
        # files that stay in host memory (``Residency.in_memory``): in ``_kept`` for good, never written or read
        self.in_memory = {self.pack_groups[p][i] for p, idx in (in_memory or {}).items() for i in idx}
        self.handed: set[int] = set()    # packs whose step takes the weights from the device (``handoff``)
        self.carry: set[int] = set()     # handed packs whose stepped weights stay on the device (``carry``)
        self._carried: dict[int, list[torch.Tensor]] = {}   # group -> its stepped weights, for the next forward
        self.order = [g for p in dict.fromkeys(list(order) + list(pack_groups)) for g in self.pack_groups.get(p, [])]
        self.files = [g for g in self.order if g not in self.in_memory]    # the groups read and written, in order
        self.layouts: dict[int, list[tuple[str, str, tuple, torch.dtype]]] = {}
        self._reads: dict[int, tuple[Future, list[torch.Tensor]]] = {}
        # a handed group's read ahead: (its state's buffer or None, the file offset it starts at, where the
        # state starts), for the step to write the weights from where the backward left them
        self._tails: dict[int, tuple[torch.Tensor | None, int, int]] = {}
        self._stepped_in_place: list[torch.Tensor] = []    # device copies stepped in place, counted until ``join``
        self._writing: list[tuple[int, Future, list[torch.Tensor]]] = []
        self._kept: dict[int, list[torch.Tensor]] = {}      # a write failed: the group stays in host memory
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()
        self.wait_seconds = self.step_seconds = self.join_seconds = 0.0
        self._background: Future | None = None      # the step running on the host thread (overlapped)
        self._device_refs: list | None = None        # what that step took from the device, freed at ``join``
        self.on_demand = 0
        self.in_place = 0        # groups stepped in the device's own copy of their weights (CPU device, handed)
        self._last = dict(store.stats(), wait_seconds=0.0, step_seconds=0.0, join_seconds=0.0, on_demand=0,
                          in_place=0)

    @classmethod
    def create(cls, plan, graph, tensors: dict, optimizers: dict, meter, device,
               offload_dir=None, fill=None, **io) -> "DiskParams | None":
        """Write the weights of the packs ``plan.residency`` places on disk to their files, leave placeholders.

        ``fill(params)``: makes the weights of a model built without them (driver/materialize.py), called for each
        group before it is written, so that the host holds one group of them at a time."""
        records = _records(plan)
        if not records:
            return None
        self = cls(DiskStore(offload_dir, **io), {p: r.disk_groups for p, r in records.items()}, tensors, optimizers,
                   step_order(graph), meter, device,
                   in_memory={p: list(r.in_memory) for p, r in records.items() if r.in_memory})
        releases = [n for n, op in ops_of(graph.nodes) if op.releases and n.args[1] == "params"]
        self.handed = {n.args[0] for n in releases if n.kwargs.get("handoff")}
        self.carry = {n.args[0] for n in releases if n.kwargs.get("handoff") and n.kwargs.get("carry")}
        try:
            for gid, names in enumerate(self.groups):
                if fill is not None:
                    fill([tensors[n] for n in names])
                lay = [(n, PARAM, tuple(tensors[n].shape), tensors[n].dtype) for n in names]
                views = self.store.empty([(s, d) for _, _, s, d in lay])
                with torch.no_grad():
                    for v, n in zip(views, names):
                        v.copy_(tensors[n].data)
                self._store_state(gid, views)
                self.layouts[gid] = lay
                for n in names:
                    withhold(tensors[n])
        except BaseException:
            self.close()
            raise
        return self

    def holds(self, name: str) -> bool:
        return name in self.pack_of

    def carried(self) -> dict:
        """The weights carried to the next forward (an evaluation's swap_in takes them: ``carry_on`` after it)."""
        return dict(self._carried)

    def carry_on(self, carried: dict) -> None:
        self._carried.update(carried)

    # -- weights for the device ---------------------------------------------------------------------
    def read_params(self, names) -> tuple[list[Future], list[tuple[str, torch.Tensor, torch.Tensor]]]:
        """Start reading the weights of ``names`` (whole groups) for the device.

        Returns the reads' futures and (name, device tensor, host view) triples: on the CPU
        device the two are the same tensor, read straight into memory the meter counts.
        """
        futs, out = [], []
        for gid in dict.fromkeys(self.pack_of[n] for n in names):
            lay = [e for e in self.layouts[gid] if e[1] == PARAM]
            carried = self._carried.pop(gid, None)
            if carried is not None:    # the last step left them on the device, up to date: nothing to read
                out += [(n, v, v) for (n, _, _, _), v in zip(lay, carried)]
                continue
            views = self.store.empty([(s, d) for _, _, s, d in lay])
            kept = self._kept.get(gid)
            if kept is not None:       # its last write failed: the weights are in host memory
                for v, k in zip(views, kept):
                    v.copy_(k)
            else:
                futs.append(self.store.read(gid, into=views))
            for (n, _, _, _), v in zip(lay, views):
                if self.device.type == "cpu":
                    self.meter.track(v)
                    out.append((n, v, v))
                else:
                    dst = torch.empty_like(v, device=self.device)
                    self.meter.track(dst)
                    out.append((n, dst, v))
        return futs, out

    # -- the optimizer step, group by group ---------------------------------------------------------
    def step(self, pack: int, to_host) -> None:
        """Step pack ``pack``'s groups on the host: gradients leave the device a group at a time."""
        t0 = time.perf_counter()
        for gid in self.pack_groups.get(pack, []):
            self._settle_writes(keep=1)
            views = self._take(gid)
            nxt = self._next(gid)
            if nxt is not None:
                self.prefetch(nxt)
            self._step_group(gid, views, to_host)
        self.step_seconds += time.perf_counter() - t0

    def step_in_background(self, pool, pack: int, to_host) -> Future:
        """``step(pack)`` on ``pool`` (the host thread), overlapping the device's next backward; ``join`` waits for it.

        The device copies the step takes (gradients, handed weights) stay alive until ``join``, as the
        memory plan has them (it cannot know how far the step got when the next backward runs).
        """
        self._device_refs = []
        self._background = pool.submit(self.step, pack, to_host)
        return self._background

    def join(self) -> None:
        """Wait for the step under way in the background, if any (its error is raised by whoever settles it),
        then free the device copies it took."""
        fut, self._background = self._background, None
        if fut is not None:
            t0 = time.perf_counter()
            wait_all([fut])
            self.join_seconds += time.perf_counter() - t0
        self._device_refs = None
        for w in self._stepped_in_place:     # their writes may still be under way: host memory now
            self.meter.forget(w)
        self._stepped_in_place = []

    def _step_group(self, gid: int, views: list[torch.Tensor], to_host) -> None:
        """Step group ``gid`` on the host: its weights (handed over by the backward, or the file's), gradients and
        optimizer state installed where its optimizer steps them, stepped, then kept in memory or written back.
        ``views``: the file's buffer, read ahead."""
        names = self.groups[gid]
        lay = self.layouts[gid]
        views, handed, tail, weights, in_place = self._step_inputs(gid, names, lay, views)
        # ``carry``: the device's copies of the weights stay there, updated, for the next iteration's forward
        carry = [self.tensors[n].data for n in names] if handed and self.group_pack[gid] in self.carry else None
        held = {(n, k): v for (n, k, _, _), v in zip(lay, views)}
        keep = self._device_refs          # a background step: device copies live until ``join``
        self._install(names, held, weights, handed, keep, to_host)
        if weights is not None:
            views = list(weights) + list(views[len(names):])
        self._run_optimizers(gid, names, views)
        entries = self._stepped_entries(gid, names, carry, in_place)
        new_lay = [(n, k, tuple(v.shape), v.dtype) for n, k, v in entries]
        out, parts = self._write_buffer(lay, new_lay, views, entries, weights, tail)
        self.layouts[gid] = new_lay
        self._leave(gid)
        self._put_back(gid, out, parts, in_place, carry, keep, weights)

    def _step_inputs(self, gid: int, names, lay, views: list[torch.Tensor]) -> tuple:
        """(views, handed, tail, weights, in_place) of group ``gid``'s step: ``handed``, whether the backward left
        the weights on the device for it (a file kept in memory has them there already; where the device no longer
        holds them the whole file is read after all, into new ``views``); ``weights``, the handed weights as host
        tensors in the file's layout (None: the file's buffer has them), ``in_place`` whether they are the device's
        own copies."""
        tail = self._tails.pop(gid, None)
        handed = self.group_pack.get(gid) in self.handed and gid not in self.in_memory  # in memory: there already
        if handed and not all(self.meter.holds(self.tensors[n].data) for n in names):
            views = self.store.empty([(s, d) for _, _, s, d in lay])   # not handed this time after all:
            self.store.read(gid, into=views).result()                    # the file has them
            handed, tail = False, None
        weights, in_place = None, False
        if handed and tail is not None:
            weights, in_place = self._weights_for_step(names, lay)
        return views, handed, tail, weights, in_place

    def _run_optimizers(self, gid: int, names, views: list[torch.Tensor]) -> None:
        """Run the optimizers of the group's parameters; where one fails, placeholders go back in, and a file kept
        in memory keeps its buffer as the step left it (it has no file to fall back on)."""
        opts = list(dict.fromkeys(self.optimizers[n] for n in names if n in self.optimizers))
        try:
            for opt in opts:
                opt.step()
        except BaseException:
            self._leave(gid)
            if gid in self.in_memory:     # no file to fall back on: the buffer stays, as the step left it
                self._kept[gid] = views
            raise

    def _stepped_entries(self, gid: int, names, carry: list | None, in_place: bool) -> list[tuple]:
        """What the group's file holds after its step, as (name, kind, tensor): the weights, then each parameter's
        optimizer state. A carried group's device copies take the update here (unless stepped in place)."""
        entries = [(n, PARAM, self.tensors[n].data) for n in names]
        if carry is not None:
            if not in_place:      # stepped in a host copy: the device's copy takes the update
                with torch.no_grad():
                    for d, (_, _, w) in zip(carry, entries):
                        d.copy_(w)
            self._carried[gid] = carry
        for n in names:
            opt = self.optimizers.get(n)
            for k, v in (opt.state.get(self.tensors[n], {}) if opt is not None else {}).items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    entries.append((n, k, v))
        return entries

    def _write_buffer(self, lay, new_lay, views: list[torch.Tensor], entries: list[tuple], weights,
                      tail) -> tuple[list[torch.Tensor], tuple | None]:
        """The buffer the stepped group is written from (or kept in memory as), and the parts of a write from two
        buffers (None: from the one buffer)."""
        # ``.data`` is a new tensor object at each access: the same memory is what makes it the same buffer
        same = new_lay == lay and all(a.data_ptr() == b.data_ptr() for a, (_, _, b) in zip(views, entries))
        if same and weights is not None:      # weights and state where they were: written from both buffers
            return views, self._parts(weights, tail)
        if same:
            return views, None
        # the first step made the optimizer state: a buffer in file layout for all of it
        out = self.store.empty([(s, d) for _, _, s, d in new_lay])
        with torch.no_grad():
            for dst, (_, _, src) in zip(out, entries):
                dst.copy_(src)
        return out, None

    def _put_back(self, gid: int, out: list[torch.Tensor], parts, in_place: bool, carry, keep, weights) -> None:
        """The stepped group's buffer ``out``: kept in memory if it is a file the offload pass keeps there, else
        written to its file in the background. The step's last group then reads the next step's first ahead."""
        if gid in self.in_memory:
            self._kept[gid] = out
        else:
            if in_place:        # the device's copy is the write's buffer now: off the device when the step is
                self.in_place += 1     # (unless carried: it stays there for the next forward; the write only reads it)
                if carry is None and keep is None:
                    self.meter.forget(weights[0])
                elif carry is None:
                    self._stepped_in_place.append(weights[0])
            fut = self.store.write_parts(gid, *parts) if parts is not None else self.store.write(gid, out)
            self._writing.append((gid, fut, out))
        if nxt_wrap := self._wrap(gid):
            self.prefetch(nxt_wrap)

    def _install(self, names, held: dict, weights, handed: bool, keep, to_host) -> None:
        """Put a group's weights, gradients and optimizer state where its optimizer steps them: the weights from
        ``weights`` (stepped in place) or ``held`` (the file's buffer), the gradients off the device."""
        for i, n in enumerate(names):
            t = self.tensors[n]
            g, t.grad = t.grad, None
            if g is None:                # left the device ahead of its weights (TieredState.parked)
                g = self.parked.pop(n, None)
            if g is not None and self.meter.holds(g):
                if keep is not None:
                    keep.append(g)
                if self.device.type != "cpu":
                    g = to_host(g)       # else the device copy goes with the last reference to it
                # on the CPU device the gradient is in host memory already: the step reads it where it
                # is (counted as moved all the same, and on the device until the step is done with it),
                # which saves a copy into fresh pages per group, on cores the next backward needs
            if handed and weights is None:   # the backward's copy of the weights: not read from the file again
                held[(n, PARAM)].copy_(t.data)
            if keep is not None and self.meter.holds(t.data):
                keep.append(t.data)      # a handed device copy (also of a file in memory, not copied)
            t.data = weights[i] if weights is not None else held[(n, PARAM)]
            t.grad = g
            opt = self.optimizers.get(n)
            if opt is not None:
                state = opt.state.setdefault(t, {})
                for (m, k), v in held.items():
                    if m == n and k != PARAM:
                        state[k] = v

    def _weights_for_step(self, names, lay) -> tuple[list[torch.Tensor], bool]:
        """The handed weights of a group as host tensors in the file's layout (its first ``len(names)`` entries),
        and whether they are the device's own copies (the CPU device: stepped where they are, no copy)."""
        ws = [self.tensors[n].data for n in names]
        specs = [(s, d) for _, _, s, d in lay[:len(names)]]
        if (self.device.type == "cpu" and all(w.dtype == d and tuple(w.shape) == s for w, (s, d) in zip(ws, specs))
                and self.store.file_range(ws) is not None):
            return ws, True
        out = self.store.empty(specs)
        with torch.no_grad():
            for o, w in zip(out, ws):
                o.copy_(w)
        return out, False

    def _parts(self, weights: list[torch.Tensor], tail) -> tuple[list, int]:
        """The file written from two buffers: the weights up to the page the state starts on, and the state's
        buffer from there (the weights' last bytes before the state copied into it first)."""
        buf, at, state_at = tail
        wbuf, _ = self.store.file_range(weights)
        if buf is None:
            return [(wbuf[:state_at], 0)], state_at
        if state_at > at:
            buf[:state_at - at].copy_(wbuf[at:state_at])
        return [(wbuf[:at], 0), (buf, at)], at + buf.numel()

    def _leave(self, gid: int) -> None:
        """Placeholders for the group's weights and optimizer state; gradients are done with."""
        for n, k, shape, dtype in self.layouts[gid]:
            t = self.tensors[n]
            if k == PARAM:
                t.grad = None
                withhold(t)
            else:
                self.optimizers[n].state[t][k] = torch.empty(shape, dtype=dtype, device="meta")

    def _next(self, gid: int) -> int | None:
        """The next group in step order that has a file to read."""
        i = self.order.index(gid) if gid in self.order else len(self.order)
        return next((g for g in self.order[i + 1:] if g not in self.in_memory), None)

    def _wrap(self, gid: int) -> int | None:
        """The last group of a step reads the first one of the next step ahead, across the forward pass."""
        return self.files[0] if len(self.files) > 1 and gid == self.order[-1] else None

    def prefetch(self, gid: int) -> None:
        """Start reading a group's file for its step: only its optimizer state where the weights are handed over.

        A handed group's state is read into a buffer of its own that starts at the 4 KiB page
        holding the state's first byte (``_tails``): the weights' part of the file is never in host
        memory twice.
        """
        if gid in self._reads or gid in self._kept:
            return
        lay = self.layouts[gid]
        specs = [(s, d) for _, _, s, d in lay]
        skip = sum(k == PARAM for _, k, _, _ in lay) if self.group_pack.get(gid) in self.handed else 0
        if not skip:
            views = self.store.empty(specs)
            self._reads[gid] = (self.store.read(gid, into=views), views)
            return
        fut, views, self._tails[gid] = self.store.read_tail(gid, specs, skip)
        views = [placeholder(torch.empty(s, dtype=d, device="meta")) if v is None else v
                 for v, (s, d) in zip(views, specs)]
        self._reads[gid] = (fut, views)

    def _take(self, gid: int) -> list[torch.Tensor]:
        return take(self, gid)

    def _settle_writes(self, keep: int = 0) -> None:
        """Wait until at most ``keep`` writes are under way; a failed one keeps its buffer in memory."""
        while len(self._writing) > keep:
            gid, fut, views = self._writing.pop(0)
            wait_all([fut])
            e = fut.exception()
            if e is None:
                continue
            with self._lock:
                self._kept[gid] = views
            carried = self._carried.pop(gid, None)
            if carried is not None:     # the device's copy is the kept buffer now: host memory, read from there
                self.meter.forget(carried[0])
            if isinstance(e, OffloadError):
                e.add_note(f"the weights and optimizer state of parameter group {gid} "
                           f"({', '.join(self.groups[gid][:3])}{', ...' if len(self.groups[gid]) > 3 else ''}) are "
                           f"kept in host memory and no partial file is left in {self.store.path}; after making "
                           f"room, resume from your last checkpoint (harmony.load) or save one now (harmony.save)")
            self._errors.append(e)

    def flush(self) -> None:
        """Wait for this step's writes; raise the first that failed (the end of a training step)."""
        self.join()
        self._settle_writes()
        self.store.flush()
        errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def _store_state(self, gid: int, views: list[torch.Tensor]) -> None:
        """The group's state between steps, now: kept in host memory if it is a file the offload pass keeps there,
        else written to its file (waiting for the write)."""
        if gid in self.in_memory:
            with self._lock:
                self._kept[gid] = views
        else:
            self.store.write(gid, views).result()

    # -- reports and lifetime -------------------------------------------------------------------------
    def step_stats(self) -> dict:
        return step_stats(self, disk_weight_step_seconds="step_seconds", disk_step_join_seconds="join_seconds",
                          disk_steps_in_place="in_place")

    def close(self) -> None:
        try:
            self.join()
            wait_all([f for _, f, _ in self._writing])
        finally:
            self._writing = []
            self._carried.clear()
            self.store.close()
