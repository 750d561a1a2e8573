"""``sm.state_dict()`` and ``sm.load_state_dict()`` as ``nn.Module`` has them: the model's parameters and persistent
buffers under the model's own names, read from and written to wherever the runtime keeps them.

>>> sd = sm.state_dict()                  # {"tok.weight": tensor, ...}: what model.state_dict() would hold
>>> sm.load_state_dict(sd)                # the weights set in place; optimizer state, step and RNG stay

A weight is read where it lives (the host master, a resident device copy, a pack's file on disk, or, under
``shard_state="full"``, gathered from the ranks' shares) and written the same way (``LiveState.write_tensor``),
so the next step trains from the loaded weights. The whole training state (optimizer state, hyperparameters,
step, RNG, schedulers) is ``training_state_dict`` (io.py); a dict in that form given to ``load_state_dict`` still
loads, with a ``FutureWarning`` naming ``load_training_state_dict``.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict

import torch
from torch.nn.modules.module import _IncompatibleKeys

from harmony.base.errors import CheckpointError, ConfigError
from harmony.driver.checkpoint.io import FORMAT, load_training_state_dict
from harmony.runtime.tiers.live import LiveState


def entries(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of what ``model.state_dict()`` holds, in its order, without calling it (the model refuses
    it while weights of it live elsewhere: driver/usermodel.py): each module's parameters, then its persistent
    buffers, a module reachable by two paths under both."""
    out = []
    for path, mod in model.named_modules(remove_duplicate=False):
        pre = f"{path}." if path else ""
        out += [(pre + n, p) for n, p in mod.named_parameters(recurse=False, remove_duplicate=False)]
        out += [(pre + n, b) for n, b in mod.named_buffers(recurse=False, remove_duplicate=False)
                if n not in mod._non_persistent_buffers_set]
    return out


def _refuse_split(sm, call: str) -> None:
    if getattr(getattr(sm, "plan", None), "stage", None) is not None:
        raise ConfigError(f"{call} under parallel='pipeline': each rank holds its own packs' weights only; use "
                          f"sm.training_state_dict() on every rank, or harmony.save, which writes each rank's")


def module_state_dict(sm, destination=None, prefix: str = "", keep_vars: bool = False) -> dict:
    """The model's weights by its names (see the module docstring); tensors the runtime holds are referenced,
    weights read from disk or gathered from the ranks are new tensors."""
    _refuse_split(sm, "sm.state_dict()")
    out = OrderedDict() if destination is None else destination
    shares = getattr(getattr(sm.runtime, "state", None), "shares", None)
    if shares is not None:      # shard_state="full": every rank gathers the whole weights into the model
        shares.gather_all(sm.runtime.state.tensors)
        values = {}
    else:
        live = LiveState(sm) if sm.runtime is not None else None
        values = live.weights(list(live.tensors)) if live is not None else {}
        values = {id(live.tensors[n]): v for n, v in values.items()}
    for name, t in entries(sm.model):
        v = values.get(id(t))
        if v is None or (keep_vars and v.data_ptr() == t.data_ptr()):    # the tensor the runtime reads
            v = t if keep_vars else t.detach()
        out[prefix + name] = v
    return out


def is_training_state(sd) -> bool:
    """A dict in ``training_state_dict``'s form (what ``sm.state_dict()`` returned before it followed nn.Module)."""
    return isinstance(sd, dict) and sd.get("format") == FORMAT and isinstance(sd.get("model"), dict) \
        and "optimizer" in sd and "step" in sd


def load_module_state_dict(sm, sd, strict: bool = True, assign: bool = False):
    """Copy ``sd``'s weights into the model wherever they live; returns ``(missing_keys, unexpected_keys)`` as
    ``nn.Module.load_state_dict`` does. A wrong shape, or under ``strict`` a missing or unexpected key, raises
    ``CheckpointError`` before anything changes."""
    if is_training_state(sd):
        warnings.warn("sm.load_state_dict() was given a training state (a dict with 'format', 'model', "
                      "'optimizer', ...): use sm.load_training_state_dict() for it; sm.load_state_dict() takes "
                      "the model's weights by name, as nn.Module.load_state_dict does", FutureWarning, stacklevel=3)
        load_training_state_dict(sm, sd)
        return _IncompatibleKeys([], [])
    _refuse_split(sm, "sm.load_state_dict()")
    if getattr(getattr(sm.runtime, "state", None), "shares", None) is not None:
        raise ConfigError("sm.load_state_dict() under shard_state='full' is not built yet: each rank holds its "
                          "shares of the weights; use harmony.load or sm.load_training_state_dict()")
    if assign:
        raise ConfigError("sm.load_state_dict(assign=True): the weights live where the plan placed them; "
                          "assign=False copies the values into them")
    expected = dict(entries(sm.model))
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    wrong = [f"{k}: given {tuple(v.shape)}, model {tuple(expected[k].shape)}" for k, v in sd.items()
             if k in expected and tuple(v.shape) != tuple(expected[k].shape)]
    if wrong or (strict and (missing or unexpected)):
        said = [f"missing keys {missing[:3]}{' ...' if len(missing) > 3 else ''}"] if strict and missing else []
        said += [f"unexpected keys {unexpected[:3]}{' ...' if len(unexpected) > 3 else ''}"] if strict and unexpected \
            else []
        raise CheckpointError(f"sm.load_state_dict(): {'; '.join(said + wrong[:3])}. Nothing was changed "
                              f"(strict=False loads the keys the model has)")
    live = LiveState(sm)
    canonical = {id(t): n for n, t in live.tensors.items()}
    for k, v in sd.items():
        if k not in expected:
            continue
        name = canonical.get(id(expected[k]))
        value = v.detach().to(dtype=expected[k].dtype)
        if name is None:            # a tensor the trace does not read: the model's own
            with torch.no_grad():
                expected[k].copy_(value)
        else:
            live.write_tensor(name, value)
    live.write_optims({}, [])       # weights of packs wholly on disk: each file written once, its state kept
    return _IncompatibleKeys(missing, unexpected)
