"""Everything a checkpoint says is checked before anything of the model changes.

``harmony.driver.checkpoint.io.load`` trusts nothing it reads: the manifest carries a sha256 of itself
(``seal`` / ``check_seal``), so an edited step or learning rate is found; every field has its
type and range checked (``check_manifest``, ``check_step``, ``check_groups``: a hyperparameter
must be of the kind the model's optimizer holds, finite, and in range); and every tensor of every
data file is compared, by name, shape and dtype, with the manifest and with the model
(``check_payload``) before the first byte is copied. Each failure is a ``CheckpointError`` naming
the field or tensor, and says that nothing was changed.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import torch

from harmony.base.errors import CheckpointError
from harmony.driver.checkpoint.files import read_file

SEAL = "manifest_sha256"
NON_NEGATIVE = ("lr", "eps", "weight_decay", "momentum", "dampening", "lr_decay", "initial_accumulator_value",
                "alpha", "rho")
_HEX = re.compile(r"[0-9a-f]{64}")


def _digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != SEAL}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def seal(manifest: dict) -> dict:
    """The manifest with a sha256 over its own contents."""
    return {**manifest, SEAL: _digest(manifest)}


def _fail(where, what: str) -> CheckpointError:
    return CheckpointError(f"{where}: {what}; nothing was changed. The checkpoint is damaged or was edited: "
                           f"load another one")


def check_seal(manifest: dict, where) -> None:
    if SEAL not in manifest:
        raise _fail(where, f"the manifest has no {SEAL!r} (its checksum), so an edit to it could not be seen")
    if manifest[SEAL] != _digest(manifest):
        raise _fail(where, "the manifest does not match its own sha256: a field was changed after it was saved")


def check_step(step, where) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise _fail(where, f"field 'step' is {step!r}; it must be a whole number >= 0")
    return step


def _spec_ok(spec) -> bool:
    if spec is None:
        return True
    return (isinstance(spec, dict) and set(spec) == {"shape", "dtype"} and isinstance(spec["shape"], list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in spec["shape"])
            and isinstance(spec["dtype"], str) and isinstance(getattr(torch, spec["dtype"], None), torch.dtype))


def check_manifest(manifest: dict, where) -> None:
    """Types and ranges of every field the loader reads (the manifest's own checksum first)."""
    check_seal(manifest, where)
    check_step(manifest.get("step"), where)
    files = manifest.get("files")
    if not isinstance(files, list) or not files:
        raise _fail(where, f"field 'files' is {type(files).__name__}; it must be a list of file entries")
    for i, f in enumerate(files):
        at = f"files[{i}]"
        if not isinstance(f, dict):
            raise _fail(where, f"{at} is {type(f).__name__}, not a file entry (a dict)")
        if not isinstance(f.get("name"), str):
            raise _fail(where, f"{at}.name is {f.get('name')!r}; it must be a file name")
        if isinstance(f.get("bytes"), bool) or not isinstance(f.get("bytes"), int) or f["bytes"] < 0:
            raise _fail(where, f"{at}.bytes is {f.get('bytes')!r}; it must be a whole number >= 0")
        if not isinstance(f.get("sha256"), str) or not _HEX.fullmatch(f["sha256"]):
            raise _fail(where, f"{at}.sha256 is {f.get('sha256')!r}; it must be 64 hex digits")
        if f.get("rng"):
            continue
        for key in ("model", "optimizer"):
            entries = f.get(key, {})
            if not isinstance(entries, dict):
                raise _fail(where, f"{at}.{key} is {type(entries).__name__}; it must map names to tensor specs")
            for name, spec in entries.items():
                specs = spec.values() if key == "optimizer" and isinstance(spec, dict) else [spec]
                if key == "optimizer" and not isinstance(spec, dict) or not all(map(_spec_ok, specs)):
                    raise _fail(where, f"{at}.{key}[{name!r}] is {spec!r}, not a tensor's shape and dtype")
    groups = manifest.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(per, list) and all(isinstance(g, dict) for g in per)
                                               for per in groups):
        raise _fail(where, "field 'param_groups' must be a list (one per optimizer) of lists of groups (dicts)")
    if "model_groups" in manifest and not valid_groups(manifest["model_groups"]):
        raise _fail(where, f"field 'model_groups' is {manifest['model_groups']!r}; it must hold the param groups' "
                           f"'count' and each parameter's group index under 'of'")
    save = manifest.get("save")
    if save is not None and not (isinstance(save, dict) and isinstance(save.get("id"), str)
                                 and isinstance(save.get("run"), str)):
        raise _fail(where, f"field 'save' is {save!r}; it must name the save's 'id' and its 'run'")
    scaler = manifest.get("loss_scaler")
    if scaler is not None:
        ok = isinstance(scaler, dict) and _finite(scaler.get("scale")) and scaler["scale"] > 0 and all(
            isinstance(scaler.get(k, 0), int) and scaler.get(k, 0) >= 0 for k in ("growth_tracker", "skipped"))
        if not ok:
            raise _fail(where, f"field 'loss_scaler' is {scaler!r}; it needs scale > 0 and counts >= 0")


def valid_groups(grouped) -> bool:
    """A ``model_groups`` entry (driver/checkpoint/groups.py) has its form: the groups' count, each parameter's."""
    return (isinstance(grouped, dict) and isinstance(grouped.get("count"), int) and grouped["count"] >= 1
            and isinstance(grouped.get("of"), dict) and all(
                isinstance(n, str) and isinstance(i, int) and not isinstance(i, bool) and 0 <= i < grouped["count"]
                for n, i in grouped["of"].items()))


def check_schedulers(states, schedulers, where) -> None:
    """One saved state per scheduler registered on the module (``sm.add_scheduler``), each a dict."""
    if not isinstance(states, list) or not all(isinstance(s, dict) for s in states):
        raise _fail(where, "field 'schedulers' must be a list of scheduler states (dicts)")
    if len(states) != len(schedulers):
        raise CheckpointError(f"{where} holds the state of {len(states)} lr schedulers, and this module has "
                              f"{len(schedulers)} registered (sm.add_scheduler); nothing was changed. Register "
                              f"the same schedulers, in the same order, before loading")


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _kind(v):
    if isinstance(v, torch.Tensor):
        v = v.tolist()
    if v is None or isinstance(v, (bool, str)):
        return type(v).__name__
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, (list, tuple)):
        return tuple(_kind(x) for x in v)
    return type(v).__name__


def check_groups(groups: list[dict], live, where) -> None:
    """Each saved hyperparameter is of the kind this model's optimizer holds there, finite and in range."""
    current = {n: g for per_opt in live.groups for names, g in per_opt for n in names}
    for i, g in enumerate(groups):
        names = g.get("params")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise _fail(where, f"param group {i} has 'params' {names!r}; it must be a list of parameter names")
        now = next((current[n] for n in names if n in current), None)
        for k, v in g.items():
            if k == "params":
                continue
            if now is not None and k in now and _kind(v) != _kind(now[k]):
                raise _fail(where, f"hyperparameter {k!r} of param group {i} ({names[0] if names else '-'}) is "
                                   f"{v!r}; this optimizer holds a {_show_kind(now[k])} there")
            numbers = v if isinstance(v, (list, tuple)) else [v]
            if any(isinstance(x, float) and not math.isfinite(x) for x in numbers):
                raise _fail(where, f"hyperparameter {k!r} of param group {i} is {v!r}: not finite")
            if (k in NON_NEGATIVE or k == "betas") and any(_finite(x) and x < 0 for x in numbers):
                raise _fail(where, f"hyperparameter {k!r} of param group {i} is {v!r}: it must be >= 0")
            if k == "betas" and any(_finite(x) and x >= 1 for x in numbers):
                raise _fail(where, f"hyperparameter 'betas' of param group {i} is {v!r}: each must be < 1")


def _show_kind(v) -> str:
    k = _kind(v)
    return f"list of {len(k)} ({', '.join(map(str, k))})" if isinstance(k, tuple) else k


def read_mapped(path: Path) -> dict:
    """A data file's tensors, mapped rather than read (checking them costs no copy), as plain tensors only."""
    return read_file(path, mmap=True)


def check_payload(data, f: dict, live, path: Path) -> None:
    """Every tensor in a data file is the one its manifest lists and the model holds: name, shape and dtype."""
    if not isinstance(data, dict) or not isinstance(data.get("model", {}), dict) \
            or not isinstance(data.get("optimizer", {}), dict):
        raise _fail(path, "it does not hold a dict of 'model' and 'optimizer' tensors")
    listed_model, listed_optim = f.get("model", {}), f.get("optimizer", {})
    if set(data.get("model", {})) != set(listed_model) or set(data.get("optimizer", {})) != set(listed_optim):
        raise _fail(path, "it does not hold the tensors its manifest lists")
    for n, t in data.get("model", {}).items():
        model = live.tensors.get(n)
        if not isinstance(t, torch.Tensor) or model is None or t.shape != model.shape or t.dtype != model.dtype:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            want = f"{tuple(model.shape)} {model.dtype}" if model is not None else "nothing (not in the model)"
            raise _fail(path, f"tensor {n!r} is {got}; the model holds {want}")
    for n, state in data.get("optimizer", {}).items():
        if not isinstance(state, dict) or n not in live.optimizers:
            raise _fail(path, f"optimizer state {n!r} is not a trained parameter's state")
        for k, v in state.items():
            spec = (listed_optim.get(n) or {}).get(k)
            if isinstance(v, torch.Tensor) and (spec is None or list(v.shape) != spec["shape"]
                                                or str(v.dtype).removeprefix("torch.") != spec["dtype"]):
                raise _fail(path, f"optimizer state {n}[{k!r}] is {tuple(v.shape)} {v.dtype}, the manifest "
                                  f"lists {spec}")


def check_against_model(live, model: dict, optim: dict, groups: list[dict], where: str) -> None:
    """Every mismatch between a checkpoint's contents and the compiled model, in one error."""
    problems = []
    missing = [n for n in live.tensors if n not in model]
    extra = [n for n in model if n not in live.tensors]
    if missing:
        problems.append(f"{len(missing)} tensors of the model are missing ({_few(missing)})")
    if extra:
        problems.append(f"{len(extra)} tensors are not in the model ({_few(extra)})")
    wrong = []
    for n, spec in model.items():
        if n in live.tensors:
            t = live.tensors[n]
            if spec is None or spec != _spec(t):
                wrong.append(f"{n}: checkpoint {_show(spec)}, model {_show(_spec(t))}")
    for n, state in optim.items():
        if n not in live.optimizers:
            wrong.append(f"optimizer state for {n!r}, which is not a trained parameter of this model")
            continue
        for k, spec in state.items():
            old = live.optim_state(n).get(k)
            if isinstance(old, torch.Tensor) and spec is not None and spec["shape"] != list(old.shape):
                wrong.append(f"optimizer state {n}[{k!r}]: checkpoint {_show(spec)}, now {_show(_spec(old))}")
    if wrong:
        problems.append(f"{len(wrong)} entries do not match: " + "; ".join(wrong[:5])
                        + (" ..." if len(wrong) > 5 else ""))
    saved = {}
    for g in groups:
        for n in g.get("params", []):
            saved[n] = g
    unplaced = [n for n in live.optimizers if n not in saved]
    if unplaced:
        problems.append(f"no optimizer hyperparameters for {len(unplaced)} parameters ({_few(unplaced)})")
    for opt_groups in live.groups:
        for names, group in opt_groups:
            found = [saved[n] for n in names if n in saved]
            if not found:
                continue
            keys = {k for k in found[0] if k != "params"}
            unknown = sorted(keys - set(group))
            if unknown:
                cls = type(live.optimizers[names[0]]).__name__
                problems.append(f"hyperparameters {unknown} are unknown to this model's {cls}: "
                                f"the checkpoint was saved with another optimizer class")
                break
            differ = [n for n, g in zip(names, found) if g is not found[0]
                      and any(_plain(g.get(k)) != _plain(found[0].get(k)) for k in keys)]
            if differ:
                problems.append(f"{names[0]} and {differ[0]} share an optimizer group here but had different "
                                f"hyperparameters when saved")
    if problems:
        raise CheckpointError(f"{where} does not match the compiled model: " + "; ".join(problems) +
                              ". Load a checkpoint saved from the same model (same parameter names and shapes, "
                              "as in model.state_dict()) and the same optimizer class; the memory budget and "
                              "microbatches may differ. Nothing was changed.")


def _few(names: list[str]) -> str:
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")


def _show(spec) -> str:
    return "a non-tensor" if spec is None else f"{tuple(spec['shape'])} {spec['dtype']}"


def _plain(v):
    if isinstance(v, torch.Tensor):
        return v.tolist()
    return list(v) if isinstance(v, tuple) else v


def _spec(t) -> dict | None:
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} if isinstance(t, torch.Tensor) \
        else None
