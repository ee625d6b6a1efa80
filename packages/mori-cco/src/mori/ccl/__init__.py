"""mori.ccl: collectives on symmetric memory, with the original's classes and call shapes.

Each collective is an object made once per rank (collective) and called per step:

* :class:`AllgatherSdma` (``__call__(inp, out, count_per_pe, stream)``, async, the FSDP
  parameter-contiguous layout), :class:`All2allSdma`, :class:`AllreduceSdma` (uint32, int32,
  float32, float16, bfloat16; one-shot up to 1 MiB, reduce-scatter + all-gather above;
  ``allreduce_inplace``; async; CUDA-graph capturable on GPUs);
* :class:`AllGatherIntoTensor` (``torch.distributed.all_gather_into_tensor`` semantics) with
  :class:`DataType` and :func:`size_of`;
* :class:`HierAllGather` (intra-node copies + inter-node ring) and its pure-Python specification
  :func:`hier_allgather_reference`;
* :mod:`mori.ccl.torch_ops`: the same as ``torch.distributed``-style calls and torch custom ops.

The original's call shape needs mori.shmem initialised (``AllgatherSdma(my_pe, npes, ...)``); pass
``comm=`` (a :class:`mori.cco.Communicator`) to run on a communicator instead. The ``cpu`` runtime
runs every collective with vectorised torch operations on shared memory; GPUs run Triton kernels
and copy-engine copies (:mod:`mori.ccl.base`, ``last_path`` says which ran). "Sdma" is the
original's name for its copy-engine paths; the names are kept.
"""

from mori.ccl import torch_ops  # registers torch.ops.mori_ccl
from mori.ccl.allgather import All2allSdma, AllgatherSdma
from mori.ccl.allreduce import AllreduceSdma
from mori.ccl.gather_into_tensor import AllGatherIntoTensor, DataType, size_of
from mori.ccl.hier import HierAllGather, hier_allgather_reference

__all__ = [
    "All2allSdma",
    "AllGatherIntoTensor",
    "AllgatherSdma",
    "AllreduceSdma",
    "DataType",
    "HierAllGather",
    "hier_allgather_reference",
    "size_of",
    "torch_ops",
]
