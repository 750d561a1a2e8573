"""Facts about this process that reports quote."""
from __future__ import annotations

import os
import resource
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor


def peak_rss_bytes() -> int:
    """The most resident memory this process has held so far, in bytes (``getrusage``'s ``ru_maxrss``).

    >>> peak_rss_bytes() > 0
    True

    Linux reports KiB and macOS bytes; child processes are not included.
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def rss_bytes() -> int:
    """The memory this process holds resident now, in bytes (``/proc/self/statm``; Linux).

    >>> rss_bytes() > 0
    True
    """
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (one that is not ours counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


THP_ENV = "THP_MEM_ALLOC_ENABLE"   # torch's switch: CPU allocations of 2 MiB or more ask for huge pages
THP_SYSFS = "/sys/kernel/mm/transparent_hugepage/enabled"


def ask_for_huge_pages() -> None:
    """Turn on torch's transparent-huge-page CPU allocations (``THP_MEM_ALLOC_ENABLE=1``) unless the user chose.

    Called when ``harmony`` is imported. torch reads the variable once, at the first CPU
    tensor it allocates, so this takes effect only if no tensor was made before; the value
    the user set (``THP_MEM_ALLOC_ENABLE=0`` turns it off) is left alone. With it, each
    tensor of 2 MiB or more is page-aligned and ``madvise(MADV_HUGEPAGE)``: filling fresh
    memory takes one page fault per 2 MiB instead of one per 4 KiB. The runtime allocates
    a lot of fresh memory (freed blocks go back to the system, ``return_freed_memory``), so
    this matters: on the 600M-parameter GPT of benchmarks/offload.py with its weights on
    disk, page faults per step fell from 3.2 million to 0.66 million and system CPU time
    from 14 to 9 seconds, at the same peak RSS.
    """
    if sys.platform.startswith("linux"):
        os.environ.setdefault(THP_ENV, "1")


def huge_pages() -> bool:
    """Whether torch's CPU allocator asks for huge pages in this process (see ``ask_for_huge_pages``).

    Measured, not read from the environment (torch latched its choice at its first allocation):
    with huge pages a large tensor starts on a page boundary, without them on a 64-byte one.
    """
    if not sys.platform.startswith("linux") or "[never]" in _read(THP_SYSFS):
        return False
    import torch
    probes = [torch.empty(n, dtype=torch.uint8) for n in (2 << 20, (2 << 20) + 4160, 3 << 20)]
    return all(t.data_ptr() % 4096 == 0 for t in probes)


def huge_pages_note(on: bool) -> str:
    """What the report says of ``huge_pages()``: on, or off and why."""
    if on:
        return "on: torch's CPU tensors of 2 MiB or more fault in 2 MiB at a time"
    if not sys.platform.startswith("linux"):
        return "off: Linux only"
    if "[never]" in _read(THP_SYSFS):
        return f"off: transparent huge pages are disabled on this machine ({THP_SYSFS} says never)"
    return ("off: fresh tensors fault in 4 KiB at a time; import harmony before making the first tensor, or set "
            f"{THP_ENV}=1 (torch reads it once)")


OMP_WAIT_ENV = "OMP_WAIT_POLICY"   # OpenMP's switch: what a thread does between parallel regions
OMP_SPIN_ENV = "GOMP_SPINCOUNT"    # libgomp's: how long it spins first


def ask_idle_threads_to_sleep() -> None:
    """Make idle OpenMP threads sleep at once (``OMP_WAIT_POLICY=PASSIVE``) unless the user chose.

    Called when ``harmony`` is imported. libgomp (torch's OpenMP, and MKL's threads with it)
    reads the variable once, when torch loads it, so this takes effect only if torch was not
    imported first; an ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` the user set is left alone.
    By default a thread that finishes its share of a parallel region spins, waiting for the
    next one, for about 8 ms on this machine before it sleeps. The runtime's disk and host
    threads share the cores with the compute's OpenMP team: while the compute thread waits
    for a read or runs the executor's Python between ops its partner spins, and when one of
    those threads takes a core from a team member the other spins at the region's barrier.
    On the 600M-parameter GPT of benchmarks/offload.py with its state on disk, steps took
    17.0 s and 25.2 user CPU-seconds instead of 18.3 s and 28.1 (six steps each, runs
    alternated; perf put 7.5% of the spinning run's samples in libgomp's wait loop, 1.8% of
    eager PyTorch's); eager PyTorch's own step, which has no such threads, did not get faster
    (12.9 s spinning, 13.6 s sleeping), nor did benchmarks/overhead.py's (0.85 s either way) or the
    demo's (0.45-0.49 s either way).
    """
    global _latched
    if not (OMP_WAIT_ENV in os.environ or OMP_SPIN_ENV in os.environ or _loaded("libgomp")):
        os.environ[OMP_WAIT_ENV] = "PASSIVE"
    # what libgomp reads when torch loads it, or read already if it was loaded first (from the same environment)
    _latched = (os.environ.get(OMP_WAIT_ENV), os.environ.get(OMP_SPIN_ENV))


_latched: tuple | None = None


def idle_threads_sleep() -> bool:
    """Whether this process's idle OpenMP threads sleep at once (see ``ask_idle_threads_to_sleep``).

    Read from the setting libgomp latched when it was loaded, not measured (timing how much the threads spin
    depends on how busy the machine is): the environment when ``harmony`` was imported, which is what libgomp
    read if torch came later, and what it read before if torch came first (``harmony`` changes nothing then).
    As libgomp does: ``GOMP_SPINCOUNT`` where set (0: sleep at once), else ``OMP_WAIT_POLICY=PASSIVE`` sleeps
    and anything else spins first. True where torch runs one thread (no partner to wait).
    """
    import torch
    if torch.get_num_threads() < 2 or not torch.backends.openmp.is_available():
        return True
    wait, spin = _latched if _latched is not None else (os.environ.get(OMP_WAIT_ENV), os.environ.get(OMP_SPIN_ENV))
    if spin is not None:
        try:
            return int(spin.strip()) == 0
        except ValueError:
            return False           # "infinite" or unreadable: libgomp spins
    return (wait or "").strip().upper() == "PASSIVE"


def idle_threads_note(sleep: bool) -> str:
    """What the report says of ``idle_threads_sleep()``."""
    if sleep:
        return "sleep: idle OpenMP threads leave the cores to the disk and host threads at once"
    return (f"spin: idle OpenMP threads spin before they sleep, taking cores from the disk and host threads; "
            f"import harmony before torch, or set {OMP_WAIT_ENV}=PASSIVE (libgomp reads it once)")


def _loaded(library: str) -> bool:
    """Whether a shared library whose file name starts with ``library`` is mapped into this process (Linux)."""
    return any(f"/{library}" in line for line in _read("/proc/self/maps").splitlines())


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def run_when_idle() -> bool:
    """Let the calling thread run only on a core nothing else wants (Linux ``SCHED_IDLE``); False where it cannot.

    On the CPU device the compute's OpenMP team, the host thread's optimizer steps and the disk
    tier's I/O threads share the same cores. The host thread's steps are CPU work whose result is
    needed only later (the next use of those weights, or the end of the step); at idle priority it
    runs on a core the team leaves (waiting for a read, between kernels, at the end of the step)
    instead of stalling the team at a barrier or delaying the disk threads' next read. Measured on
    benchmarks/offload.py's 600M GPT (the benchmark's own setup functions, 5 steps a run, three
    settings alternated three times, steps 3-5): the host thread at idle priority 14.1-14.7 s a step
    per run (the compute waited 0.7-1.2 s a step for reads); every background thread at normal
    priority 14.3-18.1 s (waits 1.7-2.2 s); the disk threads at idle priority as well 15.4-16.6 s
    (waits 0.9-1.3 s: their reads are issued late), so they keep their priority.
    """
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is None:
        return False
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))     # 0: the calling thread (a task of its own on Linux)
    except OSError:
        return False
    return True


class Pool(ThreadPoolExecutor):
    """A ``ThreadPoolExecutor`` whose jobs let go of their function and arguments before their future resolves.

    The standard pool's worker keeps a job's function and arguments until after it has set the
    job's future. Whoever waits on the future can run on and find them still alive: a buffer the job
    read into, a gradient it sent, still counted on the device's meter (a live tensor) for as long
    as the worker waits for a core. Here the worker takes them out of a box and drops them before it
    returns, so they are gone by the time the future is done.
    """

    def submit(self, fn, /, *args, **kwargs):
        return super().submit(_run_boxed, [(fn, args, kwargs)])


def _run_boxed(box: list):
    fn, args, kwargs = box.pop()
    try:
        return fn(*args, **kwargs)
    except BaseException as e:
        # the future keeps the exception, its traceback the job's frames and their locals: the lines stay
        # for the report, the buffers go
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        del fn, args, kwargs


def started_pool(workers: int, name: str):
    """A ``Pool`` of ``workers`` threads named ``name``, all started now, from the calling thread.

    A new thread takes the scheduling policy of the thread that starts it, and a pool starts a
    worker in whichever thread submits to it while none is idle: the host thread, at idle priority
    (``run_when_idle``), would start the disk tier's I/O threads at idle priority too, which delays
    every read they issue. Each worker waits at a barrier until all have started, so every submit
    here starts one.
    """
    import threading
    pool = Pool(max_workers=workers, thread_name_prefix=name)
    gate = threading.Barrier(workers + 1)
    for _ in range(workers):
        pool.submit(gate.wait)
    gate.wait()
    return pool


def idle_priority_note(on: bool) -> str:
    """What the report says of the host thread's priority on the CPU device (``run_when_idle``)."""
    if on:
        return ("idle priority: its optimizer steps run on cores the compute's OpenMP team and the disk "
                "threads leave, not in the middle of a parallel region")
    return ("normal priority (it runs all-reduces other ranks wait for, or SCHED_IDLE is not available here): "
            "its work takes cores from the compute's OpenMP team and the disk threads while it runs")


def runs_when_idle(native_id: int) -> bool:
    """Whether the thread with this id (``threading.Thread.native_id``) runs at idle priority."""
    policy = getattr(os, "SCHED_IDLE", None)
    try:
        return policy is not None and os.sched_getscheduler(native_id) == policy
    except OSError:
        return False


M_MMAP_THRESHOLD = -3          # glibc's mallopt parameter number
HEAP_MMAP_THRESHOLD = 128 << 10


def return_freed_memory() -> bool:
    """Make glibc give large freed blocks back to the system at once; False where that is not glibc.

    glibc serves an allocation below its mmap threshold from a heap arena, and raises that
    threshold (up to 32 MiB) each time a larger mmapped block is freed, so after a few steps
    the pack-sized buffers a host tier frees and allocates again stay in the heap, counted in
    the process's resident memory long after they are dead (a GPT with its weights on disk peaked
    well above its host budget without this).
    Pinning the threshold at its default of 128 KiB (which also stops the raising) maps every
    larger block on its own and unmaps it when freed. The same as ``MALLOC_MMAP_THRESHOLD_=131072``.
    The price is page faults on every fresh block (CPU time in benchmarks/offload.py, for half the
    peak RSS); the disk tier's large buffers ask for huge pages (``runtime.iobuffers.Buffers``, which
    also reuses them), which wins most of it back, and so do torch's own (``ask_for_huge_pages``).
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


CUDA_ALLOC_ENV = "PYTORCH_CUDA_ALLOC_CONF"


def cuda_expandable_segments() -> bool:
    """Make torch's CUDA allocator grow segments in place (``expandable_segments:True``) unless the user configured
    it (``PYTORCH_CUDA_ALLOC_CONF``, which wins); returns whether it is on.

    The runtime frees and allocates pack-sized blocks all step long; with fixed segments, blocks freed from one
    segment cannot serve a larger request, so reserved memory drifts above allocated (and the budget). Expandable
    segments map memory into one growing range, so the allocator's reserved bytes follow the allocated ones.
    """
    import torch
    conf = os.environ.get(CUDA_ALLOC_ENV)
    if conf is None:
        set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None) \
            or getattr(torch.cuda.memory, "_set_allocator_settings", None)     # torch before 2.9
        try:
            set_settings("expandable_segments:True")
        except (TypeError, RuntimeError):    # no such setter, or a backend without the option
            return False
        return True
    return "expandable_segments:true" in conf.replace(" ", "").lower()
