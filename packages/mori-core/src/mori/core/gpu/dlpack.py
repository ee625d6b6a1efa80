"""Zero-copy torch tensors over raw addresses, through a DLPack capsule built with ctypes.

Why not ``__cuda_array_interface__``: torch places such a tensor on the device that
``cudaPointerGetAttributes``/``hipPointerGetAttributes`` reports for the pointer, which for a peer
GPU's memory mapped with IPC is the *peer's* device; asking for this rank's device then copies. A
DLPack tensor names its device explicitly and torch trusts it (``at::fromDLPack`` passes the device
to ``from_blob``; a ROCm build of torch takes ``kDLROCM`` as its ``cuda`` device type), so a view of
a peer's heap is a tensor on this rank's GPU that reads and writes the peer's memory over NVLink or
xGMI, which is what kernels on this GPU need. The device type code is the caller's (``KDL_*``).

The managed tensor and its shape array live in ``_alive`` until torch calls the deleter (with the
GIL held) when the tensor's storage goes away.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_int32, c_int64, c_uint8, c_uint16, c_uint64, c_void_p
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: DLPack device types
KDL_CPU = 1
KDL_CUDA = 2
KDL_ROCM = 10
_KDL_UINT = 1


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", c_void_p),
        ("device", _DLDevice),
        ("ndim", c_int32),
        ("dtype", _DLDataType),
        ("shape", POINTER(c_int64)),
        ("strides", POINTER(c_int64)),
        ("byte_offset", c_uint64),
    ]


_Deleter = ctypes.CFUNCTYPE(None, c_void_p)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", c_void_p), ("deleter", _Deleter)]


_alive: dict[int, tuple[_DLManagedTensor, Any]] = {}


def _release(address: int | None) -> None:
    try:
        if address is not None:
            _alive.pop(address, None)
    except Exception:  # pragma: no cover - interpreter shutdown: module globals may be gone
        pass


_DELETER = _Deleter(_release)
_CAPSULE_NAME = b"dltensor"
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [c_void_p, ctypes.c_char_p, c_void_p]


def byte_view(addr: int, nbytes: int, device_type: int, device_id: int) -> torch.Tensor:
    """A contiguous uint8 tensor of ``nbytes`` at ``addr`` on the DLPack device
    ``(device_type, device_id)``, sharing the memory (no copy). The memory must outlive the tensor.
    ``device_id`` is ignored for :data:`KDL_CPU` (the host is one device, 0)."""
    import torch

    if nbytes == 0:
        device = "cpu" if device_type == KDL_CPU else f"cuda:{device_id}"
        return torch.empty(0, dtype=torch.uint8, device=device)
    shape = (c_int64 * 1)(nbytes)
    managed = _DLManagedTensor()
    t = managed.dl_tensor
    t.data = addr
    t.device = _DLDevice(device_type, 0 if device_type == KDL_CPU else device_id)
    t.ndim = 1
    t.dtype = _DLDataType(_KDL_UINT, 8, 1)
    t.shape = ctypes.cast(shape, POINTER(c_int64))
    t.strides = None
    t.byte_offset = 0
    managed.manager_ctx = None
    managed.deleter = _DELETER
    key = ctypes.addressof(managed)
    _alive[key] = (managed, shape)
    try:
        capsule = _capsule_new(key, _CAPSULE_NAME, None)
        return torch.utils.dlpack.from_dlpack(capsule)
    except BaseException:
        _alive.pop(key, None)
        raise
