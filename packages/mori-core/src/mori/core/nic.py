"""RDMA NICs as data: what sysfs says about them, which plugin drives which, and how to select them.

mori-core knows no NIC by name. A NIC plugin (``mori-backend-cx7``, ...) describes its family in one
:class:`NicVendor` (kernel drivers, PCI vendor ids, user-space library, firmware minimums, queue
limits, quirks) and returns a :class:`VendorNicProvider` built from it; everything below works on
such descriptors. Every function that reads the machine takes ``root`` (default ``/``), the
directory that holds ``sys/``, so tests run on fake trees (:mod:`mori.testing.fake_sysfs`).

What sysfs holds, per RDMA device ``/sys/class/infiniband/NAME``: ``device`` (a link to its PCI
function, whose ``driver`` link and ``vendor`` file name the family), ``fw_ver``, and per port
``ports/N/state`` (``4: ACTIVE``), ``ports/N/link_layer`` (``Ethernet`` for RoCE) and ``rate``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mori.core import env
from mori.core.backend import Availability, NicProvider
from mori.core.env import EnvVar
from mori.core.errors import MoriValueError, bad_value
from mori.core.plugins import hookimpl

INFINIBAND = "sys/class/infiniband"
PCI_DEVICES = "sys/bus/pci/devices"

#: where user-space provider libraries of rdma-core live (besides LD_LIBRARY_PATH)
LIBRARY_DIRS = (
    "usr/lib",
    "usr/lib64",
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib/x86_64-linux-gnu/libibverbs",
    "usr/lib/aarch64-linux-gnu/libibverbs",
    "usr/lib64/libibverbs",
    "usr/local/lib",
    "usr/local/lib64",
)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _hex(text: str | None) -> int | None:
    try:
        return int(text, 16) if text else None
    except ValueError:
        return None


# -- what sysfs says ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RdmaPort:
    """One port of an RDMA device, as sysfs shows it."""

    number: int
    #: ``ACTIVE``, ``DOWN``, ``INIT``, ``ARMED``... (the text after ``4: ``); ``?`` if unreadable
    state: str
    #: ``Ethernet`` (RoCE), ``InfiniBand``, or ``?``
    link_layer: str = "?"
    rate: str = ""

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"


@dataclass(frozen=True)
class RdmaDevice:
    """An entry of ``/sys/class/infiniband``: name, the PCI function behind it, firmware and ports."""

    name: str
    #: kernel drivers from the device ``device`` links up to its PCI function (``("mlx5_core",)``,
    #: ``("bnxt_re", "bnxt_en")`` for an auxiliary device); ``()`` if none is bound
    drivers: tuple[str, ...]
    #: PCI vendor and device id; None for a device with no PCI function (soft RoCE)
    pci_vendor: int | None
    pci_device: int | None
    #: ``0000:03:00.0``; ``""`` without a PCI function
    pci_address: str
    fw_ver: str
    ports: tuple[RdmaPort, ...]
    #: NUMA node of the PCI function (-1: unknown)
    numa_node: int = -1

    def port_names(self, active_only: bool = True) -> list[str]:
        """``["mlx5_0:1", ...]``: the UCX / NCCL spelling of each (active) port."""
        return [f"{self.name}:{p.number}" for p in self.ports if p.active or not active_only]


def gid(device: str, port: int, index: int, root: str | os.PathLike[str] = "/") -> tuple[str, str] | None:
    """``(GID, type)`` at ``index`` of a port's GID table (type ``RoCE v2``, ``IB/RoCE v1`` or
    ``""``), or None if the entry is absent or all zero (unused)."""
    p = Path(root, INFINIBAND, device, "ports", str(port))
    value = _read(p / "gids" / str(index))
    if not value or not value.replace(":", "").strip("0"):
        return None
    return value, _read(p / "gid_attrs" / "types" / str(index)) or ""


def scan_rdma_devices(root: str | os.PathLike[str] = "/") -> list[RdmaDevice]:
    """Every RDMA device under ``root``'s ``/sys/class/infiniband``, sorted by name (none: ``[]``).

    Reads files only; never opens a device or loads a library."""
    base = Path(root, INFINIBAND)
    if not base.is_dir():
        return []
    found: list[RdmaDevice] = []
    for entry in sorted(base.iterdir(), key=lambda p: p.name):
        dev_link = entry / "device"
        drivers: list[str] = []
        pci_dir: Path | None = None
        if dev_link.exists():
            # mlx5 links the PCI function itself; drivers on the auxiliary bus (bnxt_re, ionic_rdma)
            # may link an auxiliary device below it: walk up to the PCI function, noting each driver
            d = Path(os.path.realpath(dev_link))
            for _ in range(4):
                drv = d / "driver"
                if drv.exists():
                    drivers.append(Path(os.path.realpath(drv)).name)
                if _PCI_ADDRESS.match(d.name):
                    pci_dir = d
                    break
                d = d.parent
        vendor = device = None
        address = ""
        numa = -1
        if pci_dir is not None:
            vendor = _hex(_read(pci_dir / "vendor"))
            device = _hex(_read(pci_dir / "device"))
            address = pci_dir.name
            try:
                numa = int(_read(pci_dir / "numa_node") or "-1")
            except ValueError:
                numa = -1
        ports: list[RdmaPort] = []
        ports_dir = entry / "ports"
        if ports_dir.is_dir():
            for p in sorted(ports_dir.iterdir(), key=lambda q: int(q.name) if q.name.isdigit() else 0):
                if not p.name.isdigit():
                    continue
                state = _read(p / "state") or "?"
                state = state.split(":", 1)[1].strip() if ":" in state else state
                ports.append(
                    RdmaPort(int(p.name), state, _read(p / "link_layer") or "?", _read(p / "rate") or "")
                )
        found.append(
            RdmaDevice(
                entry.name,
                tuple(drivers),
                vendor,
                device,
                address,
                _read(entry / "fw_ver") or "",
                tuple(ports),
                numa,
            )
        )
    return found


_PCI_ADDRESS = re.compile(r"^[0-9a-fA-F]{4,}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


# -- versions ----------------------------------------------------------------------------------


def _version_key(text: str) -> tuple[tuple[int, int | str], ...]:
    parts = [p for p in re.split(r"[.\-_ ]+", text.strip()) if p]
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in parts)


def firmware_below(version: str, minimums: Sequence[str]) -> str | None:
    """The minimum that ``version`` falls short of, or None if it meets it (or nothing is known).

    ``minimums`` holds one minimum per firmware branch (its first number: Thor2 ships 235.x and
    237.x lines). A version is held to the minimum of its own branch, else of the nearest older
    branch; a branch older than every minimum is below the oldest one."""
    if not minimums or not version:
        return None
    key = _version_key(version)
    if not key or key[0][0] != 0:
        return None  # not a version we can compare: say nothing rather than guess
    ordered = sorted(minimums, key=_version_key)
    candidates = [m for m in ordered if _version_key(m)[0] <= key[0]]
    floor = candidates[-1] if candidates else ordered[0]
    return floor if key < _version_key(floor) else None


# -- vendors as data ---------------------------------------------------------------------------


@dataclass(frozen=True)
class NicVendor:
    """Everything MORI knows about one family of RDMA NICs: one object per NIC plugin.

    Core matches devices to it by kernel driver or PCI vendor id, never by the plugin's name."""

    #: the provider name ``mori backends`` shows (``cx7``)
    name: str
    #: the family as users know the devices (``mlx5``): used in messages
    family: str
    description: str
    #: kernel drivers of the PCI function, or of the RDMA device (``mlx5_core``, ``mlx5_ib``)
    drivers: tuple[str, ...]
    #: PCI vendor ids (0x15b3)
    pci_vendors: tuple[int, ...]
    #: RDMA device name prefixes (``mlx5_``), for a device with neither driver nor PCI function
    name_prefixes: tuple[str, ...]
    #: file-name prefixes of the user-space provider library (``libmlx5``): looked for, never loaded
    libraries: tuple[str, ...]
    #: model names by PCI device id, for messages
    models: Mapping[int, str] = field(default_factory=dict)
    #: lowest firmware per branch that MORI's original was validated with; below it: a warning
    firmware_minimums: tuple[str, ...] = ()
    #: largest send queue (work requests) the NIC accepts; None: no vendor cap
    max_send_wr: int | None = None
    #: whether RoCE UDP source ports are spread over queue pairs by default, and the variable that
    #: overrides it (None: the NIC has no such knob)
    udp_sport_spreading: bool = False
    udp_sport_env: EnvVar[bool] | None = None
    #: other facts, ``key -> what it means``, shown by ``mori check`` (data, not code paths)
    quirks: Mapping[str, str] = field(default_factory=dict)
    #: the variables this vendor reads, for ``mori env``
    env_vars: tuple[EnvVar[object], ...] = ()

    def claims(self, device: RdmaDevice) -> bool:
        """Whether ``device`` belongs to this family: one of its drivers, else (no driver bound) its
        PCI vendor id, else (no PCI function) its name prefix matches. A known driver of another
        family wins over the vendor id (a ConnectX-3 is 0x15b3 but ``mlx4_core``, not mlx5)."""
        if device.drivers:
            return any(d in self.drivers for d in device.drivers)
        if device.pci_vendor is not None:
            return device.pci_vendor in self.pci_vendors
        return device.name.startswith(self.name_prefixes) if self.name_prefixes else False

    def model(self, device: RdmaDevice) -> str:
        if device.pci_device is not None and device.pci_device in self.models:
            return self.models[device.pci_device]
        return (
            f"{self.family} device 0x{device.pci_device:04x}"
            if device.pci_device is not None
            else self.family
        )

    def udp_sport(self) -> bool:
        """Whether UDP source-port spreading is on: the vendor's variable, else its default."""
        if self.udp_sport_env is not None:
            value = self.udp_sport_env.get()
            if value is not None:
                return value
        return self.udp_sport_spreading


def find_library(prefixes: Sequence[str], root: str | os.PathLike[str] = "/") -> str | None:
    """The first file whose name starts with one of ``prefixes`` + ``.so`` or ``-rdmav`` in the
    library directories (and ``LD_LIBRARY_PATH``); None if there is none. Nothing is loaded."""
    dirs = [Path(root, d) for d in LIBRARY_DIRS]
    if str(root) in ("/", ""):
        dirs = [Path(p) for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p] + dirs
    for d in dirs:
        try:
            names = sorted(os.listdir(d))
        except OSError:
            continue
        for prefix in prefixes:
            for n in names:
                if n.startswith((prefix + ".so", prefix + "-rdmav")):
                    return str(d / n)
    return None


@dataclass(frozen=True)
class VendorReport:
    """What one vendor finds on this machine (the data behind its probe and ``mori check``)."""

    vendor: NicVendor
    devices: tuple[RdmaDevice, ...]
    library: str | None
    #: ``(device, minimum)`` for each device whose firmware is below the vendor's minimum
    old_firmware: tuple[tuple[RdmaDevice, str], ...]

    @property
    def active_ports(self) -> list[str]:
        return [n for d in self.devices for n in d.port_names()]

    def warnings(self) -> list[str]:
        """One line per firmware minimum some devices fall short of."""
        by_min: dict[str, list[str]] = {}
        for d, m in self.old_firmware:
            by_min.setdefault(m, []).append(f"{d.name} ({d.fw_ver})")
        return [
            f"firmware below {self.vendor.family}'s minimum {m} on {', '.join(names)}: upgrade it (older "
            "firmware was not validated by MORI's original)"
            for m, names in by_min.items()
        ]


def vendor_report(vendor: NicVendor, root: str | os.PathLike[str] = "/") -> VendorReport:
    devices = tuple(d for d in scan_rdma_devices(root) if vendor.claims(d))
    old = tuple(
        (d, m) for d in devices if (m := firmware_below(d.fw_ver, vendor.firmware_minimums)) is not None
    )
    return VendorReport(vendor, devices, find_library(vendor.libraries, root) if devices else None, old)


class VendorNicProvider(NicProvider):
    """A NIC provider made of one :class:`NicVendor`: a NIC plugin returns one of these."""

    def __init__(self, vendor: NicVendor, root: str | os.PathLike[str] = "/") -> None:
        self.vendor = vendor
        self.name = vendor.name
        self.description = vendor.description
        self.root = root

    def report(self) -> VendorReport:
        return vendor_report(self.vendor, self.root)

    def probe(self) -> Availability:
        """Reads sysfs and looks for the library file; loads nothing, opens no device."""
        r = self.report()
        v = self.vendor
        if not r.devices:
            drivers = "/".join(v.drivers)
            ids = "/".join(f"0x{i:04x}" for i in v.pci_vendors)
            where = Path(self.root, INFINIBAND)
            shown = "/sys/class/infiniband" if str(self.root) in ("/", "") else str(where)
            missing = "" if where.is_dir() else " (it does not exist)"
            return Availability(
                False,
                f"no {v.family} device in {shown}{missing} (looked for driver {drivers}, PCI vendor {ids})",
            )
        listed = ", ".join(
            f"{d.name} ({v.model(d)}, fw {d.fw_ver or '?'}, "
            + (", ".join(f"port {p.number} {p.state}" for p in d.ports) or "no ports")
            + ")"
            for d in r.devices
        )
        if r.library is None:
            return Availability(
                False,
                f"{listed}; but the user-space library ({' or '.join(v.libraries)}, from rdma-core) is not "
                "installed",
            )
        if not r.active_ports:
            return Availability(False, f"{listed}; no port is ACTIVE (check cabling and the subnet manager)")
        warn = r.warnings()
        return Availability(True, listed + ("; WARNING: " + "; ".join(warn) if warn else ""))


class VendorPlugin:
    """The whole plugin of a NIC family, from its descriptor: the provider (``mori_nic_providers``)
    and the vendor's variables (``mori_env_vars``). A NIC plugin's ``mori.backends`` entry point
    names one: ``mynic = "my_mori_nic.plugin:PLUGIN"`` with ``PLUGIN = VendorPlugin(VENDOR)``."""

    def __init__(self, vendor: NicVendor) -> None:
        self.vendor = vendor

    @hookimpl
    def mori_nic_providers(self) -> Sequence[NicProvider]:
        return [VendorNicProvider(self.vendor)]

    @hookimpl
    def mori_env_vars(self) -> Sequence[EnvVar[object]]:
        return list(self.vendor.env_vars)


# -- choosing devices --------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceFilter:
    """A parsed ``MORI_RDMA_DEVICES``: names to include, or (``exclude``) names to leave out.

    An entry is a device name (every port) or ``NAME:PORT``."""

    entries: tuple[tuple[str, int | None], ...] = ()
    exclude: bool = False

    def _hit(self, device: str, port: int) -> bool:
        return any(n == device and (p is None or p == port) for n, p in self.entries)

    def allows(self, device: str, port: int) -> bool:
        if not self.entries:
            return True
        return not self._hit(device, port) if self.exclude else self._hit(device, port)

    def unknown(self, devices: Iterable[RdmaDevice]) -> list[str]:
        """Entries that name no device (or port) of ``devices``: misspelled, or another machine's."""
        have = {(d.name, p.number) for d in devices for p in d.ports}
        names = {d for d, _ in have}
        return [
            n if p is None else f"{n}:{p}"
            for n, p in self.entries
            if (n not in names if p is None else (n, p) not in have)
        ]


_DEVICE_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


def parse_device_filter(text: str | None) -> DeviceFilter:
    """Parse the ``MORI_RDMA_DEVICES`` syntax: ``mlx5_0,mlx5_1`` (include), ``^mlx5_2`` (exclude),
    ``mlx5_0:1`` (one port). ``None`` or empty: no filter."""
    if text is None or not text.strip():
        return DeviceFilter()
    t = text.strip()
    exclude = t.startswith("^")
    if exclude:
        t = t[1:]
    entries: list[tuple[str, int | None]] = []
    for item in t.split(","):
        item = item.strip()
        name, sep, port = item.partition(":")
        if not _DEVICE_NAME.match(name) or (sep and not port.isdigit()):
            raise bad_value(
                "MORI_RDMA_DEVICES",
                "entry",
                item,
                "NAME or NAME:PORT (letters, digits, _ . -), comma-separated, the whole list prefixed by ^ to exclude",
            )
        entries.append((name, int(port) if sep else None))
    return DeviceFilter(tuple(entries), exclude)


@dataclass(frozen=True)
class NetworkSettings:
    """How the network transports should use the NICs: transport-neutral, each transport translates.

    ``ports`` are the selected ACTIVE ports (``mlx5_0:1``); ``explicit`` says the user chose devices
    (``MORI_RDMA_DEVICES``), which is what lets a transport listen on them."""

    ports: tuple[str, ...]
    vendors: tuple[str, ...]
    explicit: bool
    gid_index: int | None
    traffic_class: int | None
    service_level: int | None
    #: the smallest vendor cap on send queue length among the selected devices (None: no cap)
    max_send_wr: int | None
    #: whether each selected vendor spreads RoCE UDP source ports (``vendor -> on``)
    udp_sport: Mapping[str, bool] = field(default_factory=dict)


def vendors_of(providers: Iterable[object]) -> list[NicVendor]:
    """The vendor descriptors of the data-driven providers among ``providers``."""
    return [p.vendor for p in providers if isinstance(p, VendorNicProvider)]


def installed_vendors() -> list[NicVendor]:
    """The descriptors of every installed NIC plugin (through the plugin manager)."""
    from mori.core.plugins import get_plugins

    return vendors_of(f.backend for f in get_plugins().nic_providers())


def select_ports(
    vendors: Sequence[NicVendor], root: str | os.PathLike[str] = "/", spec: str | None = None
) -> list[tuple[RdmaDevice, RdmaPort, NicVendor]]:
    """The ACTIVE ports of devices an installed vendor claims, that ``spec`` (default
    ``MORI_RDMA_DEVICES``) allows, in device then port order."""
    filt = parse_device_filter(spec if spec is not None else env.MORI_RDMA_DEVICES.get())
    out: list[tuple[RdmaDevice, RdmaPort, NicVendor]] = []
    for d in scan_rdma_devices(root):
        owner = next((v for v in vendors if v.claims(d)), None)
        if owner is None:
            continue
        for p in d.ports:
            if p.active and filt.allows(d.name, p.number):
                out.append((d, p, owner))
    return out


def network_settings(
    vendors: Sequence[NicVendor] | None = None, root: str | os.PathLike[str] = "/"
) -> NetworkSettings:
    """What the network transports should do with this machine's NICs (reads ``MORI_RDMA_DEVICES``,
    ``MORI_IB_GID_INDEX``, ``MORI_RDMA_TC``, ``MORI_RDMA_SL`` and each vendor's own variables).

    Raises :class:`MoriValueError` if ``MORI_RDMA_DEVICES`` names no device of this machine."""
    vendors = installed_vendors() if vendors is None else list(vendors)
    spec = env.MORI_RDMA_DEVICES.get()
    chosen = select_ports(vendors, root, spec)
    filt = parse_device_filter(spec)
    if filt.entries and not filt.exclude:
        unknown = filt.unknown(scan_rdma_devices(root))
        if unknown:
            have = ", ".join(n for d in scan_rdma_devices(root) for n in d.port_names(False)) or "none"
            raise MoriValueError(
                f"MORI_RDMA_DEVICES={spec!r} names {', '.join(unknown)}: not on this machine (RDMA ports here: {have})"
            )
    used = []
    for _, _, v in chosen:
        if v not in used:
            used.append(v)
    caps = [v.max_send_wr for v in used if v.max_send_wr is not None]
    return NetworkSettings(
        ports=tuple(f"{d.name}:{p.number}" for d, p, _ in chosen),
        vendors=tuple(v.name for v in used),
        explicit=bool(filt.entries),
        gid_index=env.MORI_IB_GID_INDEX.get(),
        traffic_class=env.MORI_RDMA_TC.get(),
        service_level=env.MORI_RDMA_SL.get(),
        max_send_wr=min(caps) if caps else None,
        udp_sport={v.name: v.udp_sport() for v in used},
    )


__all__ = [
    "DeviceFilter",
    "NetworkSettings",
    "NicVendor",
    "RdmaDevice",
    "RdmaPort",
    "VendorNicProvider",
    "VendorPlugin",
    "VendorReport",
    "find_library",
    "gid",
    "firmware_below",
    "installed_vendors",
    "network_settings",
    "parse_device_filter",
    "scan_rdma_devices",
    "select_ports",
    "vendor_report",
    "vendors_of",
]
