"""Small helpers of the mori-umbp tests: byte buffers with addresses, client factories."""

from __future__ import annotations

import ctypes
import os

import mori.umbp as umbp


class Buf:
    """``n`` bytes of ctypes memory: ``.ptr``, ``.fill(byte)``, ``.bytes()``."""

    def __init__(self, n: int, data: bytes | None = None) -> None:
        self.n = n
        self.raw = (ctypes.c_ubyte * n)()
        self.ptr = ctypes.addressof(self.raw)
        if data is not None:
            ctypes.memmove(self.ptr, data, n)

    def fill(self, value: int) -> Buf:
        ctypes.memset(self.ptr, value, self.n)
        return self

    def bytes(self) -> bytes:
        return ctypes.string_at(self.ptr, self.n)


def rand_buf(n: int) -> Buf:
    return Buf(n, os.urandom(n))


def local_config(
    dram: int = 4 << 20, ssd_dir: object = None, ssd_capacity: int = 16 << 20
) -> umbp.UMBPConfig:
    cfg = umbp.UMBPConfig()
    cfg.dram.capacity_bytes = dram
    cfg.ssd.enabled = ssd_dir is not None
    if ssd_dir is not None:
        cfg.ssd.storage_dir = str(ssd_dir)
        cfg.ssd.capacity_bytes = ssd_capacity
    return cfg
