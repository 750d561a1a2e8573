"""The training state of a compiled module where it lives now: what a checkpoint reads and writes.

``harmony.driver.checkpoint.io`` decides what a checkpoint holds and ``harmony.driver.checkpoint.files`` how its
directory is written; ``LiveState`` finds each tensor of the state in its tier (device, host,
disk) and reads or replaces it in place, never gathering the whole model's state at once.
"""
from __future__ import annotations

import torch
import torch.fx

from harmony.base.units import nbytes
from harmony.runtime.tiers.params_disk import PARAM


def unread(gm: torch.fx.GraphModule) -> set[str]:
    """The parameters and buffers of ``gm`` that no node of its graph reads (by ``get_attr`` or in a leaf module)."""
    read = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            read.add(node.target)
        elif node.op == "call_module":
            sub = gm.get_submodule(node.target)
            read |= {f"{node.target}.{n}" for n, _ in [*sub.named_parameters(), *sub.named_buffers()]}
    return {n for n, _ in [*gm.named_parameters(), *gm.named_buffers()] if n not in read}


class LiveState:
    """Where a compiled module's training state lives right now, read and written in place.

    Parameters and buffers are the tensors the runtime reads (device copies or host masters);
    optimizer state is in the optimizers, in a disk tier's files (``runtime/tiers/disk.py``), or with the
    weights of a pack wholly on disk (``runtime/tiers/params_disk.py``), which are read a pack at a time.
    """

    def __init__(self, sm):
        gm = sm.program.gm
        self.sm = sm
        self.tensors = {**dict(gm.named_parameters()), **dict(gm.named_buffers())}
        plan = getattr(sm.program, "plan", None)
        if getattr(plan, "stage", None) is not None:      # a pipeline rank: its packs' state only
            mine = {n for s in plan.packs for n in s.params + s.buffers}
            if plan.stage.rank == 0:     # and on the first, what no pack reads (a buffer forward never uses, as a
                mine |= unread(gm)       # rotary embedding's original_inv_freq), so the ranks hold the whole model
            self.tensors = {n: t for n, t in self.tensors.items() if n in mine}
        self.tiers = sm.runtime.state if sm.runtime is not None else None
        if getattr(self.tiers, "shares", None) is not None:   # shard_state="full": this rank's chunk pieces instead
            self.tiers.shares.substitute(self.tensors)         # of the partitioned weights (runtime/partitioned/)
        if hasattr(self.tiers, "drain"):   # no background optimizer step may still write what we read or replace
            self.tiers.drain()
        self.disk = getattr(self.tiers, "disk", None)   # optimizer state of disk-placed packs (runtime/tiers/disk.py)
        self.pdisk = getattr(self.tiers, "params_disk", None)   # packs wholly on disk (runtime/tiers/params_disk.py)
        self._weights: dict[int, dict] = {}   # group -> weights given to write_tensor, written with its state
        # shard_state="full" with packs on disk: this rank's chunks are in their files (runtime/partitioned/disk.py)
        self.shared = self.disk if hasattr(self.disk, "holds_weight") else None
        self._share_weights: dict[int, dict] = {}   # pack -> pieces' weights, as _weights
        name_of = {id(t): n for n, t in self.tensors.items()}
        if getattr(sm, "optimizer", None) is not None:   # the groups' settings the next step uses (a scheduler's
            sm.optimizer.step()                          # lr), in the packs' optimizers whose groups are saved
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.groups: list[list[tuple[list[str], dict]]] = []   # per optimizer, per group: names, group
        for opt in sm.optimizers:
            groups = []
            for group in opt.param_groups:
                names = [name_of[id(p)] for p in group["params"]]
                groups.append((names, group))
                self.optimizers.update(dict.fromkeys(names, opt))
            self.groups.append(groups)

    def optim_state(self, name: str) -> dict:
        """One parameter's optimizer state as the optimizer holds it (placeholders for state on disk)."""
        opt = self.optimizers.get(name)
        return opt.state.get(self.tensors[name], {}) if opt is not None else {}

    def optim_states(self, names) -> dict[str, dict]:
        """The real optimizer state of ``names`` that have some; state on disk is read, a pack at a time."""
        names = [n for n in names if self.optim_state(n)]
        real = self.disk.state_of(names) if self.disk is not None else {}
        if self.pdisk is not None:
            for gid, files in self._groups(names):
                for n in files:
                    real[n] = {k: files[n].get(k, v) for k, v in self.optim_state(n).items()}
        return {n: real.get(n) or self.optim_state(n) for n in names}

    def _groups(self, names):
        """(group, {name: {key: tensor}}) of the wholly-disk packs' files holding ``names``, read one at a time."""
        wanted: dict[int, list[str]] = {}
        for n in names:
            if self.pdisk is not None and self.pdisk.holds(n):
                wanted.setdefault(self.pdisk.pack_of[n], []).append(n)
        for gid, ns in wanted.items():
            held = self.pdisk.read_group(gid)
            files: dict[str, dict] = {n: {} for n in ns}
            for (n, k), v in held.items():
                if n in files:
                    files[n][k] = v
            yield gid, files

    def weights(self, names) -> dict[str, torch.Tensor]:
        """The fp32 weights and buffers of ``names``: the tensors the runtime reads, or read from their files."""
        out = {n: self.tensors[n].data for n in names}
        if self.shared is not None:
            out.update(self.shared.weights_of(names))
        if self.pdisk is not None:
            for _, files in self._groups(names):
                out.update({n: f[PARAM] for n, f in files.items()})
        return out

    def write_optims(self, states: dict, names) -> None:
        """``write_optim`` for each of ``states``; a disk-placed pack among ``names`` gets its whole state
        (its parameters without an entry in ``states`` have none) and is written to its file once."""
        packs: dict[int, dict] = {}
        files: dict[int, dict] = {}
        for n in names:
            if self.disk is not None and n in self.disk.pack_of:
                packs.setdefault(self.disk.pack_of[n], {})
            elif self.pdisk is not None and self.pdisk.holds(n):
                files.setdefault(self.pdisk.pack_of[n], {})
        for n, s in states.items():
            if self.disk is not None and n in self.disk.pack_of:
                packs.setdefault(self.disk.pack_of[n], {})[n] = s
            elif self.pdisk is not None and self.pdisk.holds(n):
                files.setdefault(self.pdisk.pack_of[n], {})[n] = s
            else:
                self.write_optim(n, s)
        for pack, given in packs.items():
            if self.shared is not None:
                self.shared.set_state(pack, given, self._share_weights.pop(pack, None))
            else:
                self.disk.set_state(pack, given)
        for gid in dict.fromkeys(list(files) + list(self._weights)):   # weights and state: one write per file
            self.pdisk.write_group(gid, self._weights.pop(gid, {}), files.get(gid))

    def layout(self) -> list[tuple[str, int | None, list[str]]]:
        """(file stem, pack, names) per file: a parameter goes with the pack that owns its update,
        a buffer (or an un-owned parameter) with the first pack that reads it. A weight tied across pipeline ranks
        is written once, by the first of them (the others load it from there: driver/checkpoint/reshard.py)."""
        plan = getattr(self.sm.program, "plan", None)
        packs = getattr(plan, "packs", None) or []
        stage = getattr(plan, "stage", None)
        home: dict[str, int] = {n: -1 for n, ranks in getattr(stage, "tied", {}).items() if ranks[0] != stage.rank}
        for spec in packs:
            for n in spec.owned:
                home.setdefault(n, spec.index)
        for spec in packs:
            for n in list(spec.params) + list(spec.buffers):
                home.setdefault(n, spec.index)
        files = [(f"pack-{spec.index:03d}", spec.index, [n for n in self.tensors if home.get(n) == spec.index])
                 for spec in packs]
        rest = [n for n in self.tensors if n not in home]
        if rest:
            files.append(("rest", None, rest))
        return [f for f in files if f[2]]

    def payload(self, names: list[str]) -> dict:
        """One file's plain dicts of tensors, referencing the live tensors (a view is cut to its own bytes).

        This is the one place that pulls state from its tier; a disk tier reads the pack's
        file here, so saving holds one pack's state at a time, never the whole model's.
        """
        model = {n: _own_bytes(t) for n, t in self.weights(names).items()}
        optim = {n: {k: _own_bytes(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                 for n, s in self.optim_states(names).items()}
        return {"model": model, "optimizer": optim}

    def nbytes(self) -> int:
        total = sum(nbytes(t) for t in self.tensors.values())
        return total + sum(nbytes(v) for n in self.optimizers for v in self.optim_state(n).values()
                           if isinstance(v, torch.Tensor))

    # -- writing, in place --------------------------------------------------------------------
    def write_tensor(self, name: str, value: torch.Tensor) -> None:
        """Copy into the tensor the runtime reads, and into its host master if that is another copy."""
        t = self.tensors[name]
        carry = getattr(getattr(self.tiers, "shares", None), "carry", None)
        if carry is not None:      # weights carried on the device across the step are the old ones now
            carry.drop()
        if self.pdisk is not None and self.pdisk.holds(name):   # its file is written with its state (write_optims)
            self._weights.setdefault(self.pdisk.pack_of[name], {})[name] = value
            return
        if self.shared is not None and self.shared.holds_weight(name):   # written with its pack's state, too
            self._share_weights.setdefault(self.shared.piece_pack[name], {})[name] = value
            return
        with torch.no_grad():
            t.data.copy_(value)
            master = self.tiers.master.get(name) if self.tiers is not None else None
            if master is not None and master.untyped_storage().data_ptr() != t.data.untyped_storage().data_ptr():
                master.copy_(value)

    def write_optim(self, name: str, values: dict) -> None:
        """Replace one parameter's optimizer state: into its tensors where they exist, else new ones
        in the tier the runtime keeps that parameter's optimizer state in between steps."""
        opt, p = self.optimizers[name], self.tensors[name]
        current = opt.state.get(p, {})
        resident = self.tiers is not None and self.tiers.refs[("optim", name)] > 0
        state = {}
        for k, v in values.items():
            old = current.get(k)
            if not isinstance(v, torch.Tensor):
                state[k] = v
            elif isinstance(old, torch.Tensor) and old.shape == v.shape and old.dtype == v.dtype:
                with torch.no_grad():
                    old.copy_(v)
                state[k] = old
            else:
                state[k] = self._new(v, resident)
        opt.state[p] = state

    def _new(self, v: torch.Tensor, resident: bool) -> torch.Tensor:
        if self.tiers is None:
            return v.detach().to("cpu", copy=True)
        if resident:   # on the device, counted against its budget like the runtime's own copies
            dst = torch.empty_like(v, device=self.tiers.device)
            self.tiers.meter.track(dst)
        else:
            dst = torch.empty(v.shape, dtype=v.dtype, pin_memory=self.tiers.pin)
        return dst.copy_(v)

    def clear_optim(self, keep: set[str]) -> None:
        """Parameters without optimizer state in the checkpoint had none when it was saved."""
        for n, opt in self.optimizers.items():
            if n not in keep:
                opt.state.pop(self.tensors[n], None)

    def write_groups(self, saved: list[dict]) -> None:
        by_name = {n: g for g in saved for n in g["params"]}
        for groups in self.groups:
            for names, group in groups:
                for k, v in by_name[names[0]].items():
                    if k != "params":
                        group[k] = _like(group.get(k), v)


def _own_bytes(t: torch.Tensor) -> torch.Tensor:
    """``torch.save`` writes a tensor's whole storage: a view into a larger buffer is copied out first."""
    t = t.detach()
    if t.storage_offset() == 0 and t.is_contiguous() and t.untyped_storage().nbytes() == nbytes(t):
        return t
    return t.clone()


def _like(current, value):
    """A saved hyperparameter in the type the optimizer holds now (JSON turns tuples into lists)."""
    if isinstance(current, torch.Tensor):
        with torch.no_grad():
            current.copy_(torch.as_tensor(value, dtype=current.dtype))
        return current
    if isinstance(current, tuple) and isinstance(value, list):
        return tuple(value)
    return value
