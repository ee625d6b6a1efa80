"""Launch geometry of the EP kernels: the config's (MANUAL) or a measured table's (AUTO).

``MORI_EP_LAUNCH_CONFIG_MODE=MANUAL`` (default): ``block_num`` and ``warp_per_block`` come from the
config (or the call); the tile is :data:`DEFAULT_TILE_ELEMS`. ``AUTO``: a call that leaves them at
``-1`` takes them from the JSON rules under ``mori/ep/tuning_configs/``, named
``{arch}_{model}_{kernel}_ep{N}_{phase}.json`` (e.g. ``sm90_H200_IntraNode_ep2_dispatch.json``);
``MORI_EP_TUNING_CONFIG`` names one file to use instead.

File match, first that exists: the exact arch, model, kernel and EP size; the same arch and
kernel with another model (same EP size); the same arch, model and kernel at the nearest EP size;
the same arch and kernel at the nearest EP size. Rule match: the dispatch dtype exactly (for
combine also ``zero_copy``, and ``quant_type``, default ``"none"``, whose rules also stand in for
a quant type the file lacks), then the smallest
``num_tokens`` at least the call's (else the largest), then the exact ``hidden_dim`` (else the
nearest), then the exact ``topk`` (else the nearest; rules without ``topk`` match any). Each rule
holds ``block_num``, ``warp_per_block``, ``tile_elems`` (elements of a program's tile, our
addition), the ``latency_us`` / ``bandwidth_gbps`` it was measured at, and the file's ``about``
the command. ``tools/ep_tune.py`` measures and writes such tables.

Where AUTO finds no file or no rule, the config's (or the call's) values are used, and the first
such call of each kind logs a warning on the ``mori.ep.tuning`` logger naming what was looked for;
a rule found elsewhere than the exact file logs which file it came from. :attr:`LaunchRule.source`
says where each rule came from.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
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


_log = logging.getLogger("mori.ep.tuning")
_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        _log.warning("%s", message)


@dataclass(frozen=True)
class LaunchRule:
    """One row of a table: the launch geometry measured best for a shape."""

    block_num: int
    warp_per_block: int
    tile_elems: int
    #: the file and the rule's keys, e.g. ``sm90_H200_IntraNode_ep2_dispatch.json (bfloat16, 4096
    #: tokens, hidden 7168, topk 8)``
    source: str = field(default="", compare=False)


@lru_cache(maxsize=64)
def _load(path: str) -> list[dict[str, Any]]:
    try:
        rules = json.loads(Path(path).read_text())["rules"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise MoriValueError(f"EP tuning table {path} is not readable as {{'rules': [...]}}: {e}") from None
    return list(rules)


def _ep_of(path: Path) -> int:
    try:
        return int(path.stem.rsplit("_ep", 1)[1].split("_")[0])
    except (IndexError, ValueError):
        return 0


def _table(arch: str, model: str, kernel: str, world: int, phase: str) -> tuple[str, str] | None:
    """(path, how it was found) of the table for a launch, or None."""
    override = MORI_EP_TUNING_CONFIG.get()
    if override:
        return override, "MORI_EP_TUNING_CONFIG"
    exact = TABLES / f"{arch}_{model}_{kernel}_ep{world}_{phase}.json"
    if exact.exists():
        return str(exact), "exact"
    same_arch = sorted(TABLES.glob(f"{arch}_*_{kernel}_ep{world}_{phase}.json"))
    if same_arch:
        return str(same_arch[0]), f"another {arch} model ({model} has no table)"
    for pattern, why in (
        (f"{arch}_{model}_{kernel}_ep*_{phase}.json", f"the nearest EP size of {model} (no ep{world} table)"),
        (
            f"{arch}_*_{kernel}_ep*_{phase}.json",
            f"the nearest EP size of {arch} (no {model} ep{world} table)",
        ),
    ):
        found = sorted(TABLES.glob(pattern), key=lambda f: (abs(_ep_of(f) - world), f.name))
        if found:
            return str(found[0]), why
    return None


def _nearest(rules: list[dict[str, Any]], key: str, want: int) -> list[dict[str, Any]]:
    """The rules with ``key`` equal to ``want``, else those with the nearest value; rules without
    the key count as a match for any value."""
    if not rules:
        return rules
    exact = [r for r in rules if r.get(key, want) == want]
    if exact:
        return exact
    best = min(abs(int(r[key]) - want) for r in rules)
    return [r for r in rules if abs(int(r[key]) - want) == best]


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
    topk: int | None = None,
    quant_type: str = "none",
) -> LaunchRule | None:
    """The AUTO rule for one call, or None (MANUAL mode, or nothing fits: the caller then uses the
    config's values, and the first such call logs a warning)."""
    if MORI_EP_LAUNCH_CONFIG_MODE.get() != "AUTO":
        return None
    what = f"{arch} {model} {kernel} ep{world} {phase}"
    found = _table(arch, model, kernel, world, phase)
    if found is None:
        _say_once(
            f"MORI_EP_LAUNCH_CONFIG_MODE=AUTO: no tuned table for {what} in {TABLES}; using the config's "
            "block_num / warp_per_block (run tools/ep_tune.py to measure one)"
        )
        return None
    path, how = found
    # (a rule may name its phase: one file for both, e.g. a MORI_EP_TUNING_CONFIG candidate)
    rules = [r for r in _load(path) if r.get("dtype") == dtype and r.get("phase", phase) == phase]
    if phase == "combine":
        rules = [r for r in rules if bool(r.get("zero_copy", False)) == zero_copy]
        quant = [r for r in rules if r.get("quant_type", "none") == quant_type]
        if not quant and quant_type != "none":  # the same input's plain combine is the nearest shape
            quant = [r for r in rules if r.get("quant_type", "none") == "none"]
            if quant:
                _say_once(
                    f"MORI_EP_LAUNCH_CONFIG_MODE=AUTO: {Path(path).name} has no quant_type={quant_type} "
                    "rule; using its quant_type=none rules"
                )
        rules = quant
    if not rules:
        _say_once(
            f"MORI_EP_LAUNCH_CONFIG_MODE=AUTO: {Path(path).name} has no rule for {phase} {dtype}"
            + (f" zero_copy={zero_copy} quant_type={quant_type}" if phase == "combine" else "")
            + "; using the config's block_num / warp_per_block"
        )
        return None
    ceilings = [r for r in rules if r["num_tokens"] >= num_tokens]
    tokens = min(r["num_tokens"] for r in ceilings) if ceilings else max(r["num_tokens"] for r in rules)
    rules = [r for r in rules if r["num_tokens"] == tokens]
    rules = _nearest(rules, "hidden_dim", hidden_dim)
    if topk is not None:
        rules = _nearest(rules, "topk", topk)
    r = rules[0]
    if how != "exact":
        _say_once(f"MORI_EP_LAUNCH_CONFIG_MODE=AUTO: {what} uses {Path(path).name} ({how})")
    keys = f"{dtype}, {tokens} tokens, hidden {r.get('hidden_dim', 'any')}, topk {r.get('topk', 'any')}"
    return LaunchRule(
        int(r["block_num"]),
        int(r["warp_per_block"]),
        int(r.get("tile_elems", 0)),
        source=f"{Path(path).name} ({keys})",
    )
