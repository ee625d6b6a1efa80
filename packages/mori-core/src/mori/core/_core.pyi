# Stub of the native module (csrc/). tests/test_units.py checks it against the built module.
import enum
from collections.abc import Callable, Sequence
from typing import Any

SHM_MAP_ALIGN: int

class SharedMemory:
    @staticmethod
    def create(name: str, size: int) -> SharedMemory: ...
    @staticmethod
    def open(name: str, size: int) -> SharedMemory: ...
    @property
    def addr(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def linked(self) -> bool: ...
    def unlink(self) -> bool: ...
    def close(self) -> None: ...

def shm_is_stale(name: str) -> bool: ...
def shm_unlink_if_stale(name: str) -> bool: ...
def shm_unlink(name: str) -> bool: ...
def atomic_rmw(addr: int, op: int, word: int, value: int) -> int: ...
def atomic_compare_swap(addr: int, word: int, expected: int, desired: int) -> int: ...
def wait_until(addr: int, cmp: int, word: int, value: int, timeout_s: float) -> tuple[bool, int]: ...
def fence() -> None: ...
def copy(dst: int, src: int, nbytes: int) -> None: ...

# -- the transport contract (csrc/transport.cpp, include/mori/transport.h) ---------------------------

TRANSPORT_ABI: int

class TransportMemory:
    addr: int
    size: int
    @property
    def rkey(self) -> bytes: ...

class TransportRemoteKey: ...

class TransportRequest:
    def test(self) -> bool: ...
    def wait(self, timeout_ms: int = -1) -> None: ...
    @property
    def old(self) -> int: ...

class TransportEndpoint:
    def unpack_rkey(self, rkey: bytes) -> TransportRemoteKey: ...
    def put(
        self,
        src: int,
        local_memory: TransportMemory | None,
        remote_addr: int,
        rkey: TransportRemoteKey,
        nbytes: int,
    ) -> TransportRequest: ...
    def get(
        self,
        dst: int,
        local_memory: TransportMemory | None,
        remote_addr: int,
        rkey: TransportRemoteKey,
        nbytes: int,
    ) -> TransportRequest: ...
    def atomic(
        self, op: int, word: int, value: int, compare: int, remote_addr: int, rkey: TransportRemoteKey
    ) -> TransportRequest: ...
    def fence(self) -> None: ...
    def flush(self) -> TransportRequest: ...

class TransportInstance:
    @property
    def name(self) -> str: ...
    @property
    def caps(self) -> int: ...
    def address(self) -> bytes: ...
    def connect(self, address: bytes) -> TransportEndpoint: ...
    def register(self, addr: int, size: int, mem_type: int = 0, device: int = -1) -> TransportMemory: ...
    def flush_all(self) -> TransportRequest: ...
    def progress(self) -> None: ...

def transport_open(ops: object, options: str = "") -> TransportInstance: ...
def tcp_transport_ops() -> object: ...

# -- the SHMEM proxy (csrc/proxy.cpp; used by mori.shmem.network) ---------------------------------

PROXY_LAYOUT: dict[str, int]

class Proxy:
    def __init__(
        self,
        transport: TransportInstance,
        my_pe: int,
        n_pes: int,
        heap_base: int,
        heap_size: int,
        heap: TransportMemory,
        ring: int,
        ring_bytes: int,
        nslots: int,
        piece: int,
        timeout_s: float,
        rma_signals: bool = False,
    ) -> None: ...
    def add_peer(self, pe: int, endpoint: TransportEndpoint, rkey: TransportRemoteKey, base: int) -> None: ...
    def add_local(self, memory: TransportMemory) -> None: ...
    def remove_local(self, addr: int) -> None: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def set_paused(self, paused: bool) -> None: ...
    def check(self) -> None: ...
    def quiet(self, timeout_s: float) -> None: ...
    def submit(
        self,
        op: int,
        pe: int,
        dst: int = 0,
        src: int = 0,
        nbytes: int = 0,
        amo: int = 0,
        word: int = 0,
        value: int = 0,
        compare: int = 0,
        sig_addr: int = 0,
        reply: bool = False,
        timeout_s: float = 10.0,
    ) -> tuple[int, int]: ...
    @property
    def head(self) -> int: ...
    @property
    def completed(self) -> int: ...
    @property
    def error_code(self) -> int: ...
    @property
    def error_message(self) -> str: ...
    @property
    def running(self) -> bool: ...
    @staticmethod
    def ring_size(nslots: int) -> int: ...

# -- the one-sided transfer machinery (csrc/transfer/; public face: mori.core.transfer) -----------

class StatusCode(enum.IntEnum):
    SUCCESS = 0
    INIT = 1
    IN_PROGRESS = 2
    ERR_INVALID_ARGS = 3
    ERR_NOT_FOUND = 4
    ERR_RDMA_OP = 5
    ERR_BAD_STATE = 6
    ERR_GPU_OP = 7

class TransferStatus:
    def __init__(self) -> None: ...
    def Code(self) -> StatusCode: ...
    def Message(self) -> str: ...
    def Init(self) -> bool: ...
    def InProgress(self) -> bool: ...
    def Succeeded(self) -> bool: ...
    def Failed(self) -> bool: ...
    def Wait(self) -> None: ...
    def WaitFor(self, timeout_ms: int) -> bool: ...
    def set_in_progress(self) -> None: ...
    def complete(self, code: int, message: str = "") -> bool: ...

class TcpEngine:
    def __init__(
        self,
        key: str,
        host: str,
        port: int,
        node_id: str,
        token: str,
        cp_timeout_ms: int,
        allow_unauthenticated: bool = False,
        max_connections: int = 1024,
        max_handshakes: int = 64,
        handshake_timeout_ms: int = 10000,
        idle_timeout_ms: int = 600000,
        inbound_per_peer: int = 65536,
        inbound_total: int = 262144,
        thp: bool = False,
        thp_collapse_bytes: int = 1 << 30,
        short_slice: bool = False,
        move_copy_threads: bool = False,
    ) -> None: ...
    @property
    def port(self) -> int: ...
    def configure_tcp(
        self,
        conns_per_peer: int,
        chunk_bytes: int,
        socket_buffer_bytes: int,
        enable_cma: bool,
        enable_notification: bool,
        cma_threads: int = 0,
        cma_split_bytes: int = 0,
    ) -> None: ...
    def register_memory(self, addr: int, size: int, loc: int, device: int) -> int:
        """Add a region to the table; returns its (random) id."""
    def deregister_memory(self, id: int, timeout_ms: int) -> bool: ...
    def has_memory(self, id: int) -> bool: ...
    def add_peer(self, key: str, host: str, port: int, same_node: bool) -> None: ...
    def remove_peer(self, key: str) -> None: ...
    def peer_alive(self, key: str) -> bool: ...
    def post(
        self,
        op: str,
        local_id: int,
        peer_key: str,
        remote_id: int,
        local_offsets: Sequence[int],
        remote_offsets: Sequence[int],
        sizes: Sequence[int],
        uid: int,
        remote_cpu: bool,
        remote_size: int,
    ) -> TransferStatus: ...
    def post1(
        self,
        op: str,
        local_id: int,
        peer_key: str,
        remote_id: int,
        local_offset: int,
        remote_offset: int,
        size: int,
        uid: int,
        remote_cpu: bool,
        remote_size: int,
    ) -> TransferStatus: ...
    def session(
        self, local_id: int, peer_key: str, remote_id: int, remote_cpu: bool, remote_size: int
    ) -> SessionPost:
        """The fixed half of posts between one local and one remote region (IOEngineSession's
        fast path)."""
    def pop_inbound(self, key: str, uid: int) -> TransferStatus | None: ...
    def notice(self, peer_key: str, uid: int, total_parts: int, code: int) -> str: ...
    def route_of(self, peer_key: str, local_id: int, remote_cpu: bool) -> str: ...
    def set_device_copier(self, copier: object) -> None: ...
    def set_gpu_copier(self, calls: dict[str, Any], contexts: dict[int, int]) -> GpuCopier: ...
    def has_device_copier(self) -> bool: ...
    def counters(self) -> dict[str, int]: ...
    def shutdown(self) -> None: ...

class SessionPost:
    """Posts between one local and one remote region (Engine.session); TypeError on anything but
    lists or tuples of equal length of non-negative ints."""
    def batch_read(
        self,
        local_offsets: Sequence[int],
        remote_offsets: Sequence[int],
        sizes: Sequence[int],
        uid: int,
    ) -> TransferStatus: ...
    def batch_write(
        self,
        local_offsets: Sequence[int],
        remote_offsets: Sequence[int],
        sizes: Sequence[int],
        uid: int,
    ) -> TransferStatus: ...
    def read(self, local_offset: int, remote_offset: int, size: int, uid: int) -> TransferStatus: ...
    def write(self, local_offset: int, remote_offset: int, size: int, uid: int) -> TransferStatus: ...

class GpuCopier:
    """The TCP backend's staging copier on a GPU driver (Engine.set_gpu_copier)."""
    @property
    def copies(self) -> int: ...
    def add_context(self, device: int, context: int) -> None: ...

class XgmiToken:
    """A region's validity for XgmiQueue (retire() ends it)."""
    @property
    def valid(self) -> bool: ...

class XgmiQueue:
    """The XGMI backend's data path (csrc/xgmi_queue.hpp): checks, plans and queues copies and
    scatter-gather kernel launches with the GPU driver's functions, completes statuses."""
    def __init__(
        self,
        calls: dict[str, Any],
        context: int,
        streams: Sequence[int],
        tables: Sequence[tuple[int, int, int, int]],
        num_events: int,
        threshold: int,
        timeout_ms: int,
    ) -> None: ...
    def set_kernel(self, word: int, function: int, threads: int, shared: int, trace: int = 0) -> None: ...
    def has_kernel(self, word: int) -> bool: ...
    @property
    def threshold(self) -> int: ...
    @threshold.setter
    def threshold(self, value: int) -> None: ...
    def token(self) -> XgmiToken: ...
    def retire(self, token: XgmiToken, timeout_ms: int = -1) -> bool: ...
    def post(
        self,
        op: str,
        local_base: int,
        local_size: int,
        remote_base: int,
        remote_size: int,
        local_offsets: Sequence[int],
        remote_offsets: Sequence[int],
        sizes: Sequence[int],
        uid: int,
        stream: int,
        kernel_ok: bool,
        local_token: XgmiToken,
        remote_token: XgmiToken,
        peer: str,
    ) -> TransferStatus: ...
    def session(
        self,
        local_base: int,
        local_size: int,
        remote_base: int,
        remote_size: int,
        kernel_ok: bool,
        local_token: XgmiToken,
        remote_token: XgmiToken,
        peer: str,
        stream_of: Callable[[int], int],
        device: int,
    ) -> XgmiSessionPost: ...
    def counters(self) -> dict[str, int]: ...
    def close(self) -> None: ...

class XgmiSessionPost:
    """Posts between two regions on the XGMI route (XgmiQueue.session); TypeError as SessionPost."""
    def batch_read(
        self,
        local_offsets: Sequence[int],
        remote_offsets: Sequence[int],
        sizes: Sequence[int],
        uid: int,
    ) -> TransferStatus: ...
    def batch_write(
        self,
        local_offsets: Sequence[int],
        remote_offsets: Sequence[int],
        sizes: Sequence[int],
        uid: int,
    ) -> TransferStatus: ...
    def read(self, local_offset: int, remote_offset: int, size: int, uid: int) -> TransferStatus: ...
    def write(self, local_offset: int, remote_offset: int, size: int, uid: int) -> TransferStatus: ...

class RmaQueue:
    """The RDMA backend's data path: checks, merges and posts a transfer's blocks on a network transport (mori.core.transport) and completes its status, in the waiting thread or a completion thread (csrc/transfer/rma_queue.hpp)."""
    def __init__(
        self, instance: TransportInstance, engine: TcpEngine | None, notify: bool, timeout_ms: int
    ) -> None: ...
    def post(
        self,
        op: str,
        local_memory: TransportMemory,
        endpoint: TransportEndpoint,
        rkey: TransportRemoteKey,
        remote_base: int,
        remote_size: int,
        local_offsets: Sequence[int],
        remote_offsets: Sequence[int],
        sizes: Sequence[int],
        uid: int,
        peer: str,
    ) -> TransferStatus: ...
    def session(
        self,
        local_memory: TransportMemory,
        endpoint: TransportEndpoint,
        rkey: TransportRemoteKey,
        remote_base: int,
        remote_size: int,
        peer: str,
    ) -> RmaSessionPost: ...
    def drain(self, timeout_ms: int = -1) -> bool: ...
    def counters(self) -> dict[str, int]: ...
    def close(self) -> None: ...

class RmaSessionPost:
    """Posts between two regions on the RDMA route (RmaQueue.session); TypeError as SessionPost."""
    def batch_read(
        self,
        local_offsets: Sequence[int],
        remote_offsets: Sequence[int],
        sizes: Sequence[int],
        uid: int,
    ) -> TransferStatus: ...
    def batch_write(
        self,
        local_offsets: Sequence[int],
        remote_offsets: Sequence[int],
        sizes: Sequence[int],
        uid: int,
    ) -> TransferStatus: ...
    def read(self, local_offset: int, remote_offset: int, size: int, uid: int) -> TransferStatus: ...
    def write(self, local_offset: int, remote_offset: int, size: int, uid: int) -> TransferStatus: ...

def wait_all(statuses: Sequence[TransferStatus], timeout_ms: int) -> StatusCode: ...
def transfer_set_log_level(level: int) -> None: ...
def transfer_get_log_level() -> int: ...
