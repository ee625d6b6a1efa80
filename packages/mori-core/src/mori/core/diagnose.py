"""``mori diagnose``: this node against a peer. One side serves (``mori diagnose --serve
[HOST:]PORT``), the other asks (``mori diagnose --peer HOST:PORT``): can it be reached, do both
sides agree on versions and transports, which transport a transfer between them would take, and a
small latency and bandwidth probe over the built-in ``tcp`` network transport (bytes verified).

Exit codes (for scripts), of ``--peer``: **0** all fine, **1** problems found (misconfiguration,
authentication refused, a probe failed or came back wrong), **2** usage error, **3** peer
unreachable (refused, no route, timed out, or not a ``mori diagnose --serve``). ``--serve`` exits
0 when stopped (``--once`` after one peer, Ctrl-C), 2 on a usage error.

Manners: the server listens on loopback unless given another address, and beyond loopback only
with ``MORI_AUTH_TOKEN`` set; then both sides prove they hold it (HMAC challenge-response, the
token never crosses the wire), as the ``tcp`` transport itself does. Every wait is bounded by
``--timeout`` and names the peer when it runs out; messages are at most 64 KiB; the server talks
to one peer at a time and bounds each session.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import socket
import statistics
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from mori.core import __version__, env, topology
from mori.core.errors import MoriError
from mori.core.plugins import hookimpl

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
PROTOCOL = 1
MAX_MESSAGE = 64 << 10
#: the probe's largest transfer; the server registers this much
MAX_PROBE_BYTES = 64 << 20
#: how many --timeout periods a served session may last in all
SESSION_STEPS = 6


class Unreachable(Exception):
    """The peer's diagnose service could not be reached or did not answer in time."""


class Refused(Exception):
    """The peer answered but refused us (authentication, protocol)."""


# -- framing ------------------------------------------------------------------------------------


def _send(sock: socket.socket, obj: dict[str, Any]) -> None:
    data = json.dumps(obj).encode()
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"diagnose message of {len(data)} bytes is larger than {MAX_MESSAGE}")
    sock.sendall(struct.pack(">I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int, peer: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except TimeoutError:
            raise Unreachable(f"{peer} did not answer within {sock.gettimeout():g} s") from None
        if not chunk:
            raise Unreachable(f"{peer} closed the connection")
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket, peer: str) -> dict[str, Any]:
    (n,) = struct.unpack(">I", _recv_exact(sock, 4, peer))
    if n > MAX_MESSAGE:
        raise Refused(f"{peer} sent a message of {n} bytes (at most {MAX_MESSAGE}): not a mori diagnose peer")
    try:
        obj = json.loads(_recv_exact(sock, n, peer))
    except ValueError:
        raise Refused(f"{peer} sent something that is not a mori diagnose message") from None
    if not isinstance(obj, dict):
        raise Refused(f"{peer} sent something that is not a mori diagnose message")
    return obj


def _mac(token: str, *parts: str) -> str:
    return hmac.new(token.encode(), "|".join(parts).encode(), hashlib.sha256).hexdigest()


def parse_endpoint(text: str, arg: str, default_host: str | None = None) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT``), or ``PORT`` alone where ``default_host`` is given."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = (default_host or ""), text
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        want = "HOST:PORT" + (" or PORT" if default_host else "") + " with PORT 0-65535"
        raise ValueError(f"{arg}={text!r} is not allowed; expected {want}")
    return host, int(port)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _local_info() -> dict[str, Any]:
    from mori.core.plugins import get_plugins
    from mori.core.transport import find_network_transport

    try:
        name = env.MORI_SHMEM_TRANSPORT.get()
        network = find_network_transport(name, "MORI_SHMEM_TRANSPORT").name
        why = ""
    except MoriError as e:
        network, why = "", str(e)
    usable = [f.backend.name for f in get_plugins().transports() if f.availability.usable]
    return {
        "hostname": socket.gethostname(),
        "node_id": topology.node_id(),
        "version": __version__,
        "network_transport": network,
        "network_transport_error": why,
        "transports": usable,
        "token_set": bool(env.MORI_AUTH_TOKEN.get()),
    }


# -- the serving side ---------------------------------------------------------------------------


class _Buffer:
    """Memory the probe writes into, registered with a tcp transport instance."""

    def __init__(self, size: int) -> None:
        self.raw = ctypes.create_string_buffer(size)
        self.addr = ctypes.addressof(self.raw)
        self.size = size


def _tcp_instance(listen_host: str, timeout_s: float) -> Any:
    from mori.core.backends.tcp import TcpTransport
    from mori.core.transport import open_transport

    t = TcpTransport()
    return open_transport(t.ops(), t.options(listen_host) + f";timeout_ms={max(1, int(timeout_s * 1000))}")


def serve(host: str, port: int, *, timeout: float, once: bool, out: Any = None) -> int:
    """Serve peers until interrupted (or one peer, ``once``). Returns an exit code."""
    out = out or sys.stdout
    token = env.MORI_AUTH_TOKEN.get() or ""
    if not _is_loopback(host) and not token:
        print(
            f"mori diagnose: --serve {host}:{port} listens beyond loopback: set MORI_AUTH_TOKEN (the same "
            "on both sides), or serve on 127.0.0.1",
            file=sys.stderr,
        )
        return EXIT_USAGE
    tp_host = host if _is_loopback(host) or host not in ("0.0.0.0", "::") else topology.advertised_host()
    tp = _tcp_instance(tp_host, timeout)
    buf = _Buffer(MAX_PROBE_BYTES)
    mem = tp.register(buf.addr, buf.size)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            srv.bind((host, port))
        except OSError as e:
            print(f"mori diagnose: cannot listen on {host}:{port}: {e.strerror}", file=sys.stderr)
            return EXIT_USAGE
        srv.listen(4)
        srv.settimeout(0.5)
        print(f"mori diagnose: serving on {host}:{srv.getsockname()[1]}", file=out, flush=True)
        try:
            while True:
                try:
                    conn, addr = srv.accept()
                except TimeoutError:
                    continue
                peer = f"{addr[0]}:{addr[1]}"
                with conn:
                    conn.settimeout(timeout)
                    try:
                        result = _serve_one(conn, peer, token, tp, mem, buf)
                    except (Unreachable, Refused, OSError, ValueError) as e:
                        result = f"failed: {e}"
                print(f"mori diagnose: peer {peer}: {result}", file=out, flush=True)
                if once:
                    return EXIT_OK
        except KeyboardInterrupt:
            return EXIT_OK


def _serve_one(conn: socket.socket, peer: str, token: str, tp: Any, mem: Any, buf: _Buffer) -> str:
    nonce = secrets.token_hex(16)
    _send(conn, {"mori": "diagnose", "protocol": PROTOCOL, "auth": bool(token), "nonce": nonce})
    hello = _recv(conn, peer)
    if hello.get("protocol") != PROTOCOL:
        _send(conn, {"error": f"protocol {hello.get('protocol')!r} is not {PROTOCOL}"})
        return "refused: other protocol version"
    if token:
        cnonce = str(hello.get("nonce", ""))
        if not cnonce or not hmac.compare_digest(
            str(hello.get("mac", "")), _mac(token, "client", nonce, cnonce)
        ):
            _send(conn, {"error": "authentication failed: this server requires the job's MORI_AUTH_TOKEN"})
            return "refused: authentication failed"
        proof = _mac(token, "server", cnonce, nonce)
    else:
        proof = ""
    info = _local_info()
    info.update(
        {
            "ok": True,
            "mac": proof,
            "tcp_address": tp.address().hex(),
            "rkey": mem.rkey.hex(),
            "base": buf.addr,
            "size": buf.size,
        }
    )
    _send(conn, info)
    peer_info = _recv(conn, peer)  # its own info
    # the client probes our memory meanwhile (each of its steps bounded by the same timeout), then
    # says it is done: the whole session is bounded by SESSION_STEPS timeouts
    step = conn.gettimeout()
    conn.settimeout(step * SESSION_STEPS if step else None)
    done = _recv(conn, peer)
    return (
        f"{peer_info.get('hostname', '?')} ({peer_info.get('version', '?')}): {done.get('summary', 'done')}"
    )


# -- the asking side ----------------------------------------------------------------------------


@dataclass
class DiagnoseReport:
    peer: str
    reachable: bool = False
    connect_ms: float | None = None
    local: dict[str, Any] = field(default_factory=dict)
    remote: dict[str, Any] = field(default_factory=dict)
    route: str = ""
    probe: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    exit_code: int = EXIT_OK

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def diagnose(
    host: str, port: int, *, timeout: float, size: int = 4 << 20, rounds: int = 50
) -> DiagnoseReport:
    """Ask the peer serving at ``host:port``; never waits longer than ``timeout`` per step."""
    peer = f"{host}:{port}"
    r = DiagnoseReport(peer)
    token = env.MORI_AUTH_TOKEN.get() or ""
    t0 = time.perf_counter()
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except TimeoutError:
        r.problems.append(f"peer {peer} unreachable: no answer to the connection within {timeout:g} s")
        r.exit_code = EXIT_UNREACHABLE
        return r
    except OSError as e:
        r.problems.append(f"peer {peer} unreachable: {e.strerror or e}")
        r.exit_code = EXIT_UNREACHABLE
        return r
    r.connect_ms = (time.perf_counter() - t0) * 1e3
    with sock:
        sock.settimeout(timeout)
        try:
            return _ask(sock, r, token, timeout, size, rounds)
        except Unreachable as e:
            r.problems.append(f"peer {peer}: {e} (is it a `mori diagnose --serve`?)")
            r.exit_code = EXIT_UNREACHABLE
        except Refused as e:
            r.problems.append(str(e))
            r.exit_code = EXIT_PROBLEMS
        except OSError as e:
            r.problems.append(f"peer {peer}: connection failed: {e}")
            r.exit_code = EXIT_UNREACHABLE
    return r


def _ask(
    sock: socket.socket, r: DiagnoseReport, token: str, timeout: float, size: int, rounds: int
) -> DiagnoseReport:
    peer = r.peer
    hello = _recv(sock, peer)
    if hello.get("mori") != "diagnose":
        raise Refused(f"{peer} is not a mori diagnose server")
    if hello.get("protocol") != PROTOCOL:
        raise Refused(
            f"{peer} speaks diagnose protocol {hello.get('protocol')!r}, this side {PROTOCOL}: upgrade one side"
        )
    r.reachable = True
    cnonce = secrets.token_hex(16)
    snonce = str(hello.get("nonce", ""))
    if hello.get("auth") and not token:
        raise Refused(f"{peer} requires MORI_AUTH_TOKEN (the job's shared secret) and it is not set here")
    mine = {"protocol": PROTOCOL, "nonce": cnonce}
    if hello.get("auth"):
        mine["mac"] = _mac(token, "client", snonce, cnonce)
    _send(sock, mine)
    info = _recv(sock, peer)
    if "error" in info:
        raise Refused(f"{peer} refused: {info['error']}")
    if hello.get("auth") and not hmac.compare_digest(
        str(info.get("mac", "")), _mac(token, "server", cnonce, snonce)
    ):
        raise Refused(f"{peer} could not prove it holds MORI_AUTH_TOKEN: not the job's peer")
    if token and not hello.get("auth"):
        r.notes.append(f"{peer} serves without authentication (loopback)")
    local = _local_info()
    r.local, r.remote = local, {k: v for k, v in info.items() if k not in ("mac", "rkey", "tcp_address")}
    _send(sock, local)

    # agreement: versions and transports
    if local["version"] != info.get("version"):
        r.problems.append(f"mori-core versions differ: here {local['version']}, {peer} {info.get('version')}")
    same_node = local["node_id"] == info.get("node_id")
    if same_node:
        r.route = (
            "same node: load/store ("
            + ", ".join(t for t in local["transports"] if t in ("shm", "p2p", "xgmi"))
            + ")"
        )
        if local["hostname"] != info.get("hostname"):
            r.problems.append(
                f"node ids are equal ({local['node_id']}) but hostnames differ ({local['hostname']}, "
                f"{info.get('hostname')}): set MORI_NODE_ID per node"
            )
    else:
        mine_t, theirs = local["network_transport"], info.get("network_transport", "")
        if not mine_t:
            r.problems.append(f"no network transport here: {local['network_transport_error']}")
        if not theirs:
            r.problems.append(f"no network transport on {peer}: {info.get('network_transport_error', '?')}")
        if mine_t and theirs and mine_t != theirs:
            r.problems.append(
                f"network transports differ: here {mine_t}, {peer} {theirs}; every rank must choose the same "
                "(set MORI_SHMEM_TRANSPORT on both)"
            )
        r.route = f"other node: network transport {mine_t or '?'}"
        beyond_loopback = not _is_loopback(sock.getpeername()[0])
        if (
            beyond_loopback
            and "tcp" in (mine_t, theirs)
            and not (local["token_set"] and info.get("token_set"))
        ):
            r.problems.append(
                "MORI_AUTH_TOKEN is not set on both sides: the tcp transport listens on loopback only "
                "without it, so ranks on these two nodes could not connect"
            )

    summary = "probe not run"
    try:
        r.probe = _probe(info, timeout, size, rounds, peer, same_node)
        summary = (
            f"latency {r.probe['latency_us_median']:.1f} us, bandwidth {r.probe['bandwidth_gbps']:.2f} GB/s, "
            f"verified {r.probe['verified']}"
        )
        if not r.probe["verified"]:
            r.problems.append(
                f"bytes read back from {peer} differ from those written: the transfer path corrupts data"
            )
    except (MoriError, OSError, ValueError) as e:
        r.problems.append(f"tcp transport probe against {peer} failed: {e}")
    with contextlib.suppress(OSError):  # the report is ours already; the server only logs it
        _send(sock, {"done": True, "summary": summary})
    if r.problems and r.exit_code == EXIT_OK:
        r.exit_code = EXIT_PROBLEMS
    return r


def _probe(
    info: dict[str, Any], timeout: float, size: int, rounds: int, peer: str, same_node: bool
) -> dict[str, Any]:
    """Latency (8-byte put + flush, ``rounds`` times) and bandwidth (puts of ``size`` bytes) into the
    peer's registered memory through the tcp transport; then read back and compare."""
    size = min(size, int(info["size"]))
    base, rkey_hex = int(info["base"]), str(info["rkey"])
    tmo = max(1, int(timeout * 1000))
    token = env.MORI_AUTH_TOKEN.get()
    tp = _tcp_instance(topology.advertised_host() if token and not same_node else "127.0.0.1", timeout)
    local = _Buffer(2 * size)
    mem = tp.register(local.addr, local.size)
    ep = tp.connect(bytes.fromhex(str(info["tcp_address"])))
    rk = ep.unpack_rkey(bytes.fromhex(rkey_hex))
    ep.put(local.addr, mem, base, rk, 8).wait(tmo)  # the first put opens the connection: not timed
    ep.flush().wait(tmo)
    lat = []
    for _ in range(rounds):
        t = time.perf_counter()
        ep.put(local.addr, mem, base, rk, 8).wait(tmo)
        ep.flush().wait(tmo)
        lat.append((time.perf_counter() - t) * 1e6)
    pattern = os.urandom(size)
    ctypes.memmove(local.addr, pattern, size)
    reps = max(1, min(16, (64 << 20) // max(size, 1)))
    t = time.perf_counter()
    for _ in range(reps):
        ep.put(local.addr, mem, base, rk, size).wait(tmo)
    ep.flush().wait(tmo)
    secs = time.perf_counter() - t
    ep.get(local.addr + size, mem, base, rk, size).wait(tmo)
    back = ctypes.string_at(local.addr + size, size)
    lat.sort()
    return {
        "transport": "tcp",
        "path": "same node (Unix socket, cross-memory attach)" if same_node else "TCP",
        "rounds": rounds,
        "latency_us_median": statistics.median(lat),
        "latency_us_p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "bytes": size,
        "repetitions": reps,
        "bandwidth_gbps": size * reps / secs / 1e9,
        "verified": back == pattern,
    }


def _print(r: DiagnoseReport) -> None:
    print(f"peer {r.peer}: " + ("reachable" if r.reachable else "not reachable"), end="")
    print(f" (connected in {r.connect_ms:.1f} ms)" if r.connect_ms is not None else "")
    if r.remote:
        print(
            f"  remote: {r.remote.get('hostname')} ({r.remote.get('node_id')}), mori-core {r.remote.get('version')}, "
            f"network transport {r.remote.get('network_transport') or 'none'}"
        )
        print(
            f"  local:  {r.local.get('hostname')} ({r.local.get('node_id')}), mori-core {r.local.get('version')}, "
            f"network transport {r.local.get('network_transport') or 'none'}"
        )
    if r.route:
        print(f"  a transfer would take: {r.route}")
    if r.probe:
        p = r.probe
        print(
            f"  probe over {p['transport']} ({p['path']}): 8-byte put+flush median {p['latency_us_median']:.1f} us "
            f"(p99 {p['latency_us_p99']:.1f}); {p['bytes']} B x {p['repetitions']} puts {p['bandwidth_gbps']:.2f} GB/s; "
            f"read back {'identical' if p['verified'] else 'DIFFERENT'}"
        )
    for n in r.notes:
        print(f"  note: {n}")
    for pr in r.problems:
        print(f"  FAIL {pr}")
    print(f"{len(r.problems)} problem(s); exit {r.exit_code}")


def _cmd_diagnose(args: argparse.Namespace) -> int:
    if (args.peer is None) == (args.serve is None):
        print("mori diagnose: give exactly one of --peer HOST:PORT or --serve [HOST:]PORT", file=sys.stderr)
        return EXIT_USAGE
    if not args.timeout > 0:
        print(
            f"mori diagnose: --timeout={args.timeout!r} is not allowed; expected seconds > 0", file=sys.stderr
        )
        return EXIT_USAGE
    if not 8 <= args.size <= MAX_PROBE_BYTES:
        print(
            f"mori diagnose: --size={args.size!r} is not allowed; expected 8 to {MAX_PROBE_BYTES} bytes",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        if args.serve is not None:
            host, port = parse_endpoint(args.serve, "--serve", default_host="127.0.0.1")
            return serve(host, port, timeout=args.timeout, once=args.once)
        host, port = parse_endpoint(args.peer, "--peer")
    except ValueError as e:
        print(f"mori diagnose: {e}", file=sys.stderr)
        return EXIT_USAGE
    r = diagnose(host, port, timeout=args.timeout, size=args.size, rounds=args.rounds)
    if args.json:
        print(json.dumps(r.to_json(), indent=2))
    else:
        _print(r)
    return r.exit_code


def add_diagnose_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "diagnose",
        help="this node against a peer: reachability, transports, a tcp latency/bandwidth probe "
        "(exit 0 fine, 1 problems, 2 usage error, 3 peer unreachable)",
    )
    p.add_argument("--peer", metavar="HOST:PORT", help="ask the peer serving there")
    p.add_argument(
        "--serve",
        metavar="[HOST:]PORT",
        help="serve peers here (HOST default 127.0.0.1; beyond loopback needs MORI_AUTH_TOKEN)",
    )
    p.add_argument("--once", action="store_true", help="with --serve: exit after one peer")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds each step may take (default 10)")
    p.add_argument(
        "--size", type=int, default=4 << 20, help="bytes per bandwidth put (default 4 MiB, at most 64 MiB)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=50,
        choices=range(1, 10001),
        metavar="N",
        help="latency rounds (1-10000, default 50)",
    )
    p.add_argument("--json", action="store_true", help="with --peer: print the report as one JSON object")
    p.set_defaults(func=_cmd_diagnose)


@hookimpl
def mori_add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    add_diagnose_command(subparsers)


__all__ = ["DiagnoseReport", "add_diagnose_command", "diagnose", "parse_endpoint", "serve"]
