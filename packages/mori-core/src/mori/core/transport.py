"""The one transport contract, from Python: open any transport's native ops table and move bytes
between registered memory of two processes.

The contract itself is a C ABI (``mori/transport.h``, shipped in this package: :func:`include_dir`).
A network transport plugin returns a :class:`mori.core.backend.NetworkTransport` whose
``ops()`` is a PyCapsule named ``"mori.transport.v1"``; :func:`open_transport` makes an instance::

    tp = open_transport(plugin_transport.ops(), "")
    mem = tp.register(addr, size)                 # -> .rkey (bytes for the peer)
    ep = tp.connect(peer_address)                 # peer_address = the peer's tp.address()
    rk = ep.unpack_rkey(peer_rkey)
    ep.put(src, mem, peer_addr, rk, n).wait()     # non-blocking; .test() polls
    old = ep.atomic(OP_ADD, WORD_UINT64, 1, 0, peer_addr, rk)  # .wait(), then .old
    ep.fence(); ep.flush().wait()

Every call that can wait releases the GIL; failures raise :class:`MoriBackendError` (bad
arguments :class:`MoriValueError`, a wait that ran out :class:`MoriTimeoutError`) with the
transport's own message. The tests every transport must pass are in
``mori.testing.transport_conformance``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mori.core import _core
from mori.core._core import (
    TransportEndpoint,
    TransportInstance,
    TransportMemory,
    TransportRemoteKey,
    TransportRequest,
)
from mori.core.backend import NetworkTransport
from mori.core.errors import MoriBackendError, MoriValueError

#: atomic operations and word types (include/mori/transport.h); the same codes as mori.core.backend
OP_FETCH, OP_SET, OP_ADD, OP_SWAP, OP_AND, OP_OR, OP_XOR, OP_CSWAP = range(8)
WORD_INT32, WORD_UINT32, WORD_INT64, WORD_UINT64 = range(4)
#: memory types for TransportInstance.register
MEM_HOST, MEM_CUDA, MEM_ROCM = range(3)
#: capabilities (TransportInstance.caps)
#: (CAP_DEVICE_ATOMIC: atomics on a peer's registered device memory; without it they fail, ENOTSUP)
(
    CAP_RMA,
    CAP_ATOMIC64,
    CAP_ATOMIC32,
    CAP_ATOMIC_NATIVE,
    CAP_CUDA_MEMORY,
    CAP_ROCM_MEMORY,
    CAP_DEVICE_ATOMIC,
) = (1 << i for i in range(7))
# the same numbers as the C header: changing one side without the other breaks every plugin
ABI: int = _core.TRANSPORT_ABI


def open_transport(ops: Any, options: str = "") -> TransportInstance:
    """An instance of the transport whose ops table ``ops`` holds (a PyCapsule named
    ``"mori.transport.v1"``). ``options``: ``key=value`` pairs separated by ``;``, as that
    transport documents them."""
    instance: TransportInstance = _core.transport_open(ops, options)
    return instance


def find_network_transport(name: str | None, setting: str = "the transport name") -> NetworkTransport:
    """The installed network transport named ``name``, or (``None``) the usable one of highest
    priority. Errors name ``setting`` (the variable or argument the name came from), what was
    found, and why a transport is unusable here."""
    from mori.core.plugins import get_plugins

    found = [
        (f.backend, f.availability)
        for f in get_plugins().transports()
        if isinstance(f.backend, NetworkTransport)
    ]
    if name:
        for t, avail in found:
            if t.name == name:
                if not avail.usable:
                    raise MoriBackendError(
                        f"{setting}={name!r}: that transport is not usable here: {avail.reason}"
                    )
                return t
        raise MoriValueError(
            f"{setting}={name!r} is not allowed; expected one of the network transports found: "
            + (", ".join(sorted(t.name for t, _ in found)) or "none")
        )
    usable = sorted((t for t, avail in found if avail.usable), key=lambda t: -t.priority)
    if not usable:
        why = "; ".join(f"{t.name}: {avail.reason}" for t, avail in found) or "none installed"
        raise MoriBackendError(f"no usable network transport ({why})")
    return usable[0]


def include_dir() -> str:
    """The directory holding ``mori/transport.h``, for plugins that build against the contract."""
    installed = Path(__file__).parent / "include"
    if (installed / "mori" / "transport.h").is_file():
        return str(installed)
    return str(Path(__file__).parents[3] / "include")  # a source checkout


__all__ = [
    "ABI",
    "CAP_ATOMIC32",
    "CAP_ATOMIC64",
    "CAP_ATOMIC_NATIVE",
    "CAP_CUDA_MEMORY",
    "CAP_DEVICE_ATOMIC",
    "CAP_RMA",
    "CAP_ROCM_MEMORY",
    "MEM_CUDA",
    "MEM_HOST",
    "MEM_ROCM",
    "OP_ADD",
    "OP_AND",
    "OP_CSWAP",
    "OP_FETCH",
    "OP_OR",
    "OP_SET",
    "OP_SWAP",
    "OP_XOR",
    "WORD_INT32",
    "WORD_INT64",
    "WORD_UINT32",
    "WORD_UINT64",
    "TransportEndpoint",
    "TransportInstance",
    "TransportMemory",
    "TransportRemoteKey",
    "TransportRequest",
    "find_network_transport",
    "include_dir",
    "open_transport",
]
