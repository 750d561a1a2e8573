"""Measuring this machine: its memory, CPU, disk and speeds, for ``Hardware.detect`` and ``Hardware.profile``.

Each function reads or times one thing and returns plain numbers; ``compiler/hardware/``
turns them into a ``Hardware`` description. Each timing takes about the budget of seconds
it is given (compute timings: repeated after a warm-up, the median):

>>> matmul_flops(2.0, threads=1)            # fp32 FLOP/s of a 2048 x 2048 matmul
>>> disk_bandwidth(4.0, path="/nvme")       # (read, write) bytes/s and how (O_DIRECT or buffered)
"""
from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import time
from pathlib import Path

from harmony.base.errors import ConfigError
from harmony.runtime.ondemand import OnDemand
from harmony.runtime.tiers.memory import CountAllocations, MemoryMeter

GiB = 2**30


def meminfo(key: str) -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one, else every core)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def disk_free(path=None) -> int:
    st = os.statvfs(path or tempfile.gettempdir())
    return st.f_bavail * st.f_frsize


def wants_cuda(device) -> bool:
    """Whether ``device`` (None: whatever this machine has) names a CUDA GPU that is here."""
    if device is not None and not str(device).startswith("cuda"):
        return False
    try:
        import torch
    except ImportError:
        return False
    if device is not None and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} but torch sees no CUDA GPU here; use device='cpu'")
    return torch.cuda.is_available()


def _timed(fn, budget: float, at_least: int = 2) -> list[float]:
    """Seconds of each run of ``fn`` after one warm-up, until ``budget`` seconds pass (at least ``at_least`` runs)."""
    stop = time.perf_counter() + budget
    fn()
    times: list[float] = []
    while len(times) < at_least or time.perf_counter() < stop:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def matmul_flops(budget: float, threads: int, n: int = 2048) -> float:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        out = torch.empty(n, n)
        times = _timed(lambda: torch.mm(a, b, out=out), budget)
    finally:
        torch.set_num_threads(before)
    return 2 * n**3 / _median(times)


def _sync(device) -> None:
    if getattr(device, "type", device) == "cuda":
        import torch
        torch.cuda.synchronize(device)


def kernel_latency(budget: float, threads: int, device: str = "cpu", metered: bool = True) -> float:
    """Seconds per tensor op of a transformer block too small to compute anything (width 16, 8 tokens).

    What every op pays besides its arithmetic, as a pack's ops pay it: PyTorch's dispatch,
    module calls, autograd's bookkeeping and (``metered``) the runtime's allocation accounting.
    """
    block = _Block(16, 8, 8, threads, layers=1, device=device)
    try:
        return _median(_timed(block.run if metered else block.run_plain, budget, at_least=5)) / block.ops
    finally:
        block.close()


def ondemand_latency(budget: float, threads: int, device: str = "cpu") -> tuple[float, float]:
    """Seconds the ``ondemand`` runtime's fetch checks (runtime/ondemand.py) add to each tensor op, its state
    already fetched: (ops called from Python, as a forward and an optimizer step make them: a function-level and
    a dispatch-level mode; ops autograd's backward runs: the dispatch level only). A block too small to compute
    anything (width 16, 8 tokens), its forward and backward timed apart with and without the modes."""
    import types
    from collections import Counter

    import torch
    block = _Block(16, 8, 8, threads, layers=1, device=device)
    meter = MemoryMeter("profile")
    state = types.SimpleNamespace(tensors=dict(block.layer.named_parameters()), optimizers={}, moved=Counter())
    od = OnDemand(types.SimpleNamespace(meter=meter, state=state, device=block.device))

    def modes(on: bool):
        if not on:
            return CountAllocations(meter)
        stack = contextlib.ExitStack()
        stack.enter_context(od.calls())
        stack.enter_context(CountAllocations(meter, od))
        return stack

    def forward(on: bool):
        with modes(on), torch.no_grad():
            block.layer(block.x)
        _sync(block.device)

    def backward(on: bool) -> float:
        with modes(False):
            out = block.layer(block.x.detach().requires_grad_())
        _sync(block.device)
        t0 = time.perf_counter()
        with modes(on):
            torch.autograd.backward(out, block.seed)
        _sync(block.device)
        return time.perf_counter() - t0
    try:
        forward(True)                # fetches the weights once: what follows are the checks alone
        with torch.no_grad():      # as ``forward`` runs it; the block's ops are a forward, another, a backward
            fwd_ops = block.ops_of(lambda: block.layer(block.x))
        bwd_ops = block.ops - 2 * fwd_ops
        call = [_median(_timed(lambda on=on: forward(on), budget / 4, at_least=5)) for on in (False, True)]
        op = [_median([backward(on) for _ in range(max(5, int(budget / 4 / max(call[1], 1e-4))))])
              for on in (False, True)]
        return max(0.0, (call[1] - call[0]) / fwd_ops), max(0.0, (op[1] - op[0]) / max(bwd_ops, 1))
    finally:
        od.close()
        block.close()


def block_efficiency(budget: float, peak: float, latency: float, threads: int, width: int = 512,
                      tokens: int = 512, seq: int = 128, device: str = "cpu") -> float:
    """Share of ``peak`` a transformer block sustains, run as a recomputing backward runs it, net of op latency.

    On a GPU the ops are queued, not waited for, so a launch's cost hides behind the kernels before it
    where those are long: only the time beyond the ops' launches counts against the latency."""
    block = _Block(width, tokens, seq, threads, device=device)
    try:
        t = _median(_timed(block.run, budget, at_least=3))
    finally:
        block.close()
    compute = t if block.device.type == "cuda" else max(t - block.ops * latency, 0.05 * t)
    return min(1.0, block.flops / compute / peak)


def _counter():
    """A dispatch mode that counts the tensor ops run under it (``.n``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))
    return Count()


class _Block:
    """Pre-norm GELU transformer blocks run as a pack's backward runs them: forward without grad,
    then forward again with grad and backward, under the runtime's allocation accounting.

    A pack holds several layers whose weights have left the caches by the time it runs
    again, so unless told otherwise there are as many distinct layers as it takes to hold
    64 MiB of weights (at most 8): the caches start cold for each, as in a step.
    """

    def __init__(self, width: int, tokens: int, seq: int, threads: int, layers: int | None = None,
                 device: str = "cpu"):
        import torch
        from torch.utils.flop_counter import FlopCounterMode

        self.threads = torch.get_num_threads()
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        seq = min(seq, tokens)
        if layers is None:
            layers = max(1, min(8, -(-64 * 2**20 // (12 * width * width * 4))))
        self.device = torch.device(device)
        self.layer = torch.nn.Sequential(*(torch.nn.TransformerEncoderLayer(
            width, max(1, width // 64), 4 * width, dropout=0.0, activation="gelu", batch_first=True,
            norm_first=True) for _ in range(layers))).to(self.device)
        self.x = torch.randn(max(1, tokens // seq), seq, width, device=self.device)
        self.seed = torch.ones_like(self.x)
        with FlopCounterMode(display=False) as fc, _counter() as count:
            self.pack()
        self.flops, self.ops = fc.get_total_flops(), count.n

    def ops_of(self, fn) -> int:
        """Tensor ops ``fn`` dispatches."""
        with _counter() as count:
            fn()
        return count.n

    def pack(self):
        import torch
        with torch.no_grad():
            self.layer(self.x)
        leaf = self.x.detach().requires_grad_()
        torch.autograd.backward(self.layer(leaf), self.seed)

    def run(self):
        with CountAllocations(MemoryMeter("profile")):
            self.pack()
        _sync(self.device)

    def run_plain(self):
        self.pack()
        _sync(self.device)

    def close(self):
        import torch
        torch.set_num_threads(self.threads)


def memcpy_bandwidth(budget: float, size: int = 128 * 2**20) -> float:
    import torch

    src = torch.ones(size // 4)
    dst = torch.full_like(src, 2.0)         # touched, so the timed copies take no page faults
    return size / _median(_timed(lambda: dst.copy_(src), budget))


def codec_rates(budget: float, bits=(1, 4, 8), numel: int = 1 << 20) -> tuple[tuple[int, float], ...]:
    """(bits, fp32 bytes/s) one thread quantizes (stochastic rounding, CGX's default) and dequantizes once: the
    codec a quantized all-reduce runs on the host thread (runtime/comm/compression.py). Timed in the thread's CPU
    time, a rate per core however busy the machine is (the simulator books the core's sharing itself)."""
    import torch

    from harmony.runtime.comm.compression import dequantize, quantize
    x, before = torch.randn(numel), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rates = []
        for b in bits:
            dequantize(quantize(x, bits=b, bucket_size=512))        # warm-up
            runs, t0, stop = 0, time.thread_time(), time.perf_counter() + budget / len(bits)
            while runs < 2 or time.perf_counter() < stop:
                dequantize(quantize(x, bits=b, bucket_size=512))
                runs += 1
            rates.append((b, runs * x.nbytes / max(time.thread_time() - t0, 1e-9)))
        return tuple(rates)
    finally:
        torch.set_num_threads(before)


def disk_bandwidth(budget: float, path=None, block: int = 16 * 2**20, cap: int = 1 * GiB):
    """(read, write) bytes/s of a temporary file, and how it was measured.

    The write rate is that of overwriting the file's blocks in place, as the disk tier does: the
    file is written once first (until ``cap`` or a quarter of ``budget``; that rate, which also
    pays the file system's block allocation, goes into ``how``), then written again, timed, and
    read back."""
    buf = mmap.mmap(-1, block)              # page aligned, as O_DIRECT wants
    buf.write(os.urandom(4096) * (block // 4096))
    fd, name = tempfile.mkstemp(prefix="harmony-disk-", dir=path)
    os.close(fd)
    try:
        direct = os.O_DIRECT if takes_direct_io(name, buf) else 0
        how = "O_DIRECT" if direct else "fsync + posix_fadvise DONTNEED"
        fd = os.open(name, os.O_WRONLY | direct)
        written, t0 = 0, time.perf_counter()
        while written < cap and (written == 0 or time.perf_counter() - t0 < budget / 4):
            written += os.pwrite(fd, buf, written)
        os.fsync(fd)
        first = written / (time.perf_counter() - t0)
        at, t0 = 0, time.perf_counter()
        while at < written:
            at += os.pwrite(fd, buf, at)
        os.fsync(fd)
        write = written / (time.perf_counter() - t0)
        os.close(fd)
        how += f", overwriting allocated blocks (the first write, allocating them: {first / 1e9:.3g} GB/s)"
        fd = os.open(name, os.O_RDONLY | direct)
        if not direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        got, t0 = 0, time.perf_counter()
        while got < written:
            n = os.readv(fd, [buf])
            if n <= 0:
                break
            got += n
        read = got / (time.perf_counter() - t0)
        os.close(fd)
    finally:
        os.unlink(name)
        buf.close()
    return read, write, how


def takes_direct_io(name: str, buf) -> bool:
    """Whether the file system under ``name`` takes an O_DIRECT write (tmpfs and some others refuse it)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        fd = os.open(name, os.O_WRONLY | os.O_DIRECT)
    except OSError:
        return False
    try:
        os.write(fd, buf)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


# -- a CUDA device ----------------------------------------------------------------------------------
CUDA_DTYPES = {"fp32": "float32", "tf32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def cuda_timed(fn, budget: float, device, at_least: int = 3) -> list[float]:
    """Seconds of each run of ``fn`` on the GPU (CUDA events around it), after one warm-up, until ``budget``."""
    import torch
    fn()
    torch.cuda.synchronize(device)
    stop, times = time.perf_counter() + budget, []
    while len(times) < at_least or time.perf_counter() < stop:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def cuda_matmul_flops(budget: float, device, dtype: str, n: int = 8192) -> float:
    """FLOP/s of an ``n``-cube matrix product at ``dtype`` ("fp32" without TF32, "tf32", "bf16", "fp16")
    on random data (zeros run faster than real data on some cards)."""
    import torch
    dt = getattr(torch, CUDA_DTYPES[dtype])
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        a, b = torch.randn(n, n, device=device, dtype=dt), torch.randn(n, n, device=device, dtype=dt)
        out = torch.empty(n, n, device=device, dtype=dt)
        times = cuda_timed(lambda: torch.mm(a, b, out=out), budget, device)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    return 2 * n**3 / _median(times)


def cuda_copy_bandwidth(budget: float, device, size: int = 256 * 2**20) -> tuple[float, float, float]:
    """(host -> device, device -> host, device -> device) bytes/s: copies to and from pinned host memory, and
    the device's own memory traffic (a device copy reads and writes each byte: counted twice)."""
    import torch
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True).fill_(1)
    dev = torch.empty(size, dtype=torch.uint8, device=device)
    other = torch.empty_like(dev)
    h2d = size / _median(cuda_timed(lambda: dev.copy_(host, non_blocking=True), budget / 3, device))
    d2h = size / _median(cuda_timed(lambda: host.copy_(dev, non_blocking=True), budget / 3, device))
    d2d = 2 * size / _median(cuda_timed(lambda: other.copy_(dev), budget / 3, device))
    return h2d, d2h, d2d


def cuda_launch_latency(budget: float, device, ops: int = 200) -> float:
    """Seconds the host spends issuing one small tensor op on the GPU (dispatch and launch; the runtime's
    accounting around each op is in ``kernel_latency``)."""
    import torch
    x = torch.ones(16, device=device)

    def issue():
        for _ in range(ops):
            x.add_(1)
    return _median(_timed(lambda: (issue(), torch.cuda.synchronize(device)), budget, at_least=5)) / ops


def cuda_name(device) -> tuple[str, int]:
    """The card's name and memory in bytes."""
    import torch
    props = torch.cuda.get_device_properties(device)
    return props.name, props.total_memory


def cuda_library_bytes(device, dtype=None) -> int:
    """Device bytes the CUDA libraries take through torch's allocator once a training step has run: cuBLAS
    (and cuBLASLt) workspaces, one per thread and stream that multiplies matrices, which for the runtime is its
    own thread and autograd's device thread. Measured: the workspaces are freed, a small matmul is run forward
    and backward (at ``dtype`` too, if given), and what stays allocated once its tensors are gone is counted.
    The runtime's meter cannot see these bytes (no op allocates them), so the planner leaves them out of the
    budget."""
    import torch
    dev = torch.device(device)
    torch.cuda.synchronize(dev)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    before = torch.cuda.memory_allocated(dev)
    for dt in dict.fromkeys([torch.float32, dtype or torch.float32]):
        a = torch.ones(64, 64, device=dev, dtype=dt, requires_grad=True)
        (a @ a).sum().backward()
        del a
    torch.cuda.synchronize(dev)
    return max(0, torch.cuda.memory_allocated(dev) - before)
