"""Loading a checkpoint into another world size or sharding mode: each rank assembles its own state from the pieces.

Every layout (``harmony.driver.checkpoint.ranks``) stores the same training state under names: a weight or buffer whole
(``blocks.0.w``), or a piece of one (``share:blocks.0.w[a:b]``: elements ``a:b`` of the flattened parameter, with
the optimizer state of those elements under the same name). So a rank of any layout finds what it holds by
name and element range: a whole tensor, or its own piece, is cut from whichever saved entries cover those
elements, the optimizer state with it (an element-wise optimizer's state tensors have the parameter's elements;
its step count, a scalar, is the same in every piece). The result is a state dict in this run's layout, which
``harmony.driver.checkpoint.io`` checks against the module like any other before it writes the first byte.

Only the files holding something this rank needs are read, each checked against its sha256 and its manifest;
the files are mapped, not read, so a whole tensor cut from one costs no copy.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from harmony.base.errors import CheckpointError
from harmony.driver.checkpoint import files as ckfiles
from harmony.driver.checkpoint.check import read_mapped
from harmony.driver.checkpoint.ranks import Layout, describe
from harmony.driver.checkpoint.saves import choose, held

_PIECE = re.compile(r"share:(.+)\[(\d+):(\d+)\]")


def piece_of(name: str) -> tuple[str, int | None, int | None]:
    """(parameter, first element, end element) of a piece's name; (name, None, None) for a whole tensor."""
    m = _PIECE.fullmatch(name)
    return (m.group(1), int(m.group(2)), int(m.group(3))) if m else (name, None, None)


@dataclass
class Entry:
    """One saved tensor: elements ``lo:hi`` of ``base``, under ``name`` in file ``file`` of saved rank ``rank``."""

    base: str
    lo: int
    hi: int
    name: str
    rank: int
    file: int
    whole: bool


def _numel(spec: dict) -> int:
    n = 1
    for d in spec["shape"]:
        n *= d
    return n


def _index(manifests: list[dict], key: str) -> dict[str, list[Entry]]:
    """base -> the saved entries of it (``key``: 'model' or 'optimizer'), rank 0's first."""
    out: dict[str, list[Entry]] = {}
    for rank, manifest in enumerate(manifests):
        for i, f in enumerate(manifest["files"]):
            for name, spec in (f.get(key) or {}).items() if not f.get("rng") else ():
                base, lo, hi = piece_of(name)
                whole = lo is None
                if whole:
                    specs = spec if key == "model" else f.get("model", {}).get(name)
                    lo, hi = 0, _numel(specs) if isinstance(specs, dict) else 0
                out.setdefault(base, []).append(Entry(base, lo, hi, name, rank, i, whole))
    return out


def _cover(entries: list[Entry], lo: int, hi: int, prefer: int) -> list[tuple[Entry, int, int]] | None:
    """Saved entries covering elements ``lo:hi``, as (entry, from, to) in order (rank ``prefer``'s first where
    ranks saved the same elements); None where some elements are in no entry."""
    ranked = sorted(entries, key=lambda e: (e.rank != prefer, e.rank))
    out, cur = [], lo
    while cur < hi:
        e = next((e for e in ranked if e.lo <= cur < e.hi), None)
        if e is None:
            return None
        end = min(e.hi, hi)
        out.append((e, cur, end))
        cur = end
    return out


class Reshard:
    """A checkpoint saved in ``saved`` read into this rank's layout ``here`` (``rank`` of it)."""

    def __init__(self, path: Path, saved: Layout, here: Layout, rank: int, read_manifest):
        self.path, self.saved, self.here, self.rank = path, saved, here, rank
        chosen = choose([held(d) for d in saved.dirs], path)    # one save's directories, or refused naming ranks
        if chosen is None:           # a rank's directory holds no checkpoint: find names it (or, first, what is
            for d in saved.dirs:     # wrong with an earlier rank's)
                read_manifest(ckfiles.find(*ckfiles.paths(d)[:2])[0])
            raise CheckpointError(f"a rank's directory under {path} holds no checkpoint")
        self.srcs = [Path(h.path) for h in chosen[0]]
        self.note = chosen[1]
        self.recovered = any(src == ckfiles.paths(d)[1] for src, d in zip(self.srcs, saved.dirs))
        self.manifests = [read_manifest(src) for src in self.srcs]
        steps = {m["step"] for m in self.manifests}
        if len(steps) > 1:
            raise CheckpointError(f"its ranks' directories were saved at different steps ({sorted(steps)}): they "
                                  f"are not one save's. Load another checkpoint")
        self.step = steps.pop()
        self.models, self.optims = _index(self.manifests, "model"), _index(self.manifests, "optimizer")
        self.data: dict[tuple[int, int], dict] = {}

    def where(self) -> str:
        return f"{self.path} (saved by {describe(self.saved)})"

    def _read(self, e: Entry) -> dict:
        """The mapped payload of an entry's file, verified once: its sha256, then its tensors against its manifest."""
        key = (e.rank, e.file)
        if key not in self.data:
            f, src = self.manifests[e.rank]["files"][e.file], self.srcs[e.rank]
            ckfiles.verify(src, f)
            data = read_mapped(src / f["name"])
            _check_listed(data, f, src / f["name"])
            self.data[key] = data
        return self.data[key]

    def _flat(self, key: str, cover, state_key: str | None = None) -> torch.Tensor:
        parts = []
        for e, a, b in cover:
            data = self._read(e)
            t = data["model"][e.name] if key == "model" else data["optimizer"][e.name].get(state_key)
            if not isinstance(t, torch.Tensor) or t.numel() != e.hi - e.lo:
                raise CheckpointError(f"{e.name}{'' if key == 'model' else f'[{state_key!r}]'} in saved rank "
                                      f"{e.rank}'s files does not hold the {e.hi - e.lo} elements its name says")
            parts.append(t.reshape(-1)[a - e.lo: b - e.lo])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def weight(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The saved elements of the live tensor ``name`` (whole or a piece), shaped as it is."""
        base, lo, hi = piece_of(name)
        lo, hi = (0, like.numel()) if lo is None else (lo, hi)
        cover = _cover(self.models.get(base, []), lo, hi, self.rank)
        if cover is None:
            raise CheckpointError(f"{base!r} elements {lo}:{hi} are in none of its files; it does not match the "
                                  f"compiled model (another model, or a rank's directory is missing)")
        return self._flat("model", cover).view(like.shape)

    def optim(self, name: str, like: torch.Tensor) -> dict | None:
        """The optimizer state of the live parameter ``name``'s elements, or None where none was saved."""
        base, lo, hi = piece_of(name)
        whole = lo is None
        lo, hi = (0, like.numel()) if whole else (lo, hi)
        entries = self.optims.get(base)
        if not entries:
            return None
        cover = _cover(entries, lo, hi, self.rank)
        if cover is None:
            raise CheckpointError(f"the optimizer state of {base!r} elements {lo}:{hi} is in none of its files: some "
                                  f"of its pieces were saved without state")
        first, a0, b0 = cover[0]
        if whole and first.whole and len(cover) == 1:      # saved whole, wanted whole: as it is, any optimizer
            return dict(self._read(first)["optimizer"][first.name])
        out = {}
        for k, v in self._read(first)["optimizer"][first.name].items():
            if not isinstance(v, torch.Tensor) or v.dim() == 0:
                out[k] = v          # a step count: the same for every element
            elif v.numel() == first.hi - first.lo:
                out[k] = self._flat("optimizer", cover, k).view(like.shape)
            else:
                raise CheckpointError(
                    f"the optimizer state {base}[{k!r}] has {v.numel()} elements for the parameter's "
                    f"{first.hi - first.lo}: it is not element-wise, so it cannot be cut into another rank's "
                    f"piece. Load it into {describe(self.saved)}, or into a layout that keeps each parameter "
                    f"whole (no shard_state, shard_state=True or a pipeline)")
        return out

    def groups(self, live) -> list[list[dict]]:
        """This run's param groups with the saved hyperparameters of their parameters."""
        saved = {}
        for manifest in self.manifests:
            for per_opt in manifest["param_groups"]:
                for g in per_opt:
                    for n in g.get("params", []) if isinstance(g.get("params"), list) else ():
                        saved.setdefault(piece_of(n)[0], g)
        out = []
        for per_opt in live.groups:
            out.append([{**{k: v for k, v in saved.get(piece_of(names[0])[0], {}).items() if k != "params"},
                         "params": list(names)} for names, _ in per_opt])
        return out

    def rng(self) -> dict:
        """This rank's saved RNG where it had a rank of that number, else rank 0's."""
        r = self.rank if self.rank < len(self.srcs) else 0
        f = next(f for f in self.manifests[r]["files"] if f.get("rng"))
        ckfiles.verify(self.srcs[r], f)
        rng = ckfiles.read_file(self.srcs[r] / f["name"])
        if not isinstance(rng, dict) or not isinstance(rng.get("cpu"), torch.Tensor):
            raise CheckpointError(f"{self.srcs[r]}: its RNG file holds no CPU generator state")
        return rng

    def state_dict(self, live, fmt: int) -> dict:
        """This rank's state in ``checkpoint.io.training_state_dict``'s form, every piece read and checked."""
        model = {n: self.weight(n, t) for n, t in live.tensors.items()}
        optim = {}
        for n in live.optimizers:
            state = self.optim(n, live.tensors[n])
            if state:
                optim[n] = state
        first = self.manifests[0]
        sd = {"format": fmt, "model": model, "optimizer": optim, "param_groups": self.groups(live),
              "step": self.step, "rng": self.rng(), "schedulers": first.get("schedulers", [])}
        if first.get("loss_scaler") is not None:
            sd["loss_scaler"] = first["loss_scaler"]
        return sd


def _check_listed(data, f: dict, path: Path) -> None:
    """A data file holds exactly the tensors its manifest lists, each of the listed shape and dtype."""
    def fail(what):
        return CheckpointError(f"{path}: {what}; nothing was changed. The checkpoint is damaged or was edited: load "
                               f"another one")

    if not isinstance(data, dict) or not isinstance(data.get("model"), dict) \
            or not isinstance(data.get("optimizer"), dict):
        raise fail("it does not hold a dict of 'model' and 'optimizer' tensors")
    listed_model, listed_optim = f.get("model", {}), f.get("optimizer", {})
    if set(data["model"]) != set(listed_model) or set(data["optimizer"]) != set(listed_optim):
        raise fail("it does not hold the tensors its manifest lists")
    for n, t in data["model"].items():
        if not _matches(t, listed_model[n]):
            raise fail(f"tensor {n!r} is not the {listed_model[n]} its manifest lists")
    for n, state in data["optimizer"].items():
        if not isinstance(state, dict):
            raise fail(f"optimizer state {n!r} is not a dict")
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and not _matches(v, (listed_optim.get(n) or {}).get(k)):
                raise fail(f"optimizer state {n}[{k!r}] is not the {(listed_optim.get(n) or {}).get(k)} its "
                           f"manifest lists")


def _matches(t, spec) -> bool:
    return isinstance(t, torch.Tensor) and isinstance(spec, dict) and list(t.shape) == spec["shape"] \
        and str(t.dtype).removeprefix("torch.") == spec["dtype"]
