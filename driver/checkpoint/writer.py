"""``harmony.save``: a compiled module's training state written into a checkpoint directory, atomically.

What a checkpoint holds and how it is read back is ``harmony.driver.checkpoint.io``; the directory's mechanics
(temporary directory, renames, fsyncs, checksums) are ``harmony.driver.checkpoint.files``; how every rank's part
belongs to one save is ``harmony.driver.checkpoint.saves``.
"""
from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import torch

from harmony.base.errors import CheckpointError
from harmony.base.units import fmt_bytes
from harmony.driver.checkpoint import files as ckfiles
from harmony.driver.checkpoint import saves
from harmony.driver.checkpoint.check import seal
from harmony.driver.checkpoint.files import MANIFEST
from harmony.driver.checkpoint.groups import model_groups
from harmony.driver.checkpoint.io import FORMAT, KIND, jsonable, rank_path, refuse_torn, rng_state, scaler, spec
from harmony.driver.checkpoint.ranks import this_layout
from harmony.driver.guard import guarded
from harmony.driver.handshake import CALLS, agree
from harmony.runtime.comm import failures
from harmony.runtime.tiers.live import LiveState


@guarded("harmony.save")
def save(sm, path, *, progress=None) -> Path:
    """Write ``sm``'s training state to the directory ``path``, replacing the checkpoint there atomically.

    >>> harmony.save(sm, "runs/ckpt")
    PosixPath('/.../runs/ckpt')

    ``progress(done, total, file)`` is called after each file is durably written. A full
    disk or an unwritable path raises ``CheckpointError``; the previous checkpoint stays
    intact and no temporary files are left behind. With optimizer state sharded over
    data-parallel ranks (``shard_state``) or a pipeline, every rank calls it with the same ``path`` and writes
    its own ``path/rank-R-of-W`` (``load`` reads it back on the same rank), each renamed into place only once every
    rank's is complete (``harmony.driver.checkpoint.saves``): a rank that fails makes every rank raise, each keeping
    its previous checkpoint. With replicated state every rank calls it too, rank 0 writes (the ranks hold the same
    state) and the others return once it has, raising its ``CheckpointError`` if it failed. Every rank's files name
    the same save id, so ``load`` never mixes two saves. Called on some ranks only (``if rank == 0``), it raises
    ``CommunicationError`` at once on every rank, naming each rank's call (``harmony.driver.handshake``).
    """
    agree(sm, CALLS[1])     # every rank saves now: one that steps instead is named at once, on every rank
    ident = saves.draw(sm, CALLS[1])
    if getattr(sm, "handshake", None) is not None and getattr(sm.program.plan, "sharded", False):
        return saves.commit_together(sm, lambda: _stage(sm, path, progress, ident), CALLS[1])
    refuse_torn(sm)
    if not _replicated_ranks(sm):
        return _save_here(sm, path, progress, ident)
    import torch.distributed as dist
    box, error = [None], None
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", str(_save_here(sm, path, progress, ident)))
        except CheckpointError as e:
            box[0], error = ("error", str(e)), e
    failures.guarded("harmony.save's word from rank 0 on the checkpoint the ranks share", dist.broadcast_object_list,
                     box, src=0, timeout=sm.program.config.comm_timeout, peer=0)
    if error is not None:
        raise error
    kind, value = box[0]
    if kind == "error":
        raise CheckpointError(f"rank 0 could not save the checkpoint the ranks share: {value}")
    return Path(value)


def _replicated_ranks(sm) -> bool:
    """Data-parallel ranks holding the same (unsharded) state: one of them writes the checkpoint."""
    import torch.distributed as dist
    cfg, plan = sm.program.config, getattr(sm.program, "plan", None)
    return (bool(getattr(cfg, "data_parallel", False)) and (getattr(cfg, "world_size", 1) or 1) > 1
            and dist.is_available() and dist.is_initialized() and not getattr(plan, "sharded", False))


def _save_here(sm, path, progress, ident: dict) -> Path:
    """``save`` on this process alone: every file written into a fresh temporary directory, which then takes the
    place of ``path``'s (``ckfiles.commit``)."""
    staged = _stage(sm, path, progress, ident)
    try:
        ckfiles.commit(staged.tmp, staged.target, staged.old)
    except OSError as e:
        staged.discard()
        raise CheckpointError(ckfiles.explain_save(e, staged.target, staged.need, staged.previous)) from e
    except BaseException:
        staged.discard()
        raise
    return staged.target


def _stage(sm, path, progress, ident: dict) -> saves.Staged:
    """This rank's checkpoint written completely under a temporary name beside its directory (not yet in place)."""
    refuse_torn(sm)
    target, old, tmp = ckfiles.paths(rank_path(sm, path))
    live = LiveState(sm)
    groups = _param_groups(live, target)
    need = live.nbytes()
    previous = False
    try:
        ckfiles.recover(target, old)
        previous = ckfiles.check_replaceable(target)
        _make_temp(target, tmp, need)
        layout = live.layout() if sm.mode.saves_state(sm.program.plan) else []     # a grid: its first pipeline's
        total = len(layout) + 2         # the steps ``progress`` counts: each pack's file, rng.pt, the manifest
        files = _write_packs(live, layout, tmp, progress, total)
        size, digest = ckfiles.write_file(tmp / "rng.pt", rng_state())
        files.append({"name": "rng.pt", "pack": None, "bytes": size, "sha256": digest, "rng": True})
        if progress is not None:
            progress(total - 1, total, tmp / "rng.pt")
        _write_manifest(sm, live, tmp, groups, files, ident)
        if progress is not None:
            progress(total, total, tmp / MANIFEST)
        ckfiles.fsync_dir(tmp)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(ckfiles.explain_save(e, target, need, previous)) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return saves.Staged(tmp, target, old, need, previous)


def _param_groups(live: LiveState, target: Path) -> list:
    """The optimizers' parameter groups as the manifest holds them (names, plain hyperparameters); refused, naming
    ``target``, where a hyperparameter is not plain JSON."""
    groups = [[{"params": list(names), **{k: jsonable(v) for k, v in g.items() if k != "params"}}
               for names, g in per_opt] for per_opt in live.groups]
    try:
        json.dumps(groups)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"cannot save to {target}: an optimizer hyperparameter is not a number, "
                              f"string, bool or list ({e}); keep hyperparameters plain values") from None
    return groups


def _make_temp(target: Path, tmp: Path, need: int) -> None:
    """An empty private ``tmp`` beside ``target``, once the file system has ``need`` bytes free (ENOSPC if not)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    ckfiles.remove_stale_temps(target)
    usage = shutil.disk_usage(target.parent)
    if usage.total and usage.free < need:   # (pseudo file systems such as /proc report no size at all)
        raise OSError(errno.ENOSPC, f"{fmt_bytes(usage.free)} free, the checkpoint needs at least "
                      f"{fmt_bytes(need)}", str(target.parent))
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(mode=0o700)       # private, as the offload directories are: it is the model


def _write_packs(live: LiveState, layout: list, tmp: Path, progress, total: int) -> list[dict]:
    """Write each pack's file into ``tmp``, one pack's state in memory at a time; returns their manifest entries."""
    files = []
    for i, (stem, pack, names) in enumerate(layout):
        payload = live.payload(names)
        name = f"{stem}.pt"
        size, digest = ckfiles.write_file(tmp / name, payload)
        files.append({"name": name, "pack": pack, "bytes": size, "sha256": digest,
                      "model": {n: spec(t) for n, t in payload["model"].items()},
                      "optimizer": {n: {k: spec(v) for k, v in s.items()}
                                    for n, s in payload["optimizer"].items()}})
        del payload
        if progress is not None:
            progress(i + 1, total, tmp / name)
    return files


def _write_manifest(sm, live: LiveState, tmp: Path, groups: list, files: list[dict], ident: dict) -> None:
    """The manifest: format, step, layout, the save it belongs to, hyperparameters, the model's param groups,
    schedulers, loss scaler and every file's entry."""
    here = this_layout(sm)
    manifest = {"format": KIND, "version": FORMAT, "step": sm.steps, "torch": torch.__version__,
                "world": here.world, "mode": here.mode, "save": ident,
                "param_groups": groups, "files": files,
                "constants": {k: jsonable(v) for k, v in sm.program.constants.items()},   # the batch traced with
                "schedulers": [jsonable(s.state_dict()) for s in getattr(sm, "schedulers", ())]}
    grouped = model_groups(sm, live)
    if grouped is not None:
        manifest["model_groups"] = grouped
    if scaler(sm) is not None:
        manifest["loss_scaler"] = scaler(sm).state_dict()
    ckfiles.write_bytes(tmp / MANIFEST, json.dumps(seal(manifest), indent=1).encode())
