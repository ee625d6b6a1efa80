"""Fixtures for the ucx transport's in-process tests: two instances of one process talking to each
other (each with its own UCX worker and progress thread), over shared memory or TCP loopback."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from mori_backend_ucx import UcxTransport

from mori.core import transport as T


@pytest.fixture(scope="session")
def ops() -> Any:
    return UcxTransport().ops()


@dataclass
class Side:
    tp: T.TransportInstance
    buf: Any  # ctypes array: keeps the memory alive
    addr: int
    mem: T.TransportMemory


def _side(ops: Any, options: str, size: int) -> Side:
    tp = T.open_transport(ops, options)
    buf = (ctypes.c_uint8 * size)()
    addr = ctypes.addressof(buf)
    return Side(tp, buf, addr, tp.register(addr, size))


@dataclass
class Pair:
    a: Side  # the initiator
    b: Side  # the target
    ep: T.TransportEndpoint  # a -> b
    rk: T.TransportRemoteKey  # b's memory, on ep
    options: str  # what both were opened with


SIZE = 1 << 16


@pytest.fixture(params=["tls=tcp", "tls=sm,self"], ids=["tcp", "sm"])
def pair(request: pytest.FixtureRequest, ops: Any) -> Iterator[Pair]:
    a, b = _side(ops, request.param, SIZE), _side(ops, request.param, SIZE)
    ep = a.tp.connect(b.tp.address())
    yield Pair(a, b, ep, ep.unpack_rkey(b.mem.rkey), request.param)
