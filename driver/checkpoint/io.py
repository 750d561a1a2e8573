"""Checkpoints of a compiled training run: a training state dict in memory, and a crash-safe directory on disk.

A checkpoint holds what a resumed run needs to continue bitwise as if it had never
stopped: every parameter and buffer, each parameter's optimizer state, the optimizer
hyperparameters, the step count, torch's RNG state and, under fp16, the loss scale.
Under mixed precision the parameters saved are the fp32 masters: the runtime's tensors
point at them between steps (the device's compute copies live only within a step).

>>> harmony.save(sm, "ckpt")          # after some steps
>>> harmony.load(sm2, "ckpt")         # sm2: the same model compiled again, any budget
CheckpointInfo(path=PosixPath('/.../ckpt'), step=2, recovered=False)

On disk::

    ckpt/manifest.json   format, step, hyperparameters; per file its bytes, sha256 and tensor shapes
    ckpt/pack-000.pt     pack 0's parameters, buffers and optimizer state: plain dicts of tensors
    ckpt/...
    ckpt/rng.pt          torch's RNG state

Saving writes ``ckpt.tmp-<pid>`` completely (each file and the directory fsynced), then
renames ``ckpt`` to ``ckpt.old``, the new one to ``ckpt``, and removes ``ckpt.old``. A
process killed at any moment leaves a complete checkpoint under ``ckpt`` or, between the
two renames, under ``ckpt.old``, which ``load`` falls back to (and the next ``save``
puts back). Loading reads files with ``torch.load(weights_only=True)`` only after the
manifest matches the model and every file matches its checksum. (Saving is
``harmony.driver.checkpoint.writer``; the directory's mechanics, the renames, fsyncs, checksums and error
messages, are ``harmony.driver.checkpoint.files``; how the ranks' directories belong to one save is
``harmony.driver.checkpoint.saves``; finding each tensor in the tier it lives in is
``harmony.runtime.tiers.live``.)

Tensors are referenced where the runtime keeps them (device copy or host master), never
gathered first: the writer pulls one pack's state at a time, the unit the runtime moves.
"""
from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from harmony.base.errors import CheckpointError, TornStepError
from harmony.driver.checkpoint import files as ckfiles
from harmony.driver.checkpoint import saves
from harmony.driver.checkpoint.check import (
    check_against_model,
    check_groups,
    check_manifest,
    check_payload,
    check_schedulers,
    check_step,
    read_mapped,
    valid_groups,
)
from harmony.driver.checkpoint.files import MANIFEST
from harmony.driver.checkpoint.groups import check_model_groups, merged, model_groups
from harmony.driver.checkpoint.ranks import describe, saved_layout, this_layout
from harmony.driver.checkpoint.reshard import Reshard
from harmony.driver.guard import guarded
from harmony.driver.handshake import CALLS, agree
from harmony.runtime.tiers.live import LiveState
from harmony.runtime.transaction import describe_torn

FORMAT = 1
KIND = "harmony-checkpoint"


@dataclass
class CheckpointInfo:
    """What ``load`` loaded: the directory, the step it was saved at, and whether it was ``<dir>.old``."""

    path: Path
    step: int
    recovered: bool


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def spec(t) -> dict | None:
    return {"shape": list(t.shape), "dtype": _dtype_name(t.dtype)} if isinstance(t, torch.Tensor) else None


# -- state dicts -------------------------------------------------------------------------------
def training_state_dict(sm) -> dict:
    """The training state of ``sm``, referencing its live tensors (no copies).

    >>> sd = sm.training_state_dict()
    >>> sorted(sd)
    ['format', 'model', 'model_groups', 'optimizer', 'param_groups', 'rng', 'schedulers', 'step']

    The tensors are the ones the runtime trains: save or clone them before the next step.
    Optimizer state the runtime keeps on disk (``host_memory_budget``) is read into new
    tensors, so this dict holds all of it in memory; ``harmony.save`` reads one pack at a time.
    """
    live = LiveState(sm)
    grouped = model_groups(sm, live)
    return {
        "format": FORMAT,
        "model": live.weights(list(live.tensors)),
        "optimizer": {n: dict(s) for n, s in live.optim_states(list(live.optimizers)).items()},
        "param_groups": [[{"params": list(names), **{k: v for k, v in g.items() if k != "params"}}
                          for names, g in groups] for groups in live.groups],
        "step": sm.steps,
        "rng": rng_state(),
        "schedulers": [s.state_dict() for s in getattr(sm, "schedulers", ())],
        **({"model_groups": grouped} if grouped is not None else {}),
        **({"loss_scaler": scaler(sm).state_dict()} if scaler(sm) is not None else {}),
    }


def scaler(sm):
    """fp16's loss scaler (runtime/precision.py), whose scale a resumed run continues from; else None."""
    return getattr(sm.runtime, "scaler", None)


def _load_scaler(sm, state: dict | None) -> None:
    """Continue from the saved loss scale; a checkpoint without one (fp32, bf16) leaves the initial scale."""
    if state is not None and scaler(sm) is not None:
        scaler(sm).load_state_dict(state)


def load_training_state_dict(sm, sd: dict) -> None:
    """Restore ``sm`` from ``sd`` (from ``training_state_dict``) in place, after checking it matches the model.

    >>> sm2.load_training_state_dict(sm.training_state_dict())

    A mismatch raises ``CheckpointError`` before anything is changed.
    """
    if not isinstance(sd, dict) or sd.get("format") != FORMAT:
        got = sd.get("format") if isinstance(sd, dict) else type(sd).__name__
        raise CheckpointError(f"state dict has format {got!r}, this Harmony reads format {FORMAT}; "
                              f"pass the dict that sm.training_state_dict() returns")
    for key in ("model", "optimizer", "param_groups", "step", "rng"):
        if key not in sd:
            raise CheckpointError(f"state dict has no {key!r} entry; pass the dict that "
                                  f"sm.training_state_dict() returns")
    check_step(sd["step"], "the state dict")
    live, sd, groups = _checked_state(sm, sd, "the state dict")
    _write_state(sm, live, sd, groups)


def _checked_state(sm, sd: dict, where: str) -> tuple:
    """``sd`` (a state dict's entries) checked against ``sm``, nothing written: (its LiveState, sd, the flat groups)."""
    live = LiveState(sm)
    model = {n: spec(t) for n, t in sd["model"].items()}
    optim = {n: {k: spec(v) for k, v in s.items()} for n, s in sd["optimizer"].items()}
    groups = [g for per_opt in sd["param_groups"] for g in per_opt]
    grouped = sd.get("model_groups")
    if grouped is not None and not valid_groups(grouped):
        raise CheckpointError(f"{where}: its 'model_groups' is {grouped!r}, not the param groups' count and each "
                              f"parameter's group; nothing was changed. Pass what sm.training_state_dict() returns")
    check_model_groups(grouped, sm, live, where)
    check_groups(groups, live, where)
    check_against_model(live, model, optim, groups, where)
    check_schedulers(sd.get("schedulers", []), getattr(sm, "schedulers", ()), where)
    return live, sd, groups


def _write_state(sm, live: LiveState, sd: dict, groups: list[dict]) -> None:
    """Replace ``sm``'s state with the checked ``sd``."""
    for n, t in sd["model"].items():
        live.write_tensor(n, t)
    live.write_optims(sd["optimizer"], list(live.optimizers))
    live.clear_optim(set(sd["optimizer"]))
    live.write_groups(groups)
    _load_schedules(sm, sd.get("schedulers", []))
    sm.steps = int(sd["step"])
    _consistent_again(sm)
    _set_rng_state(sd["rng"])
    _load_scaler(sm, sd.get("loss_scaler"))


def _load_schedules(sm, states: list) -> None:
    """``sm.optimizer`` takes its groups' settings back from the packs' optimizers (``write_groups`` restored
    theirs), then each registered scheduler its state (``check_schedulers`` matched their number)."""
    if getattr(sm, "optimizer", None) is not None:
        sm.optimizer.pull()
    for scheduler, state in zip(getattr(sm, "schedulers", ()), states):
        scheduler.load_state_dict(state)


def rng_state() -> dict:
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def _set_rng_state(rng: dict) -> None:
    torch.set_rng_state(rng["cpu"])
    if rng.get("cuda") and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(rng["cuda"])


# -- checkpoint directories (harmony.save is harmony.driver.checkpoint.writer) ---------------------------
@guarded("harmony.load")
def load(sm, path) -> CheckpointInfo:
    """Restore ``sm`` in place from the checkpoint directory ``path`` written by ``save``.

    >>> harmony.load(sm, "runs/ckpt")
    CheckpointInfo(path=PosixPath('/.../runs/ckpt'), step=2, recovered=False)

    The manifest is checked against the model and every file against its checksum before
    anything changes. If only ``<path>.old`` exists (a save was killed between its two
    renames) that is loaded, with a warning. A checkpoint saved by another number of ranks, or
    with another ``shard_state``, is resharded: each rank reads the pieces of the state it holds
    (``harmony.driver.checkpoint.reshard``). Over several ranks, each rank's part is read and checked
    before any rank changes anything: a rank that fails makes every rank raise.
    """
    agree(sm, CALLS[2])      # every rank loads now
    handshake = getattr(sm, "handshake", None)
    held = saves.exchange(sm, _held_here(sm, path), CALLS[2])    # before anything that can fail on one rank only
    apply, error = None, None
    try:
        apply = _prepare(sm, path, held)
    except Exception as e:    # noqa: BLE001 (told to the other ranks, then raised here)
        if handshake is None:
            raise
        error = e
    if handshake is not None:
        handshake.outcome(CALLS[2], error)
    return apply()


def _held_here(sm, path) -> list:
    """The saves this rank's own directory of ``path`` holds (``saves.held``); never raises."""
    try:
        return saves.held(rank_path(sm, path))
    except Exception:   # noqa: BLE001 (its load names what is wrong)
        return []


def _prepare(sm, path, held: list):
    """Everything ``load`` reads, read and checked; returns what writes it into ``sm``. ``held``: what each rank's
    own directory holds (``saves.held``), the same list on every rank."""
    here, saved = this_layout(sm), saved_layout(path)
    if saved is None:
        ckfiles.find(*ckfiles.paths(path)[:2])      # raises: no checkpoint there
    if saved.same(here) and _fits(sm, path, here):
        return _prepare_own(sm, path, held)
    where = f"cannot load {os.path.realpath(os.fspath(path))}: it was saved by {describe(saved)}; this run has " \
            f"{describe(here)}. Resharding it"
    try:
        rank = sm.program.plan.rank if here.world > 1 else 0
        reshard = Reshard(Path(path), saved, here, rank, _read_manifest)
        sd = reshard.state_dict(LiveState(sm), FORMAT)
        grouped = merged([m.get("model_groups") for m in reshard.manifests])
        if grouped is not None:
            sd["model_groups"] = grouped
        checked = _checked_state(sm, sd, f"{where}: the checkpoint")
    except CheckpointError as e:
        raise CheckpointError(f"{where} failed: {e}") from e
    except OSError as e:
        raise CheckpointError(f"{where} failed: could not read {e.filename}: {e.strerror or e}; nothing was "
                              f"changed. Check the file system, or load an older checkpoint.") from e

    def apply():
        _write_state(sm, *checked)
        _warn_recovered(reshard.recovered, path, sm.steps, reshard.note)
        return CheckpointInfo(Path(os.path.realpath(os.fspath(path))), reshard.step, reshard.recovered)
    return apply


def _fits(sm, path, here) -> bool:
    """This rank's own directory holds the names it holds now: the same owners (``balance``'s shares) or pipeline
    placement as when saved. Where not (another budget placed the packs otherwise), it is resharded too."""
    if here.mode == "whole":
        return True
    try:
        manifest = json.loads((ckfiles.paths(rank_path(sm, path))[0] / MANIFEST).read_text())
        files = [f for f in manifest["files"] if not f.get("rng")]
        model = {n for f in files for n in f.get("model", {})}
        optim = {n for f in files for n in f.get("optimizer", {})}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return True         # the own directory's load names what is wrong with it
    live = LiveState(sm)
    return model == set(live.tensors) and optim <= set(live.optimizers)


def _prepare_own(sm, path, held: list):
    """``_prepare`` of a checkpoint in this run's own layout: this rank's directory, of the save every rank holds
    (``saves.choose``)."""
    target, old, _ = ckfiles.paths(rank_path(sm, path))
    own = getattr(sm.program.plan, "sharded", False)     # each rank its own directory; else all read ``path``
    chosen = saves.choose(held, os.path.realpath(os.fspath(path))) if own else None
    if chosen is None:
        src, recovered = ckfiles.find(target, old)      # raises where there is none
        note = None
    else:
        src, note = Path(chosen[0][getattr(getattr(sm, "handshake", None), "rank", 0)].path), chosen[1]
        recovered = src == old
    manifest = _read_manifest(src)
    live = LiveState(sm)
    packs = [f for f in manifest["files"] if not f.get("rng")]
    model = {n: s for f in packs for n, s in f.get("model", {}).items()}
    optim = {n: s for f in packs for n, s in f.get("optimizer", {}).items()}
    groups = [g for per_opt in manifest["param_groups"] for g in per_opt]
    check_model_groups(manifest.get("model_groups"), sm, live, f"checkpoint {src}")
    check_groups(groups, live, src / MANIFEST)
    check_schedulers(manifest.get("schedulers", []), getattr(sm, "schedulers", ()), src / MANIFEST)
    check_against_model(live, model, optim, groups, f"checkpoint {src}")
    try:
        for f in manifest["files"]:
            ckfiles.verify(src, f)
        # every tensor checked against the manifest and the model before the first byte is copied: the files are
        # mapped, not read, so holding all of them costs no memory, and what is checked is what is copied
        datas = [read_mapped(src / f["name"]) for f in packs]
        for f, data in zip(packs, datas):
            check_payload(data, f, live, src / f["name"])
        rng = next(ckfiles.read_file(src / f["name"]) for f in manifest["files"] if f.get("rng"))
        if not isinstance(rng, dict) or not isinstance(rng.get("cpu"), torch.Tensor):
            raise CheckpointError(f"{src}: its RNG file holds no CPU generator state; nothing was changed. Load "
                                  f"another checkpoint")
    except OSError as e:
        raise CheckpointError(f"could not read checkpoint {src}: {e.strerror or e} ({e.filename}); "
                              f"nothing was changed. Check the file system, or load an older checkpoint.") from e

    def apply():
        try:
            for data in datas:
                for n, t in data["model"].items():
                    live.write_tensor(n, t)
                live.write_optims(data["optimizer"], list(data["model"]))
            datas.clear()
        except OSError as e:
            raise CheckpointError(f"could not read checkpoint {src}: {e.strerror or e} ({e.filename}). The model "
                                  f"may be partly loaded: load again, or another checkpoint, before training.") from e
        live.clear_optim(set(optim))
        live.write_groups(groups)
        _load_schedules(sm, manifest.get("schedulers", []))
        sm.steps = int(manifest["step"])
        _set_rng_state(rng)
        _consistent_again(sm)
        _load_scaler(sm, manifest.get("loss_scaler"))
        _warn_recovered(recovered, src, sm.steps, note)
        return CheckpointInfo(src, int(manifest["step"]), recovered)
    return apply


def _warn_recovered(recovered: bool, src, step: int, note: str | None = None) -> None:
    if note is not None:       # the ranks' directories of a save that did not commit on all: the previous one
        warnings.warn(note, stacklevel=3)
    elif recovered:
        warnings.warn(f"a checkpoint directory was missing under {src}: a save was interrupted between its renames; "
                      f"loaded the previous checkpoint {src} (step {step}). The next harmony.save there moves it "
                      f"back.", stacklevel=3)


def refuse_torn(sm) -> None:
    """A failed step updated some packs only (runtime/transaction.py): saving would store that mix as if whole."""
    torn = getattr(sm.runtime, "torn", None)
    if torn is not None:
        raise TornStepError(f"harmony.save refused: {describe_torn(torn)}")


def _consistent_again(sm) -> None:
    """A checkpoint loaded whole: a torn step's mix is gone."""
    if getattr(sm, "runtime", None) is not None:
        sm.runtime.torn = None


def jsonable(v):
    if isinstance(v, torch.Tensor):
        return v.tolist()
    return list(v) if isinstance(v, tuple) else v


def rank_path(sm, path) -> Path:
    """Where this rank's checkpoint goes: ``path`` itself, or ``path/rank-R-of-W`` when optimizer state is
    sharded over ranks (each rank holds only its shard, so each saves and loads its own, every one atomically)."""
    plan = getattr(sm.program, "plan", None)
    if not getattr(plan, "sharded", False):
        return Path(path)
    return Path(path) / f"rank-{plan.rank}-of-{sm.program.config.world_size}"


def _read_manifest(src: Path) -> dict:
    try:
        manifest = json.loads((src / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {src / MANIFEST}: {e}; the checkpoint is damaged, "
                              f"load an older one") from e
    if not isinstance(manifest, dict) or manifest.get("format") != KIND:
        raise CheckpointError(f"{src / MANIFEST} is not a Harmony checkpoint manifest")
    if manifest.get("version") != FORMAT:
        raise CheckpointError(f"{src} has checkpoint format {manifest.get('version')!r}; this Harmony reads "
                              f"format {FORMAT}: load it with the Harmony version that wrote it")
    check_manifest(manifest, src / MANIFEST)
    for f in manifest.get("files", []):
        name = f.get("name", "")
        if not name or name != os.path.basename(name) or name.startswith("."):
            raise CheckpointError(f"{src / MANIFEST} names a file outside the checkpoint ({name!r}); refusing it")
    if not any(f.get("rng") for f in manifest.get("files", [])) or "param_groups" not in manifest:
        raise CheckpointError(f"{src / MANIFEST} is incomplete (no RNG file or hyperparameters); load an older one")
    return manifest
