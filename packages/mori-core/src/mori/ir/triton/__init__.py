"""mori.ir.triton: the original's device functions for ``@triton.jit`` kernels, and its set-up calls.

::

    import mori.shmem as ms
    from mori.ir import triton as mori_shmem_device
    from mori.ir.triton import get_extern_libs, install_hook

    ms.shmem_torch_process_group_init("default")
    install_hook()

    @triton.jit
    def kernel(buf_ptr, nbytes):
        peer = (mori_shmem_device.my_pe() + 1) % mori_shmem_device.n_pes()
        mori_shmem_device.putmem_nbi_block(buf_ptr, buf_ptr, nbytes, peer, 0)
        mori_shmem_device.quiet_thread()

    kernel[(1,)](buf, buf.numel() * buf.element_size(), extern_libs=get_extern_libs())

The device functions (:mod:`mori.ir.triton.ops`, all re-exported here) are ``@triton.jit``
functions over :mod:`mori.shmem.device`, not calls into bitcode; their conventions (pointers as
``uint64`` or Triton pointers, ``int32`` status returns, what scope and ``qp`` mean in Triton) are
in :mod:`mori.ir.triton.ops`. :func:`get_extern_libs` and :func:`install_hook`
(:mod:`mori.ir.triton.runtime`) are optional here. Shmem must be initialised before a kernel that
uses these functions is first compiled or run (:mod:`mori.ir.triton.context` says why).
"""

from __future__ import annotations

from mori.ir.ops import SIGNAL_ADD, SIGNAL_SET
from mori.ir.triton.ops import *  # noqa: F403  (the 89 device functions, listed in ops.__all__)
from mori.ir.triton.ops import __all__ as _device_functions
from mori.ir.triton.runtime import get_extern_libs, install_hook

__all__ = [*_device_functions, "SIGNAL_ADD", "SIGNAL_SET", "get_extern_libs", "install_hook"]
