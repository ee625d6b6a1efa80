"""mori.core.topology's hardware layout: GPUs, NICs, NUMA and PCIe paths on fake sysfs trees of real
machine shapes, GPU-to-NIC matching, MORI_DISABLE_TOPO, and opt-in CPU affinity."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mori.core import nic, topology
from mori.core.errors import MoriValueError
from mori.testing.fake_sysfs import AMD, CLASS_ETH, INTEL, eight_gpus_eight_nics, no_nic

MLX5 = nic.NicVendor(
    name="t-mlx5",
    family="mlx5",
    description="",
    drivers=("mlx5_core",),
    pci_vendors=(0x15B3,),
    name_prefixes=("mlx5_",),
    libraries=("libmlx5",),
)


def test_eight_gpus_eight_nics_two_numa_nodes(tmp_path: Path) -> None:
    eight_gpus_eight_nics(tmp_path)
    t = topology.scan(tmp_path)
    assert len(t.gpus) == 8 and [g.vendor for g in t.gpus] == ["nvidia"] * 8
    assert [g.pci.numa_node for g in t.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert t.gpus[0].pci.root_complex == "pci0000:00" and t.gpus[7].pci.root_complex == "pci0000:80"
    assert t.gpus[0].pci.bridges == ("0000:00:01.0", "0000:01:00.0", "0000:02:00.0")
    assert sorted(t.numa_cpus) == [0, 1] and t.numa_cpus[1] == frozenset([*range(8, 16), *range(24, 32)])
    assert len(t.rdma_devices) == 8
    # switches, bridges, root ports are not GPUs; neither are the NICs
    assert all(g.pci.pci_class >> 16 == 0x03 for g in t.gpus)


def test_amd_accelerators_are_gpus(tmp_path: Path) -> None:
    eight_gpus_eight_nics(tmp_path, gpu_vendor=AMD)
    t = topology.scan(tmp_path)
    assert len(t.gpus) == 8 and {g.vendor for g in t.gpus} == {"amd"}


def test_pcie_path_kinds(tmp_path: Path) -> None:
    eight_gpus_eight_nics(tmp_path)
    t = topology.scan(tmp_path)
    by = {p.device.name: p.pci for p in t.ports()}
    g0 = t.gpus[0].pci
    assert by["mlx5_0"] is not None and by["mlx5_2"] is not None and by["mlx5_7"] is not None
    assert topology.pcie_path(g0, by["mlx5_0"]) == ("PIX", 2)  # same switch
    assert topology.pcie_path(g0, by["mlx5_2"])[0] == "PHB"  # another switch, same root complex
    assert topology.pcie_path(g0, by["mlx5_7"])[0] == "SYS"  # the other NUMA node


def test_each_gpu_gets_its_own_closest_nic(tmp_path: Path) -> None:
    eight_gpus_eight_nics(tmp_path)
    t = topology.scan(tmp_path)
    first = [t.match_gpu_nics(g.index)[0].name for g in t.gpus]
    assert first == [f"mlx5_{i}:1" for i in range(8)]  # GPU i and NIC i share a switch, dealt 1:1
    # k NICs: the switch's two first, then the same NUMA node, never the other node before it
    four = [p.name for p in t.match_gpu_nics(1, k=4)]
    assert four[:2] == ["mlx5_1:1", "mlx5_0:1"] and set(four[2:]) == {"mlx5_2:1", "mlx5_3:1"}
    assert len(t.match_gpu_nics(0, k=100)) == 8
    assert t.match_gpu_nics("0000:04:00.0")[0].name == "mlx5_1:1"  # by PCI address


def test_numa_nics_for_host_memory(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    eight_gpus_eight_nics(tmp_path, inactive=(5,))
    t = topology.scan(tmp_path)
    assert [p.name for p in t.match_numa_nics(1, k=3)] == ["mlx5_4:1", "mlx5_6:1", "mlx5_7:1"]
    assert [p.name for p in t.match_numa_nics(1, k=5)][3:] == ["mlx5_0:1", "mlx5_1:1"]  # then the other node
    with pytest.raises(
        MoriValueError, match=r"numa_node=3 is not allowed; expected a NUMA node of this machine \[0, 1\]"
    ):
        t.match_numa_nics(3)
    clean_env.setenv("MORI_DISABLE_TOPO", "1")
    assert [p.name for p in t.match_numa_nics(1, k=2)] == ["mlx5_1:1", "mlx5_2:1"]


def test_inactive_ports_are_skipped(tmp_path: Path) -> None:
    eight_gpus_eight_nics(tmp_path, inactive=(3, 4, 5))
    t = topology.scan(tmp_path)
    names = [p.name for p in t.ports()]
    assert "mlx5_3:1" not in names and len(names) == 5
    assert t.match_gpu_nics(3)[0].name == "mlx5_2:1"  # its switch neighbour
    # GPUs 4 and 5 lost both NICs of their switch: the next switch of their NUMA node
    assert {t.match_gpu_nics(4)[0].name, t.match_gpu_nics(5)[0].name} <= {"mlx5_6:1", "mlx5_7:1"}
    assert t.match_gpu_nics(4)[0].pci is not None and t.match_gpu_nics(4)[0].pci.numa_node == 1


def test_machine_without_nics(tmp_path: Path) -> None:
    no_nic(tmp_path)
    t = topology.scan(tmp_path)
    assert len(t.gpus) == 2 and t.rdma_devices == () and t.ports() == []
    assert t.match_gpu_nics(0) == [] and t.match_gpu_nics(1, k=4) == []
    assert t.cpus_of_gpu(1) == frozenset(range(4))


def test_unknown_vendor_nic_is_left_to_no_plugin(tmp_path: Path) -> None:
    fs = eight_gpus_eight_nics(tmp_path)
    fs.pci(
        "0000:09:00.0", parent="0000:00:01.0", vendor=INTEL, device=0x1593, pci_class=CLASS_ETH, driver="ice"
    )
    fs.rdma("irdma0", "0000:09:00.0")
    t = topology.scan(tmp_path)
    assert "irdma0:1" in [p.name for p in t.ports()]  # no vendor filter: every RDMA device
    assert "irdma0:1" not in [p.name for p in t.ports(vendors=[MLX5])]
    assert all(p.device.name.startswith("mlx5_") for p in t.match_gpu_nics(0, k=9, vendors=[MLX5]))


def test_disable_topo_is_round_robin(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    eight_gpus_eight_nics(tmp_path, inactive=(0,))
    clean_env.setenv("MORI_DISABLE_TOPO", "1")
    t = topology.scan(tmp_path)
    active = [p.name for p in t.ports()]
    assert len(active) == 7
    assert [t.match_gpu_nics(g.index)[0].name for g in t.gpus] == [active[i % 7] for i in range(8)]
    assert [p.name for p in t.match_gpu_nics(6, k=3)] == [active[6], active[0], active[1]]


def test_rdma_devices_filter_applies(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    eight_gpus_eight_nics(tmp_path)
    clean_env.setenv("MORI_RDMA_DEVICES", "^mlx5_0,mlx5_1")
    t = topology.scan(tmp_path)
    assert t.match_gpu_nics(0)[0].name not in ("mlx5_0:1", "mlx5_1:1")
    assert t.match_gpu_nics(0)[0].pci is not None and t.match_gpu_nics(0)[0].pci.numa_node == 0
    assert [p.name for p in t.ports(devices="mlx5_5")] == ["mlx5_5:1"]


def test_bad_arguments_name_what_is_allowed(tmp_path: Path) -> None:
    no_nic(tmp_path)
    t = topology.scan(tmp_path)
    with pytest.raises(MoriValueError, match=r"gpu=7 is not allowed; expected a GPU index or PCI address"):
        t.match_gpu_nics(7)
    with pytest.raises(MoriValueError, match=r"k=0 is not allowed; expected a whole number >= 1"):
        t.match_gpu_nics(0, k=0)


def test_cpulist_parsing() -> None:
    assert topology.parse_cpulist("0-3,8,10-11\n") == frozenset({0, 1, 2, 3, 8, 10, 11})
    assert topology.parse_cpulist("") == frozenset()


def test_cpu_affinity_only_when_asked(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    fs = no_nic(tmp_path)
    del fs
    t = topology.scan(tmp_path)
    before = os.sched_getaffinity(0)
    assert topology.bind_thread_to_gpu(0, t) is None  # default: nothing changes
    assert os.sched_getaffinity(0) == before
    clean_env.setenv("MORI_CPU_AFFINITY", "numa")
    import threading

    seen: dict[str, object] = {}

    def worker() -> None:  # a thread of its own: the test process keeps its affinity
        seen["bound"] = topology.bind_thread_to_gpu(0, t)
        seen["mask"] = os.sched_getaffinity(0)

    th = threading.Thread(target=worker)
    th.start()
    th.join()
    want = frozenset(range(4)) & before
    assert seen["bound"] == (want or None)
    if want:
        assert seen["mask"] == set(want)
    assert os.sched_getaffinity(0) == before
