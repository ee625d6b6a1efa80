"""What every mori.ccl collective object shares: construction, argument checks, the implementation
choice, streams, and asynchronous calls.

**Implementations** (``impl=``): ``"host"``: vectorised torch operations on views of the peers'
staging (the ``cpu`` runtime); ``"triton"``: the load/store kernels of :mod:`mori.ccl.kernels`
and, on GPUs above a size, copy-engine copies (``cudaMemcpyAsync`` on the caller's stream)
ordered by small kernels; ``"auto"`` (default): host on the ``cpu`` runtime, triton on GPUs. On the
``cpu`` runtime, ``"triton"`` runs the kernels in Triton's interpreter (``TRITON_INTERPRET=1`` set
before triton is imported), which is how CI checks them. After each call :attr:`last_path` says
what ran, e.g. ``"host:oneshot"``, ``"triton:rsag"``, ``"copy-engine:large"``.

**Streams** (GPU): ``stream`` is None (the current stream), a ``torch.cuda.Stream`` or a raw handle
(int); calls only enqueue work there, never synchronise the host, so they can be captured in a
CUDA graph and replayed. On the ``cpu`` runtime there are no streams: calls return when done.

**Async**: ``start_async(...)`` runs the call on a side stream (GPU, after the caller's current
stream) or on a worker thread (CPU) and returns; ``wait_async()`` orders the caller's current stream
after it (GPU) or blocks until it finished and re-raises its error (CPU). One async call at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch

from mori.ccl import channel as ch
from mori.ccl.channel import Channel, resolve_comm
from mori.core.errors import MoriStateError, bad_type, bad_value

__all__ = ["Collective"]

#: most programs of one kernel launch on a GPU (they must all be resident with the peers')
MAX_GPU_PROGRAMS = 64
#: programs of a launch under the interpreter (they run one after another)
INTERPRETER_PROGRAMS = 2


def _size(func: str, arg: str, value: Any, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise bad_value(func, arg, value, "None or a number of bytes > 0")
    return value


class Collective:
    """Base of the collective objects (see the module docstring).

    ``my_pe``, ``npes``: this PE and the number of PEs (checked against ``comm`` or mori.shmem).
    ``input_buffer_size`` / ``output_buffer_size``: most bytes of one call's input / output (None:
    what the transit buffer allows); a larger call raises. ``transit_buffer_size``: bytes of
    symmetric staging per rank (default 512 MiB; calls whose staged bytes exceed it raise).
    ``copy_output_to_user``: False leaves the result in a local output transit buffer
    (:meth:`get_output_transit_buffer`) instead of ``out``. ``comm``: run on this communicator
    instead of one made over mori.shmem. ``impl``: see the module docstring. ``max_programs``:
    programs of a kernel launch (GPU default: the SMs divided by the ranks sharing this GPU, at most
    64). ``small_cap``: calls staging at most this many bytes use the one-sync protocol (default
    1 MiB, the original's one-shot limit; :class:`~mori.ccl.AllreduceSdma` on the host path: 512 KiB).
    """

    #: the class name in messages
    NAME = "Collective"

    def __init__(
        self,
        my_pe: int,
        npes: int,
        input_buffer_size: int | None = None,
        output_buffer_size: int | None = None,
        transit_buffer_size: int | None = None,
        copy_output_to_user: bool = True,
        *,
        comm: Any = None,
        impl: str = "auto",
        max_programs: int | None = None,
        small_cap: int | None = None,
    ) -> None:
        func = self.NAME
        transit = _size(func, "transit_buffer_size", transit_buffer_size, ch.DEFAULT_TRANSIT)
        self.input_buffer_size = _size(func, "input_buffer_size", input_buffer_size, 0) or None
        self.output_buffer_size = _size(func, "output_buffer_size", output_buffer_size, 0) or None
        if small_cap is not None:
            _size(func, "small_cap", small_cap, 0)
        if not isinstance(copy_output_to_user, bool):
            raise bad_type(func, "copy_output_to_user", copy_output_to_user, "a bool")
        self.copy_output_to_user = copy_output_to_user
        self.impl = ch.reject_unknown(func, "impl", impl, ch.IMPLS)
        need = 2 * (small_cap or ch.SMALL_CAP) + transit + (8 << 20)
        self.comm, owned = resolve_comm(func, my_pe, npes, comm, need)
        try:
            self.my_pe, self.npes = my_pe, npes
            self.device = torch.device(self.comm.device)
            self.gpu = self.device.type != "cpu"
            if self.impl == "auto":
                self.impl = "triton" if self.gpu else "host"
            if self.impl == "host" and self.gpu:
                raise bad_value(
                    func, "impl", impl, "'auto' or 'triton' on a GPU runtime (the host path is for cpu)"
                )
            self.kernels: Any = None
            if self.impl == "triton":
                self.kernels = self._load_kernels(func)
            programs = 1 if self.impl == "host" else self._programs(func, max_programs)
            small = small_cap or self._default_small_cap()
            self.ch = Channel(
                func, self.comm, small_cap=small, large_cap=transit, programs=programs, owned=owned
            )
        except BaseException:
            if owned:
                self.comm.destroy()
            raise
        self.last_path = ""
        self._trace_buffer: Any = None
        self._out_transit: torch.Tensor | None = None
        self._async: _Async | None = None
        self._lock = threading.Lock()

    # -- setup helpers ------------------------------------------------------------------------------

    def _default_small_cap(self) -> int:
        """Bytes of the small protocol when ``small_cap`` is None (``self.impl`` is known here)."""
        return ch.SMALL_CAP

    def _load_kernels(self, func: str) -> Any:
        from mori.ccl import kernels

        if not self.gpu and type(kernels.gather_kernel).__name__ != "InterpretedFunction":
            raise MoriStateError(
                f"{func}: impl='triton' on the cpu runtime runs the kernels in Triton's interpreter: set "
                f"TRITON_INTERPRET=1 before triton is first imported (or use impl='host')"
            )
        return kernels

    def _programs(self, func: str, max_programs: Any) -> int:
        if max_programs is not None:
            if (
                isinstance(max_programs, bool)
                or not isinstance(max_programs, int)
                or not 1 <= max_programs <= 1024
            ):
                raise bad_value(func, "max_programs", max_programs, "None or an int in [1, 1024]")
            return max_programs
        if not self.gpu:
            return INTERPRETER_PROGRAMS
        props = torch.cuda.get_device_properties(self.device)
        mine = str(getattr(props, "uuid", self.device)).encode()
        sharing = sum(1 for u in self.comm.allgather_bytes(mine) if u == mine)
        return max(1, min(MAX_GPU_PROGRAMS, props.multi_processor_count // max(1, sharing)))

    # -- argument checks ----------------------------------------------------------------------------

    def _tensor(self, func: str, arg: str, t: Any, *, min_bytes: int) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise bad_type(func, arg, t, "a torch.Tensor")
        if t.device != self.device and not (t.device.type == self.device.type == "cpu"):
            raise bad_value(
                func, f"{arg}.device", str(t.device), f"the communicator's device ({self.device})"
            )
        if not t.is_contiguous():
            raise bad_value(func, arg, f"a tensor with strides {t.stride()}", "a contiguous tensor")
        have = t.numel() * t.element_size()
        if have < min_bytes:
            raise bad_value(
                func, arg, f"{tuple(t.shape)} {t.dtype} ({have} bytes)", f"at least {min_bytes} bytes"
            )
        return t

    def _count(self, func: str, arg: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise bad_value(func, arg, value, "a count >= 0")
        return value

    def _check_limits(self, func: str, in_bytes: int, out_bytes: int, staged: int) -> None:
        if self.input_buffer_size is not None and in_bytes > self.input_buffer_size:
            raise bad_value(
                func, "input", f"{in_bytes} bytes", f"at most input_buffer_size={self.input_buffer_size}"
            )
        if self.output_buffer_size is not None and out_bytes > self.output_buffer_size:
            raise bad_value(
                func, "output", f"{out_bytes} bytes", f"at most output_buffer_size={self.output_buffer_size}"
            )
        self.ch.check_staged(func, staged, "staged input")

    def _output(self, func: str, out: Any, nbytes: int, like: torch.Tensor) -> torch.Tensor:
        """Where the result goes: ``out``, or the output transit buffer without copy_output_to_user."""
        if self.copy_output_to_user:
            return self._tensor(func, "out", out, min_bytes=nbytes)
        if self._out_transit is None or self._out_transit.numel() < nbytes:
            self._out_transit = torch.empty(
                max(nbytes, self.output_buffer_size or 0), dtype=torch.uint8, device=self.device
            )
        return (
            self._out_transit[:nbytes].view(like.dtype)
            if nbytes % like.element_size() == 0
            else self._out_transit
        )

    def get_output_transit_buffer(self, dtype: torch.dtype | None = None, device: Any = None) -> torch.Tensor:
        """The local buffer results go to with ``copy_output_to_user=False`` (1-D, ``dtype``, default
        uint8). Valid until the next call. ``device`` must be the communicator's (or None)."""
        func = f"{self.NAME}.get_output_transit_buffer"
        if device is not None and torch.device(device) != self.device:
            raise bad_value(func, "device", device, f"None or the communicator's device ({self.device})")
        if self._out_transit is None:
            raise MoriStateError(f"{func}: no call has produced a result yet (or copy_output_to_user=True)")
        buf = self._out_transit
        if dtype is None:
            return buf
        n = buf.numel() // dtype.itemsize
        return buf[: n * dtype.itemsize].view(dtype)

    # -- running ------------------------------------------------------------------------------------

    def _stream(self, func: str, stream: Any) -> Any:
        if not self.gpu:
            if stream is not None:
                raise bad_value(func, "stream", stream, "None on the cpu runtime (there are no streams)")
            return None
        if stream is None:
            return torch.cuda.current_stream(self.device)
        if isinstance(stream, int) and not isinstance(stream, bool):
            return torch.cuda.ExternalStream(stream, device=self.device)  # type: ignore[no-untyped-call]
        if not isinstance(stream, torch.cuda.Stream):
            raise bad_value(func, "stream", stream, "None, a torch.cuda.Stream or a raw stream handle (int)")
        return stream

    def _run(self, func: str, stream: Any, body: Callable[[], str]) -> None:
        """Run ``body`` (which enqueues or does the work and returns the path taken) on ``stream``."""
        if self.ch.closed:
            raise MoriStateError(f"{func}: the collective was closed")
        if self._async is not None and not self._async.waited:
            raise MoriStateError(f"{func}: an async call is in progress; wait_async() first")
        s = self._stream(func, stream)
        with self._lock:
            if s is None:
                self.last_path = body()
            else:
                with torch.cuda.stream(s):
                    self.last_path = body()

    def _start_async(self, func: str, stream: Any, body: Callable[[], str]) -> None:
        if self.ch.closed:
            raise MoriStateError(f"{func}: the collective was closed")
        if self._async is not None and not self._async.waited:
            raise MoriStateError(f"{func}: an async call is already in progress; wait_async() first")
        self._async = _Async(self, func, self._stream(func, stream), body)

    def is_async_in_progress(self) -> bool:
        """Whether an async call was started and not waited for."""
        return self._async is not None and not self._async.waited

    def wait_async(self, stream: Any = None) -> bool:
        """Finish the async call (see the module docstring). Returns True; False if none was started."""
        func = f"{self.NAME}.wait_async"
        if self._async is None or self._async.waited:
            return False
        a = self._async
        a.wait(self._stream(func, stream))
        return True

    def reset_flags(self) -> None:
        """Collective: zero the protocol's epochs on every rank (after a rank was restarted, say).
        Not needed between calls: the epochs never need a reset."""
        if self.is_async_in_progress():
            raise MoriStateError(f"{self.NAME}.reset_flags: an async call is in progress")
        self.ch.reset()

    def close(self) -> None:
        """Free the staging. Collective (every rank closes, in the same order as other collective
        calls); the context manager's exit does it."""
        if self.is_async_in_progress():
            self.wait_async()
        self.ch.close()

    def __enter__(self) -> Collective:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- tracing (mori.viz) ----------------------------------------------------------------------

    def enable_tracing(self, buffer: Any = None, *, capacity: int = 4096, n_rings: int | None = None) -> Any:
        """Record the protocol phases of every following kernel launch of this collective (their
        traced variants) into ``buffer`` (a :class:`mori.viz.TraceBuffer` on the communicator's
        device), or a new one of ``n_rings`` rings (default: the programs per launch) of
        ``capacity`` events; return it. Read it with ``mori.viz.capture([buf])`` when the device
        is idle. Not collective. Only the Triton kernels record: raises
        :class:`~mori.core.errors.MoriStateError` on the host path (``impl='host'``).
        """
        func = f"{self.NAME}.enable_tracing"
        if self.impl != "triton":
            raise MoriStateError(
                f"{func}: this collective runs the host path (impl={self.impl!r}); tracing records the "
                "Triton kernels (impl='triton', or a GPU communicator)"
            )
        from mori.viz import TraceBuffer

        if buffer is None:
            rings = self.ch.programs if n_rings is None else n_rings
            buffer = TraceBuffer(rings, capacity, device=self.device, rank=self.my_pe, name=self.NAME)
        elif not isinstance(buffer, TraceBuffer) or buffer.device != self.device:
            raise bad_type(func, "buffer", buffer, f"None or a mori.viz.TraceBuffer on {self.device}")
        self._trace_buffer = buffer
        return buffer

    def disable_tracing(self) -> None:
        """Launch the untraced kernels again (the buffer of :meth:`enable_tracing` stays readable)."""
        self._trace_buffer = None

    @property
    def trace_buffer(self) -> Any:
        """The :class:`mori.viz.TraceBuffer` the kernels record into, or None (tracing off)."""
        return self._trace_buffer

    def _trace(self) -> dict[str, Any]:
        # launch arguments of the traced variant; none (the defaults: untraced) when off
        buf = self._trace_buffer
        return {} if buf is None else {"trace_ptr": buf.tensor, "TRACE": True}

    # -- kernel launch helpers ----------------------------------------------------------------------

    def _per_program(self, elems: int) -> int:
        """Elements of one program's slice: a multiple of BLOCK covering ``elems`` in P slices."""
        block = int(self.kernels.BLOCK)
        return max(block, -(-elems // (self.ch.programs * block)) * block)

    def _stage(self, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's staging bytes ``[offset, offset+nbytes)`` viewed as ``dtype`` (a kernel pointer)."""
        return self.ch.view(self.ch.rank, offset, max(nbytes, dtype.itemsize)).view(dtype)

    def _sync(self, phase: int) -> None:
        k = self.kernels
        grid = (self.ch.programs,) if phase == k.PHASE_READY else (1,)
        k.sync_kernel[grid](
            self.ch.devcomm.tensor, self.ch.ticket, self.ch.programs, PHASE=phase, num_warps=1
        )


class _Async:
    """One async call: a side stream and an event (GPU) or a worker thread (CPU)."""

    def __init__(self, owner: Collective, func: str, stream: Any, body: Callable[[], str]) -> None:
        self.waited = False
        self.error: BaseException | None = None
        self._owner = owner
        if stream is None:
            self._thread = threading.Thread(
                target=self._work, args=(body,), name=f"mori-ccl-{func}", daemon=True
            )
            self._thread.start()
            self._event = None
        else:
            side = torch.cuda.Stream(device=owner.device)  # type: ignore[no-untyped-call]
            side.wait_stream(stream)
            with owner._lock, torch.cuda.stream(side):
                owner.last_path = body()
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record(side)
            self._side = side

    def _work(self, body: Callable[[], str]) -> None:
        try:
            with self._owner._lock:
                self._owner.last_path = body()
        except BaseException as e:  # re-raised by wait()
            self.error = e

    def wait(self, stream: Any) -> None:
        self.waited = True
        if self._event is None:
            self._thread.join()
            if self.error is not None:
                raise self.error
        else:
            stream.wait_event(self._event)
