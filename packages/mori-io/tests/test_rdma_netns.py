"""BackendType.RDMA over UCX between two network namespaces joined by a veth pair (as root), so that
every byte really crosses a network stack: two engine processes started with ``ip netns exec``,
each listening on its veth end only (UCX ``tls=tcp``, ``net_devices`` = that end; the engines'
control connections on the veth addresses, authenticated with a shared secret), different
``MORI_NODE_ID``s. The initiator runs the IO test path (write and read, single blocks and batches,
engine calls and sessions), every block checked byte-exact on the other side, and the target sees
each write's inbound status; then the veth counters must show the bytes went through it.

Run as a script, this file is one of the two engine processes (``target`` or ``initiator``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mori.core import netns

pytestmark = pytest.mark.root

#: bytes each side registers
REGION = 10 << 20
#: reads take the target's bytes from here on (the writes before them cover less than this)
READ_BASE = 5 << 20
#: (op, blocks, block size, through a session); strided blocks, so nothing merges
CASES = [
    (op, batch, size, session)
    for op in ("write", "read")
    for batch in (1, 64)
    for size in (8, 8192, 65536)
    for session in (False, True)
]


def _pattern(seed: int, n: int) -> bytes:
    out = bytearray()
    block = hashlib.blake2b(seed.to_bytes(8, "little")).digest()
    while len(out) < n:
        block = hashlib.blake2b(block).digest()
        out += block
    return bytes(out[:n])


def _make_engine(key: str, host: str) -> tuple[Any, Any, Any]:
    import torch

    from mori.io import BackendType, IOEngine, IOEngineConfig, RdmaBackendConfig

    engine = IOEngine(key, IOEngineConfig(host, 0))
    engine.create_backend(BackendType.RDMA, RdmaBackendConfig(enable_notification=True))
    buf = torch.zeros(REGION, dtype=torch.uint8)
    return engine, buf, engine.register_torch_tensor(buf)


def _send(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _recv() -> dict:
    line = sys.stdin.readline()
    if not line:
        raise SystemExit("the test closed the pipe")
    out: dict = json.loads(line)
    return out


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _target(host: str) -> None:
    """Registers a region filled with pattern 2, answers digests and inbound statuses."""
    import torch

    from mori.io import EngineDesc

    engine, buf, desc = _make_engine("netns-target", host)
    buf.copy_(torch.frombuffer(bytearray(_pattern(2, REGION)), dtype=torch.uint8))
    _send({"engine": _b64(engine.get_engine_desc().pack()), "mem": _b64(desc.pack())})
    while True:
        msg = _recv()
        if msg["do"] == "peer":
            engine.register_remote_engine(EngineDesc.unpack(base64.b64decode(msg["engine"])))
            _send({"ok": True})
        elif msg["do"] == "blocks":  # the bytes at these offsets, as a digest
            data = b"".join(bytes(buf[o : o + msg["size"]].numpy()) for o in msg["offsets"])
            _send({"digest": hashlib.blake2b(data).hexdigest()})
        elif msg["do"] == "inbound":
            st = None
            for _ in range(500):
                st = engine.pop_inbound_transfer_status("netns-initiator", msg["uid"])
                if st is not None:
                    break
                time.sleep(0.01)
            _send({"inbound": None if st is None else bool(st.Succeeded())})
        elif msg["do"] == "stop":
            engine.shutdown()
            _send({"ok": True})
            return


def _initiator(host: str) -> None:
    """Runs every case against the target; reports per case whether the bytes arrived."""
    import torch

    from mori.io import EngineDesc, MemoryDesc

    engine, buf, local = _make_engine("netns-initiator", host)
    mine = _pattern(1, REGION)
    buf.copy_(torch.frombuffer(bytearray(mine), dtype=torch.uint8))
    hello = _recv()
    engine.register_remote_engine(EngineDesc.unpack(base64.b64decode(hello["engine"])))
    remote = MemoryDesc.unpack(base64.b64decode(hello["mem"]))
    _send({"engine": _b64(engine.get_engine_desc().pack()), "route": engine._route_name(local, remote)})
    theirs = _pattern(2, REGION)
    results = []
    for op, batch, size, session in CASES:
        stride = size + 24
        base = READ_BASE if op == "read" else 0
        offs = [base + i * stride for i in range(batch)]
        uid = engine.allocate_transfer_uid()
        if session:
            sess = engine.create_session(local, remote)
            post = sess.batch_write if op == "write" else sess.batch_read
            st = post(offs, offs, [size] * batch, uid)
        else:
            many = engine.batch_write if op == "write" else engine.batch_read
            st = many([local], [offs], [remote], [offs], [[size] * batch], [uid])[0]
        ok = bool(st.WaitFor(60_000) and st.Succeeded())
        got = b"".join(bytes(buf[o : o + size].numpy()) for o in offs)
        want = b"".join((mine if op == "write" else theirs)[o : o + size] for o in offs)
        results.append(
            {
                "case": [op, batch, size, session],
                "ok": ok,
                "message": st.Message(),
                "uid": uid,
                "offsets": offs,
                "size": size,
                "digest": hashlib.blake2b(want).hexdigest(),
                "local_ok": op == "write" or got == want,
            }
        )
    _send({"results": results})
    _recv()  # stop
    engine.shutdown()


@pytest.fixture
def two_namespaces() -> Iterator[list[netns.Node]]:
    try:
        from mori.core.transport import find_network_transport

        find_network_transport("ucx")
    except Exception as e:
        pytest.skip(f"the ucx transport is not usable here: {e}")
    try:
        with netns.pair("io", 232) as nodes:
            yield nodes
    except netns.NetnsUnavailable as e:
        pytest.skip(str(e))


class _Proc:
    def __init__(self, node: netns.Node, role: str, secret: str) -> None:
        env = {
            **os.environ,
            "MORI_IO_RDMA_TRANSPORT": "ucx",
            "MORI_UCX_OPTIONS": f"tls=tcp;net_devices={node.dev}",
            "MORI_IO_AUTH_TOKEN": secret,  # the engines listen beyond loopback
            "MORI_NODE_ID": f"netns-{role}",
            "PYTHONUNBUFFERED": "1",
        }
        cmd = ["ip", "netns", "exec", node.name, sys.executable, str(Path(__file__).resolve()), role, node.ip]
        self.p = subprocess.Popen(
            cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def send(self, obj: dict) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(obj) + "\n")
        self.p.stdin.flush()

    def recv(self) -> dict:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        if not line:
            self.p.kill()
            _, err = self.p.communicate(timeout=10)
            raise AssertionError(f"engine process exited ({self.p.returncode}): {err[-3000:]}")
        out: dict = json.loads(line)
        return out

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.communicate(timeout=10)


def test_rdma_backend_across_network_namespaces(two_namespaces: list[netns.Node]) -> None:
    nodes = two_namespaces
    secret = secrets.token_hex(16)
    target = _Proc(nodes[1], "target", secret)
    ini = _Proc(nodes[0], "initiator", secret)
    try:
        hello = target.recv()
        ini.send(hello)
        back = ini.recv()
        assert back["route"] == "RdmaBackend", back
        target.send({"do": "peer", "engine": back["engine"]})
        assert target.recv()["ok"]
        results = ini.recv()["results"]
        assert len(results) == len(CASES)
        moved = {"write": 0, "read": 0}
        for r in results:
            op, batch, size, _session = r["case"]
            assert r["ok"], f"{r['case']}: {r['message']}"
            assert r["local_ok"], f"{r['case']}: the bytes read differ from the target's"
            if op == "write":
                target.send({"do": "blocks", "offsets": r["offsets"], "size": size})
                assert target.recv()["digest"] == r["digest"], f"{r['case']}: the target holds other bytes"
                target.send({"do": "inbound", "uid": r["uid"]})
                assert target.recv()["inbound"] is True, f"{r['case']}: the target saw no inbound status"
            moved[op] += batch * size
        ini.send({"do": "stop"})
        target.send({"do": "stop"})
        assert target.recv()["ok"]
        # every byte went through the veth pair, not around it (CMA, shared memory, loopback)
        assert netns.tx_bytes(nodes[0]) >= moved["write"]
        assert netns.tx_bytes(nodes[1]) >= moved["read"]
    finally:
        ini.close()
        target.close()


if __name__ == "__main__":
    {"target": _target, "initiator": _initiator}[sys.argv[1]](sys.argv[2])
