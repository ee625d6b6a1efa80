"""Vendor-neutral GPU device support that the GPU device plugins (CUDA, HIP) build on: the driver
protocol and ctypes plumbing (:mod:`.driver`), the runtime (:mod:`.runtime`), the copy engine (:mod:`.copy_engine`), segment handles (:mod:`.handles`),
DLPack views (:mod:`.dlpack`), the host-atomic Triton kernel (:mod:`.atomics`) and the same-node
load/store transport (:mod:`.transport`).

Importing it (or any module here but :mod:`.atomics`, which needs Triton) loads no driver, torch or
Triton; a plugin supplies the driver binding.
"""
