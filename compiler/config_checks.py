"""The checks every option group of ``compiler/config.py`` shares, and the base of its chain of ``__post_init__``."""
from __future__ import annotations

import inspect
import math
from dataclasses import field
from functools import partial

import torch

from harmony.base import env
from harmony.base.errors import ConfigError
from harmony.base.tiers import Tier
from harmony.base.units import parse_bytes


def env_field(name: str):
    return field(default_factory=partial(env.env_default, name))


def choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(f"unknown {name}: {name}={value!r}; choose one of {', '.join(map(repr, choices))}")


def tier(name: str, value, choices):
    """``choice``, then ``value`` as the ``Tier`` it names where it names one (``Tier(value)``: the string a user
    gave, as its member); the choices that are no tier (``"auto"``, ``"always"``) stay as they are."""
    choice(name, value, choices)
    return Tier(value) if value in Tier.names() else value


def count(name: str, value, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive integer: {what}")


def positive(value, finite: bool) -> bool:
    """A real number above 0 (``finite``: and not infinite); bools and strings are not numbers here."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return value > 0 and (math.isfinite(value) or not finite and value == math.inf)


def pass_list(passes, default: tuple) -> tuple:
    """``passes=`` as a tuple of entries: a name, or (name, choice); None: ``default``, the whole pipeline."""
    if passes is None:
        return default
    if isinstance(passes, str):
        return (passes,)
    if not isinstance(passes, (list, tuple)) or not passes:
        raise ConfigError(f"passes={passes!r}: give a tuple of pass names, at least ('partition',); the whole "
                          f"pipeline is {default}")
    return tuple(passes)


def margin_bytes(value):
    """``plan_margin=`` checked: ``"auto"``, or its bytes (an int, or a size such as ``"4MiB"``), 0 or more."""
    if value == "auto" or (value == 0 and not isinstance(value, bool)):
        return value
    return parse_bytes(value, "plan_margin")


def margin_of(config) -> int:
    """A config's ``plan_margin`` in bytes: ``"auto"`` that compile has not resolved (driver/misses.py) is 0."""
    return config.plan_margin if isinstance(config.plan_margin, int) else 0


def check_optimizer(optimizer: type, kwargs: dict, groups=None) -> None:
    """``optimizer`` takes ``kwargs``, and ``kwargs`` under each param group's settings: each built once on a
    stand-in parameter, so a misspelled argument or a value out of its range is a ``ConfigError`` naming it before
    the model is traced (torch's own check says what is wrong). A group's keys the optimizer does not take are left
    to it, as torch keeps them (a group's ``"name"``)."""
    takes = inspect.signature(optimizer.__init__).parameters
    tries = [("optimizer_kwargs", dict(kwargs), dict(kwargs))]
    for i, group in enumerate(groups or ()):
        own = {k: v for k, v in group.items() if k != "params" and k in takes}
        if own:
            tries.append((f"param_groups[{i}]", own, {**kwargs, **own}))
    for where, shown, given in tries:
        try:
            optimizer([torch.nn.Parameter(torch.zeros(1))], **given)
        except (TypeError, ValueError, RuntimeError) as e:
            names = ", ".join(n for n in takes if n not in ("self", "params", "args", "kwargs"))
            raise ConfigError(f"{where}: {optimizer.__name__} refuses {shown!r} ({e}); it takes {names}") from None


class Group:
    """The end of the chain of ``__post_init__`` checks: every group checks its fields, then calls the next."""

    def __post_init__(self):
        pass


HYBRID = ("pipeline", "data")      # parallel= of a pipeline inside each server, data parallel across (grid.py)


def check_parallel(cfg) -> None:
    """``ParallelConfig``'s fields; ``parallel=("pipeline", "data")``, and ``"pipeline"`` with ``data_parallel=True``,
    both become ``HYBRID``."""
    from harmony.runtime.comm.compression import parse_compression
    parse_compression(cfg.compression)      # a bad value fails even when there is one rank
    if isinstance(cfg.min_size, bool) or not isinstance(cfg.min_size, int) or cfg.min_size < 0:
        raise ConfigError(f"min_size={cfg.min_size!r}: give the number of elements below which a tensor travels "
                          f"uncompressed (an integer >= 0; CGX uses 16)")
    if isinstance(cfg.shard_state, str) and cfg.shard_state == "optimizer":
        cfg.shard_state = True          # ZeRO stage 1 by the name of what it shards
    for name in ("data_parallel", "shard_state"):
        value = getattr(cfg, name)
        if value is not None and not isinstance(value, bool) and not (name == "shard_state" and value == "full"):
            raise ConfigError(f"{name}={value!r}: use None (the default), True or False"
                              + (", or 'full' ('optimizer' is True)" if name == "shard_state" else ""))
    spec = cfg.balance
    if not (spec is None or spec in ("auto", "uniform") or (isinstance(spec, (list, tuple)) and spec)):
        raise ConfigError(f"balance={spec!r}: use 'auto', 'uniform', or one entry per rank ((microbatch size, "
                          f"microbatches) or a sample count)")
    cfg.comm_timeout = env.check("comm_timeout", cfg.comm_timeout)
    if isinstance(cfg.parallel, (list, tuple)):
        if sorted(cfg.parallel) != sorted(HYBRID) or len(cfg.parallel) != 2:
            raise ConfigError(f"parallel={cfg.parallel!r}: the one combination is ('pipeline', 'data'): a pipeline "
                              f"inside each server, data parallelism across servers")
        cfg.parallel = HYBRID
    else:
        choice("parallel", cfg.parallel, (None, "data", "pipeline"))
    if cfg.parallel == "pipeline" and cfg.data_parallel is True:
        cfg.parallel = HYBRID
    if cfg.parallel == HYBRID and cfg.data_parallel is False:
        raise ConfigError("parallel=('pipeline', 'data') with data_parallel=False: the pipelines are data-parallel "
                          "replicas; use data_parallel=None, or parallel='pipeline' for one pipeline")
    size = cfg.pipeline_size
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1
                             or cfg.parallel != HYBRID):
        raise ConfigError(f"pipeline_size={size!r}: give the ranks of one pipeline (a server's devices, >= 2) with "
                          f"parallel=('pipeline', 'data'), or leave it None")
    choice("placement", cfg.placement, ("contiguous", "layers", "round_robin"))
    group = cfg.pipeline_group
    if group is not None and (group != "auto" and (isinstance(group, bool) or not isinstance(group, int)
                                                   or group < 1) or cfg.parallel not in ("pipeline", HYBRID)):
        raise ConfigError(f"pipeline_group={group!r}: give a number of microbatches >= 1 or 'auto', with "
                          f"parallel='pipeline' (it orders a pipeline rank's packs), or leave it None")
