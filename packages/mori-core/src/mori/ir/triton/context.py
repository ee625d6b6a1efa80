"""How kernels written for the original's IR reach this process's shmem context without an argument.

The original's device functions read a device global (``globalGpuStates``) that a post-compile hook
fills in. Triton has no device globals, and the functions of :mod:`mori.shmem.device` take the
context as an argument (``ctx_ptr``). A kernel written for the original calls ``my_pe()`` with no
argument at all, so here the context's **address is a compile-time constant**: the module global
:data:`CONTEXT` below, a ``tl.constexpr`` whose value is the address of this process's *IR context
buffer*, an int64 tensor ``[my_pe, n_pes, base_0, ..., base_{n_pes-1}, ring]`` (the layout of
:func:`mori.shmem.device.shmem_device_context`, zero past it, ``3 + MAX_PES`` words) on the heap's device.

The rules that make this safe:

* **One buffer per process, never moved.** It is made when a kernel that uses it is first compiled
  (or, under the interpreter, first run), on the device of the shmem heap, and lives until the
  process ends. The compiled code holds its address, so it must never move.
* **Refreshed, not replaced.** Triton checks a kernel's constexpr globals on every launch (it
  compares each with the copy it took when compiling, using ``!=``); :class:`IrContext` answers
  that check by making sure the buffer holds the *current* shmem context (it copies it again after
  ``shmem_finalize`` and a new ``shmem_init``), and raises :class:`~mori.core.errors.MoriStateError`
  if shmem is not initialised, instead of letting a kernel read a context that is gone. Under the
  interpreter every read of the constant does the same.
* **Per process in Triton's cache.** The constant's text in Triton's cache key is this process's id
  and a random nonce, fixed at import, so no process ever loads code compiled with another
  process's address (a shared ``TRITON_CACHE_DIR`` is safe). The price: kernels that use
  :mod:`mori.ir.triton` are compiled once per process and add entries to the cache each run, which
  :func:`mori.jit.precompile` cannot avoid (it skips them and says so).
* **Compiled without shmem, never launched.** Code compiled before shmem is initialised (for
  example by ``tools/compile_kernels.py``, which only proves that kernels compile) gets address 0;
  a process that did that can never launch such a kernel: the launch check raises.

The same device, one buffer: re-initialising shmem on another device in the same process raises.
"""

from __future__ import annotations

import os
import secrets
import threading
from typing import TYPE_CHECKING, Any

import triton.language as tl

from mori.core.errors import MoriStateError
from mori.shmem import layout

if TYPE_CHECKING:
    import torch

__all__ = ["CONTEXT", "IrContext"]

_UNBOUND, _PLACEHOLDER, _BOUND = "unbound", "placeholder", "bound"


class IrContext(tl.constexpr):  # type: ignore[misc]
    """The address of this process's IR context buffer, as a Triton constexpr (see the module doc).

    There is one instance, :data:`CONTEXT`. Its :attr:`value` binds the buffer on first use.
    """

    def __init__(self) -> None:
        # tl.constexpr.__init__ would store a value; ours is computed on use
        self.type = tl.constexpr_type(0)
        self._lock = threading.RLock()
        self._state = _UNBOUND
        self._buffer: torch.Tensor | None = None
        self._source: Any = None  # the shmem_device_context() tensor last copied into the buffer
        self._token = f"mori.ir context of process {os.getpid()}-{secrets.token_hex(8)}"
        self.interpreted = False  # set by mori.ir.triton.ops: its functions run under the interpreter

    # -- the value Triton bakes into the code ---------------------------------------------------

    @property
    def value(self) -> int:
        """The buffer's address; binds it on first use (see the module docstring)."""
        with self._lock:
            if self._state == _UNBOUND:
                if not _shmem_ready():
                    if self.interpreted:
                        raise _not_initialised("a kernel that uses mori.ir.triton ran")
                    self._state = _PLACEHOLDER  # compiled without shmem: never launchable here
                    return 0
                self._bind()
            elif self._state == _BOUND and self.interpreted:
                self.refresh()
            return 0 if self._buffer is None else int(self._buffer.data_ptr())

    @value.setter
    def value(self, _: object) -> None:  # tl.constexpr's methods never assign it; keep it read-only
        raise AttributeError("the mori.ir context address cannot be set")

    def _bind(self) -> None:
        import torch

        from mori.shmem.device import shmem_device_context

        source = shmem_device_context()
        buf = torch.zeros(3 + layout.MAX_PES, dtype=torch.int64, device=source.device)  # + the ring word
        buf[: source.numel()].copy_(source)
        self._buffer, self._source, self._state = buf, source, _BOUND

    def refresh(self) -> None:
        """Make the buffer hold the current shmem context (after a re-init); raise if there is none.

        Called by Triton's launch check (through ``!=``) and, under the interpreter, on every read.
        """
        with self._lock:
            if self._state == _UNBOUND:
                return
            if self._state == _PLACEHOLDER:
                raise MoriStateError(
                    "a kernel that uses mori.ir.triton was compiled in this process before mori.shmem was "
                    "initialised, so its code holds no context address and it cannot be launched here: "
                    "initialise shmem (shmem_torch_process_group_init, shmem_init_attr, ...) before the "
                    "first launch or warmup of such a kernel"
                )
            if not _shmem_ready():
                raise _not_initialised("a kernel that uses mori.ir.triton was launched")
            from mori.shmem.device import shmem_device_context

            source = shmem_device_context()
            if source is self._source:
                return
            assert self._buffer is not None
            if source.device != self._buffer.device:
                raise MoriStateError(
                    f"mori.shmem was re-initialised on {source.device}, but kernels that use mori.ir.triton "
                    f"in this process hold the address of a context on {self._buffer.device}: a process "
                    f"can use these kernels with one device only"
                )
            self._buffer.zero_()
            self._buffer[: source.numel()].copy_(source)
            self._source = source

    # -- what Triton does with a constexpr global ---------------------------------------------------

    def __repr__(self) -> str:
        # Triton's cache key holds this text (not the address): unique per process, known at import
        return f"constexpr[{self._token}]"

    def __deepcopy__(self, memo: dict[int, Any]) -> _Snapshot:
        # Triton keeps a deep copy of each global, compares the copies of a kernel and its callees
        # while it hashes them (no side effect wanted there), and compares the live global with the
        # copy at each launch (where this instance refreshes the buffer, see __ne__)
        return _Snapshot(self._token)

    def __ne__(self, other: object) -> bool:
        if isinstance(other, _Snapshot):  # Triton's launch check: has the global changed since compile?
            self.refresh()
            return other.token != self._token
        return other is not self

    def __eq__(self, other: object) -> bool:
        return not self.__ne__(other)

    def __hash__(self) -> int:
        return hash(self._token)


class _Snapshot(tl.constexpr):  # type: ignore[misc]
    """What Triton keeps of :data:`CONTEXT` when it compiles: its text, for the cache key and the
    launch check."""

    def __init__(self, token: str) -> None:
        super().__init__(0)
        self.token = token

    def __repr__(self) -> str:
        return f"constexpr[{self.token}]"

    def __ne__(self, other: object) -> bool:
        if isinstance(other, IrContext):
            return other.__ne__(self)
        return not (isinstance(other, _Snapshot) and other.token == self.token)

    def __eq__(self, other: object) -> bool:
        return not self.__ne__(other)

    def __hash__(self) -> int:
        return hash(self.token)


def _shmem_ready() -> bool:
    from mori.shmem import shmem_is_initialized

    return shmem_is_initialized()


def _not_initialised(what: str) -> MoriStateError:
    return MoriStateError(
        f"{what}, but mori.shmem is not initialised in this process: call shmem_torch_process_group_init, "
        f"shmem_init_attr or shmem_mpi_init first (and allocate the symmetric buffers the kernel uses)"
    )


#: the constexpr that every function of mori.ir.triton.ops reads the context address from
CONTEXT = IrContext()
