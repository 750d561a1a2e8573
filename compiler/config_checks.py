"""The checks every option group of ``compiler/config.py`` shares, and the base of its chain of ``__post_init__``."""
from __future__ import annotations

import math
from dataclasses import field
from functools import partial

from harmony.base import env
from harmony.base.errors import ConfigError
from harmony.base.tiers import Tier


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


class Group:
    """The end of the chain of ``__post_init__`` checks: every group checks its fields, then calls the next."""

    def __post_init__(self):
        pass
