"""Facts about this process that reports quote."""
from __future__ import annotations

import os
import resource
import sys


def peak_rss_bytes() -> int:
    """The most resident memory this process has held so far, in bytes (``getrusage``'s ``ru_maxrss``).

    >>> peak_rss_bytes() > 0
    True

    Linux reports KiB and macOS bytes; child processes are not included.
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (one that is not ours counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
