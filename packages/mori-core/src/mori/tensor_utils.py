"""mori.tensor_utils: tensors over memory named by a raw address, without copies (the original's
module of this name).

* :func:`from_gpu_ptr` ``(ptr, shape, dtype)``: a torch tensor (or a JAX array) that *is* the memory
  at ``ptr``, on the current GPU, or on the CPU where there is no GPU (a host address then) or
  ``device="cpu"`` is asked for;
* :class:`GpuTensorView` / :func:`gpu_tensor_view`: the same memory as an object any framework takes
  through DLPack (``torch.from_dlpack(view)``, ``jax.dlpack.from_dlpack(view)``), and through
  ``__cuda_array_interface__`` for GPU memory;
* :func:`dtype_to_int`: the original's integer codes of the dtypes its kernels take.

The tensor names its device explicitly (DLPack), so a peer GPU's memory mapped into this process is
a tensor on *this* process's GPU. Nothing is owned: the memory must outlive the tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mori.core.errors import MoriValueError, bad_type, bad_value
from mori.core.gpu import dlpack

if TYPE_CHECKING:
    import torch

__all__ = ["GpuTensorView", "dtype_to_int", "from_gpu_ptr", "gpu_tensor_view"]

#: the original's dtype codes (its kernels' dtype argument), by torch dtype name
_DTYPE_CODES = {
    "float32": 0,
    "bfloat16": 1,
    "float8_e4m3fn": 2,
    "float8_e4m3fnuz": 3,
    "int32": 4,
    "float4_e2m1fn_x2": 5,
}


def dtype_to_int(dtype: torch.dtype) -> int:
    """The original's integer code of ``dtype``: float32 0, bfloat16 1, float8_e4m3fn 2,
    float8_e4m3fnuz 3, int32 4, float4_e2m1fn_x2 5 (where torch has it)."""
    import torch

    if not isinstance(dtype, torch.dtype):
        raise bad_type("dtype_to_int", "dtype", dtype, "a torch.dtype")
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_CODES:
        raise bad_value(
            "dtype_to_int", "dtype", dtype, f"one of {', '.join('torch.' + n for n in _DTYPE_CODES)}"
        )
    return _DTYPE_CODES[name]


def _device(func: str, device: Any) -> tuple[str, int]:
    """``("cpu", 0)`` or ``("cuda", index)``: the device a view lives on (None: the current GPU, or the
    CPU if torch sees no GPU)."""
    import torch

    if device is None:
        if torch.cuda.is_available():
            return "cuda", int(torch.cuda.current_device())
        return "cpu", 0
    if isinstance(device, int) and not isinstance(device, bool):
        device = torch.device("cuda", device)
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError):
        raise bad_value(
            func, "device", device, "None, 'cpu', 'cuda', 'cuda:N', an int or a torch.device"
        ) from None
    if dev.type == "cpu":
        return "cpu", 0
    if dev.type != "cuda":
        raise bad_value(func, "device", device, "a CPU or GPU ('cuda', which is ROCm's name too) device")
    if not torch.cuda.is_available():
        raise MoriValueError(
            f"{func}: device={device!r} is a GPU, but torch sees none (torch.cuda.is_available() is False)"
        )
    return "cuda", int(torch.cuda.current_device() if dev.index is None else dev.index)


def _dlpack_device(kind: str, index: int) -> tuple[int, int]:
    import torch

    if kind == "cpu":
        return dlpack.KDL_CPU, 0
    return (dlpack.KDL_ROCM if getattr(torch.version, "hip", None) else dlpack.KDL_CUDA), index


def _check(func: str, ptr: Any, shape: Any, dtype: Any) -> tuple[int, tuple[int, ...], torch.dtype]:
    import torch

    if isinstance(ptr, bool) or not isinstance(ptr, int):
        raise bad_type(func, "ptr", ptr, "an int (a raw address, e.g. tensor.data_ptr())")
    dims = (shape,) if isinstance(shape, int) else tuple(shape) if isinstance(shape, Sequence) else None
    if dims is None or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise bad_value(func, "shape", shape, "an int or a sequence of ints >= 0")
    if not isinstance(dtype, torch.dtype):
        raise bad_type(func, "dtype", dtype, "a torch.dtype")
    if ptr < 0 or ptr >= 2**64:
        raise bad_value(func, "ptr", ptr, "an address in [0, 2**64)")
    if ptr == 0 and math.prod(dims) > 0:
        raise bad_value(func, "ptr", ptr, "a non-null address for a non-empty tensor")
    return ptr, dims, dtype


def _tensor(ptr: int, dims: tuple[int, ...], dtype: torch.dtype, kind: str, index: int) -> torch.Tensor:
    nbytes = math.prod(dims) * dtype.itemsize
    raw = dlpack.byte_view(ptr, nbytes, *_dlpack_device(kind, index))
    return raw.view(dtype).view(dims)


def from_gpu_ptr(
    ptr: int, shape: int | Sequence[int], dtype: torch.dtype, framework: str = "torch", *, device: Any = None
) -> Any:
    """The memory at ``ptr`` as a ``shape`` tensor of ``dtype`` (contiguous, no copy).

    ``framework``: ``"torch"`` (a ``torch.Tensor``) or ``"jax"`` (a ``jax.Array`` through DLPack;
    needs a JAX build for the device). ``device``: None for the current GPU (the CPU when torch sees
    none), or ``"cpu"``, ``"cuda:N"``, an index. Any dtype torch has works (bf16, fp8, fp4x2, ...).
    """
    func = "from_gpu_ptr"
    ptr, dims, dtype = _check(func, ptr, shape, dtype)
    if framework not in ("torch", "jax"):
        raise bad_value(func, "framework", framework, "'torch' or 'jax'")
    kind, index = _device(func, device)
    if framework == "torch":
        return _tensor(ptr, dims, dtype, kind, index)
    try:
        import jax.dlpack
    except ImportError as e:
        raise ImportError(
            f"{func}: framework='jax' needs JAX (pip install jax, with the build for your GPU)"
        ) from e
    return jax.dlpack.from_dlpack(GpuTensorView(ptr, dims, dtype, device=f"{kind}:{index}"))


class GpuTensorView:
    """A view of ``shape`` x ``dtype`` at ``ptr`` that frameworks take without a copy: DLPack
    (``__dlpack__`` / ``__dlpack_device__``) and, for GPU memory, ``__cuda_array_interface__``
    (version 3). It owns nothing: the memory must outlive whatever is made from it."""

    def __init__(
        self, ptr: int, shape: int | Sequence[int], dtype: torch.dtype, *, device: Any = None
    ) -> None:
        func = "GpuTensorView"
        self.ptr, self.shape, self.dtype = _check(func, ptr, shape, dtype)
        self._kind, self._index = _device(func, device)

    def __repr__(self) -> str:
        return (
            f"GpuTensorView(ptr={self.ptr:#x}, shape={self.shape}, dtype={self.dtype}, device={self.device})"
        )

    @property
    def device(self) -> str:
        return "cpu" if self._kind == "cpu" else f"cuda:{self._index}"

    def to_torch(self) -> torch.Tensor:
        """The view as a torch tensor (no copy)."""
        return _tensor(self.ptr, self.shape, self.dtype, self._kind, self._index)

    def __dlpack__(self, *, stream: Any = None, **kwargs: Any) -> Any:
        # the torch tensor's capsule keeps that tensor (and so our DLPack record) alive
        return self.to_torch().__dlpack__(stream=stream, **kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return _dlpack_device(self._kind, self._index)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        if self._kind == "cpu":
            raise AttributeError("__cuda_array_interface__ describes GPU memory; this view is on the CPU")
        return {
            "data": (self.ptr, False),
            "shape": self.shape,
            "typestr": _typestr(self.dtype),
            "strides": None,
            "version": 3,
        }


def _typestr(dtype: torch.dtype) -> str:
    # the array-interface type of a torch dtype; numpy has no bf16 / fp8 / fp4: those travel as
    # unsigned integers of their size, as the original does
    import torch

    size = dtype.itemsize
    if dtype == torch.bool:
        return "|b1"
    if dtype in (torch.float16, torch.float32, torch.float64):
        return f"<f{size}"
    if dtype in (torch.complex64, torch.complex128):
        return f"<c{size}"
    if not dtype.is_floating_point and not dtype.is_complex and dtype.is_signed:
        return f"|i{size}" if size == 1 else f"<i{size}"
    return f"|u{size}" if size == 1 else f"<u{size}"


def gpu_tensor_view(
    ptr: int, shape: int | Sequence[int], dtype: torch.dtype, device_id: int = 0
) -> GpuTensorView:
    """:class:`GpuTensorView` of GPU ``device_id`` (the original's signature)."""
    if isinstance(device_id, bool) or not isinstance(device_id, int) or device_id < 0:
        raise bad_value("gpu_tensor_view", "device_id", device_id, "a GPU index >= 0")
    return GpuTensorView(ptr, shape, dtype, device=device_id)
