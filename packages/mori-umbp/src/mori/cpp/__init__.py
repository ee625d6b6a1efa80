"""mori.cpp: the original MORI's binding module. Here it re-exports the UMBP names.

Code written for the original reaches UMBP as ``mori.cpp.UMBPClient``, ``mori.cpp.UMBPMasterClient``,
``mori.cpp.UMBPTierType``, ...; they are the same objects as in :mod:`mori.umbp`. This package
comes with the ``mori-umbp`` distribution.
"""

from __future__ import annotations

from typing import Any

import mori.umbp as _umbp
from mori.umbp import *  # noqa: F403

__all__ = list(_umbp.__all__)


def __getattr__(name: str) -> Any:
    return getattr(_umbp, name)


def __dir__() -> list[str]:
    return sorted(__all__)
