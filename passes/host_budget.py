"""The host's share of the training state under ``host_memory_budget`` (the offload pass's arithmetic).

``HostBytes`` holds, per pack, the bytes the host's plan weighs and adds them up for one choice of the
packs whose optimizer state, or whole self (weights too, in files of at most ``disk_group_bytes``), lives
on disk; ``least_host_bytes`` is the smallest budget any choice meets, ``packs_to_disk`` the choice for a
budget, and ``files_in_memory`` the wholly-disk files the room left keeps in host memory.
passes/offload.py explains the plan and uses these.
"""
from __future__ import annotations

from dataclasses import dataclass

from harmony.base.tiers import Tier
from harmony.base.units import nbytes
from harmony.compiler.ir import Program


@dataclass(frozen=True)
class HostBytes:
    """Per pack, the bytes the host's plan weighs (this rank's share of them under ``shard_state="full"``);
    ``need`` adds them up for one choice of the packs whose state, or whole self, goes to disk."""
    world: int                 # ranks sharing each pack's weights and state (1: replicated or one rank)
    buffers: int
    sizes: dict                # parameter -> bytes
    owned: dict                # pack -> its fp32 weights' bytes
    held: dict                 # pack -> its gradients' bytes on the host between their release and its step
    optim: dict                # pack -> its optimizer state's bytes
    chunk_grads: dict          # pack -> its share's fp32 gradients (partitioned)
    groups: dict               # pack -> its files' parameters, were it wholly on disk
    file_bytes: dict           # pack -> its largest file: weights and their share of the optimizer state
    group_grads: dict          # pack -> its largest file's gradients
    every_gradient: bool       # fp16 and clipping hold every pack's gradients until the last is in
    largest_pack: int          # the largest pack's weights (partitioned: its gathered weights)

    @classmethod
    def of(cls, program: Program, world: int, every_gradient: bool) -> HostBytes:
        """``world``: the ranks sharing each pack (``shard_state="full"``: this rank keeps its share of each pack's
        weights and optimizer state, runtime/partitioned/), else 1."""
        cfg, plan, gm = program.config, program.plan, program.gm
        sizes = {n: nbytes(t) for n, t in gm.named_parameters()}
        owned = {s.index: sum(sizes.get(n, 0) for n in s.owned) // world for s in plan.packs}
        # a pack's gradients on the host between its release and its step; under mixed precision they arrive in
        # the compute dtype and step as fp32 copies, and fp16 and clipping hold every pack's until the last is in
        held = {s.index: s.param_bytes + (s.master_bytes if cfg.precision != "fp32" else 0) for s in plan.packs}
        optim = {s.index: s.optim_bytes // world for s in plan.packs}
        chunk_grads = {s.index: (s.master_bytes or s.param_bytes) // world for s in plan.packs}   # partitioned: fp32
        # a partitioned pack wholly on disk is one file of its share (runtime/partitioned/disk.py), not groups
        groups = groups_of(plan, set(optim), cfg.disk_group_bytes, sizes) if world == 1 else {p: [] for p in optim}
        file_bytes = {p: max((sum(sizes[n] for n in g) * (1 + optim[p] / max(owned[p], 1)) for g in gs), default=0)
                      for p, gs in groups.items()}
        group_grads = {p: max((sum(sizes[n] for n in g) for g in gs), default=0) for p, gs in groups.items()}
        return cls(world=world, buffers=sum(nbytes(t) for t in gm.buffers()), sizes=sizes, owned=owned, held=held,
                   optim=optim, chunk_grads=chunk_grads, groups=groups, file_bytes=file_bytes,
                   group_grads=group_grads, every_gradient=every_gradient,
                   largest_pack=max((s.param_bytes for s in plan.packs), default=0))

    def need(self, disk: set[int], whole: set[int]) -> dict:
        """What the host holds with ``disk`` packs' optimizer state and ``whole`` packs wholly on disk."""
        owned, optim, world = self.owned, self.optim, self.world
        masters = self.buffers + sum(b for p, b in owned.items() if p not in whole)
        # partitioned: every pack's whole gradients reach the host for its reduce-scatter, and its gathers assemble
        # its whole weights there
        host_held = [b for p, b in self.held.items() if world > 1 or p not in whole]
        host_optim = sum(b for p, b in optim.items() if p not in disk and p not in whole)
        if world > 1:      # two packs' whole gradients in flight; fp16 and clipping keep every pack's fp32 chunk;
            # a file (the share's weights and state) stepping, one read ahead by a pack's last gather, one written
            grads = 2 * max(host_held, default=0) + (sum(self.chunk_grads.values()) if self.every_gradient else 0)
            staging = 3 * max([optim[p] for p in disk] + [owned[p] + optim[p] for p in whole], default=0) + \
                self.largest_pack
        else:
            grads = (sum(host_held) if self.every_gradient else 2 * max(host_held, default=0)) + \
                max((self.group_grads[p] for p in whole), default=0)
            staging = 2 * max((optim[p] for p in disk), default=0) + \
                3 * max((self.file_bytes[p] for p in whole), default=0)
        return dict(masters=masters, grads=grads, host_optim=host_optim, staging=int(staging),
                    planned=int(masters + grads + host_optim + staging))


def least_host_bytes(host: HostBytes, weights_on: Tier | str, packs: set[int]) -> int:
    """The least the host can do with: usually everything on disk, but for a small model the files in flight can
    outweigh what they replace."""
    if weights_on == Tier.DISK:
        return host.need(set(), packs)["planned"]
    options = [host.need(set(), set())["planned"], host.need(set(host.optim), set())["planned"]]
    if weights_on == "auto":
        options.append(host.need(set(), packs)["planned"])
    return min(options)


def packs_to_disk(host: HostBytes, budget: int | None, weights_on: Tier | str, packs: set[int],
             order: list[int]) -> tuple[set[int], set[int]]:
    """The packs whose optimizer state goes to disk and those that go wholly, first-stepped first, until the host
    holds what ``budget`` allows (the state of each first, then, under ``weights_on="auto"``, whole packs)."""
    disk: set[int] = set()
    whole: set[int] = packs if weights_on == Tier.DISK else set()
    if budget is None or weights_on == Tier.DISK:
        return disk, whole
    for p in order:
        if host.need(disk, whole)["planned"] <= budget:
            break
        if host.optim[p]:
            disk.add(p)
    for p in order if weights_on == "auto" else ():
        if host.need(disk, whole)["planned"] <= budget:
            break
        if host.owned[p]:
            disk.discard(p)
            whole.add(p)
    return disk, whole


def files_in_memory(spare: int, packs: list[int], groups: dict, sizes: dict, state_per_byte: dict):
    """Files of wholly-disk packs that stay in host memory, in the room ``spare`` the host budget leaves.

    Each such file is never written or read: per byte held that is a write and a read of the step
    (both under the backward, where the disk is busiest) plus the weights' read for the forward
    (and for the backward, unless handed over). Every byte saves about as much wherever it sits,
    so the files of the last-stepped packs go first (``packs`` in that order): their writes would
    end the step and their weights are the first the next forward reads.
    Returns ({pack: [group index]}, {pack: share of its files' bytes kept}, bytes kept).
    """
    memory: dict[int, list[int]] = {}
    weights: dict[int, int] = {}
    kept = 0
    for p in packs:
        for i in reversed(range(len(groups[p]))):
            w = sum(sizes[n] for n in groups[p][i])
            cost = int(w * (1 + state_per_byte[p]))
            if cost <= spare - kept:
                memory.setdefault(p, []).insert(0, i)
                weights[p] = weights.get(p, 0) + w
                kept += cost
    share = {p: w / max(sum(sizes[n] for g in groups[p] for n in g), 1) for p, w in weights.items()}
    return memory, share, kept


def groups_of(plan, packs, group_bytes: int, sizes: dict[str, int]) -> dict[int, list[list[str]]]:
    """Each pack's owned parameters cut into groups of at most ``group_bytes`` (one larger parameter alone).

    Parameters go together only if the same packs read them, so reading a group for one
    pack never brings another pack's weights.
    """
    readers: dict[str, tuple] = {}
    for spec in plan.packs:
        for n in spec.params:
            readers[n] = readers.get(n, ()) + (spec.index,)
    out: dict[int, list[list[str]]] = {}
    for spec in plan.packs:
        if spec.index not in packs:
            continue
        groups: list[list[str]] = []
        open_: dict[tuple, tuple[list[str], int]] = {}
        for n in spec.owned:
            key = readers.get(n, (spec.index,))
            cur, used = open_.get(key, (None, 0))
            if cur is None or (used + sizes[n] > group_bytes and cur):
                cur, used = [], 0
                groups.append(cur)
            cur.append(n)
            open_[key] = (cur, used + sizes[n])
        out[spec.index] = groups
    return out
