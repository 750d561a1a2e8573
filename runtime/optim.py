"""Which of torch's implementations of the user's optimizer Harmony steps with.

Torch has up to three implementations of an optimizer's update: a Python loop over the
parameters (its default on the CPU), ``foreach`` (lists of tensors per op) and ``fused``
(one kernel per parameter doing the whole update in one pass over memory). On this
project's machine AdamW steps 50M fp32 CPU parameters in 0.28 s looping, 0.20 s foreach
and 0.035 s fused, and in an offloaded step the optimizer's time competes with the next
pack's backward for the same cores. So where the caller chose neither ``fused`` nor
``foreach``, Harmony asks for ``fused=True`` if torch has the fused kernel for every
device type the optimizer will step on (probed once per class on a one-element tensor);
otherwise it leaves the arguments as they are. (Not under the ``ondemand`` policy: its
runtime brings to the device every tensor an op touches, and one fused op touches the
whole state of the parameters it steps.)

The fused update rounds differently from the loop (measured: at most 1 ulp apart after 5
AdamW steps); foreach and the loop agree bitwise. To compare with eager PyTorch bit for bit,
give the eager optimizer the same arguments (``sm.optimizer_kwargs``, or
``harmony.optimizer_kwargs(cls, kwargs)``), or pass ``fused=False`` to Harmony for torch's
default.
"""
from __future__ import annotations

import functools
import inspect

import torch

from harmony.base.errors import ConfigError


def optimizer_kwargs(optimizer: type, kwargs: dict | None = None, device_types=("cpu",)) -> dict:
    """``kwargs`` with ``fused=True`` added where ``optimizer`` has a fused kernel for each of
    ``device_types`` and ``kwargs`` names neither ``fused`` nor ``foreach``; otherwise a copy of ``kwargs``.

    >>> optimizer_kwargs(torch.optim.AdamW, {"lr": 1e-3})
    {'lr': 0.001, 'fused': True}
    >>> optimizer_kwargs(torch.optim.AdamW, {"lr": 1e-3, "foreach": False})
    {'lr': 0.001, 'foreach': False}
    """
    out = dict(kwargs or {})
    if "fused" in out or "foreach" in out:
        return out
    if all(_has_fused(optimizer, t) for t in sorted(set(device_types))):
        out["fused"] = True
    return out


@functools.lru_cache(maxsize=None)
def _has_fused(optimizer: type, device_type: str) -> bool:
    """Whether ``optimizer(..., fused=True)`` builds and steps a one-element fp32 tensor on ``device_type``."""
    try:
        p = torch.nn.Parameter(torch.zeros(1, device=device_type))
        p.grad = torch.zeros_like(p)
        optimizer([p], fused=True).step()
    except (TypeError, ValueError, RuntimeError, NotImplementedError):
        return False       # no fused argument, or no kernel for this device (torch says which)
    return True


def from_instance(model: torch.nn.Module, optimizer: torch.optim.Optimizer, kwargs: dict) -> tuple[type, dict, list]:
    """(class, arguments, param groups by name) of an optimizer the user built on ``model``'s parameters: its
    defaults under ``kwargs`` (those win), each group's hyperparameters that differ from its defaults. Every
    trainable parameter must be in a group: Harmony steps each one, so one left out would train where eager
    would not."""
    names = {id(p): n for n, p in model.named_parameters()}
    takes = inspect.signature(type(optimizer).__init__).parameters    # defaults may hold more (AdamW's decoupling)
    defaults = {k: v for k, v in optimizer.defaults.items()
                if k in takes and not (k in ("fused", "foreach") and v is None)}
    groups, seen = [], set()
    for i, group in enumerate(optimizer.param_groups):
        mine = [names.get(id(p)) for p in group["params"]]
        if None in mine:
            raise ConfigError(f"optimizer's param group {i} holds a tensor that is not a parameter of the model "
                              f"passed to compile: build the optimizer on model.parameters()")
        seen.update(mine)
        groups.append({"params": mine, **{k: v for k, v in group.items()
                                          if k != "params" and k in defaults and v != defaults[k]}})
    left = [n for n, p in model.named_parameters() if p.requires_grad and n not in seen]
    if left:
        raise ConfigError(f"optimizer leaves out {len(left)} trainable parameters ({', '.join(left[:3])}"
                          f"{', ...' if len(left) > 3 else ''}); Harmony steps every parameter that requires grad: "
                          f"add them to a param group, or set requires_grad=False on them before compile")
    return type(optimizer), {**defaults, **kwargs}, groups


def group_of(names: list[str], groups: list | None) -> tuple[list[dict], dict[str, int]]:
    """The model's param groups as ``sm.optimizer`` holds them (hyperparameters only) and each name's group:
    ``groups`` (``param_groups=``) in their order, after a first group of the parameters none of them names
    where there are such parameters."""
    named = {n for g in groups or () for n in g["params"]}
    rest = [{}] if any(n not in named for n in names) or not groups else []
    which = {n: i + len(rest) for i, g in enumerate(groups or ()) for n in g["params"]}
    hyper = rest + [{k: v for k, v in g.items() if k != "params"} for g in groups or ()]
    return hyper, {n: which.get(n, 0) for n in names}


class PackedOptimizer(torch.optim.Optimizer):
    """``sm.optimizer``: the optimizers Harmony steps (one per pack, per file for a pack wholly on disk) seen as one
    optimizer over the model, for ``torch.optim.lr_scheduler`` and the user.

    Its ``param_groups`` are the model's (one, or those of ``param_groups=`` or of an optimizer instance given to
    compile) and hold the hyperparameters: ``sm(...)`` writes them into every pack's optimizer before it steps, so a
    scheduler built on ``sm.optimizer`` (or ``sm.optimizer.param_groups[0]["lr"] = ...``) drives them all, wherever
    they step. The state stays in the packs' optimizers; ``harmony.save`` keeps both. ``step()`` and
    ``zero_grad()`` do no work of their own: ``sm(...)`` steps, and gradients never outlive it.
    """

    def __init__(self, groups: list[tuple[list[torch.Tensor], dict]], defaults: dict, links: list[tuple[dict, int]]):
        super().__init__([{"params": params, **hyper} for params, hyper in groups], defaults)
        self.links = links     # (a pack optimizer's param group, the index of the model's group it belongs to)

    def step(self, closure=None):
        """Write the groups' hyperparameters into the packs' optimizers (``sm(...)`` calls it before each step): the
        optimizer's own settings only, not what a scheduler keeps beside them (``initial_lr``, ``max_lr``, ...),
        which the scheduler's state holds."""
        for group, i in self.links:
            mine = self.param_groups[i]
            group.update({k: mine[k] for k in group if k != "params" and k in mine})
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def pull(self) -> None:
        """Take the hyperparameters from the packs' optimizers (after a checkpoint restored theirs)."""
        for group, i in self.links:
            self.param_groups[i].update({k: v for k, v in group.items() if k != "params"})   # its own settings


def build_optimizers(cfg, plan, tensors: dict) -> tuple[dict, PackedOptimizer]:
    """One optimizer per pack (per file of a pack wholly on disk), in the model's param groups, and the one
    ``sm.optimizer`` that holds those groups' hyperparameters: ({param name: its optimizer}, facade)."""
    stepped = [n for spec in plan.packs for n in spec.stepped]
    hyper, which = group_of(stepped, cfg.param_groups)
    by_name, links = {}, []
    for spec in plan.packs:
        shares = plan.at(spec.index).shares
        # partitioned (runtime/partitioned/): one optimizer over this rank's pieces (on the meta device, where the
        # plan is only simulated, there are no pieces: the whole parameters stand in)
        if shares is not None and all(p.name in tensors for p in shares.pieces):
            parts = [(i, [tensors[p.name] for p in shares.pieces if p.group == i]) for i in range(len(hyper))]
            parts = [(i, ts) for i, ts in parts if ts]
            if not parts:      # this rank's chunks of a small pack are empty (more ranks than its elements): no step
                continue
            opt = cfg.optimizer([{"params": ts, **hyper[i]} for i, ts in parts], **cfg.optimizer_kwargs)
            links += [(group, i) for group, (i, _) in zip(opt.param_groups, parts)]
            by_name.update(dict.fromkeys(spec.stepped, opt))
            continue
        for names in plan.at(spec.index).disk_groups or [spec.stepped]:
            parts = [(i, [tensors[n] for n in names if which[n] == i]) for i in range(len(hyper))]
            parts = [(i, ts) for i, ts in parts if ts]
            if not parts:
                continue
            opt = cfg.optimizer([{"params": ts, **hyper[i]} for i, ts in parts], **cfg.optimizer_kwargs)
            links += [(group, i) for group, (i, _) in zip(opt.param_groups, parts)]
            by_name.update(dict.fromkeys(names, opt))
    probe = torch.nn.Parameter(torch.zeros(1))
    defaults = cfg.optimizer([probe], **cfg.optimizer_kwargs).defaults
    groups = [([tensors[n] for n in stepped if which[n] == i], h) for i, h in enumerate(hyper)]
    return by_name, PackedOptimizer(groups, defaults, links)


def elementwise(optimizer: type, kwargs: dict) -> bool:
    """Whether ``optimizer(**kwargs)`` updates a tensor cut in pieces at multiples of 64 elements bitwise as it updates
    the whole: what stepping a rank's pieces of a pack's parameters (``shard_state="full"``,
    runtime/partitioned/) needs. Probed on 20000 values in pieces of 192 over three steps (an update that reads
    the whole tensor, such as a norm or a factored second moment, fails)."""
    g = torch.Generator().manual_seed(0)
    n, cut = 20000, 192
    whole = torch.nn.Parameter(torch.randn(n, generator=g) * 0.02)
    parts = [torch.nn.Parameter(p.clone()) for p in whole.detach().split(cut)]
    try:
        one, two = optimizer([whole], **kwargs), optimizer(parts, **kwargs)
        for _ in range(3):
            grad = torch.randn(n, generator=g) * 1e-3
            whole.grad = grad
            for p, q in zip(parts, grad.split(cut)):
                p.grad = q.clone()
            one.step()
            two.step()
    except (TypeError, ValueError, RuntimeError):
        return False
    return torch.equal(whole.detach(), torch.cat([p.detach() for p in parts]))
