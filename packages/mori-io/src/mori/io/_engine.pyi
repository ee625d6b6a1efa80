# Stub of the native extension mori.io._engine (csrc/module.cpp); a test keeps it in sync.
import enum
from collections.abc import Callable, Sequence
from typing import Any

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
    def _set_in_progress(self) -> None: ...
    def _complete(self, code: int, message: str = "") -> bool: ...

class Engine:
    def __init__(
        self, key: str, host: str, port: int, node_id: str, token: str, cp_timeout_ms: int
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
    ) -> None: ...
    def register_memory(self, addr: int, size: int, loc: int, device: int) -> int:
        """Add a region to the table; returns its id. CPU memory's 2 MiB-aligned interior is put on
        transparent huge pages (contents unchanged; MORI_IO_THP=0: not)."""
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
    def route_of(self, peer_key: str, local_id: int, remote_cpu: bool) -> str: ...
    def set_device_copier(self, copier: object) -> None: ...
    def set_gpu_copier(self, calls: dict[str, Any], contexts: dict[int, int]) -> GpuCopier: ...
    def has_device_copier(self) -> bool: ...
    def _install_test_copier(self, fail: bool = False) -> None: ...
    def _test_refuse_cma(self, on: bool) -> None: ...
    def _test_refuse_direct(self, on: bool) -> None: ...
    def _test_direct_delay_ms(self, ms: int) -> None: ...
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
    def set_kernel(self, word: int, function: int, threads: int, shared: int) -> None: ...
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

def wait_all(statuses: Sequence[TransferStatus], timeout_ms: int) -> StatusCode: ...
def set_log_level(level: int) -> None: ...
def get_log_level() -> int: ...
def _parse_message(data: bytes) -> dict[str, object]: ...
def _move_off_cpu(tid: int, cpu: int) -> bool: ...
