"""``mori check``: what this node has (GPUs, NICs, drivers, ports, firmware, NUMA), what each layer
of MORI would use here, and why not the rest.

Exit codes (for scripts): **0** nothing wrong (warnings may be printed), **1** problems found (or,
with ``--strict``, warnings), **2** usage error. ``--json`` prints the same as one JSON object.
Reads sysfs under ``--root`` (default ``/``) and probes every installed backend; changes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mori.core import env, nic, topology
from mori.core.backend import NetworkTransport, Transport
from mori.core.errors import MoriError
from mori.core.plugins import Plugins, get_plugins, hookimpl

OK, INFO, WARN, PROBLEM = "ok", "info", "warn", "problem"
EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2


@dataclass(frozen=True)
class Finding:
    """One line of the report: ``level`` is ok, info, warn or problem; ``topic`` groups it."""

    level: str
    topic: str
    message: str


@dataclass
class CheckReport:
    """Everything ``mori check`` found; :attr:`problems` decide the exit code."""

    host: dict[str, Any]
    findings: list[Finding] = field(default_factory=list)

    def add(self, level: str, topic: str, message: str) -> None:
        self.findings.append(Finding(level, topic, message))

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.level == PROBLEM]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.level == WARN]

    def exit_code(self, strict: bool = False) -> int:
        return EXIT_PROBLEMS if self.problems or (strict and self.warnings) else EXIT_OK

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "findings": [asdict(f) for f in self.findings],
            "problems": len(self.problems),
            "warnings": len(self.warnings),
        }


def _env_findings(report: CheckReport, plugins: Plugins) -> None:
    variables = list(env.ALL)
    for extra in plugins.call("mori_env_vars"):
        variables.extend(extra)
    for var in variables:
        try:
            var.get()
        except MoriError as e:
            report.add(PROBLEM, "env", str(e))


def _backend_findings(report: CheckReport, plugins: Plugins) -> None:
    for r in plugins.records:
        if r.error:
            report.add(
                PROBLEM,
                "plugins",
                f"plugin {r.name} ({r.distribution} {r.version}) failed to load: {r.error}",
            )
    for kind, found in (("device runtime", plugins.runtimes()), ("transport", plugins.transports())):
        for f in found:
            a = f.availability
            report.add(
                OK if a.usable else INFO,
                kind + "s",
                f"{f.backend.name} ({f.plugin.distribution} {f.plugin.version}): "
                + ("usable" if a.usable else "not usable")
                + (f": {a.reason}" if a.reason else ""),
            )
    # what the user asked for must exist and work here
    asked = env.MORI_DEVICE_RUNTIME.get() if _valid(env.MORI_DEVICE_RUNTIME) else None
    runtimes = plugins.runtimes()
    if asked and asked != "auto":
        match = [f for f in runtimes if f.backend.name == asked]
        if not match:
            report.add(
                PROBLEM,
                "device runtimes",
                f"MORI_DEVICE_RUNTIME={asked!r}: not found: misspelled or not installed",
            )
        elif not match[0].availability.usable:
            report.add(
                PROBLEM,
                "device runtimes",
                f"MORI_DEVICE_RUNTIME={asked!r} is not usable here: {match[0].availability.reason}",
            )
    usable = [f for f in runtimes if f.availability.usable]
    chosen = next((f for f in usable if f.backend.name == asked), usable[0] if usable else None)
    if chosen is None:
        report.add(
            PROBLEM, "device runtimes", "no usable device runtime: the symmetric heap cannot be created"
        )
    else:
        report.add(OK, "uses", f"symmetric heap: device runtime {chosen.backend.name}")
    load_store = [
        f.backend.name
        for f in plugins.transports()
        if isinstance(f.backend, Transport)
        and f.backend.load_store
        and not isinstance(f.backend, NetworkTransport)
        and f.availability.usable
    ]
    report.add(
        OK if load_store else PROBLEM,
        "uses",
        "peers on this node: " + (", ".join(load_store) if load_store else "no load/store transport usable"),
    )
    _network_findings(report, plugins)
    # the feature packages stand on these same layers: name what is installed
    from importlib import metadata

    dists = sorted(
        {
            f"{d.metadata['Name']} {d.version}"
            for d in metadata.distributions()
            if (d.metadata["Name"] or "").startswith("mori-")
            and not (d.metadata["Name"] or "").startswith(("mori-backend-", "mori-core", "mori-testing"))
        }
    )
    report.add(
        INFO,
        "uses",
        "components installed (each uses the heap and transports above): "
        + (", ".join(dists) or "none but mori-core"),
    )


def _valid(var: env.EnvVar[Any]) -> bool:
    try:
        var.get()
        return True
    except MoriError:
        return False


def _network_findings(report: CheckReport, plugins: Plugins) -> None:
    from mori.core.transport import find_network_transport

    name = env.MORI_SHMEM_TRANSPORT.get() if _valid(env.MORI_SHMEM_TRANSPORT) else None
    try:
        t = find_network_transport(name, "MORI_SHMEM_TRANSPORT")
    except MoriError as e:
        report.add(PROBLEM, "uses", f"peers on other nodes: {e}")
        return
    how = "MORI_SHMEM_TRANSPORT" if name else "the usable network transport of highest priority"
    report.add(OK, "uses", f"peers on other nodes: {t.name} ({how})")
    if t.name == "tcp" and not env.MORI_AUTH_TOKEN.get():
        report.add(
            WARN,
            "uses",
            "tcp listens on loopback only without MORI_AUTH_TOKEN: peers on other nodes cannot connect "
            "(set the same MORI_AUTH_TOKEN on every node)",
        )


def _nic_findings(report: CheckReport, plugins: Plugins, root: str) -> None:
    vendors = nic.vendors_of(f.backend for f in plugins.nic_providers())
    others = [f for f in plugins.nic_providers() if not isinstance(f.backend, nic.VendorNicProvider)]
    for f in others:  # providers that are not descriptors: show what they say
        a = f.availability
        report.add(OK if a.usable else INFO, "nic providers", f"{f.backend.name}: {a.reason}")
    if not vendors and not others:
        report.add(INFO, "nic providers", "no NIC plugin installed (mori-backend-cx7, -thor2, -pollara)")
    for v in vendors:
        a = nic.VendorNicProvider(v, root).probe()
        report.add(
            OK if a.usable else INFO,
            "nic providers",
            f"{v.name}: {'usable' if a.usable else 'not usable'}: {a.reason}",
        )
        if any(v.claims(d) for d in nic.scan_rdma_devices(root)):
            for key, what in v.quirks.items():
                report.add(INFO, "nic providers", f"{v.name} quirk {key}: {what}")
    devices = nic.scan_rdma_devices(root)
    if not devices:
        report.add(
            INFO,
            "nics",
            "no RDMA device (/sys/class/infiniband is empty or absent): other nodes are reached over TCP",
        )
    for d in devices:
        owner = next((v for v in vendors if v.claims(d)), None)
        ports = (
            ", ".join(f"port {p.number} {p.state} {p.link_layer} {p.rate}".rstrip() for p in d.ports)
            or "no ports"
        )
        pci = (
            f"PCI {d.pci_address} vendor 0x{d.pci_vendor:04x}"
            if d.pci_vendor is not None
            else "no PCI function"
        )
        drivers = "/".join(d.drivers) or "no driver"
        line = f"{d.name}: {pci}, driver {drivers}, fw {d.fw_ver or '?'}, NUMA {d.numa_node}, {ports}"
        if owner is None:
            report.add(WARN, "nics", line + "; no installed NIC plugin claims it: MORI will not use it")
            continue
        r = nic.vendor_report(owner, root)
        report.add(OK, "nics", line + f"; driven by {owner.name} ({owner.model(d)})")
        for dev, minimum in r.old_firmware:
            if dev.name == d.name:
                report.add(
                    WARN, "nics", f"{d.name}: firmware {d.fw_ver} is below {owner.family}'s minimum {minimum}"
                )
        if not any(p.active for p in d.ports):
            report.add(WARN, "nics", f"{d.name}: no ACTIVE port (cable, switch port, or subnet manager)")
        if r.library is None:
            report.add(
                PROBLEM,
                "nics",
                f"{d.name}: {owner.name} needs {' or '.join(owner.libraries)} (rdma-core), which is not installed",
            )
    # the user's device selection must name devices of this machine
    if _valid(env.MORI_RDMA_DEVICES):
        filt = nic.parse_device_filter(env.MORI_RDMA_DEVICES.get())
        unknown = filt.unknown(devices)
        if unknown:
            report.add(
                PROBLEM,
                "nics",
                f"MORI_RDMA_DEVICES names {', '.join(unknown)}: not on this machine "
                f"(RDMA devices here: {', '.join(d.name for d in devices) or 'none'})",
            )
        try:
            s = nic.network_settings(vendors, root)
        except MoriError:
            s = None
        if s is not None and s.ports:
            report.add(
                OK,
                "uses",
                f"RDMA ports for the network transports: {', '.join(s.ports)}"
                + (
                    ""
                    if s.explicit
                    else " (used once MORI_RDMA_DEVICES opts in; the ucx transport stays on loopback until then)"
                ),
            )
            if s.gid_index is not None:
                for name in s.ports:
                    dev_name, _, port = name.partition(":")
                    g = nic.gid(dev_name, int(port), s.gid_index, root)
                    if g is None:
                        report.add(
                            PROBLEM,
                            "nics",
                            f"{name}: MORI_IB_GID_INDEX={s.gid_index} is an empty GID entry on this port "
                            "(list them: ports/N/gids/ in sysfs; RoCE v2 is usually 3)",
                        )
                    else:
                        report.add(INFO, "nics", f"{name}: GID {s.gid_index} = {g[0]} {g[1]}".rstrip())
            extras = {
                "GID index": s.gid_index,
                "traffic class": s.traffic_class,
                "service level": s.service_level,
                "send queue cap": s.max_send_wr,
            }
            shown = ", ".join(f"{k} {v}" for k, v in extras.items() if v is not None)
            if shown:
                report.add(INFO, "uses", "RDMA settings: " + shown)
            if s.udp_sport:
                report.add(
                    INFO,
                    "uses",
                    "UDP source-port spreading: "
                    + ", ".join(f"{k} {'on' if on else 'off'}" for k, on in s.udp_sport.items()),
                )


def _gpu_findings(report: CheckReport, plugins: Plugins, topo: topology.NodeTopology) -> None:
    vendors = nic.vendors_of(f.backend for f in plugins.nic_providers())
    if not topo.gpus:
        report.add(INFO, "gpus", "no GPU on the PCI bus")
    for g in topo.gpus:
        line = f"GPU {g.index}: {g.vendor} PCI {g.pci.address}, NUMA {g.pci.numa_node}"
        try:
            near = topo.match_gpu_nics(g.index, vendors=vendors)
        except MoriError as e:
            report.add(PROBLEM, "gpus", f"{line}; cannot match a NIC: {e}")
            continue
        if near and near[0].pci is not None:
            kind, hops = topology.pcie_path(g.pci, near[0].pci)
            line += f"; NIC {near[0].name} ({kind}, {hops} hops)"
        elif near:
            line += f"; NIC {near[0].name}"
        elif topo.rdma_devices:
            line += "; no ACTIVE port of a NIC a plugin drives"
        report.add(OK, "gpus", line)


def run_check(root: str = "/", plugins: Plugins | None = None) -> CheckReport:
    """Look at this node (sysfs under ``root``) and every installed backend; return the report."""
    plugins = plugins or get_plugins()
    topo = topology.scan(root)
    try:
        node = topology.node_id()
    except MoriError as e:
        node = f"? ({e})"
    report = CheckReport(
        {
            "hostname": socket.gethostname(),
            "node_id": node,
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "cpus_allowed": len(os.sched_getaffinity(0)),
            "numa_nodes": sorted(topo.numa_cpus),
            "gpus": len(topo.gpus),
            "rdma_devices": [d.name for d in topo.rdma_devices],
            "sysfs_root": root,
        }
    )
    _env_findings(report, plugins)
    _backend_findings(report, plugins)
    _nic_findings(report, plugins, root)
    _gpu_findings(report, plugins, topo)
    return report


_MARK = {OK: "ok  ", INFO: "    ", WARN: "WARN", PROBLEM: "FAIL"}


def print_report(report: CheckReport) -> None:
    h = report.host
    print(
        f"node {h['hostname']} ({h['node_id']}), kernel {h['kernel']}, {h['cpus']} CPUs "
        f"({h['cpus_allowed']} allowed), NUMA nodes {h['numa_nodes'] or 'unknown'}"
    )
    topic = None
    for f in report.findings:
        if f.topic != topic:
            topic = f.topic
            print(f"{topic}:")
        print(f"  {_MARK[f.level]} {f.message}")
    n, w = len(report.problems), len(report.warnings)
    print(f"{n} problem(s), {w} warning(s)")


def _cmd_check(args: argparse.Namespace) -> int:
    if not Path(args.root).is_dir():
        print(f"mori check: --root {args.root!r} is not a directory", file=sys.stderr)
        return EXIT_USAGE
    report = run_check(args.root)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print_report(report)
    return report.exit_code(args.strict)


def add_check_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "check",
        help="check this node: devices, drivers, NICs, ports, firmware, and what MORI would use "
        "(exit 0 fine, 1 problems, 2 usage error)",
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument(
        "--strict", action="store_true", help="exit 1 on warnings too (old firmware, unclaimed NICs)"
    )
    p.add_argument(
        "--root", default="/", help="directory holding sys/ to read (default /; for copied or test trees)"
    )
    p.set_defaults(func=_cmd_check)


@hookimpl
def mori_add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    add_check_command(subparsers)


__all__ = ["CheckReport", "Finding", "add_check_command", "print_report", "run_check"]
