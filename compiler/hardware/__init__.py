"""Hardware descriptions: devices, host, disk and network, as figures the simulator and planner read.

>>> hw = Hardware.preset("a100-40gb", count=4, link="pcie4")
>>> hw.devices[0].flops, hw.devices[0].h2d_bandwidth          # dense fp32 FLOP/s, bytes/s
(19500000000000.0, 31500000000.0)
>>> mixed = Hardware.preset(["l4", "l4", "a6000", "p40"])       # a mixed cluster (Cephalo's example)
>>> cpu = Hardware.this_machine().logical([512 * 2**20])        # this CPU as a device with a 512 MiB budget
>>> torch.set_num_threads(1)
>>> print(Hardware.profile(seconds=8).describe())               # measure this machine (and cache it)
device 0: cpu (2 cores, AMD EPYC), 23.5 GiB, 0.1 TFLOP/s fp32 (90% sustained by a layer pack), 16.7 us per tensor op, \
h2d 16.4 GB/s (memcpy), memory 32.75 GB/s
host: 23.5 GiB, disk read 1.13 GB/s, write 2.06 GB/s, network 1.25 GB/s + 50 us
device 0's host: 2 cores, memory 32.75 GB/s
measured by Hardware.profile: fp32 matmul at 1 threads, tensor-op latency, a transformer block of width 512 on 512 \
tokens, memcpy, disk (O_DIRECT); nominal, not measured: network

Units everywhere: bytes, bytes per second, seconds, FLOP/s.

GPU figures are the vendor's datasheet numbers, each cited on its preset. Three
conventions apply to all of them:

- FLOP/s are peak and dense. NVIDIA's Ampere and later datasheets star their Tensor
  Core figures "with sparsity" (2:4 structured sparsity, twice the dense rate); the
  presets hold half of those starred numbers, which is the dense rate.
- Memory sizes are binary: a "40GB" HBM2 or "24GB" GDDR6 board holds 40 or 24 GiB.
  Some of it goes to the CUDA context and ECC, so a budget should stay below it.
- The host link is PCIe x16 at the PCI-SIG per-direction rate (8, 16, 32 GT/s per lane,
  128b/130b encoding: 15.75, 31.5, 63 GB/s for gen 3, 4, 5); NVIDIA's datasheets quote
  the two directions together (32, 64, 128 GB/s). Measured pinned copies reach roughly
  80% of the per-direction rate; pass ``link=<bytes/s>`` for a measured figure
  (msr-fiddle/harmony's scheduler, 3_scheduler/sched_args.py, defaults to a swap
  bandwidth of 11.5 GiB/s per direction for its GTX 1080 Ti servers: ``link=11.5 * 2**30``).

Host, disk and network figures of a preset are nominal placeholders, not from any
spec sheet (``NOMINAL``); pass your own as keyword arguments.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from harmony.base.env import env_default
from harmony.base.errors import ConfigError
from harmony.compiler.hardware import machine, nodes
from harmony.compiler.hardware.cpu_profile import profile_cpu
from harmony.compiler.hardware.cuda_profile import profile_cuda
from harmony.compiler.hardware.logical import logical
from harmony.compiler.hardware.nodes import PCIE
from harmony.runtime.plan import NOMINAL_NETWORK_BANDWIDTH, NOMINAL_NETWORK_LATENCY

GiB = 2**30
T = 1e12
GB = 1e9


# Nominal placeholders (not measured, not from a spec sheet): override them for real setups.
NOMINAL = dict(host_memory=256 * GiB, host_flops=1 * T, host_memory_bandwidth=100 * GB,
               disk_read_bandwidth=3.5 * GB, disk_write_bandwidth=3.0 * GB,   # one PCIe 3 x4 NVMe drive
               network_bandwidth=NOMINAL_NETWORK_BANDWIDTH,                   # 10 Gb/s Ethernet
               network_latency=NOMINAL_NETWORK_LATENCY)
NOMINAL_CORE_FLOPS = 40e9      # fp32 matmul FLOP/s one AVX2 core sustains, roughly; profile() measures
NOMINAL_MEMCPY = 10 * GB       # bytes/s a large memcpy copies on a few server cores, roughly; profile() measures
PROFILE_VERSION = 5            # bumped when profile() measures more or differently: older caches are not used


@dataclass(frozen=True)
class Device:
    """One accelerator (or a logical device on the CPU) as the simulator sees it.

    ``peak_flops`` maps a dtype ("fp32", "tf32", "fp16", "bf16", "fp8") to dense peak
    FLOP/s; ``dtype`` picks the one compute is costed at (``flops``). ``speed_factor``
    is for emulation only: the simulator (and an emulating runtime) stretch compute time
    by it, while the FLOP/s figures stay the spec sheet's; reports call such a device
    emulated.

    How fast compute really goes, beyond the peak: ``efficiency`` is the share of peak
    FLOP/s a layer pack's mix of ops sustains (matmuls at a pack's shapes, plus the
    elementwise, normalisation and softmax ops around them that move bytes rather than
    multiply); ``kernel_latency`` is the fixed cost of each tensor op a pack dispatches
    (a kernel launch on a GPU; on the CPU runtime, PyTorch's dispatch plus the runtime's
    allocation accounting); ``op_latency`` is a fixed cost per schedule op (the executor's
    loop). ``ondemand_call_latency`` and ``ondemand_op_latency`` are what the ``ondemand`` baseline's
    fetch checks add to each tensor op (runtime/ondemand.py): ops called from Python pass a function-level and a
    dispatch-level mode, autograd's backward ops the dispatch level only. ``Hardware.profile`` measures all of
    these on this machine; presets keep the datasheet peak (efficiency 1, no latencies) unless told otherwise.
    ``plain_kernel_latency`` (CUDA): ``kernel_latency`` without the runtime's accounting (``accounting="allocator"``).
    ``queued``: the host queues ops to the device (CUDA), so a pack's compute takes the longer of its
    kernels' time and its launches' time, not their sum.
    ``sync_copies``: the runtime on the CPU runs compute on the thread that issues the ops,
    so a copy is issued only when the compute before it is done, and every copy but a
    ``swap_in`` (the one with a copy engine, a worker thread) blocks the compute stream:
    write-backs, stashes, unstashes and batch loads run on that thread.
    ``real_link_bandwidth`` is for emulation only (``Hardware.logical(..., link_bandwidth=)``): the bytes/s the
    host link's copies really run at, while ``h2d_bandwidth`` and ``d2h_bandwidth`` are the slower link emulated;
    the runtime paces every copy to them, and copies out of the device go on a thread of their own, as a GPU's
    copy engine takes them (``link_emulated``).
    """

    name: str
    memory: int                            # bytes
    peak_flops: dict[str, float]           # dtype -> dense FLOP/s
    h2d_bandwidth: float                   # bytes/s host -> device
    d2h_bandwidth: float                   # bytes/s device -> host
    memory_bandwidth: float                # bytes/s of device memory (read + write traffic)
    dtype: str = "fp32"
    speed_factor: float = 1.0
    op_latency: float = 0.0                # seconds per compute op of the schedule
    efficiency: float = 1.0                # share of peak FLOP/s a layer pack's compute sustains
    kernel_latency: float = 0.0            # seconds per tensor op (kernel) a compute op dispatches
    plain_kernel_latency: float = 0.0      # the same without the runtime's per-op accounting (0: not measured)
    ondemand_call_latency: float = 0.0     # seconds the ondemand runtime's fetch checks add per tensor op called
    ondemand_op_latency: float = 0.0       # from Python (forward, step); per op of autograd's backward
    sync_copies: bool = False              # copies follow the compute before them; all but swap_in block it
    queued: bool = False                   # ops are queued to the device (a GPU): launches hide behind kernels
    link: str = ""                         # what the host link is, for reports ("pcie4", "memcpy", ...)
    p2p_bandwidth: float = 0.0             # bytes/s to a peer device of the node, one direction (0: none given)
    real_link_bandwidth: float = 0.0       # an emulated link's real rate: h2d/d2h are paced down from it (0: real)
    source: str = ""                       # where the figures come from

    def __post_init__(self):
        if self.dtype not in self.peak_flops:
            raise ConfigError(f"device {self.name!r} has no {self.dtype} FLOP/s figure; "
                              f"it has {', '.join(self.peak_flops)}")
        if self.speed_factor <= 0:
            raise ConfigError(f"device {self.name!r}: speed_factor must be positive, got {self.speed_factor}")
        if self.real_link_bandwidth < 0 or min(self.h2d_bandwidth, self.d2h_bandwidth) <= 0:
            raise ConfigError(f"device {self.name!r}: h2d_bandwidth and d2h_bandwidth must be positive and "
                              f"real_link_bandwidth >= 0, got {self.h2d_bandwidth:g}, {self.d2h_bandwidth:g}, "
                              f"{self.real_link_bandwidth:g}")
        if not 0 < self.efficiency <= 1:
            raise ConfigError(f"device {self.name!r}: efficiency is a share of peak FLOP/s in (0, 1], "
                              f"got {self.efficiency}")

    @property
    def flops(self) -> float:
        """Peak FLOP/s at ``dtype`` (not stretched by ``speed_factor``)."""
        return self.peak_flops[self.dtype]

    @property
    def effective_flops(self) -> float:
        """FLOP/s a layer pack sustains: peak at ``dtype`` times ``efficiency``."""
        return self.flops * self.efficiency

    @property
    def emulated(self) -> bool:
        return self.speed_factor != 1.0 or self.link_emulated

    @property
    def link_emulated(self) -> bool:
        """Whether the host link is an emulated slower one (the runtime paces copies to ``h2d_bandwidth``)."""
        return self.real_link_bandwidth > 0

    def stretch(self, stream: str) -> float:
        """How many times longer work on ``stream`` takes than the CPU time it needs: compute ``speed_factor``; an
        emulated link's copies their real rate over the emulated one (the rest is slept out); else 1."""
        if stream == "compute":
            return self.speed_factor
        if stream in ("h2d", "d2h") and self.link_emulated:
            return max(1.0, self.real_link_bandwidth / getattr(self, f"{stream}_bandwidth"))
        return 1.0

    def replace(self, **changes) -> "Device":
        """A copy with some fields changed: ``dev.replace(memory=8 * GiB, dtype="bf16")``."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str, link: str | float | None = None) -> "Device":
        """A GPU from ``PRESETS`` by name (case, dashes and spaces ignored), on its own or another host link."""
        key = _key(name)
        if key not in PRESETS:
            raise ConfigError(f"no hardware preset {name!r}; presets: {', '.join(PRESET_NAMES)} (case, dashes and "
                              f"spaces ignored)")
        dev = PRESETS[key]
        if link is None:
            return dev
        if isinstance(link, str):
            if link not in PCIE:
                raise ConfigError(f"unknown link {link!r}; choose one of {', '.join(PCIE)} or give bytes/s")
            return dev.replace(h2d_bandwidth=PCIE[link], d2h_bandwidth=PCIE[link], link=link)
        return dev.replace(h2d_bandwidth=float(link), d2h_bandwidth=float(link), link=f"{link / GB:g} GB/s")


@dataclass(frozen=True)
class Hardware:
    """Devices and what they share: host memory and CPU, disk, network."""

    devices: tuple[Device, ...]
    host_memory: int = NOMINAL["host_memory"]
    host_flops: float = NOMINAL["host_flops"]                       # CPU FLOP/s (optimizer step on the host)
    host_memory_bandwidth: float = NOMINAL["host_memory_bandwidth"]
    disk_read_bandwidth: float = NOMINAL["disk_read_bandwidth"]
    disk_write_bandwidth: float = NOMINAL["disk_write_bandwidth"]
    disk_free: int = 0                                             # bytes free where offload files go (0: unknown)
    network_bandwidth: float = NOMINAL["network_bandwidth"]        # bytes/s per rank
    network_latency: float = NOMINAL["network_latency"]            # seconds per message
    notes: tuple[str, ...] = field(default_factory=tuple)          # what is measured, nominal or emulated
    switches: tuple[tuple[int, ...], ...] = ()   # devices whose host links share one upstream link (a PCIe switch)
    switch_bandwidth: float = 0.0                # bytes/s of that upstream link, per direction
    host_cores: float = 0.0      # CPU cores of each host its devices' ranks share (0: not given, host work unshared)
    hosts: tuple[tuple[int, ...], ...] = ()      # devices of each host (server); (): all on one host
    # (bits, fp32 bytes/s) one core quantizes and dequantizes once with CGX's codec; (): nominal (runtime/plan.py), as
    # in a profile cached before profile() measured it (the version is kept: only this figure is missing there)
    codec_rates: tuple[tuple[int, float], ...] = ()
    socket_rate: float = 0.0     # bytes/s of all-reduce TCP traffic one core's gloo carries (CPU devices); 0: nominal
    network_shared: bool = False    # a host's devices pool their network_bandwidth: one transfer at a time gets it all

    def __post_init__(self):
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "switches", tuple(tuple(g) for g in self.switches))
        object.__setattr__(self, "hosts", tuple(tuple(g) for g in self.hosts))
        object.__setattr__(self, "codec_rates", tuple((int(b), float(r)) for b, r in self.codec_rates))
        if not self.devices:
            raise ConfigError("a Hardware needs at least one device")
        nodes.check_hosts(self)
        shared = [d for g in self.switches for d in g]
        if len(shared) != len(set(shared)) or any(not 0 <= d < len(self.devices) for d in shared) or \
                (shared and self.switch_bandwidth <= 0):
            raise ConfigError(f"switches={self.switches!r}: each of the {len(self.devices)} devices in at most one "
                              f"group, with switch_bandwidth > 0 (got {self.switch_bandwidth:g})")

    @property
    def emulated(self) -> bool:
        return any(d.emulated for d in self.devices)

    def replace(self, **changes) -> "Hardware":
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name, count: int = 1, link: str | float | None = None, **host) -> "Hardware":
        """``count`` GPUs of preset ``name`` (or a list of names, one per device) on one host.

        ``link``: "pcie3", "pcie4", "pcie5" or bytes/s, for every device (default: each GPU's own).
        ``host``: any other ``Hardware`` field (host_memory, network_bandwidth, ...).
        """
        names = [name] * count if isinstance(name, str) else list(name)
        devices = tuple(Device.preset(n, link) for n in names)
        nominal = [k for k in NOMINAL if k not in host]
        notes = (f"GPU figures: vendor datasheets (dense peak); nominal, not measured: {', '.join(nominal)}",)
        return cls(devices, notes=notes, **host)

    @classmethod
    def of(cls, hardware) -> "Hardware":
        """``hardware=`` as compile takes it (a ``Hardware``, a ``Device`` or a GPU preset name) as a ``Hardware``."""
        if isinstance(hardware, str):
            return cls.preset(hardware)
        return cls((hardware,)) if isinstance(hardware, Device) else hardware

    def computing_in(self, precision: str, accounting: str = "ops") -> "Hardware":
        """The devices costed at ``precision``'s FLOP/s ("bf16", "fp16") where they have a figure for it: a plan
        in mixed precision multiplies in that dtype, not in the fp32 a description defaults to. ``accounting=
        "allocator"``: each tensor op costs ``plain_kernel_latency`` where measured (no hook runs around it)."""
        plain = accounting == "allocator"
        return self.replace(devices=tuple(d.replace(
            dtype=precision if precision in d.peak_flops else d.dtype,
            kernel_latency=d.plain_kernel_latency if plain and d.plain_kernel_latency else d.kernel_latency)
            for d in self.devices))

    @classmethod
    def node(cls, name: str) -> "Hardware":
        """A whole server from ``compiler/hardware/nodes.py``: "4x1080ti", "8x1080ti" (one PCIe 3.0 switch),
        "8xa100-40gb"."""
        return nodes.node(name, cls)

    def server_link(self, bandwidth: float, ranks: int) -> "Hardware":
        """Each server's one link of ``bandwidth`` bytes/s to the others, pooled by its ``ranks`` ranks: each device's
        ``network_bandwidth`` its 1/``ranks`` share, and a transfer alone there has the whole link
        (``network_shared``; runtime/simulate/node.py)."""
        return nodes.server_link(self, bandwidth, ranks)

    def logical(self, budgets, speed_factors=None, link_bandwidth=None) -> "Hardware":
        """This hardware's first device as several logical devices, each with its own memory budget.

        ``speed_factors`` (one per device) stretch compute time: emulated slower devices. ``link_bandwidth``
        (bytes/s, one for every device or one per device) emulates a slower host link: its devices' h2d and d2h
        rate, to which the runtime paces each of their copies (compiler/hardware/logical.py)."""
        return logical(self, budgets, speed_factors, link_bandwidth)

    def describe(self) -> str:
        """One line per device and one for the host, as a person reads them."""
        lines = []
        for i, d in enumerate(self.devices):
            emu = f", emulated: compute x{d.speed_factor:g}" if d.speed_factor != 1 else ""
            emu += f", emulated link (really {d.real_link_bandwidth / GB:.3g} GB/s)" if d.link_emulated else ""
            eff = f" ({d.efficiency:.0%} sustained by a layer pack)" if d.efficiency != 1 else ""
            lat = f", {d.kernel_latency * 1e6:.3g} us per tensor op" if d.kernel_latency else ""
            if d.ondemand_call_latency or d.ondemand_op_latency:
                lat += (f" (ondemand +{d.ondemand_call_latency * 1e6:.3g} us, +{d.ondemand_op_latency * 1e6:.3g} us "
                        f"in backward)")
            lines.append(f"device {i}: {d.name}, {d.memory / GiB:.1f} GiB, {d.flops / T:.3g} TFLOP/s {d.dtype}{eff}"
                         f"{lat}, h2d {d.h2d_bandwidth / GB:.3g} GB/s ({d.link}), memory "
                         f"{d.memory_bandwidth / GB:.4g} GB/s{emu}"
                         + (f", p2p {d.p2p_bandwidth / GB:.3g} GB/s" if d.p2p_bandwidth else ""))
        for g in self.switches:
            lines.append(f"devices {', '.join(map(str, g))} share one host link of {self.switch_bandwidth / GB:.3g} "
                         f"GB/s per direction (a PCIe switch)")
        lines.append(f"host: {self.host_memory / GiB:.1f} GiB, disk read {self.disk_read_bandwidth / GB:.3g} GB/s, "
                     f"write {self.disk_write_bandwidth / GB:.3g} GB/s, network {self.network_bandwidth / GB:.3g} "
                     f"GB/s + {self.network_latency * 1e6:.0f} us")
        if self.codec_rates:
            lines.append("gradient codec per core (quantize + dequantize): " + ", ".join(
                f"{b} bits {r / GB:.3g} GB/s" for b, r in self.codec_rates))
        lines += nodes.describe_hosts(self)
        return "\n".join(lines + list(self.notes))

    # -- this machine ----------------------------------------------------------------------------
    @classmethod
    def detect(cls, path=None, device: str | None = None) -> "Hardware":
        """This machine without measuring: cores, RAM (/proc/meminfo), free disk (statvfs); nominal speeds.

        ``device``: ``"cuda"`` (``"cuda:N"``) describes that GPU, by its name's preset where one matches
        (datasheet figures) and with its real memory; ``"cpu"`` the CPU as a logical device holding all
        RAM (give it a budget with ``hw.logical([budget])``); default: the first GPU where CUDA is
        available, else the CPU.
        """
        if machine.wants_cuda(device):
            return cls._detect_cuda(path, device or "cuda")
        cores = machine.cores()
        ram, model = machine.meminfo("MemTotal"), machine.cpu_model()
        dev = Device(name=f"cpu ({cores} cores{', ' + model if model else ''})", memory=ram,
                     peak_flops={"fp32": cores * NOMINAL_CORE_FLOPS}, h2d_bandwidth=NOMINAL_MEMCPY,
                     d2h_bandwidth=NOMINAL_MEMCPY, memory_bandwidth=2 * NOMINAL_MEMCPY, link="memcpy",
                     sync_copies=True,
                     source="Hardware.detect: nominal per-core FLOP/s and memcpy rate, not measured")
        return cls((dev,), host_memory=ram, host_flops=cores * NOMINAL_CORE_FLOPS, host_cores=cores,
                   host_memory_bandwidth=2 * NOMINAL_MEMCPY, disk_free=machine.disk_free(path),
                   notes=("detected, not measured: speeds are nominal; Hardware.profile() measures them",))

    @classmethod
    def _detect_cuda(cls, path, device) -> "Hardware":
        host = cls.detect(path, device="cpu")
        name, memory = machine.cuda_name(device)
        match = next((d for k, d in sorted(PRESETS.items(), key=lambda kv: -len(kv[0])) if k in _key(name)
                      or _key(d.name) in _key(name)), None)
        base = match or PRESETS[_key("a100-40gb")]
        figures = f"datasheet of {base.name}" if match else "no preset matches: an A100 datasheet"
        dev = base.replace(name=name, memory=memory, queued=True,
                           source=f"Hardware.detect: {figures}, not measured; memory from the driver")
        return host.replace(devices=(dev,), notes=(f"detected, not measured: {name}'s speeds are "
                                                    f"{'its datasheet' if match else 'nominal'}; Hardware.profile() "
                                                    f"measures them",))

    @classmethod
    def profile(cls, seconds: float = 8.0, path=None, threads: int | None = None, save: bool = True,
                block: tuple[int, ...] | None = None, device: str | None = None) -> "Hardware":
        """Measure this machine in about ``seconds``: FLOP/s, per-op latency, memcpy and disk bandwidth.

        - peak: a 2048 x 2048 fp32 matmul at ``threads`` threads (default: as many as torch
          uses now, which the runtime will use too), median of a few;
        - ``kernel_latency``: the time per tensor op of a transformer block too small to
          compute anything (width 16, 8 tokens), run as below: what every op pays besides
          its arithmetic (dispatch, module calls, autograd, the runtime's accounting);
        - ``ondemand_call_latency``, ``ondemand_op_latency``: that block's forward and its backward timed with
          and without the ondemand runtime's modes, its weights fetched: the extra seconds per op;
        - ``efficiency``: transformer blocks (pre-norm, GELU; ``block`` = (width, tokens per
          microbatch[, sequence length, default 128]); as many distinct layers as hold 64 MiB
          of weights, at most 8, so caches start cold as in a step) run as a pack's backward
          runs them (forward without grad, then forward again with grad and backward), FLOPs counted by
          ``torch.utils.flop_counter``; its time less its tensor ops times ``kernel_latency``,
          against the matmul peak. Pass the width and tokens per microbatch of the model you
          will simulate: small matmuls run further below peak than large ones;
        - the host link: a large ``copy_`` (bytes copied per second);
        - disk: a temporary file in ``path`` written and read back with O_DIRECT where the
          file system allows it, else with fsync and ``posix_fadvise(DONTNEED)``.

        The device is the CPU as the runtime uses it: copies other than ``swap_in`` run on
        the issuing thread, so ``sync_copies``. On a machine shared with other busy processes,
        measure (and train) with one intra-op thread: with two on two cores, every op waits
        at its barrier for a thread the other processes preempted, and a transformer block
        ran ten times slower at random here (0.05 s or 0.53 s), while one thread ran it in
        0.08 s every time.
        On a GPU (``device="cuda"``, the default where CUDA is available) the card is measured instead:
        matmul FLOP/s at fp32, tf32, bf16 and fp16, pinned h2d and d2h copies, device memory bandwidth, the
        time per tensor op under the runtime's accounting, and a transformer block (``block`` default
        (2048, 4096)) against the fp32 peak; its compute is ``queued`` (launches overlap kernels).
        The result is cached for ``this_machine()`` when ``save``.
        """
        if machine.wants_cuda(device):
            hw = profile_cuda(cls._detect_cuda(path, device or "cuda"), seconds, path, device or "cuda",
                              block or (2048, 4096))
        else:
            hw = profile_cpu(cls.detect(path, device="cpu"), seconds, path, threads, block or (512, 512))
        if save:
            _save_profile(hw)
        return hw

    @classmethod
    def this_machine(cls, path=None, cache_dir=None) -> "Hardware":
        """The cached profile of this machine if it still matches (cores and RAM), else ``detect()``; ``cache_dir``:
        where the profile is cached (``PlanConfig.cache_dir``; None: its default)."""
        detected = cls.detect(path)
        try:
            raw = json.loads(_cache_path(cache_dir).read_text())
            if raw.pop("profile_version", None) != PROFILE_VERSION:
                return detected        # a profile that measured less than this one does
            cached = cls.from_dict(raw)
        except (OSError, ValueError, TypeError, KeyError, ConfigError):
            return detected
        if cached.host_memory != detected.host_memory or cached.devices[0].name.split(",")[0] != \
                detected.devices[0].name.split(",")[0]:
            return detected
        # (a profile cached before hosts had cores still has them: the cores are detected, not measured)
        return cached.replace(disk_free=detected.disk_free, host_cores=cached.host_cores or detected.host_cores)

    @classmethod
    def from_dict(cls, d: dict) -> "Hardware":
        d = dict(d)
        d["devices"] = tuple(Device(**dev) for dev in d["devices"])
        d["notes"] = tuple(d.get("notes", ()))
        d["switches"] = tuple(tuple(g) for g in d.get("switches", ()))
        d["hosts"] = tuple(tuple(g) for g in d.get("hosts", ()))
        return cls(**d)


def _save_profile(hw: "Hardware") -> None:
    _cache_path().parent.mkdir(parents=True, exist_ok=True)
    _cache_path().write_text(json.dumps(dict(dataclasses.asdict(hw), profile_version=PROFILE_VERSION), indent=1))


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _gpu(name, memory_gib, flops_t: dict, memory_gbs, link, source) -> Device:
    return Device(name=name, memory=memory_gib * GiB, peak_flops={k: v * T for k, v in flops_t.items()},
                  h2d_bandwidth=PCIE[link], d2h_bandwidth=PCIE[link], memory_bandwidth=memory_gbs * GB,
                  link=link, source=source)


# Tensor Core figures are dense: half of the datasheets' "with sparsity" figures where those are starred.
_V100 = ("NVIDIA Tesla V100 GPU Accelerator datasheet, SXM2 column: FP32 15.7 TFLOPS, Tensor (FP16 in, "
         "FP32 accumulate) 125 TFLOPS, HBM2 900 GB/s; host link PCIe Gen3 x16")
_A100 = ("NVIDIA A100 Tensor Core GPU datasheet, SXM column: FP32 19.5 TFLOPS; TF32 / BF16 / FP16 Tensor "
         "156 / 312 / 312 TFLOPS dense (312 / 624 / 624 with sparsity); PCIe Gen4 64 GB/s both ways")
_WRITTEN: dict[str, Device] = {
    "v100-16gb": _gpu("Tesla V100 SXM2 16GB", 16, dict(fp32=15.7, fp16=125), 900, "pcie3", _V100),
    "v100-32gb": _gpu("Tesla V100 SXM2 32GB", 32, dict(fp32=15.7, fp16=125), 900, "pcie3", _V100),
    "a100-40gb": _gpu("A100 SXM4 40GB", 40, dict(fp32=19.5, tf32=156, bf16=312, fp16=312), 1555, "pcie4",
                      _A100 + "; 40GB HBM2 1,555 GB/s"),
    "a100-80gb": _gpu("A100 SXM4 80GB", 80, dict(fp32=19.5, tf32=156, bf16=312, fp16=312), 2039, "pcie4",
                      _A100 + "; 80GB HBM2e 2,039 GB/s"),
    "h100-sxm": _gpu("H100 SXM5 80GB", 80, dict(fp32=67, tf32=494.5, bf16=989.5, fp16=989.5, fp8=1979), 3350,
                     "pcie5", "NVIDIA H100 Tensor Core GPU datasheet, SXM column: FP32 67 TFLOPS; TF32 / BF16 / "
                     "FP16 / FP8 Tensor 989 / 1,979 / 1,979 / 3,958 TFLOPS with sparsity, so approximately "
                     "494.5 / 989.5 / 989.5 / 1,979 dense; HBM3 3.35 TB/s; PCIe Gen5 128 GB/s both ways"),
    "h200-sxm": _gpu("H200 SXM 141GB", 141, dict(fp32=67, tf32=494.5, bf16=989.5, fp16=989.5, fp8=1979), 4800,
                     "pcie5", "NVIDIA H200 Tensor Core GPU datasheet, SXM column: FP32 67 TFLOPS; TF32 / BF16 / "
                     "FP16 / FP8 Tensor 989 / 1,979 / 1,979 / 3,958 TFLOPS with sparsity, so approximately "
                     "494.5 / 989.5 / 989.5 / 1,979 dense; 141GB HBM3e 4.8 TB/s; PCIe Gen5 128 GB/s both ways"),
    "rtx3090": _gpu("GeForce RTX 3090", 24, dict(fp32=35.6, tf32=35.6, fp16=71, bf16=71), 936, "pcie4",
                    "NVIDIA Ampere GA102 GPU architecture whitepaper, GeForce RTX 3090 column: FP32 35.6 TFLOPS; "
                    "TF32 Tensor 35.6, FP16 and BF16 Tensor with FP32 accumulate 71 TFLOPS dense (142 with FP16 "
                    "accumulate); GDDR6X 936 GB/s; PCIe Gen4 x16"),
    "gtx1080ti": _gpu("GeForce GTX 1080 Ti", 11, dict(fp32=11.3), 484, "pcie3",
                      "NVIDIA GeForce GTX 1080 Ti specifications: 3,584 CUDA cores at 1,582 MHz boost, so FP32 "
                      "approximately 11.3 TFLOPS (2 FLOP per core per clock); 11 GB GDDR5X at 11 Gbps on 352 bits, "
                      "484 GB/s; PCIe Gen3 x16. Pascal GeForce has no fast FP16, so no fp16 figure"),
    "l4": _gpu("L4", 24, dict(fp32=30.3, tf32=60, fp16=121, bf16=121, fp8=242.5), 300, "pcie4",
               "NVIDIA L4 Tensor Core GPU datasheet: FP32 30.3 TFLOPS; TF32 / FP16 / BF16 / FP8 Tensor 120 / 242 / "
               "242 / 485 TFLOPS with sparsity, so approximately 60 / 121 / 121 / 242.5 dense; 24GB GDDR6 300 GB/s; "
               "PCIe Gen4 x16 64 GB/s both ways"),
    "t4": _gpu("T4", 16, dict(fp32=8.1, fp16=65), 320, "pcie3",
               "NVIDIA T4 Tensor Core GPU datasheet: single precision 8.1 TFLOPS, mixed precision (FP16/FP32) "
               "65 TFLOPS; 16GB GDDR6, approximately 320 GB/s (the datasheet says 320+ GB/s); PCIe Gen3 x16"),
    "a6000": _gpu("RTX A6000", 48, dict(fp32=38.7, tf32=77.4, fp16=154.8, bf16=154.8), 768, "pcie4",
                  "NVIDIA RTX A6000 datasheet: single precision 38.7 TFLOPS, Tensor 309.7 TFLOPS with sparsity, "
                  "so approximately 154.8 dense FP16/BF16 (TF32 approximately half of that); 48GB GDDR6 "
                  "768 GB/s; PCIe Gen4 x16"),
    "p40": _gpu("Tesla P40", 24, dict(fp32=12.0), 346, "pcie3",
                "NVIDIA Tesla P40 datasheet: single precision 12 TFLOPS (at boost clock), INT8 47 TOPS; 24GB "
                "GDDR5 346 GB/s; PCIe Gen3 x16. No fast FP16 on Pascal GP102, so no fp16 figure"),
}
_WRITTEN["h100"], _WRITTEN["h200"] = _WRITTEN["h100-sxm"], _WRITTEN["h200-sxm"]
PRESET_NAMES = tuple(_WRITTEN)    # as README and errors write them; lookups ignore case, dashes and spaces
PRESETS: dict[str, Device] = {_key(k): v for k, v in _WRITTEN.items()}


# -- the profile's cache ----------------------------------------------------------------------------
def _cache_path(cache_dir=None) -> Path:
    """hardware.json in ``cache_dir``, else $HARMONY_CACHE_DIR (base/env.py), else the XDG cache directory."""
    root = cache_dir or env_default("cache_dir") or \
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "harmony"
    return Path(root) / "hardware.json"
