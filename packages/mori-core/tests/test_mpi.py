"""MPI bootstrap (mpi4py): ``shmem_mpi_init`` and ``shmem_init_attr(MORI_SHMEM_INIT_WITH_MPI_COMM, ...)``."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mori.shmem as shmem
from mori.core.errors import MoriError

_SCRIPT = """
import sys
import torch
from mpi4py import MPI
import mori.shmem as shmem
from mori.core.errors import MoriValueError

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
for round in range(2):
    if round == 0:
        shmem.shmem_mpi_init()
    else:
        try:
            shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_MPI_COMM, (rank + 1) % size, size, comm)
            raise SystemExit("a wrong rank for the communicator was accepted")
        except MoriValueError as e:
            assert "rank/nranks" in str(e), e
        shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_MPI_COMM, rank, size, comm)
    assert (shmem.shmem_mype(), shmem.shmem_npes()) == (rank, size)
    buf = shmem.shmem_malloc(64)
    sig = shmem.shmem_malloc(8)
    shmem.shmem_tensor_view(buf, 8, torch.int64).fill_(rank)
    shmem.shmem_barrier_all()
    right = (rank + 1) % size
    shmem.shmem_putmem_signal(buf + 32, buf, 32, sig, 1, shmem.SIGNAL_SET, right)
    shmem.shmem_wait_until(sig, shmem.SHMEM_CMP_EQ, 1, dtype="uint64", timeout=30)
    got = shmem.shmem_tensor_view(buf + 32, 4, torch.int64)
    assert bool((got == (rank - 1) % size).all()), got
    shmem.shmem_finalize()
print(f"rank {rank} ok", flush=True)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("nranks", [2, 4])
def test_mpi_bootstrap(nranks: int, tmp_path: Path) -> None:
    mpirun = shutil.which("mpirun")
    if mpirun is None or importlib.util.find_spec("mpi4py") is None:
        pytest.skip(
            "needs mpirun on PATH and mpi4py installed (apt install openmpi-bin libopenmpi-dev; pip install mpi4py)"
        )
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    env = {
        **os.environ,
        "MORI_SHMEM_HEAP_SIZE": "8M",
        "MORI_BOOTSTRAP_TIMEOUT": "30",
        # CI runs as root; Open MPI refuses that unless told, and must not look for more slots than cores
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
        "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
    }
    out = subprocess.run(
        [mpirun, "-n", str(nranks), sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # mpirun may interleave the ranks' lines, so look for the words, not the lines
    assert sorted(int(r) for r in re.findall(r"rank (\d+) ok", out.stdout)) == list(range(nranks))


def test_mpi_bootstrap_without_mpi4py_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes `import mpi4py` fail
    with pytest.raises(MoriError, match="pip install mpi4py"):
        shmem.shmem_mpi_init()
    assert not shmem.shmem_is_initialized()
