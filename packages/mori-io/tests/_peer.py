"""A hand-written peer of mori-io's wire protocol (csrc/protocol.hpp) for attack tests: it speaks the
handshake and the requests byte by byte, so a test can send what no engine would send.

Loaded by conftest.py as the ``peer`` fixture (a module); also run as a script by tests that need
the attacker in a process of its own (``python _peer.py PROGRAM``: see ``main``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from dataclasses import dataclass, field

HEADER = struct.Struct("<IHHIiQQQIIQII")  # Header, 64 bytes
MAGIC = 0x4F49524D
VERSION = 2
HELLO, HELLO_ACK, WRITE, READ, ACK, READ_DATA, NOTIFY, CHALLENGE, AUTH = range(1, 10)
FLAG_CMA, FLAG_NOTIFY, FLAG_DIRECT, FLAG_AUTH = 1, 2, 4, 8
CMA_UNAVAILABLE = 100
ACK_PARAMS = struct.Struct("<QQ")
GRANT = struct.Struct("<QQII16s")  # DirectGrant: table_addr, token, slot, reserved, nonce
assert HEADER.size == 64 and GRANT.size == 40


def header(
    mtype: int,
    *,
    flags: int = 0,
    status: int = 0,
    req_id: int = 0,
    uid: int = 0,
    mem_id: int = 0,
    nsegs: int = 0,
    body_len: int = 0,
    payload_len: int = 0,
    total_parts: int = 0,
    magic: int = MAGIC,
    version: int = VERSION,
    reserved: int = 0,
) -> bytes:
    return HEADER.pack(
        magic,
        version,
        mtype,
        flags,
        status,
        req_id,
        uid,
        mem_id,
        nsegs,
        body_len,
        payload_len,
        total_parts,
        reserved,
    )


def strings(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(s)) + s for s in items)


def parse_strings(body: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos < len(body):
        (n,) = struct.unpack_from("<I", body, pos)
        out.append(body[pos + 4 : pos + 4 + n])
        pos += 4 + n
    return out


def transcript(side: str, cn: bytes, sn: bytes, ikey: bytes, tkey: bytes, inst: bytes) -> bytes:
    """What a side signs (csrc/auth.cpp ``transcript``)."""
    return f"mori-io handshake v2 {side}".encode() + strings(cn, sn, ikey, tkey, inst)


def proof(token: str, side: str, cn: bytes, sn: bytes, ikey: bytes, tkey: bytes, inst: bytes) -> bytes:
    return hmac.new(token.encode(), transcript(side, cn, sn, ikey, tkey, inst), hashlib.sha256).digest()


class Refused(Exception):
    """The target refused the handshake; ``args[0]`` is its reason."""


@dataclass
class Ack:
    idle_timeout_ms: int
    unix_name: bytes
    grant: tuple[int, int, int, bytes] | None  # (table_addr, token, slot, nonce)
    fds: list[int] = field(default_factory=list)  # table memfd, slot memfd (with a grant)


class RawPeer:
    """One connection to an engine: over TCP (``host``, ``port``) or its Unix socket (``unix``)."""

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, unix: bytes | None = None, timeout: float = 10
    ) -> None:
        if unix is not None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout)
            self.sock.connect(b"\0" + unix)
        else:
            self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sent = bytearray()
        self.received = bytearray()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, data: bytes) -> None:
        self.sent += data
        self.sock.sendall(data)

    def recv_exact(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("closed by the engine")
            out += chunk
        self.received += out
        return bytes(out)

    def recv(self, with_fds: bool = False) -> tuple[tuple[int, ...], bytes, list[int]]:
        """One message: (header fields, body, passed descriptors)."""
        fds: list[int] = []
        if with_fds:
            data, fds, _, _ = socket.recv_fds(self.sock, 64, 4)
            if not data:
                raise ConnectionError("closed by the engine")
            self.received += data
            data += self.recv_exact(64 - len(data))
        else:
            data = self.recv_exact(64)
        h = HEADER.unpack(data)
        return h, self.recv_exact(h[9]), fds

    def closed_by_engine(self, timeout: float = 10) -> bool:
        self.sock.settimeout(timeout)
        try:
            while True:
                chunk = self.sock.recv(1 << 16)
                if not chunk:
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False

    def handshake(
        self,
        key: str,
        target_key: str | None = None,
        token: str | None = None,
        node_id: str = "elsewhere",
        direct: bool = False,
        instance: bytes | None = None,
    ) -> Ack:
        """The initiator's side of the handshake; raises Refused with the engine's reason."""
        cn, inst = os.urandom(32), instance or os.urandom(16)
        body = strings(key.encode(), node_id.encode(), cn, inst)
        self.send(header(HELLO, flags=FLAG_DIRECT if direct else 0, body_len=len(body)) + body)
        h, b, _ = self.recv()
        if h[2] == HELLO_ACK:
            raise Refused(b.decode())
        assert h[2] == CHALLENGE, h
        tkey, sn, tproof = parse_strings(b)
        if target_key is not None:
            assert tkey == target_key.encode()
        p = b""
        if h[3] & FLAG_AUTH:
            if token is None:
                p = b""
            else:
                assert hmac.compare_digest(tproof, proof(token, "target", cn, sn, key.encode(), tkey, inst))
                p = proof(token, "initiator", cn, sn, key.encode(), tkey, inst)
        body = strings(p)
        self.send(header(AUTH, body_len=len(body)) + body)
        h, b, fds = self.recv(with_fds=direct)
        if h[4] != 0:
            raise Refused(b.decode())
        parts = parse_strings(b)
        grant = None
        if len(parts) > 2:
            table_addr, token, slot, _, nonce = GRANT.unpack(parts[2])
            grant = (table_addr, token, slot, nonce)
        return Ack(ACK_PARAMS.unpack(parts[0])[0], parts[1], grant, fds)

    def request(
        self,
        mtype: int,
        mem_id: int,
        segs: list[tuple[int, int, int]],
        payload: bytes = b"",
        *,
        flags: int = 0,
        uid: int = 1,
        req_id: int = 1,
        total_parts: int = 1,
        payload_len: int | None = None,
    ) -> None:
        body = b"".join(struct.pack("<QQQ", *s) for s in segs)
        n = len(payload) if payload_len is None else payload_len
        self.send(
            header(
                mtype,
                flags=flags,
                req_id=req_id,
                uid=uid,
                mem_id=mem_id,
                nsegs=len(segs),
                body_len=len(body),
                payload_len=n,
                total_parts=total_parts,
            )
            + body
            + payload
        )

    def notify(self, records: list[tuple[int, int, int]]) -> None:
        body = b"".join(struct.pack("<QiI", *r) for r in records)
        self.send(header(NOTIFY, body_len=len(body)) + body)


def main() -> None:
    """``python _peer.py HOST PORT KEY PROGRAM``: run PROGRAM (Python source) with ``peer`` (this
    module), ``host``, ``port`` and ``key`` in scope, in a process of its own."""
    import sys

    host, port, key, program = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    exec(program, {"peer": sys.modules[__name__], "host": host, "port": port, "key": key})


if __name__ == "__main__":
    main()
