"""torch views of symmetric memory on self and on peers."""

from __future__ import annotations

import pytest

import mori.shmem as shmem
from mori.core.errors import MoriTypeError, MoriValueError
from mori.testing import shmem_ranks


def _tensors(rank: int, nranks: int) -> None:
    import torch

    t = shmem.mori_shmem_create_tensor((4, 8), torch.float32)
    assert t.shape == (4, 8) and t.dtype == torch.float32 and t.device.type == "cpu"
    assert getattr(t, "__symm_tensor__", False)
    t.fill_(float(rank))
    shmem.shmem_barrier_all()
    for peer in range(nranks):
        view = shmem.symm_mori_shmem_tensor(t, peer)
        assert view.shape == t.shape and bool((view == peer).all())
    # a strided slice maps to the same slice on the peer
    right = (rank + 1) % nranks
    col = shmem.symm_mori_shmem_tensor(t[:, 3], right)
    assert col.stride() == (8,) and bool((col == right).all())
    shmem.shmem_barrier_all()
    # writing into a peer's view is a store into the peer's memory
    shmem.symm_mori_shmem_tensor(t, right)[rank % 4, 0] = 100.0 + rank
    shmem.shmem_barrier_all()
    left = (rank - 1) % nranks
    assert float(t[left % 4, 0]) == 100.0 + left
    views = shmem.mori_shmem_create_tensor_list_intra_node(16, torch.int64)
    assert len(views) == nranks
    views[rank].fill_(rank)
    shmem.shmem_barrier_all()
    assert [int(v[0]) for v in views] == list(range(nranks))
    # raw-address view on a peer
    raw = shmem.shmem_tensor_view(views[rank].data_ptr(), (2, 8), torch.int64, pe=right)
    assert bool((raw == right).all())
    with pytest.raises(MoriTypeError, match="dtype"):
        shmem.mori_shmem_create_tensor(4, "float32")  # type: ignore[arg-type]
    with pytest.raises(MoriValueError, match="shape"):
        shmem.mori_shmem_create_tensor((2, -1), torch.float32)
    with pytest.raises(MoriValueError, match="not made by mori_shmem_create_tensor"):
        shmem.mori_shmem_free_tensor(torch.zeros(3))
    with pytest.raises(MoriValueError, match="not inside the symmetric heap"):
        shmem.symm_mori_shmem_tensor(torch.zeros(3), right)
    shmem.shmem_barrier_all()
    shmem.mori_shmem_free_tensor(views[rank])
    shmem.mori_shmem_free_tensor(t)


@pytest.mark.parametrize("nranks", [2, 4])
def test_tensor_views_on_self_and_peers(nranks: int) -> None:
    shmem_ranks(_tensors, nranks)
