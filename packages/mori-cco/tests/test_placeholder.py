"""mori-cco is a placeholder: its modules import, export nothing and say so when touched."""

from __future__ import annotations

from types import ModuleType

import pytest

import mori.ccl
import mori.cco
from mori.testing.placeholder import check_empty_placeholder, check_planned_name

MODULES = [mori.cco, mori.ccl]
#: (module, a public name the implemented component will provide)
PLANNED = [
    (mori.cco, "Communicator"),
    (mori.ccl, "AllgatherSdma"),
    (mori.ccl, "HierAllGather"),
]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_module_is_an_empty_placeholder(module: ModuleType) -> None:
    check_empty_placeholder(module)


@pytest.mark.parametrize(("module", "name"), PLANNED, ids=lambda v: getattr(v, "__name__", v))
def test_planned_name_raises_attribute_error_saying_placeholder(module: ModuleType, name: str) -> None:
    check_planned_name(module, name, "mori-cco")
