"""Fixtures for mori-io: pairs of engines in this process, connected both ways."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch

from mori.io import BackendType, IOEngine, IOEngineConfig, MemoryDesc, TcpBackendConfig


@dataclass
class Pair:
    """Initiator ``a`` and target ``b``, each with one registered CPU buffer."""

    a: IOEngine
    b: IOEngine
    src: torch.Tensor
    dst: torch.Tensor
    src_desc: MemoryDesc
    dst_desc: MemoryDesc


def make_engine(key: str, cfg: TcpBackendConfig | None = None) -> IOEngine:
    engine = IOEngine(key, IOEngineConfig("127.0.0.1", 0))
    engine.create_backend(BackendType.TCP, cfg or TcpBackendConfig())
    return engine


def connect(*engines: IOEngine) -> None:
    for e in engines:
        for other in engines:
            if other is not e:
                e.register_remote_engine(other.get_engine_desc())


@pytest.fixture(params=["socket", "cma"])
def path(request: pytest.FixtureRequest) -> str:
    """How bytes move between two engines of one host: through the socket, or by attach."""
    return str(request.param)


@pytest.fixture
def pair(path: str) -> Iterator[Pair]:
    cfg = TcpBackendConfig(num_connections_per_peer=3, chunk_bytes=256 << 10, enable_cma=path == "cma")
    a, b = make_engine("a", cfg), make_engine("b", cfg)
    connect(a, b)
    nbytes = 8 << 20
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    pair = Pair(a, b, src, dst, a.register_torch_tensor(src), b.register_torch_tensor(dst))
    yield pair
    a.shutdown()
    b.shutdown()


@pytest.fixture
def make() -> Iterator[object]:
    """``make(key, cfg=None)``: an engine with a TCP backend, shut down after the test."""
    made: list[IOEngine] = []

    def factory(key: str, cfg: TcpBackendConfig | None = None) -> IOEngine:
        made.append(make_engine(key, cfg))
        return made[-1]

    yield factory
    for e in made:
        e.shutdown()


PEER_SCRIPT = Path(__file__).with_name("_peer.py")


def _load_peer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mori_io_test_peer", PEER_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def peer() -> ModuleType:
    """The hand-written wire peer for attack tests (_peer.py): RawPeer, header(), strings(), ..."""
    return _load_peer()
