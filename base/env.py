"""The ``HARMONY_*`` environment variables: each one is the default of one config field, read and checked here only.

A variable is read when the object that needs it is made (a ``harmony.Config``, a disk store, the hardware
profile's cache), never at import, so a test or a launcher may set it late. A field given explicitly wins over
its variable; a variable set to an empty string counts as unset.

- ``HARMONY_COMM_TIMEOUT`` -> ``ParallelConfig.comm_timeout``: seconds a collective waits for its peers (300)
- ``HARMONY_CACHE_DIR`` -> ``PlanConfig.cache_dir``: where the hardware profile is cached (``~/.cache/harmony``)
- ``HARMONY_DIRECT_IO`` -> ``DiskConfig.direct_io``: ``0`` forces buffered disk I/O; ``1`` uses direct I/O where
  the file system takes it (the default)
- ``HARMONY_READ_DEPTH`` -> ``DiskConfig.read_depth``: concurrent ``preadv`` calls of one disk read (4)
- ``HARMONY_KEEP_FREE`` -> ``DiskConfig.keep_free``: free I/O buffer bytes a disk store keeps (default: as many as
  keep its mapped bytes within the most it ever had in use)
"""
from __future__ import annotations

import math
import os

from harmony.base.errors import ConfigError

VARIABLES = {"comm_timeout": "HARMONY_COMM_TIMEOUT", "cache_dir": "HARMONY_CACHE_DIR",
             "direct_io": "HARMONY_DIRECT_IO", "read_depth": "HARMONY_READ_DEPTH", "keep_free": "HARMONY_KEEP_FREE"}
DEFAULTS = {"comm_timeout": 300.0, "cache_dir": None, "direct_io": None, "read_depth": 4, "keep_free": None}
_OFF, _ON = ("0", "false", "no", "off"), ("1", "true", "yes", "on", "auto")


def env_default(name: str):
    """The default of field ``name``: its variable's value if set (checked), else the built-in default."""
    raw = os.environ.get(VARIABLES[name], "").strip()
    return check(name, raw, from_env=True) if raw else DEFAULTS[name]


def check(name: str, value, from_env: bool = False):
    """``value`` of field ``name`` (a string when ``from_env``) as the field holds it; a ``ConfigError`` naming the
    field, or the variable it came from, if it is not one."""
    where = f"{VARIABLES[name]}={value!r}" if from_env else f"{name}={value!r}"
    if name == "direct_io":
        if from_env and value.lower() in _OFF + _ON:
            return False if value.lower() in _OFF else None
        if from_env or value not in (None, True, False):
            raise ConfigError(f"{where}: use " + ("0 (buffered I/O) or 1 (direct I/O where the file system takes it)"
                                                  if from_env else "None (direct I/O where the file system takes it), "
                                                  "False (buffered) or True (direct, or an error)"))
        return value
    if name == "cache_dir":
        return None if value is None else os.fspath(value)
    number = _number(value) if from_env else value
    if name == "comm_timeout":
        if isinstance(number, (int, float)) and not isinstance(number, bool) and math.isfinite(number) and number > 0:
            return float(number)
        raise ConfigError(f"{where}: give the seconds a collective waits for its peers, a positive number")
    if name == "read_depth":
        if _whole(number) and number >= 1:
            return int(number)
        raise ConfigError(f"{where}: give the preadv calls a disk read may have in flight, a whole number >= 1 "
                          f"(1 turns concurrent reads off)")
    if number is None or (_whole(number) and number >= 0):      # keep_free
        return number if number is None else int(number)
    raise ConfigError(f"{where}: give the free I/O buffer bytes a disk store keeps, a whole number >= 0, or leave "
                      f"it unset to keep what its busiest moment needed")


def _number(text: str):
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def _whole(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool)
