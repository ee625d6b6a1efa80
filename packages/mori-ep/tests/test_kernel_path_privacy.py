"""KernelPath uses the operator through its public surface only (``op.buffers``, ``op.config``,
``op.rank``, ...): no ``op._name`` / ``self.op._name`` reads or writes (issue 22 item 2)."""

from __future__ import annotations

import ast
from pathlib import Path

import mori.ep.kernel_path as kernel_path


def _is_op(node: ast.expr) -> bool:
    """``op`` or ``<anything>.op`` (``self.op``)."""
    return (isinstance(node, ast.Name) and node.id == "op") or (
        isinstance(node, ast.Attribute) and node.attr == "op"
    )


def private_op_accesses(source: str) -> list[str]:
    """``line: expr`` of every access to a private (``_``, not dunder) attribute of the operator."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and _is_op(node.value)
        ):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_detector_finds_private_accesses() -> None:
    src = "def f(self, op):\n    a = op._m\n    b = self.op._recv_tok\n    op._symm.append(1)\n    c = op.buffers.m\n"
    assert private_op_accesses(src) == ["2: op._m", "3: self.op._recv_tok", "4: op._symm"]


def test_kernel_path_reads_no_private_attribute_of_the_op() -> None:
    source = Path(kernel_path.__file__).read_text()
    assert private_op_accesses(source) == []
