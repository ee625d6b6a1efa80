"""Every ``MORI_*`` environment variable mori-core reads, parsed and validated in one place.

Each variable is a :class:`EnvVar` constant with its default, an example and the accepted values;
``mori env`` prints them all (plugins add theirs through the ``mori_env_vars`` hook). Values are
read on use, never at import, so tests and launchers may set them late.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from mori.core.errors import MoriValueError

T = TypeVar("T")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``"6G"`` -> 6 GiB in bytes. Suffixes K, M, G, T are binary; ``B``/``iB`` may follow."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError("expected a byte count such as 4096, 512M, 6G or 1.5G")
    value = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])
    if value <= 0:
        raise ValueError("must be larger than 0")
    return value


def parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "on", "true", "yes"):
        return True
    if t in ("0", "off", "false", "no"):
        return False
    raise ValueError("expected one of 1/0, on/off, true/false, yes/no")


def parse_positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("must be a number of seconds larger than 0")
    return value


def choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text.strip() not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}")
        return text.strip()

    return parse


def _bounded_int(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text.strip(), 0)
        except ValueError:
            raise ValueError(f"expected a whole number from {low} to {high}") from None
        if not low <= value <= high:
            raise ValueError(f"expected a whole number from {low} to {high}")
        return value

    return parse


def _device_list(text: str) -> str:
    # the full syntax check is mori.core.nic.parse_device_filter's; here only what can be told alone
    from mori.core.nic import parse_device_filter

    parse_device_filter(text)
    return text.strip()


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One environment variable: ``get()`` returns the parsed value or the default."""

    name: str
    default: str | None
    doc: str
    example: str
    parse: Callable[[str], T]
    accepted: str = ""

    def raw(self) -> str | None:
        value = os.environ.get(self.name)
        return None if value is None or value.strip() == "" else value

    def get(self) -> T | None:
        text = self.raw()
        if text is None:
            text = self.default
        if text is None:
            return None
        try:
            return self.parse(text)
        except ValueError as e:
            raise MoriValueError(
                f"environment variable {self.name}={text!r} is not valid: {e} (example: {self.example})"
            ) from None

    def require(self) -> T:
        value = self.get()
        if value is None:
            raise MoriValueError(f"environment variable {self.name} must be set (example: {self.example})")
        return value


MORI_SHMEM_HEAP_SIZE = EnvVar(
    "MORI_SHMEM_HEAP_SIZE",
    "4G",
    "Bytes of symmetric heap per rank (static heap mode); on the cpu runtime each rank's heap is in "
    "/dev/shm, and init refuses a heap larger than its free space.",
    "6G",
    parse_size,
)
MORI_SHMEM_MODE = EnvVar(
    "MORI_SHMEM_MODE",
    "static_heap",
    "Symmetric heap mode. The CPU runtime supports static_heap only; vmm_heap comes with GPU runtimes.",
    "static_heap",
    choice("static_heap", "vmm_heap", "isolation"),
    "static_heap, vmm_heap, isolation",
)
MORI_BOOTSTRAP_TIMEOUT = EnvVar(
    "MORI_BOOTSTRAP_TIMEOUT",
    "300",
    "Seconds a rendezvous, barrier or default wait may take before it fails naming the missing ranks.",
    "60",
    parse_positive_float,
)
MORI_NODE_ID = EnvVar(
    "MORI_NODE_ID",
    None,
    "Identity of this node: ranks with equal ids share memory. Default: the kernel boot id, else the hostname.",
    "rack3-node7",
    str,
)
MORI_SHMEM_TRANSPORT = EnvVar(
    "MORI_SHMEM_TRANSPORT",
    None,
    "The network transport that reaches PEs on other nodes (loads and stores cannot): a name "
    "`mori backends` lists (tcp, ucx, ...). Default: the usable one of highest priority. Every rank "
    "must choose the same.",
    "tcp",
    str,
)


def parse_ring_slots(text: str) -> int:
    value = int(text)
    if value < 4 or value > 1 << 20 or value & (value - 1):
        raise ValueError("expected a power of two in [4, 1048576]")
    return value


MORI_SHMEM_PROXY_SLOTS = EnvVar(
    "MORI_SHMEM_PROXY_SLOTS",
    "256",
    "Requests the proxy's ring holds (device-initiated operations on PEs of other nodes); a full "
    "ring makes the device wait. 128 bytes of pinned host memory each.",
    "1024",
    parse_ring_slots,
    "a power of two in [4, 1048576]",
)
MORI_SHMEM_PROXY_PIECE = EnvVar(
    "MORI_SHMEM_PROXY_PIECE",
    "1M",
    "Largest transport operation the proxy posts: larger puts and gets are split into pieces of this size.",
    "4M",
    parse_size,
)
MORI_SHMEM_PROXY_ATOMICS = EnvVar(
    "MORI_SHMEM_PROXY_ATOMICS",
    "auto",
    "How the proxy carries atomics and signals to PEs of other nodes. auto: the transport's atomics, "
    "except for a GPU heap on a transport without atomics on device memory (ucx without RDMA), where "
    "signals, sets and fetches become puts and gets and every other atomic is refused. rma: that "
    "restriction on any heap, e.g. to check on CPU that kernels run under it.",
    "rma",
    choice("auto", "rma"),
    "auto, rma",
)
MORI_AUTH_TOKEN = EnvVar(
    "MORI_AUTH_TOKEN",
    None,
    "The job's shared secret for connections of the built-in tcp transport (SHMEM across nodes, the "
    "proxy): peers prove they hold it by HMAC challenge-response, it never crosses the wire. Required "
    "for the transport to listen beyond loopback. mori-io has its own, MORI_IO_AUTH_TOKEN.",
    "s3cret-job-42",
    str,
)
MORI_SOCKET_IFNAME = EnvVar(
    "MORI_SOCKET_IFNAME",
    None,
    "Network interface whose IPv4 address the unique-id rendezvous advertises. Default: the hostname's address.",
    "eth0",
    str,
)
MORI_DEVICE_RUNTIME = EnvVar(
    "MORI_DEVICE_RUNTIME",
    "auto",
    "Device runtime that backs the symmetric heap: a runtime name from `mori backends`, or auto "
    "(the usable runtime of highest priority).",
    "cpu",
    str,
)
MORI_DISABLE_P2P = EnvVar(
    "MORI_DISABLE_P2P",
    "0",
    "Do not use load/store transports between ranks: every peer is reached through the network "
    "transport (the original's proxy path; MORI_SHMEM_TRANSPORT picks it); the device API reaches "
    "them through the proxy.",
    "1",
    parse_bool,
)
MORI_PRECOMPILE = EnvVar(
    "MORI_PRECOMPILE",
    "0",
    "At `import mori`, compile every kernel variant of the installed MORI packages for this machine's GPU "
    "into Triton's cache (mori.jit.precompile; progress on stderr).",
    "1",
    parse_bool,
)
MORI_JIT_CACHE_DIR = EnvVar(
    "MORI_JIT_CACHE_DIR",
    None,
    "Directory of compiled kernels: made Triton's cache directory (TRITON_CACHE_DIR) at `import mori`, unless "
    "TRITON_CACHE_DIR is set. Default: Triton's, ~/.triton/cache.",
    "/scratch/mori-kernels",
    str,
)
MORI_DISABLE_JIT = EnvVar(
    "MORI_DISABLE_JIT",
    "0",
    "Never compile a MORI kernel at run time: a launch whose code is not in the cache raises (fill it with "
    "`mori jit precompile` first).",
    "1",
    parse_bool,
)
MORI_BENCH_GIT_SHA = EnvVar(
    "MORI_BENCH_GIT_SHA",
    None,
    "The commit a benchmark record names as its code, for a tree without its git history (a copy "
    "on a lent machine). Default: `git rev-parse` here, with '+dirty' when tracked files differ.",
    "dbe3d40",
    str,
)

MORI_RDMA_DEVICES = EnvVar(
    "MORI_RDMA_DEVICES",
    None,
    "RDMA devices MORI may use, as the original: a comma-separated list to include (mlx5_0,mlx5_1; "
    "NAME:PORT for one port), or ^ and a list to exclude (^mlx5_2). Setting it is also the explicit "
    "choice that lets the ucx transport use (and listen on) those devices: by default it stays on loopback. "
    "Default: every device whose NIC plugin is installed.",
    "mlx5_0,mlx5_1",
    _device_list,
    "NAME[:PORT],... to include, ^NAME[:PORT],... to exclude",
)
MORI_IB_GID_INDEX = EnvVar(
    "MORI_IB_GID_INDEX",
    None,
    "GID table index of the RDMA ports (RoCE v2 is usually 3). Default: the NIC's or UCX's own choice.",
    "3",
    _bounded_int(0, 255),
    "0-255",
)
MORI_RDMA_TC = EnvVar(
    "MORI_RDMA_TC",
    None,
    "Traffic class (DSCP << 2) of RDMA traffic, as the fabric's QoS expects. Default: the NIC's (0).",
    "104",
    _bounded_int(0, 255),
    "0-255",
)
MORI_RDMA_SL = EnvVar(
    "MORI_RDMA_SL",
    None,
    "Service level of RDMA traffic (InfiniBand SL, the priority on RoCE). Default: the NIC's (0).",
    "3",
    _bounded_int(0, 15),
    "0-15",
)
MORI_DISABLE_TOPO = EnvVar(
    "MORI_DISABLE_TOPO",
    "0",
    "Do not match GPUs to NICs by PCIe distance: GPU i takes active port i modulo the number of active "
    "ports (the original's static round robin).",
    "1",
    parse_bool,
)
MORI_CPU_AFFINITY = EnvVar(
    "MORI_CPU_AFFINITY",
    "none",
    "Opt-in CPU affinity of MORI's own threads: numa binds a thread that calls "
    "mori.core.topology.bind_thread_to_gpu (the proxy and progress threads, where wired) to the CPUs of "
    "its GPU's NUMA node. Default none: MORI changes no affinity of the host process.",
    "numa",
    choice("none", "numa"),
    "none, numa",
)

#: every variable mori-core reads, in the order `mori env` prints them
ALL: tuple[EnvVar[object], ...] = (
    MORI_SHMEM_HEAP_SIZE,  # type: ignore[assignment]
    MORI_SHMEM_MODE,
    MORI_BOOTSTRAP_TIMEOUT,
    MORI_NODE_ID,
    MORI_SOCKET_IFNAME,
    MORI_AUTH_TOKEN,
    MORI_SHMEM_TRANSPORT,
    MORI_SHMEM_PROXY_SLOTS,
    MORI_SHMEM_PROXY_PIECE,
    MORI_SHMEM_PROXY_ATOMICS,
    MORI_DEVICE_RUNTIME,
    MORI_DISABLE_P2P,
    MORI_PRECOMPILE,
    MORI_JIT_CACHE_DIR,
    MORI_DISABLE_JIT,
    MORI_BENCH_GIT_SHA,
    MORI_RDMA_DEVICES,
    MORI_IB_GID_INDEX,
    MORI_RDMA_TC,
    MORI_RDMA_SL,
    MORI_DISABLE_TOPO,
    MORI_CPU_AFFINITY,
)
