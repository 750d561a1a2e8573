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


M_MMAP_THRESHOLD = -3          # glibc's mallopt parameter number
HEAP_MMAP_THRESHOLD = 128 << 10


def return_freed_memory() -> bool:
    """Make glibc give large freed blocks back to the system at once; False where that is not glibc.

    glibc serves an allocation below its mmap threshold from a heap arena, and raises that
    threshold (up to 32 MiB) each time a larger mmapped block is freed, so after a few steps
    the pack-sized buffers a host tier frees and allocates again stay in the heap, counted in
    the process's resident memory long after they are dead (measured here: a 102M-parameter
    GPT with its weights on disk peaked at 1.29 GiB RSS, 0.81 GiB with the threshold pinned).
    Pinning the threshold at its default of 128 KiB (which also stops the raising) maps every
    larger block on its own and unmaps it when freed. The same as ``MALLOC_MMAP_THRESHOLD_=131072``.
    The price is page faults on every fresh block (on the 600M-parameter GPT of
    benchmarks/offload.py about 42 CPU-seconds a step instead of 34, for a peak RSS of 2.59 GiB
    instead of 5.34 GiB); the disk tier's large buffers ask for huge pages (runtime/disk.py's
    ``aligned_buffer``), which brought that step back to 39 CPU-seconds.
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False
