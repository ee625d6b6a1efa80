"""Fake sysfs trees of real machine shapes, for the NIC and topology code (``root=`` arguments).

The tree has the layout the kernel gives: PCI functions under ``sys/devices/pci0000:NN/...`` nested
below their bridges, ``sys/bus/pci/devices/ADDR`` links to them, ``driver`` links into
``sys/bus/pci/drivers/NAME``, ``sys/class/infiniband/NAME`` with a ``device`` link, ``fw_ver`` and
``ports/N/{state,link_layer,rate}``, and ``sys/devices/system/node/nodeN/cpulist``. Links are
relative, as the kernel's are, so resolving them stays inside the tree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

#: PCI ids of the parts the shapes use
NVIDIA, AMD, MELLANOX, BROADCOM, PENSANDO, INTEL, PLX = 0x10DE, 0x1002, 0x15B3, 0x14E4, 0x1DD8, 0x8086, 0x1000
H100, MI300X, CX7, THOR2, POLLARA = 0x2330, 0x74A1, 0x1021, 0x1760, 0x1002
CLASS_3D, CLASS_ACCEL, CLASS_ETH, CLASS_IB, CLASS_BRIDGE = 0x030200, 0x120000, 0x020000, 0x020700, 0x060400

#: per NIC family: (PCI vendor, device id, PCI driver, RDMA name prefix, firmware, user-space library)
NICS = {
    "mlx5": (MELLANOX, CX7, "mlx5_core", "mlx5_", "28.39.1002", "libmlx5.so.1"),
    "bnxt": (BROADCOM, THOR2, "bnxt_en", "bnxt_re", "235.2.91.0", "libibverbs/libbnxt_re-rdmav34.so"),
    "ionic": (PENSANDO, POLLARA, "ionic", "ionic_", "1.117.5-a-63", "libionic.so.1"),
}


EMPTY_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


def _default_gids(port: int) -> dict[int, tuple[str, str]]:
    ll = f"fe80:0000:0000:0000:0a00:00ff:fe00:{port:04x}"
    return {
        0: (ll, "IB/RoCE v1"),
        1: (ll, "RoCE v2"),
        3: (f"0000:0000:0000:0000:0000:ffff:0a00:{port:04x}", "RoCE v2"),
    }


@dataclass
class FakeSysfs:
    """A sysfs tree under ``root`` that tests add devices to."""

    root: Path
    _where: dict[str, Path] = field(default_factory=dict)

    def _link(self, link: Path, target: Path) -> None:
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(target, link.parent), link)

    def pci(
        self,
        address: str,
        *,
        parent: str | None = None,
        root_complex: str = "pci0000:00",
        vendor: int = PLX,
        device: int = 0x8796,
        pci_class: int = CLASS_BRIDGE,
        numa: int = 0,
        driver: str | None = None,
    ) -> Path:
        """Add a PCI function below ``parent`` (a bridge added before) or at ``root_complex``."""
        base = self._where[parent] if parent else self.root / "sys/devices" / root_complex
        d = base / address
        d.mkdir(parents=True)
        (d / "vendor").write_text(f"0x{vendor:04x}\n")
        (d / "device").write_text(f"0x{device:04x}\n")
        (d / "class").write_text(f"0x{pci_class:06x}\n")
        (d / "numa_node").write_text(f"{numa}\n")
        if driver:
            drv = self.root / "sys/bus/pci/drivers" / driver
            drv.mkdir(parents=True, exist_ok=True)
            self._link(d / "driver", drv)
        self._link(self.root / "sys/bus/pci/devices" / address, d)
        self._where[address] = d
        return d

    def rdma(
        self,
        name: str,
        pci_address: str | None,
        *,
        ports: dict[int, str] | None = None,
        fw: str = "",
        link_layer: str = "Ethernet",
        aux_driver: str | None = None,
        gids: dict[int, tuple[str, str]] | None = None,
    ) -> Path:
        """Add ``sys/class/infiniband/NAME`` for the PCI function ``pci_address`` (None: a soft
        device with no ``device`` link). ``ports``: number -> state (``ACTIVE``, ``DOWN``).
        ``aux_driver``: link ``device`` to an auxiliary device below the function bound to it.
        ``gids``: index -> (GID, type) per port; default: index 0 a link-local RoCE v1 GID, index 1
        RoCE v2 of it, index 3 a RoCE v2 IPv4-mapped GID, index 2 empty (as the kernel shows)."""
        where = (
            self._where[pci_address] if pci_address else self.root / "sys/devices/virtual"
        ) / "infiniband"
        d = where / name
        d.mkdir(parents=True)
        if pci_address:
            target = self._where[pci_address]
            if aux_driver:
                target = target / f"{aux_driver}.rdma.0"
                target.mkdir()
                drv = self.root / "sys/bus/auxiliary/drivers" / aux_driver
                drv.mkdir(parents=True, exist_ok=True)
                self._link(target / "driver", drv)
            self._link(d / "device", target)
        if fw:
            (d / "fw_ver").write_text(fw + "\n")
        codes = {"DOWN": 1, "INIT": 2, "ARMED": 3, "ACTIVE": 4}
        for num, state in (ports or {1: "ACTIVE"}).items():
            p = d / "ports" / str(num)
            p.mkdir(parents=True)
            (p / "state").write_text(f"{codes.get(state, 0)}: {state}\n")
            (p / "link_layer").write_text(link_layer + "\n")
            (p / "rate").write_text("400 Gb/sec (4X NDR)\n")
            table = gids if gids is not None else _default_gids(num)
            (p / "gids").mkdir()
            (p / "gid_attrs" / "types").mkdir(parents=True)
            for i in range(max(table, default=-1) + 1):
                gid, kind = table.get(i, (EMPTY_GID, ""))
                (p / "gids" / str(i)).write_text(gid + "\n")
                if kind:
                    (p / "gid_attrs" / "types" / str(i)).write_text(kind + "\n")
        self._link(self.root / "sys/class/infiniband" / name, d)
        return d

    def library(self, name: str) -> Path:
        """Add an (empty) library file ``usr/lib/x86_64-linux-gnu/NAME``."""
        f = self.root / "usr/lib/x86_64-linux-gnu" / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"")
        return f

    def numa(self, node: int, cpulist: str) -> None:
        d = self.root / "sys/devices/system/node" / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist + "\n")


def eight_gpus_eight_nics(
    root: Path,
    family: str = "mlx5",
    *,
    inactive: tuple[int, ...] = (),
    gpu_vendor: int = NVIDIA,
    fw: str | None = None,
    library: bool = True,
) -> FakeSysfs:
    """A DGX/MI300X-like node: 2 NUMA nodes (root complexes pci0000:00 and pci0000:80), 2 PCIe
    switches per node, each switch with 2 GPUs and 2 NICs of ``family``. GPU i and NIC i share a
    switch (switch i // 2). NIC ``n`` in ``inactive`` has its port DOWN. ``fw`` overrides the
    family's firmware version; ``library=False`` leaves the user-space library out."""
    fs = FakeSysfs(root)
    fs.numa(0, "0-7,16-23")
    fs.numa(1, "8-15,24-31")
    vendor, dev_id, driver, prefix, default_fw, lib = NICS[family]
    fw = default_fw if fw is None else fw
    if library:
        fs.library(lib)
    gdev, gcls = (H100, CLASS_3D) if gpu_vendor == NVIDIA else (MI300X, CLASS_ACCEL)
    gdrv = "nvidia" if gpu_vendor == NVIDIA else "amdgpu"
    for sw in range(4):
        numa = sw // 2
        rc = f"pci0000:{0x80 * numa:02x}"
        bus = 0x80 * numa + 0x10 * (sw % 2)
        rp = f"0000:{0x80 * numa:02x}:{1 + sw % 2:02x}.0"
        fs.pci(rp, root_complex=rc, vendor=INTEL, device=0x347A, numa=numa)
        up = f"0000:{bus + 1:02x}:00.0"
        fs.pci(up, parent=rp, numa=numa)
        for slot in range(4):  # downstream ports: GPU, GPU, NIC, NIC
            fs.pci(f"0000:{bus + 2:02x}:{slot:02x}.0", parent=up, numa=numa)
        for j in range(2):
            g = f"0000:{bus + 3 + j:02x}:00.0"
            fs.pci(
                g,
                parent=f"0000:{bus + 2:02x}:{j:02x}.0",
                vendor=gpu_vendor,
                device=gdev,
                pci_class=gcls,
                numa=numa,
                driver=gdrv,
            )
            n = 2 * sw + j
            a = f"0000:{bus + 5 + j:02x}:00.0"
            fs.pci(
                a,
                parent=f"0000:{bus + 2:02x}:{2 + j:02x}.0",
                vendor=vendor,
                device=dev_id,
                pci_class=CLASS_ETH,
                numa=numa,
                driver=driver,
            )
            fs.rdma(
                f"{prefix}{n}",
                a,
                ports={1: "DOWN" if n in inactive else "ACTIVE"},
                fw=fw,
                aux_driver="bnxt_re" if family == "bnxt" else None,
            )
    return fs


def no_nic(root: Path) -> FakeSysfs:
    """A node with one NUMA node, two GPUs on the root complex, and no RDMA device at all."""
    fs = FakeSysfs(root)
    fs.numa(0, "0-3")
    for i in range(2):
        rp = f"0000:00:0{i + 1}.0"
        fs.pci(rp, vendor=INTEL, device=0x347A)
        fs.pci(
            f"0000:0{i + 1}:00.0", parent=rp, vendor=NVIDIA, device=H100, pci_class=CLASS_3D, driver="nvidia"
        )
    return fs


__all__ = [
    "AMD",
    "BROADCOM",
    "CLASS_3D",
    "CLASS_ACCEL",
    "CLASS_BRIDGE",
    "CLASS_ETH",
    "CLASS_IB",
    "EMPTY_GID",
    "INTEL",
    "MELLANOX",
    "NICS",
    "NVIDIA",
    "PENSANDO",
    "FakeSysfs",
    "eight_gpus_eight_nics",
    "no_nic",
]
