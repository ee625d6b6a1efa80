"""Launch geometry of the EP kernels: the config's (MANUAL) or a measured table's (AUTO).

``MORI_EP_LAUNCH_CONFIG_MODE=MANUAL`` (default): ``block_num`` and ``warp_per_block`` come from the
config (or the call); the tile is :data:`DEFAULT_TILE_ELEMS`. ``AUTO``: a call that leaves them at
``-1`` takes them from the JSON rules under ``mori/ep/tuning_configs/``, named
``{arch}_{model}_{kernel}_ep{N}_{phase}.json`` (e.g. ``sm90_H200_IntraNode_ep2_dispatch.json``);
``MORI_EP_TUNING_CONFIG`` names one file to use instead. File match: the exact model, else any
file of the same architecture. Rule match: the dispatch dtype exactly (and ``zero_copy`` for
combine), then the smallest ``num_tokens`` at least the call's (else the largest), preferring the
exact ``hidden_dim``. Each rule holds ``block_num``, ``warp_per_block``, ``tile_elems`` (elements of
a program's tile, our addition) and the ``bandwidth_gbps`` it was measured at, with the command.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from mori.core.env import EnvVar, choice
from mori.core.errors import MoriValueError

__all__ = [
    "DEFAULT_TILE_ELEMS",
    "MORI_EP_LAUNCH_CONFIG_MODE",
    "MORI_EP_PUSH_CHUNK",
    "MORI_EP_TUNING_CONFIG",
    "LaunchRule",
    "lookup",
]

MORI_EP_LAUNCH_CONFIG_MODE = EnvVar(
    "MORI_EP_LAUNCH_CONFIG_MODE",
    "MANUAL",
    "Where the EP kernels' launch geometry comes from: MANUAL (the config / call arguments) or AUTO "
    "(measured tables shipped in mori/ep/tuning_configs, for arguments left at -1).",
    "AUTO",
    choice("MANUAL", "AUTO"),
    "MANUAL or AUTO",
)
MORI_EP_TUNING_CONFIG = EnvVar(
    "MORI_EP_TUNING_CONFIG",
    None,
    "AUTO mode: one JSON rules file to use instead of the shipped tables.",
    "/path/to/sm90_H200_IntraNode_ep2_dispatch.json",
    str,
    "a path",
)


def _push_chunk(text: str) -> int:
    n = int(text)
    if n < 1 or n > 64 or n & (n - 1):
        raise ValueError(text)
    return n


MORI_EP_PUSH_CHUNK = EnvVar(
    "MORI_EP_PUSH_CHUNK",
    None,
    "Tokens per chunk of the push combine (ordinary combine input on GPUs): a rank flags each chunk "
    "to its peers once its rows are there. Default: about 6 chunks per program of "
    "max_num_inp_token_per_rank tokens, at most 16, and the gather combine when that is under 2. "
    "Setting it forces the push. Must be the same on every rank.",
    "4",
    _push_chunk,
    "a power of two from 1 to 64",
)

#: elements of one program's tile by phase when no table says otherwise (measured on H200)
DEFAULT_TILE_ELEMS = {"dispatch": 16384, "combine": 32768}
TABLES = Path(__file__).with_name("tuning_configs")


@dataclass(frozen=True)
class LaunchRule:
    """One row of a table: the launch geometry measured best for a shape."""

    block_num: int
    warp_per_block: int
    tile_elems: int


@lru_cache(maxsize=64)
def _load(path: str) -> list[dict[str, Any]]:
    try:
        rules = json.loads(Path(path).read_text())["rules"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise MoriValueError(f"EP tuning table {path} is not readable as {{'rules': [...]}}: {e}") from None
    return list(rules)


def _table(arch: str, model: str, kernel: str, world: int, phase: str) -> str | None:
    override = MORI_EP_TUNING_CONFIG.get()
    if override:
        return override
    exact = TABLES / f"{arch}_{model}_{kernel}_ep{world}_{phase}.json"
    if exact.exists():
        return str(exact)
    same_arch = sorted(TABLES.glob(f"{arch}_*_{kernel}_ep{world}_{phase}.json"))
    return str(same_arch[0]) if same_arch else None


def lookup(
    *,
    arch: str,
    model: str,
    kernel: str,
    world: int,
    phase: str,
    dtype: str,
    num_tokens: int,
    hidden_dim: int,
    zero_copy: bool = False,
) -> LaunchRule | None:
    """The AUTO rule for one call, or None (MANUAL mode, no table, or no rule for the dtype)."""
    if MORI_EP_LAUNCH_CONFIG_MODE.get() != "AUTO":
        return None
    path = _table(arch, model, kernel, world, phase)
    if path is None:
        return None
    rules = [r for r in _load(path) if r.get("dtype") == dtype]
    if phase == "combine":
        rules = [r for r in rules if bool(r.get("zero_copy", False)) == zero_copy]
    if not rules:
        return None
    ceilings = [r for r in rules if r["num_tokens"] >= num_tokens]
    tokens = min(r["num_tokens"] for r in ceilings) if ceilings else max(r["num_tokens"] for r in rules)
    rules = [r for r in rules if r["num_tokens"] == tokens]
    exact = [r for r in rules if r.get("hidden_dim") == hidden_dim]
    r = (exact or rules)[0]
    return LaunchRule(int(r["block_num"]), int(r["warp_per_block"]), int(r.get("tile_elems", 0)))
