"""The model's param groups a checkpoint was saved with, checked on load as ``torch.optim.Optimizer.load_state_dict``
checks them.

Harmony steps one optimizer per pack, each holding its pack's share of the model's param groups (``sm.optimizer``'s
groups: one, or those of ``param_groups=``). A checkpoint records how many groups the model had and which group
each parameter was in (``model_groups``); a load into a module whose groups differ in number, or that puts a
parameter in another group, is refused (``check_model_groups``), as torch refuses a state dict with another number
of groups or groups of other sizes. Where they match, the saved hyperparameters (lr, weight_decay, ...) replace
the module's, as torch's ``load_state_dict`` takes the saved groups' settings.
"""
from __future__ import annotations

from harmony.base.errors import CheckpointError
from harmony.driver.checkpoint.reshard import piece_of


def model_groups(sm, live) -> dict | None:
    """``{"count": the model's param groups, "of": {parameter: its group's index}}`` for the parameters this rank
    steps (a piece's parameter under ``shard_state="full"``), or None where the module has no ``sm.optimizer``."""
    optimizer = getattr(sm, "optimizer", None)
    links = getattr(optimizer, "links", None)
    if links is None:
        return None
    index = {id(group): i for group, i in links}
    of = {}
    for per_opt in live.groups:
        for names, group in per_opt:
            if id(group) in index:
                of.update({piece_of(n)[0]: index[id(group)] for n in names})
    return {"count": len(optimizer.param_groups), "of": of}


def merged(saved: list) -> dict | None:
    """The ranks' ``model_groups`` as one (each rank lists the parameters it stepped); None where none has one."""
    found = [g for g in saved if isinstance(g, dict)]
    if not found:
        return None
    return {"count": found[0]["count"], "of": {n: i for g in found for n, i in g["of"].items()}}


def check_model_groups(saved: dict | None, sm, live, where) -> None:
    """The module's param groups are the checkpoint's: as many, each parameter in the group it was saved in.
    A checkpoint written before checkpoints recorded them (``saved`` None) is taken as it is."""
    now = model_groups(sm, live)
    if saved is None or now is None:
        return
    fix = ("Compile with the param groups it was saved with (param_groups=, or the optimizer instance given to "
           "compile); their hyperparameters are then the saved ones. Nothing was changed.")
    if saved["count"] != now["count"]:
        raise CheckpointError(f"{where} was saved with {_groups(saved['count'])}, and this module has "
                              f"{_groups(now['count'])} (torch.optim.Optimizer.load_state_dict refuses it too). "
                              f"{fix}")
    moved = [(n, saved["of"][n], i) for n, i in now["of"].items() if n in saved["of"] and saved["of"][n] != i]
    if moved:
        said = "; ".join(f"{n} was in group {a}, is in group {b} here" for n, a, b in moved[:3])
        raise CheckpointError(f"{where}: {len(moved)} parameters are in another param group than when saved "
                              f"({said}{' ...' if len(moved) > 3 else ''}). {fix}")


def _groups(n: int) -> str:
    return f"{n} param group{'s' if n != 1 else ''}"
