"""Where this process runs: node identity, the address peers can reach it at, and the node's
hardware layout (GPUs, RDMA NICs, NUMA nodes, PCIe paths) with GPU-to-NIC matching.

The layout is read from sysfs (``/sys/bus/pci/devices``, ``/sys/class/infiniband``,
``/sys/devices/system/node``); every function that reads it takes ``root``, the directory holding
``sys/`` (default ``/``), so tests run on fake trees (:mod:`mori.testing.fake_sysfs`). Nothing here
changes the process: :func:`bind_thread_to_gpu` sets a CPU affinity only when ``MORI_CPU_AFFINITY``
asks for it.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mori.core import env
from mori.core.errors import MoriValueError, bad_value
from mori.core.nic import NicVendor, RdmaDevice, RdmaPort, parse_device_filter, scan_rdma_devices

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def node_id() -> str:
    """Ranks with the same node id share host memory: ``MORI_NODE_ID``, else boot id, else hostname."""
    explicit = env.MORI_NODE_ID.get()
    if explicit:
        return explicit
    try:
        boot = _BOOT_ID.read_text().strip()
        if boot:
            return f"boot:{boot}"
    except OSError:
        pass
    return f"host:{socket.gethostname()}"


def interface_ipv4(ifname: str) -> str:
    """IPv4 address of a network interface, e.g. ``eth0``."""
    if ifname not in {name for _, name in socket.if_nameindex()}:
        known = ", ".join(name for _, name in socket.if_nameindex())
        raise MoriValueError(f"MORI_SOCKET_IFNAME={ifname!r}: no such interface (this host has: {known})")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))  # SIOCGIFADDR
        except OSError as e:
            raise MoriValueError(
                f"MORI_SOCKET_IFNAME={ifname!r}: interface has no IPv4 address ({e})"
            ) from None
    return socket.inet_ntoa(packed[20:24])


def advertised_host() -> str:
    """The address this process tells peers to connect to (rendezvous servers)."""
    ifname = env.MORI_SOCKET_IFNAME.get()
    if ifname:
        return interface_ipv4(ifname)
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


# -- hardware layout ---------------------------------------------------------------------------

#: PCI vendors whose display / 3D / processing-accelerator functions are GPUs MORI can drive
GPU_VENDORS = {0x10DE: "nvidia", 0x1002: "amd"}
#: PCI base classes of GPUs: display controller (VGA, 3D) and processing accelerator (MI300X)
GPU_CLASSES = (0x03, 0x12)

_PCI_ADDRESS = re.compile(r"^[0-9a-fA-F]{4,}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


@dataclass(frozen=True)
class PciFunction:
    """One PCI function and where it hangs: the bridges above it up to its root complex."""

    address: str
    vendor: int
    device: int
    pci_class: int
    numa_node: int
    #: ``pci0000:00``: the host bridge (root complex) it is under
    root_complex: str
    #: addresses of the bridges from the root port down to (not including) this function
    bridges: tuple[str, ...]


def pci_function(address: str, root: str | os.PathLike[str] = "/") -> PciFunction | None:
    """The PCI function ``address`` (``0000:03:00.0``) under ``root``, or None if sysfs lacks it."""
    link = Path(root, "sys/bus/pci/devices", address)
    if not link.exists():
        return None
    real = Path(os.path.realpath(link))
    parts = real.parts
    rc = next((i for i, p in enumerate(parts) if p.startswith("pci") and ":" in p), None)
    chain = [p for p in parts[(rc + 1 if rc is not None else 0) :] if _PCI_ADDRESS.match(p)]

    def num(name: str, default: int) -> int:
        text = _read(real / name)
        try:
            return int(text, 0) if text else default
        except ValueError:
            return default

    return PciFunction(
        address,
        num("vendor", 0),
        num("device", 0),
        num("class", 0),
        num("numa_node", -1),
        parts[rc] if rc is not None else "",
        tuple(chain[:-1]),
    )


#: path kinds, closest first (NCCL's names): through one switch, through several bridges, through
#: the CPU's host bridge, across the CPUs' interconnect (another NUMA node or root complex)
PATH_KINDS = ("PIX", "PXB", "PHB", "SYS")


def pcie_path(a: PciFunction, b: PciFunction) -> tuple[str, int]:
    """``(kind, hops)`` between two functions: kind from :data:`PATH_KINDS`, hops = bridges crossed."""
    if a.root_complex != b.root_complex:
        same_numa = a.numa_node == b.numa_node and a.numa_node >= 0
        return ("PHB" if same_numa else "SYS"), len(a.bridges) + len(b.bridges) + 2
    common = 0
    for x, y in zip(a.bridges, b.bridges, strict=False):
        if x != y:
            break
        common += 1
    hops = len(a.bridges) - common + len(b.bridges) - common
    if common == 0:
        return "PHB", hops + 1
    if common == len(a.bridges) == len(b.bridges) or hops <= 2:
        return "PIX", hops
    return "PXB", hops


@dataclass(frozen=True)
class Gpu:
    """A GPU: its index (PCI address order, CUDA's ``PCI_BUS_ID`` order) and PCI function."""

    index: int
    vendor: str
    pci: PciFunction


@dataclass(frozen=True)
class NicPort:
    """One port of an RDMA device with its PCI function (None for a device without one)."""

    device: RdmaDevice
    port: RdmaPort
    pci: PciFunction | None

    @property
    def name(self) -> str:
        """``mlx5_0:1``"""
        return f"{self.device.name}:{self.port.number}"


@dataclass(frozen=True)
class NodeTopology:
    """GPUs, RDMA devices and NUMA nodes of one machine, as sysfs showed them at :func:`scan`."""

    gpus: tuple[Gpu, ...]
    rdma_devices: tuple[RdmaDevice, ...]
    #: NUMA node -> its CPUs
    numa_cpus: dict[int, frozenset[int]]
    root: str = "/"

    def ports(
        self, vendors: Sequence[NicVendor] | None = None, devices: str | None = None, active_only: bool = True
    ) -> list[NicPort]:
        """Ports of the RDMA devices (only ACTIVE ones by default), of devices one of ``vendors``
        claims (None: every device), allowed by ``devices`` (``MORI_RDMA_DEVICES`` syntax; None:
        the variable's value)."""
        filt = parse_device_filter(devices if devices is not None else env.MORI_RDMA_DEVICES.get())
        out = []
        for d in self.rdma_devices:
            if vendors is not None and not any(v.claims(d) for v in vendors):
                continue
            pci = pci_function(d.pci_address, self.root) if d.pci_address else None
            for p in d.ports:
                if (p.active or not active_only) and filt.allows(d.name, p.number):
                    out.append(NicPort(d, p, pci))
        return out

    def gpu(self, gpu: int | str) -> Gpu:
        """A GPU by index or PCI address."""
        for g in self.gpus:
            if g.index == gpu or g.pci.address == gpu:
                return g
        have = ", ".join(f"{g.index} ({g.pci.address})" for g in self.gpus) or "none"
        raise bad_value("NodeTopology.gpu", "gpu", gpu, f"a GPU index or PCI address of this node ({have})")

    def match_gpu_nics(
        self,
        gpu: int | str,
        k: int = 1,
        vendors: Sequence[NicVendor] | None = None,
        devices: str | None = None,
    ) -> list[NicPort]:
        """The ``k`` ACTIVE NIC ports closest to ``gpu`` over PCIe, closest first (fewer if there
        are fewer; ``[]`` without any).

        Ports equally close to several GPUs (two GPUs and two NICs under one switch) are dealt out
        in turn, so those GPUs start on different NICs. ``MORI_DISABLE_TOPO=1``: GPU i takes port
        ``(i + j) % n`` for j < k, the original's round robin."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise bad_value("NodeTopology.match_gpu_nics", "k", k, "a whole number >= 1")
        g = self.gpu(gpu)
        ports = self.ports(vendors, devices)
        if not ports:
            return []
        k = min(k, len(ports))
        if env.MORI_DISABLE_TOPO.get():
            return [ports[(g.index + j) % len(ports)] for j in range(k)]

        def rank(p: NicPort, of: Gpu) -> tuple[int, int, int]:
            if p.pci is None:
                return (len(PATH_KINDS), 0, 0)
            kind, hops = pcie_path(of.pci, p.pci)
            return (PATH_KINDS.index(kind), hops, 0)

        def closest(of: Gpu) -> list[NicPort]:
            return sorted(ports, key=lambda p: (rank(p, of), p.name))

        mine = closest(g)
        best = rank(mine[0], g)
        tied = [p for p in mine if rank(p, g) == best]
        # deal the tied ports among the GPUs whose best ports are exactly these
        names = [p.name for p in tied]
        peers = [
            o
            for o in self.gpus
            if [p.name for p in closest(o) if rank(p, o) == rank(closest(o)[0], o)] == names
        ]
        turn = [o.index for o in peers].index(g.index) % len(tied)
        ordered = tied[turn:] + tied[:turn] + [p for p in mine if p not in tied]
        return ordered[:k]

    def match_numa_nics(
        self,
        numa_node: int,
        k: int = 1,
        vendors: Sequence[NicVendor] | None = None,
        devices: str | None = None,
    ) -> list[NicPort]:
        """The ``k`` ACTIVE ports for host memory on ``numa_node`` (mori-io's multi-NIC transfers):
        ports of that node first, then the others, each group in port order. ``MORI_DISABLE_TOPO=1``:
        ports ``(numa_node + j) % n``."""
        f = "NodeTopology.match_numa_nics"
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise bad_value(f, "k", k, "a whole number >= 1")
        if numa_node not in self.numa_cpus and numa_node != -1:
            raise bad_value(
                f, "numa_node", numa_node, f"a NUMA node of this machine {sorted(self.numa_cpus)} or -1"
            )
        ports = self.ports(vendors, devices)
        if not ports:
            return []
        k = min(k, len(ports))
        if env.MORI_DISABLE_TOPO.get():
            return [ports[(max(numa_node, 0) + j) % len(ports)] for j in range(k)]
        near = [p for p in ports if p.pci is not None and p.pci.numa_node == numa_node]
        return (near + [p for p in ports if p not in near])[:k]

    def cpus_of_gpu(self, gpu: int | str) -> frozenset[int]:
        """CPUs of ``gpu``'s NUMA node (every CPU if the node is unknown)."""
        node = self.gpu(gpu).pci.numa_node
        if node in self.numa_cpus:
            return self.numa_cpus[node]
        return frozenset().union(*self.numa_cpus.values()) if self.numa_cpus else frozenset()


def parse_cpulist(text: str) -> frozenset[int]:
    """``0-3,8,10-11`` -> {0, 1, 2, 3, 8, 10, 11} (the kernel's cpulist format)."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(out)


def scan(root: str | os.PathLike[str] = "/") -> NodeTopology:
    """Read this machine's layout from sysfs under ``root`` (files only; no driver is called)."""
    base = Path(root, "sys/bus/pci/devices")
    gpus: list[Gpu] = []
    addresses = sorted(p.name for p in base.iterdir()) if base.is_dir() else []
    for addr in addresses:
        f = pci_function(addr, root)
        if f is None or f.vendor not in GPU_VENDORS or (f.pci_class >> 16) not in GPU_CLASSES:
            continue
        gpus.append(Gpu(len(gpus), GPU_VENDORS[f.vendor], f))
    numa: dict[int, frozenset[int]] = {}
    nodes = Path(root, "sys/devices/system/node")
    if nodes.is_dir():
        for n in sorted(nodes.glob("node[0-9]*")):
            text = _read(n / "cpulist")
            if text is not None:
                try:
                    numa[int(n.name[4:])] = parse_cpulist(text)
                except ValueError:
                    continue
    return NodeTopology(tuple(gpus), tuple(scan_rdma_devices(root)), numa, str(root))


def bind_thread_to_gpu(gpu: int | str, topology: NodeTopology | None = None) -> frozenset[int] | None:
    """Opt-in: with ``MORI_CPU_AFFINITY=numa``, restrict the *calling thread* to the CPUs of
    ``gpu``'s NUMA node (those it may already run on) and return them; otherwise change nothing and
    return None. For MORI's own threads (proxy, progress), never the caller's other threads."""
    if env.MORI_CPU_AFFINITY.get() != "numa":
        return None
    topo = topology or scan()
    allowed = set(os.sched_getaffinity(0))
    cpus = frozenset(topo.cpus_of_gpu(gpu) & allowed)
    if not cpus:
        return None  # the node's CPUs are all outside this process's cpuset: leave it as it is
    os.sched_setaffinity(0, cpus)
    return cpus
