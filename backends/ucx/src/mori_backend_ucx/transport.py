"""The ``ucx`` transport as MORI's plugins see it: a :class:`NetworkTransport` whose ``ops()`` is
the native ops table of ``mori/transport.h`` (its options are in mori-backend-ucx's README)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from mori.core.backend import Availability, NetworkTransport
from mori.core.errors import MoriBackendError, MoriValueError
from mori.core.nic import NetworkSettings, network_settings
from mori_backend_ucx import _native, library
from mori_backend_ucx.env import MORI_UCX_OPTIONS

#: UCX transports that are RDMA verbs (on InfiniBand or RoCE NICs)
RDMA_TRANSPORTS = ("rc", "dc", "ud", "srd", "gga")

_RESOURCE = re.compile(r"resource\s+\d+\s*:\s*md\s+\d+\s+dev\s+\d+\s+flags\s+\S+\s+([\w.-]+)/(\S+)")


@dataclass(frozen=True)
class UcxInventory:
    """What UCX finds on this machine with some options: its transports and their devices."""

    ucx: library.LoadedUcx
    resources: tuple[tuple[str, str], ...]  # (transport, device), as ucp_context_print_info lists them
    memory_types: tuple[str, ...]
    thread_mode: str
    text: str = field(repr=False)

    @property
    def transports(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for tl, dev in self.resources:
            out.setdefault(tl, []).append(dev)
        return out

    @property
    def rdma(self) -> dict[str, list[str]]:
        return {tl: d for tl, d in self.transports.items() if tl.split("_")[0] in RDMA_TRANSPORTS}


def inventory(options: str = "") -> UcxInventory:
    """Load UCX and list what it finds with ``options``; MoriBackendError/MoriValueError if it cannot start."""
    ucx = library.load()
    text, error = _native.describe(options)
    if error:
        cls = MoriValueError if error.startswith(("option", "unknown option")) else MoriBackendError
        raise cls(f"ucx transport: {error}")
    resources = tuple(_RESOURCE.findall(text))
    memory_types: tuple[str, ...] = ()
    thread_mode = "?"
    for line in text.splitlines():
        if line.startswith("memory_types: "):
            memory_types = tuple(line.split(": ", 1)[1].split(","))
        elif line.startswith("thread_mode: "):
            thread_mode = line.split(": ", 1)[1]
    return UcxInventory(ucx, resources, memory_types, thread_mode, text)


#: below this much free room in /dev/shm UCX's posix shared-memory transport is left out (seen:
#: 16 MiB crashes UCX 1.22 at start, 64 MiB works)
POSIX_SHM_MIN_FREE = 64 << 20


def _dev_shm_free() -> int:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _chooses_transports(options: str) -> bool:
    """Whether the user picked UCX's transports (tls= in the options, or UCX_TLS)."""
    keys = {item.split("=", 1)[0].strip() for item in options.split(";") if "=" in item}
    return bool(keys & {"tls", "UCX_TLS"}) or "UCX_TLS" in os.environ


def _why_no_rdma(ucx: library.LoadedUcx) -> str:
    if not ucx.has_verbs_build:
        return (
            "no RDMA: this UCX has no verbs module (the PyPI UCX wheels are built without rdma-core; "
            "MORI_UCX_LIBRARY=system loads a UCX built with verbs)"
        )
    ib = Path("/sys/class/infiniband")
    if not ib.is_dir() or not any(ib.iterdir()):
        return "no RDMA device on this machine (/sys/class/infiniband is empty)"
    return "UCX found no usable RDMA port (check net_devices / UCX_NET_DEVICES)"


#: where UCX takes each vendor-neutral NIC setting (UCX's IB interface variables)
_IB_SETTINGS = (
    ("gid_index", "UCX_IB_GID_INDEX"),
    ("traffic_class", "UCX_IB_TRAFFIC_CLASS"),
    ("service_level", "UCX_IB_SL"),
)


def nic_options(settings: NetworkSettings, options: str, has_verbs: bool) -> list[str]:
    """The options the NIC plugins' data adds to ``options`` (what the user gave wins):

    - ``net_devices`` = the selected ACTIVE ports (``mlx5_0:1,...``) plus ``lo``, only when the
      user chose devices with ``MORI_RDMA_DEVICES`` (listening beyond loopback stays opt-in) and
      named no ``net_devices`` / ``UCX_NET_DEVICES`` of their own;
    - GID index, traffic class and service level as UCX's ``UCX_IB_*`` settings, only where this
      UCX has its verbs module (a UCX without it refuses those names)."""
    keys = {item.split("=", 1)[0].strip() for item in options.split(";") if "=" in item}
    out: list[str] = []
    if (
        settings.explicit
        and settings.ports
        and "net_devices" not in keys
        and "UCX_NET_DEVICES" not in os.environ
    ):
        out.append("net_devices=" + ",".join((*settings.ports, "lo")))
    if has_verbs:
        for attr, var in _IB_SETTINGS:
            value = getattr(settings, attr)
            if value is not None and var not in keys and var not in os.environ:
                out.append(f"{var}={value}")
    return out


class UcxTransport(NetworkTransport):
    name = "ucx"
    description = (
        "peers on other nodes through UCX: RDMA verbs where UCX has them, else TCP, shared memory, CMA"
    )
    # Chosen over the built-in tcp only where it brings RDMA (probe() raises it then): over tcp,
    # shared memory and cma UCX authenticates no peer and lets a peer reach any address of the
    # target (see the README), where core tcp proves the shared secret and checks every request
    # against the target's own table.
    priority = 5
    PRIORITY_WITH_RDMA = 20

    def ops(self) -> object:
        library.load()
        try:
            return _native.ops()
        except RuntimeError as e:
            raise MoriBackendError(f"ucx transport: {e}") from None

    def options(self) -> str:
        options = MORI_UCX_OPTIONS.get() or ""
        if _dev_shm_free() < POSIX_SHM_MIN_FREE and not _chooses_transports(options):
            # UCX 1.22's posix transport crashes the process (SIGSEGV in ucp_init) when /dev/shm has
            # too little room, as in a container with a 16 MiB one; leave it out there.
            options = ";".join(filter(None, (options, "tls=^posix")))
        settings = network_settings()  # MoriValueError names a bad MORI_RDMA_DEVICES
        if settings.ports or any(getattr(settings, a) is not None for a, _ in _IB_SETTINGS):
            has_verbs = library.load().has_verbs_build
            options = ";".join(filter(None, (options, *nic_options(settings, options, has_verbs))))
        return options

    def probe(self) -> Availability:
        try:
            options = self.options()
            inv = inventory(options)
        except (MoriBackendError, MoriValueError) as e:
            return Availability(False, str(e))
        network = {tl: devs for tl, devs in inv.transports.items() if tl != "self"}
        if not network:
            return Availability(
                False, f"UCX {inv.ucx.version} ({inv.ucx.source}) finds no transport but self"
            )
        listed = ", ".join(
            tl if devs == ["memory"] else f"{tl} ({', '.join(devs)})" for tl, devs in inv.transports.items()
        )
        parts = [f"UCX {inv.ucx.version} ({inv.ucx.source}): {listed}"]
        rdma = inv.rdma
        self.priority = self.PRIORITY_WITH_RDMA if rdma else type(self).priority
        if rdma:
            parts.append("RDMA: " + ", ".join(f"{tl} on {', '.join(d)}" for tl, d in rdma.items()))
        else:
            parts.append(_why_no_rdma(inv.ucx) + ", so RMA runs over tcp/shared memory/cma")
        if "net_devices=" not in options and not os.environ.get("UCX_NET_DEVICES"):
            parts.append("network transports listen on loopback only (set net_devices or UCX_NET_DEVICES)")
        parts.append(f"memory: {','.join(inv.memory_types)}")
        return Availability(True, "; ".join(parts))
