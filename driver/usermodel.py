"""The user's model object after ``compile``: it holds the trained weights, or says loudly that it does not.

Between steps every parameter of the model passed to ``harmony.compile`` points at its trained
weights (the host master, or the device copy of a pack that stays resident), except those of
packs wholly on disk (``weights_on="disk"``, or a host budget that sends packs there): their
weights are in files and the parameter holds a placeholder of the right shape (runtime/tiers/params_disk.py); likewise
under ``shard_state="full"`` (other ranks' shares) and on pipeline ranks (other ranks' packs).
Reading such a model would give NaN without a word, so ``guard`` makes the model's ``forward`` and
``state_dict`` raise ``OffloadError`` while any placeholder is in it, and each such parameter refuses any read of
its values (runtime/placeholders.py ``WithheldParameter``: ``p.sum()``, ``p.data.clone()``, ``copy.deepcopy``,
``model.to(...)``, pickling), while its shape, dtype and device still answer; and ``sync_model`` (``sm.sync_model()``)
reads the weights from their files into the parameters: the model is then whole until the next step
puts the placeholders back.
"""
from __future__ import annotations

import torch

from harmony.base.errors import OffloadError
from harmony.base.tiers import Tier
from harmony.runtime.comm.failures import guarded
from harmony.runtime.placeholders import is_placeholder, mark, point, withhold
from harmony.runtime.tiers.params_disk import PARAM


def _placeholders(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if is_placeholder(p.data)]


def _refuse(model: torch.nn.Module, use: str) -> None:
    missing = _placeholders(model)
    if missing:
        raise OffloadError(f"{use} of the model passed to harmony.compile: {len(missing)} of its parameters "
                           f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}) live on disk between "
                           f"steps (weights_on={Tier.DISK!r}), in shares over the ranks (shard_state='full'), or on "
                           f"other pipeline ranks (parallel='pipeline'), and hold placeholders here. Call "
                           f"sm.sync_model() first to read the trained weights into the model (after the last step: "
                           f"each step puts placeholders back), or use sm.state_dict() / "
                           f"harmony.save, which read them from disk")


def guard(sm) -> None:
    """Make the user's model refuse to be read while weights of it live elsewhere only: its ``forward`` and
    ``state_dict`` raise OffloadError, and so does any read of a parameter holding a placeholder
    (runtime/placeholders.py ``WithheldParameter``)."""
    state = getattr(sm.runtime, "state", None)
    staged = getattr(getattr(sm, "plan", None), "stage", None) is not None   # a pipeline rank: others' packs
    if state is None or (state.params_disk is None and state.shares is None and not staged):
        return
    model = sm.model
    where = ("on other pipeline ranks (parallel='pipeline')" if staged else
             "in shares over the ranks (shard_state='full')" if state.shares is not None else
             f"on disk (weights_on={Tier.DISK!r}, or a host_memory_budget that sends packs there)")
    for name, p in model.named_parameters():
        mark(name, p, where)
    if getattr(model, "_harmony_guarded", False):    # compile guards once per tier it sets up
        return
    model._harmony_guarded = True
    model.register_forward_pre_hook(lambda m, args: _refuse(m, "forward"))
    model.register_state_dict_pre_hook(lambda m, prefix, keep_vars: _refuse(m, "state_dict()") if not prefix
                                       else None)


def sync_model(sm) -> list[str]:
    """Read the trained weights of the parameters that live elsewhere into the user's model; returns their names.

    Needs host memory for those weights (they are new tensors the model then owns). On disk: read from their
    files. ``shard_state="full"``: all-gathered from the ranks' shares. ``parallel="pipeline"``: every rank's
    packs' weights and buffers all-gathered, so every rank's model is the whole trained model (every rank calls
    it); the other ranks' weights go back to placeholders at the next step, which changes them there. Nothing to
    do for any other tier: those parameters hold their trained weights between steps."""
    if getattr(getattr(sm, "plan", None), "stage", None) is not None:
        return _gather_stages(sm)
    shares = getattr(getattr(sm.runtime, "state", None), "shares", None)
    if shares is not None:       # shard_state="full": all-gathered from the ranks (every rank must call it)
        return shares.gather_all(sm.runtime.state.tensors)
    pd = getattr(sm.runtime, "state", None) and sm.runtime.state.params_disk
    if pd is None:
        return []
    brought = []
    for gid, names in enumerate(pd.groups):
        todo = [n for n in names if is_placeholder(pd.tensors[n].data)]
        if not todo:
            continue
        values = pd.read_group(gid)
        for n in todo:
            pd.tensors[n].data = values[(n, PARAM)].clone()
            brought.append(n)
    return brought


def _gather_stages(sm) -> list[str]:
    """A pipeline rank's model gets every rank's packs' weights and buffers (an all-gather over the handshake's
    group); returns the names it got from the others."""
    import torch.distributed as dist
    state = sm.runtime.state
    # a grid's ZeRO-3: this stage's weights whole first, from its replica group's chunks (every rank calls it)
    whole = state.shares.gather_all(state.tensors) if getattr(state, "shares", None) is not None else []
    mine = {n: t.detach().to("cpu", copy=True) for n, t in sm.training_state_dict()["model"].items()
            if not n.startswith("share:")}
    mine.update({n: state.tensors[n].detach().to("cpu", copy=True) for n in whole})
    every: list = [None] * dist.get_world_size()
    guarded("sm.sync_model()'s all-gather of every stage's weights", dist.all_gather_object, every, mine,
            group=sm.handshake.group, timeout=sm.handshake.timeout)
    own = dict(sm.model.named_parameters())
    own.update(dict(sm.model.named_buffers()))
    brought = []
    for rank, state in enumerate(every):
        if rank == dist.get_rank():
            continue
        for n, t in state.items():
            target = own.get(n)
            if target is None:
                continue
            if isinstance(target, torch.nn.Parameter):
                point(target, t)
            else:
                target.data = t
            brought.append(n)
    sm._synced = [own[n] for n in dict.fromkeys(brought + whole) if isinstance(own.get(n), torch.nn.Parameter)]
    return list(dict.fromkeys(whole + brought))


def withhold_synced(sm) -> None:
    """Before a step: a pipeline rank's copies of the other ranks' weights (``sync_model``) would be stale after
    it, so they hold placeholders again (and refuse to be read, as before the sync)."""
    for p in getattr(sm, "_synced", ()):
        withhold(p)
    sm._synced = []
