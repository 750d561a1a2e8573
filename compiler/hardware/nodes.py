"""Whole servers: several GPUs of one node, their peer-to-peer link and the host links they share.

>>> hw = Hardware.node("4x1080ti")
>>> hw.switches, hw.switch_bandwidth / 2**30, hw.devices[0].p2p_bandwidth / 2**30
(((0, 1, 2, 3),), 11.5, 8.2)

The simulator (runtime/simulate/node.py) reads three things beyond one device's figures:

- ``Device.p2p_bandwidth``: bytes/s one device sends to a peer (a pipeline's boundary values);
- ``Hardware.switches``: groups of devices whose host links meet in one upstream link (a PCIe switch), and
  ``Hardware.switch_bandwidth``, that link's bytes/s per direction: concurrent swaps of the devices of one group
  share it, while each device alone still copies at its own link's rate;
- ``Hardware.hosts``: groups of devices of one server (default: every device on one), whose ranks share the host's
  ``Hardware.host_cores`` CPU cores and its ``host_memory_bandwidth``: the host's optimizer steps, its copies, and
  the compute of a device that is the CPU itself (a logical device, ``sync_copies``) each take a core, and the
  steps and copies their bytes of the memory bus, so ranks on one host slow each other as they really do.
  ``host_cores=0`` (the presets': no figure) leaves every rank's host work unshared, as does a host with one rank.
  Where several servers are emulated on one machine, give each its part of the machine's cores
  (``hw.replace(host_cores=cores / servers)``).

The presets and why each figure:

- ``4x1080ti``, ``8x1080ti``: the Harmony paper's commodity server, GTX 1080 Ti 11 GB behind one PCIe 3.0
  switch. The per-device swap rate and the switch's upstream rate are both msr-fiddle/harmony's measured swap
  bandwidth (3_scheduler/sched_args.py ``--bw_swap`` 11.5 GiB/s): one x16 gen-3 uplink carries at most what one
  x16 gen-3 device link does, so N devices swapping at once get about 1/N of it each. Peer to peer: its
  ``--bw_p2p`` default, 8.2 GiB/s (through the switch, not the uplink: P2P traffic does not share it here).
- ``8xa100-40gb``: a server of today, 8 A100 SXM4 40 GB on an NVSwitch baseboard (HGX A100). P2P: NVLink 3,
  600 GB/s per GPU both directions together in NVIDIA's A100 datasheet, so 300 GB/s one way. Host links: two
  GPUs per PCIe Gen4 x16 switch (DGX A100's layout of four host switches, assumed from its system description,
  not measured), each uplink 80% of the PCI-SIG gen-4 rate as a measured pinned copy would reach, and so each
  GPU's own link.
"""
from __future__ import annotations

from harmony.base.errors import ConfigError

GB, GiB = 1e9, 2**30
PCIE = {"pcie3": 15.75 * GB, "pcie4": 31.5 * GB, "pcie5": 63.0 * GB}   # x16, bytes/s per direction
HARMONY_SWAP = 11.5 * GiB        # msr-fiddle/harmony 3_scheduler/sched_args.py --bw_swap
HARMONY_P2P = 8.2 * GiB          # msr-fiddle/harmony 3_scheduler/sched_args.py --bw_p2p
NVLINK3 = 300e9                  # A100 datasheet: NVLink 600 GB/s, both directions together
MEASURED_SHARE = 0.8             # a pinned copy reaches about this share of the PCI-SIG rate


# Each recipe builds on ``Hardware`` (given, so that compiler/hardware/, which imports this module's links,
# is not imported back)
def _commodity(hardware, count: int):
    hw = hardware.preset("gtx1080ti", count=count, link=HARMONY_SWAP)
    devices = tuple(d.replace(p2p_bandwidth=HARMONY_P2P, link="pcie3, measured") for d in hw.devices)
    return hw.replace(devices=devices, switches=(tuple(range(count)),), switch_bandwidth=HARMONY_SWAP,
                      notes=hw.notes + (f"{count} GPUs behind one PCIe 3.0 switch: swaps share its "
                                        f"{HARMONY_SWAP / GiB:g} GiB/s uplink, P2P {HARMONY_P2P / GiB:g} GiB/s "
                                        f"(msr-fiddle/harmony scheduler defaults)",))


def _a100(hardware):
    link = MEASURED_SHARE * PCIE["pcie4"]
    hw = hardware.preset("a100-40gb", count=8, link=link)
    devices = tuple(d.replace(p2p_bandwidth=NVLINK3, link="pcie4") for d in hw.devices)
    return hw.replace(devices=devices, switches=((0, 1), (2, 3), (4, 5), (6, 7)), switch_bandwidth=link,
                      notes=hw.notes + ("8 A100 SXM4 on NVSwitch (NVLink 3, 300 GB/s one way); two GPUs per "
                                        "PCIe Gen4 switch to the host (assumed DGX A100 layout)",))


def host_groups(hw) -> tuple[tuple[int, ...], ...]:
    """The devices of each host: ``hw.hosts``, or every device on one."""
    return hw.hosts or (tuple(range(len(hw.devices))),)


def check_hosts(hw) -> None:
    """``Hardware.hosts`` names each device at most once, ``host_cores`` is not negative; else a ConfigError."""
    named = [d for g in hw.hosts for d in g]
    if len(named) != len(set(named)) or any(not 0 <= d < len(hw.devices) for d in named) or hw.host_cores < 0:
        raise ConfigError(f"hosts={hw.hosts!r}, host_cores={hw.host_cores!r}: each of the {len(hw.devices)} devices "
                          f"on at most one host, and host_cores >= 0 (0: not given)")


def describe_hosts(hw) -> list[str]:
    """A line per host whose devices share its cores (for ``Hardware.describe``)."""
    if not hw.host_cores:
        return []
    return [(f"devices {', '.join(map(str, g))} share one host" if len(g) > 1 else f"device {g[0]}'s host") +
            f": {hw.host_cores:g} cores, memory {hw.host_memory_bandwidth / GB:.3g} GB/s" for g in host_groups(hw)]


def server_link(hw, bandwidth: float, ranks: int):
    """``hw`` with each server's one link of ``bandwidth`` bytes/s to the others pooled by its ``ranks`` ranks
    (``Hardware.server_link``)."""
    if bandwidth <= 0 or ranks < 1:
        raise ConfigError(f"server_link(bandwidth={bandwidth!r}, ranks={ranks!r}): a link of positive bytes/s "
                          f"shared by one rank or more")
    return hw.replace(network_bandwidth=bandwidth / ranks, network_shared=True)


NODES = {"4x1080ti": lambda hw: _commodity(hw, 4), "8x1080ti": lambda hw: _commodity(hw, 8), "8xa100-40gb": _a100}


def node(name: str, hardware):
    """A server preset by name (``NODES``), a ``hardware`` (the ``Hardware`` class)."""
    if name not in NODES:
        raise ConfigError(f"no server preset {name!r}; presets: {', '.join(NODES)} (or build a Hardware with "
                          f"devices=, switches=, switch_bandwidth= and Device.p2p_bandwidth)")
    return NODES[name](hardware)
