"""Every peer is untrusted: each test attacks the engine the way a stranger would, then checks byte by
byte that nothing outside what was allowed moved (canaries around the registered region, a secret
outside it), that no forged status was accepted, that floods leave descriptors, threads and memory
flat, and that the engine serves a legitimate peer afterwards."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch

from mori.core import topology
from mori.core.errors import MoriValueError
from mori.io import (
    BackendType,
    EngineDesc,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    StatusCode,
    TcpBackendConfig,
)

HERE = Path(__file__).parent
CANARY = 0xA5
PAGE = 4096
SLOT_HEAD, SLOT_RING = 128, 256  # TableSlot layout (csrc/table.hpp): owner, busy[2], head, tail, ring


@dataclass
class Target:
    """Engine ``b`` with one registered region between two canary pages, and a secret elsewhere in
    its process that is not registered; ``a`` is a legitimate initiator connected to it."""

    a: IOEngine
    b: IOEngine
    whole: torch.Tensor  # canary page | region | canary page
    desc: MemoryDesc
    secret: torch.Tensor
    secret_copy: torch.Tensor
    src: torch.Tensor
    src_desc: MemoryDesc

    @property
    def region(self) -> torch.Tensor:
        return self.whole[PAGE:-PAGE]

    def intact(self) -> None:
        """Nothing moved outside the region, and the secret is where it was, unchanged."""
        assert int((self.whole[:PAGE] != CANARY).sum()) == 0, "the canary before the region changed"
        assert int((self.whole[-PAGE:] != CANARY).sum()) == 0, "the canary after the region changed"
        assert torch.equal(self.secret, self.secret_copy), "the unregistered secret changed"

    def region_never_holds_the_secret(self) -> None:
        r = bytes(self.region.numpy())
        assert bytes(self.secret.numpy()[:64]) not in r, "the secret reached the registered region"

    def legit_write(self, uid: int = 1000) -> None:
        """The engine still serves a legitimate peer, byte-exact."""
        st = self.a.write(self.src_desc, 0, self.desc, 0, PAGE, uid)
        assert st.WaitFor(30_000) and st.Succeeded(), st.Message()
        assert torch.equal(self.region[:PAGE], self.src[:PAGE])
        self.intact()


def _make_target(cfg_b: TcpBackendConfig | None = None) -> Target:
    a = IOEngine("a", IOEngineConfig("127.0.0.1", 0))
    b = IOEngine("b", IOEngineConfig("127.0.0.1", 0))
    a.create_backend(BackendType.TCP)
    b.create_backend(BackendType.TCP, cfg_b or TcpBackendConfig())
    a.register_remote_engine(b.get_engine_desc())
    whole = torch.full((PAGE + 16 * PAGE + PAGE,), CANARY, dtype=torch.uint8)
    whole[PAGE:-PAGE] = 0
    secret = torch.randint(0, 256, (PAGE,), dtype=torch.uint8)
    desc = b.register_memory(whole.data_ptr() + PAGE, 16 * PAGE, -1, MemoryLocationType.CPU)
    src = torch.randint(0, 256, (16 * PAGE,), dtype=torch.uint8)
    return Target(a, b, whole, desc, secret, secret.clone(), src, a.register_torch_tensor(src))


@pytest.fixture
def target() -> Iterator[Target]:
    t = _make_target()
    yield t
    t.a.shutdown()
    t.b.shutdown()


def _pid_counts() -> tuple[int, int]:
    """(open descriptors, threads) of this process."""
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def _fd_links() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the descriptor listdir itself used
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
    return out


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _until(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def _unix_name(peer: ModuleType, b: IOEngine) -> bytes:
    """What an authenticated peer of b's node learns: b's Unix socket."""
    with peer.RawPeer(port=b.get_engine_desc().port) as s:
        ack = s.handshake("scout", "b", node_id=topology.node_id())
    assert ack.unix_name, "the engine told a peer of its node no Unix socket"
    return ack.unix_name


# -- cross-memory attach ------------------------------------------------------------------------

_ATTACK_ATTACH = """
import json
from mori.core import topology
out = {}
# over TCP the target cannot tell which process sent a request: no attach
with peer.RawPeer(host, port) as s:
    ack = s.handshake("mallory", "b", node_id=topology.node_id())
    s.request(peer.WRITE, MEM_ID, [(0, 4096, SECRET)], flags=peer.FLAG_CMA | peer.FLAG_NOTIFY, uid=1)
    out["tcp_write"] = s.recv()[0][4]
    unix = ack.unix_name
# over the Unix socket the target attaches to *this* process (the kernel names it), whatever the
# addresses say: the target's own secret and canaries are not addresses of ours
with peer.RawPeer(unix=unix) as s:
    s.handshake("mallory", "b", node_id=topology.node_id())
    s.request(peer.WRITE, MEM_ID, [(0, 4096, SECRET)], flags=peer.FLAG_CMA | peer.FLAG_NOTIFY, uid=2)
    out["unix_write"] = s.recv()[0][4]
    s.request(peer.READ, MEM_ID, [(0, 4096, CANARY)], flags=peer.FLAG_CMA | peer.FLAG_NOTIFY, uid=3)
    out["unix_read"] = s.recv()[0][4]
# the old handshake's claims (a pid and a nonce address in the HELLO) are refused outright
with peer.RawPeer(host, port) as s:
    body = peer.strings(b"mallory", topology.node_id().encode(), b"n" * 32, b"i" * 16)
    s.send(peer.header(peer.HELLO, uid=NONCE, mem_id=PID, body_len=len(body)) + body)
    out["forged_hello_closed"] = s.closed_by_engine()
print(json.dumps(out))
"""


def _run_attacker(program: str, b: IOEngine, timeout: float = 60, **names: int) -> dict:
    """Runs ``program`` in a process of its own (the attacker), with ``peer``, host, port and
    ``names`` in scope; returns the JSON it prints last."""
    for k, v in names.items():
        program = program.replace(k, str(v))
    desc = b.get_engine_desc()
    out = subprocess.run(
        [sys.executable, str(HERE / "_peer.py"), "127.0.0.1", str(desc.port), "b", program],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_attach_requests_never_reach_the_targets_own_memory(target: Target) -> None:
    """The critical hole: a peer made the target attach to *itself* (a pid claimed in the HELLO,
    proven by a nonce it had first written into the region) and read or write any address. Now the
    target attaches only to the process the kernel names for its Unix socket, so the addresses of a
    request are addresses of the requester's own memory."""
    got = _run_attacker(
        _ATTACK_ATTACH,
        target.b,
        MEM_ID=target.desc.id,
        SECRET=target.secret.data_ptr(),
        CANARY=target.whole.data_ptr(),
        PID=os.getpid(),
        NONCE=target.whole.data_ptr() + PAGE,
    )
    assert got["tcp_write"] == 100, got  # "attach unavailable": the initiator would resend over the socket
    assert got["unix_write"] != 0 and got["unix_read"] != 0, got  # not our addresses there: EFAULT
    assert got["forged_hello_closed"] is True
    target.region_never_holds_the_secret()
    target.intact()
    assert target.b._counters()["served_cma"] == 0
    target.legit_write()


def test_attach_is_off_on_the_request_path_when_the_target_turned_it_off(peer: ModuleType) -> None:
    """MORI_IO_TCP_CMA=0 (enable_cma=False) on the target is checked on the path that serves each
    request, not only when connections open."""
    t = _make_target(TcpBackendConfig(enable_cma=False))
    try:
        unix = _unix_name(peer, t.b)
        with peer.RawPeer(unix=unix) as s:
            ack = s.handshake("mallory", "b", node_id=topology.node_id(), direct=True)
            assert ack.grant is None and not ack.fds, "a table was granted with attach off"
            s.request(peer.WRITE, t.desc.id, [(0, PAGE, t.src.data_ptr())], flags=peer.FLAG_CMA, uid=1)
            h, body, _ = s.recv()
            assert h[4] == peer.CMA_UNAVAILABLE and b"off" in body, (h, body)
        assert int(t.region.count_nonzero()) == 0
        t.intact()
        t.legit_write()
    finally:
        t.a.shutdown()
        t.b.shutdown()


# -- authentication -----------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["", "0.0.0.0"])
def test_listening_beyond_loopback_needs_a_secret(monkeypatch: pytest.MonkeyPatch, host: str) -> None:
    monkeypatch.delenv("MORI_IO_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("MORI_IO_ALLOW_UNAUTHENTICATED", raising=False)
    with pytest.raises(MoriValueError, match=r"without a shared secret.*MORI_IO_AUTH_TOKEN"):
        IOEngine("open", IOEngineConfig(host, 0))
    for cfg in (
        IOEngineConfig(host, 0, auth_token="s3cret"),
        IOEngineConfig(host, 0, allow_unauthenticated=True),
        IOEngineConfig("127.0.0.1", 0),
    ):
        IOEngine("ok", cfg).shutdown()
    monkeypatch.setenv("MORI_IO_ALLOW_UNAUTHENTICATED", "1")
    IOEngine("ok", IOEngineConfig(host, 0)).shutdown()
    monkeypatch.delenv("MORI_IO_ALLOW_UNAUTHENTICATED")
    monkeypatch.setenv("MORI_IO_AUTH_TOKEN", "from-the-environment")
    IOEngine("ok", IOEngineConfig(host, 0)).shutdown()


def _relay(port: int) -> tuple[int, list[bytearray], threading.Event]:
    """A TCP relay to 127.0.0.1:port that records both directions: (its port, [up, down], stop)."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.1)
    stop = threading.Event()
    streams = [bytearray(), bytearray()]

    def pump(src: socket.socket, dst: socket.socket, rec: bytearray) -> None:
        try:
            while data := src.recv(1 << 16):
                rec += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            dst.close()

    def run() -> None:
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            u = socket.create_connection(("127.0.0.1", port))
            threading.Thread(target=pump, args=(c, u, streams[0]), daemon=True).start()
            threading.Thread(target=pump, args=(u, c, streams[1]), daemon=True).start()
        srv.close()

    threading.Thread(target=run, daemon=True).start()
    return srv.getsockname()[1], streams, stop


def test_no_secret_crosses_the_wire() -> None:
    token = "correct-horse-battery-staple"
    a = IOEngine("a", IOEngineConfig("127.0.0.1", 0, auth_token=token))
    b = IOEngine("b", IOEngineConfig("127.0.0.1", 0, auth_token=token))
    port, streams, stop = _relay(b.get_engine_desc().port)
    try:
        for e in (a, b):
            e.create_backend(BackendType.TCP)
        # another node, through the relay: every byte of both directions goes over TCP and is recorded
        a.register_remote_engine(EngineDesc("b", "another-node", "h", "127.0.0.1", port, 1))
        x = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
        y = torch.zeros(1 << 16, dtype=torch.uint8)
        mx, my = a.register_torch_tensor(x), b.register_torch_tensor(y)
        st = a.write(mx, 0, my, 0, 1 << 16, 1)
        assert st.WaitFor(30_000) and st.Succeeded(), st.Message()
        assert torch.equal(x, y)
        y.random_(0, 256)
        st = a.read(mx, 0, my, 0, 1 << 16, 2)
        assert st.WaitFor(30_000) and st.Succeeded(), st.Message()
        assert torch.equal(x, y)
        assert len(streams[0]) > 1 << 16 and len(streams[1]) > 1 << 16
        for s in streams:
            assert token.encode() not in s
    finally:
        stop.set()
        a.shutdown()
        b.shutdown()


def test_an_initiator_proves_nothing_to_a_target_that_cannot_prove_itself(peer: ModuleType) -> None:
    """A fake target that claims to need a secret but cannot prove it holds one gets the HELLO only:
    no proof (nothing to replay or test guesses against), no request, and never the secret."""
    srv = socket.create_server(("127.0.0.1", 0))
    hello, after = bytearray(), bytearray()

    def fake() -> None:
        c, _ = srv.accept()
        c.settimeout(10)
        h = peer.HEADER.unpack(c.recv(64, socket.MSG_WAITALL))
        hello.extend(c.recv(h[9], socket.MSG_WAITALL))
        body = peer.strings(b"b", os.urandom(32), os.urandom(32))
        c.sendall(peer.header(peer.CHALLENGE, flags=peer.FLAG_AUTH, body_len=len(body)) + body)
        try:
            while data := c.recv(1 << 16):
                after.extend(data)
        except OSError:
            pass
        c.close()

    th = threading.Thread(target=fake, daemon=True)
    th.start()
    a = IOEngine("a", IOEngineConfig("127.0.0.1", 0, auth_token="s3cret"))
    try:
        a.create_backend(BackendType.TCP)
        a.register_remote_engine(EngineDesc("b", "another-node", "h", "127.0.0.1", srv.getsockname()[1], 1))
        ma = a.register_torch_tensor(torch.ones(64, dtype=torch.uint8))
        st = a.write(ma, 0, MemoryDesc("b", 1, -1, "", 4096, 64, 1, -1, b""), 0, 8, 1)
        assert st.WaitFor(30_000) and st.Code() == StatusCode.ERR_BAD_STATE
        assert "did not prove it holds" in st.Message(), st.Message()
    finally:
        a.shutdown()
        th.join(10)
        srv.close()
    assert hello and b"s3cret" not in hello
    assert after == b"", f"the initiator sent {len(after)} more bytes after an unproven challenge"


# -- identities and forged statuses -------------------------------------------------------------


def test_a_peer_cannot_take_a_connected_key_nor_forge_a_status(target: Target, peer: ModuleType) -> None:
    target.legit_write(uid=1)  # 'a' is connected now
    port = target.b.get_engine_desc().port
    with (
        peer.RawPeer(port=port) as s,
        pytest.raises(peer.Refused, match="already connected from another engine"),
    ):
        s.handshake("a", "b")
    # a notification (the direct path's doorbell) on a connection that holds no slot is refused
    with peer.RawPeer(port=port) as s:
        s.handshake("mallory", "b")
        s.notify([(77, 0, 1)])
        assert s.closed_by_engine()
    assert target.b.pop_inbound_transfer_status("mallory", 77) is None
    assert target.b.pop_inbound_transfer_status("a", 77) is None
    assert target.b._counters()["protocol_errors"] >= 2
    target.intact()
    target.legit_write(uid=2)
    st = target.b.pop_inbound_transfer_status("a", 2)
    assert st is not None and st.Succeeded()


def _slot_holder(peer: ModuleType, b: IOEngine, key: str = "mallory"):
    """A raw peer of b's node holding a slot: (connection, table memfd, slot mapping)."""
    s = peer.RawPeer(unix=_unix_name(peer, b))
    ack = s.handshake(key, "b", node_id=topology.node_id(), direct=True)
    assert ack.grant is not None and len(ack.fds) == 2, "no slot was granted"
    table_fd, slot_fd = ack.fds
    slot = mmap.mmap(slot_fd, os.fstat(slot_fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(slot_fd)
    return s, table_fd, slot


def test_the_table_is_read_only_and_a_slot_credits_only_its_holder(target: Target, peer: ModuleType) -> None:
    target.legit_write(uid=1)  # a's own slot exists too (same-host direct path)
    s, table_fd, slot = _slot_holder(peer, target.b)
    try:
        size = os.fstat(table_fd).st_size
        with pytest.raises(PermissionError):  # sealed against every writer but its owner's mapping
            mmap.mmap(table_fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.pwrite(table_fd, b"\0" * 8, 4096)
        ro = mmap.mmap(table_fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        assert struct.unpack_from("<Q", ro, 0)[0] == 0x314C4254494F524D  # "MROITBL1"
        ro.close()
        # no other slot's memory can be reached through this process's descriptors: the engines
        # (b granting, a holding its own slot of b) keep none open, their mappings are all they
        # need; the one descriptor left is the one Python's mmap of our slot keeps
        slots = [x for x in _fd_links() if "mori-io-slot" in x]
        assert len(slots) == 1, slots
        # a record in this slot is credited to its holder, whatever it claims
        struct.pack_into("<QiI", slot, SLOT_RING, 5, 0, 1)
        struct.pack_into("<Q", slot, SLOT_HEAD, 1)
        s.notify([])
        assert _until(lambda: target.b._counters()["inbound_pending"] >= 1)
        assert target.b.pop_inbound_transfer_status("a", 5) is None
        st = target.b.pop_inbound_transfer_status("mallory", 5)
        assert st is not None and st.Succeeded()
    finally:
        slot.close()
        os.close(table_fd)
        s.close()
    target.intact()
    target.legit_write(uid=2)


def test_a_flood_of_statuses_stays_bounded(target: Target, peer: ModuleType) -> None:
    """A million notification records (before: 122 MB kept, never freed) are capped at the
    per-peer bound, the rest counted as dropped; memory stays flat and the engine keeps serving."""
    target.legit_write(uid=1)
    s, table_fd, slot = _slot_holder(peer, target.b)
    rss0 = _rss_kib()
    try:
        n, per = 1_000_000, 256
        for start in range(0, n, per):
            s.notify([(u, 0, 1) for u in range(start, min(n, start + per))])
        assert _until(lambda: target.b._counters()["inbound_dropped"] >= n - 65536, timeout=60)
        c = target.b._counters()
        assert c["inbound_pending"] <= 65536 + 1, c
    finally:
        slot.close()
        os.close(table_fd)
        s.close()
    grown = (_rss_kib() - rss0) / 1024
    assert grown < 48, f"RSS grew by {grown:.0f} MiB"
    # the newest records are kept for their consumer, the oldest went
    st = target.b.pop_inbound_transfer_status("mallory", n - 1)
    assert st is not None and st.Succeeded()
    assert target.b.pop_inbound_transfer_status("mallory", 0) is None
    target.legit_write(uid=2)


def test_a_torn_write_and_a_missing_part_end_in_failed_statuses(target: Target, peer: ModuleType) -> None:
    port = target.b.get_engine_desc().port
    with peer.RawPeer(port=port) as s:
        s.handshake("tearer", "b")
        s.request(
            peer.WRITE,
            target.desc.id,
            [(0, PAGE, 0)],
            b"x" * 100,
            flags=peer.FLAG_NOTIFY,
            uid=9,
            payload_len=PAGE,
        )
    assert _until(lambda: target.b._counters()["torn_transfers"] == 1)
    st = target.b.pop_inbound_transfer_status("tearer", 9)
    assert st is not None and st.Code() == StatusCode.ERR_BAD_STATE
    assert "after 100 of 4096 bytes" in st.Message(), st.Message()
    target.intact()
    # a transfer of two parts whose second never comes: failed once its last connection closed
    with peer.RawPeer(port=port) as s:
        s.handshake("halfway", "b")
        s.request(
            peer.WRITE, target.desc.id, [(0, 8, 0)], b"y" * 8, flags=peer.FLAG_NOTIFY, uid=3, total_parts=2
        )
        h, _, _ = s.recv()
        assert h[2] == peer.ACK and h[4] == 0
        assert target.b.pop_inbound_transfer_status("halfway", 3) is None  # still waiting for part 2
    found: list = []

    def popped() -> bool:
        st = target.b.pop_inbound_transfer_status("halfway", 3)
        if st is not None:
            found.append(st)
        return bool(found)

    assert _until(popped)
    assert found[0].Code() == StatusCode.ERR_BAD_STATE and "1 of 2 parts arrived" in found[0].Message()
    target.intact()
    target.legit_write()


# -- resource exhaustion ------------------------------------------------------------------------


def test_connection_cap_handshake_deadline_and_idle_timeout(
    monkeypatch: pytest.MonkeyPatch, peer: ModuleType
) -> None:
    monkeypatch.setenv("MORI_IO_MAX_CONNECTIONS", "6")
    monkeypatch.setenv("MORI_IO_HANDSHAKE_TIMEOUT_MS", "400")
    monkeypatch.setenv("MORI_IO_IDLE_TIMEOUT_MS", "700")
    t = _make_target()
    try:
        fds0, threads0 = _pid_counts()
        port = t.b.get_engine_desc().port
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]  # never say HELLO
        assert _until(lambda: t.b._counters()["connections_refused"] >= 14)
        assert t.b._counters()["inbound_connections"] <= 6
        for s in silent:
            p = peer.RawPeer.__new__(peer.RawPeer)
            p.sock = s
            assert p.closed_by_engine(5), "a silent connection outlived the handshake deadline"
            s.close()
        idle = []
        for i in range(3):
            p = peer.RawPeer(port=port)
            p.handshake(f"idler-{i}", "b")
            idle.append(p)
        assert all(p.closed_by_engine(5) for p in idle), "an idle connection was kept"
        for p in idle:
            p.close()
        c = t.b._counters()
        assert c["handshakes_failed"] >= 6 and c["idle_closed"] >= 3, c
        t.legit_write(uid=1)
        # b closes a's connections once idle; a learnt the idle timeout in the handshake and
        # replaces connections silent for half of it before use, so its next transfer just works
        assert _until(lambda: t.b._counters()["inbound_connections"] == 0, timeout=5)
        t.legit_write(uid=2)
        t.a.deregister_remote_engine(t.b.get_engine_desc())  # a closes its side
        assert _until(lambda: _pid_counts() == (fds0, threads0), timeout=5), (_pid_counts(), (fds0, threads0))
    finally:
        t.a.shutdown()
        t.b.shutdown()


_EXHAUSTED_TARGET = """
import json, os, resource, sys, time
from mori.io import BackendType, IOEngine, IOEngineConfig, TcpBackendConfig
import torch
b = IOEngine("b", IOEngineConfig("127.0.0.1", 0))
b.create_backend(BackendType.TCP, TcpBackendConfig(num_connections_per_peer=1))
y = torch.zeros(4096, dtype=torch.uint8)
d = b.register_torch_tensor(y)
print(json.dumps({"desc": list(b.get_engine_desc().pack()), "mem": list(d.pack())}), flush=True)
kind = sys.argv[1]
if kind == "fds":
    lim = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 3, lim[1]))
else:  # no memory for another thread's stack
    lim = resource.getrlimit(resource.RLIMIT_AS)
    vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize:")][0].split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + (24 << 20), lim[1]))
print("exhausted", flush=True)
for line in sys.stdin:
    if line.strip() == "restore":
        resource.setrlimit(resource.RLIMIT_NOFILE if kind == "fds" else resource.RLIMIT_AS, lim)
        print("restored", flush=True)
    elif line.strip() == "counters":
        print(json.dumps(b._counters()), flush=True)
    elif line.strip() == "bytes":
        print(json.dumps(y[:64].tolist()), flush=True)
"""


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize("kind", ["fds", "memory"])
def test_resource_exhaustion_neither_crashes_nor_spins(kind: str) -> None:
    """Out of descriptors, accept fails (EMFILE) with the connection still queued: the engine backs
    off instead of spinning. Out of memory, a connection's thread cannot be created: the engine
    refuses that connection instead of aborting. Either way it serves again once resources return."""
    from mori.io import MemoryDesc as MD

    proc = subprocess.Popen(
        [sys.executable, "-c", _EXHAUSTED_TARGET, kind],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    attackers: list[socket.socket] = []
    a = IOEngine("a", IOEngineConfig("127.0.0.1", 0))
    try:
        hello = json.loads(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "exhausted"
        desc, mem = EngineDesc.unpack(bytes(hello["desc"])), MD.unpack(bytes(hello["mem"]))
        for _ in range(15):
            attackers.append(socket.create_connection(("127.0.0.1", desc.port)))
        cpu0 = _cpu_seconds(proc.pid)
        time.sleep(1.0)
        spent = _cpu_seconds(proc.pid) - cpu0
        assert proc.poll() is None, "the target died"
        assert spent < 0.5, f"the target used {spent:.2f} s of CPU in 1 s: it spins"
        for s in attackers:
            s.close()
        proc.stdin.write("restore\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "restored"
        a.create_backend(BackendType.TCP)
        a.register_remote_engine(desc)
        x = torch.arange(64, dtype=torch.uint8)
        st = a.write(a.register_torch_tensor(x), 0, mem, 0, 64, 1)
        assert st.WaitFor(30_000) and st.Succeeded(), st.Message()
        proc.stdin.write("bytes\ncounters\n")
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline()) == list(range(64))
        counters = json.loads(proc.stdout.readline())
        key = "accept_errors" if kind == "fds" else "thread_failures"
        assert counters[key] >= 1, counters
        assert proc.poll() is None
    finally:
        for s in attackers:
            s.close()
        a.shutdown()
        proc.kill()
        proc.wait(30)
        proc.stdin.close()
        proc.stdout.close()


# -- registration ---------------------------------------------------------------------------------


def test_registration_rejects_ranges_that_are_not_memory(target: Target) -> None:
    b = target.b
    with pytest.raises(MoriValueError, match=r"register_memory: size=4096.*wraps around"):
        b.register_memory(2**64 - 16, 4096, -1, MemoryLocationType.CPU)
    with pytest.raises(MoriValueError, match="register_memory: ptr=18446744073709551616"):
        b.register_memory(2**64, 16, -1, MemoryLocationType.CPU)
    with pytest.raises(MoriValueError, match="register_memory: device_id"):
        b.register_memory(target.src.data_ptr(), 16, 2**40, MemoryLocationType.GPU)
    m = mmap.mmap(-1, 3 * PAGE)
    hole = torch.frombuffer(m, dtype=torch.uint8).data_ptr() + PAGE
    m.close()  # the whole mapping is gone: nothing is mapped at `hole` any more
    with pytest.raises(MoriValueError, match=r"register_memory: .*not mapped memory of this process"):
        b.register_memory(hole, PAGE, -1, MemoryLocationType.CPU)
    with pytest.raises(MoriValueError, match="write: remote_offsets\\[0\\]=18446744073709551616"):
        target.a.write(target.src_desc, 0, target.desc, 2**64, 8, 1)
    target.legit_write()


def test_region_ids_cannot_be_guessed(target: Target) -> None:
    descs = [target.b.register_torch_tensor(torch.zeros(64, dtype=torch.uint8)) for _ in range(4)]
    ids = [d.id for d in descs] + [target.desc.id]
    assert len(set(ids)) == len(ids) and all(i > 2**20 for i in ids), ids
    assert sorted(ids) != list(range(min(ids), min(ids) + len(ids)))
    for guess in (1, 2, 3):
        st = target.a.write(
            target.src_desc, 0, MemoryDesc(**{**target.desc.__dict__, "id": guess}), 0, 8, guess
        )
        assert (
            st.WaitFor(30_000)
            and st.Code() == StatusCode.ERR_INVALID_ARGS
            and "not registered" in st.Message()
        )
    target.intact()
