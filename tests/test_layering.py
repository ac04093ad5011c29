"""Imports only go downwards (docs/architecture.md, "Module map"): each top folder of tessera
imports only from its own folder and lower floors. Every import statement counts, also one
inside a function or under TYPE_CHECKING: a name in a signature is a dependency too."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kernels.attention.batch_view import AttentionBatch, DecodeTablesView, KVBuffers
from runtime.forward_batch import DecodeTables, ForwardBatch, ForwardMode
from runtime.memory_pool import KVPool, ReqToTokenPool

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {
    "kernels": 1,
    "runtime": 2,
    "vision": 3,
    "tokenizer_manager": 4,
    "scheduler": 4,
    "launch": 5,
}


def sources(top: str) -> list[Path]:
    if top == "launch":
        return [ROOT / "launch.py"]
    return sorted((ROOT / top).rglob("*.py"))


def imported_modules(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in `tree`; relative imports stay inside
    their package and are left out."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def upward_imports(top: str) -> list[str]:
    """`path:line module` for each import in `top` of a tessera folder on its floor or above."""
    found = []
    for path in sources(top):
        for line, module in imported_modules(ast.parse(path.read_text())):
            head = module.split(".")[0]
            if head in FLOORS and head != top and FLOORS[head] >= FLOORS[top]:
                found.append(f"{path.relative_to(ROOT)}:{line} {module}")
    return found


@pytest.mark.parametrize("top", list(FLOORS))
def test_each_folder_imports_only_lower_floors(top: str) -> None:
    assert sources(top), f"no sources found for {top}"
    assert upward_imports(top) == []


def test_the_rule_sees_an_upward_import() -> None:
    """The parse finds imports wherever they stand (lazy, under TYPE_CHECKING)."""
    code = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from runtime.forward_batch import ForwardBatch\n"
        "def f():\n    import scheduler.req\n"
    )
    assert [m for _, m in imported_modules(ast.parse(code))] == [
        "typing", "runtime.forward_batch", "scheduler.req"
    ]  # fmt: skip


def members(protocol: type) -> list[str]:
    return [name for name in vars(protocol) if not name.startswith("_")]


def test_the_runtime_batch_has_what_the_kernels_read() -> None:
    """ForwardBatch, its KVPool and its DecodeTables carry every member of the kernels' batch
    protocols (kernels/attention/batch_view.py), so they satisfy them by their shape."""
    kv = KVPool(4, 1, 1, 2, torch.float32)
    tables = DecodeTables(torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long), 1)
    empty = torch.zeros(0, dtype=torch.long)
    batch = ForwardBatch(ForwardMode.DECODE, empty, empty, empty, [0], [0], [1],
                         ReqToTokenPool(1, 4), kv, decode_tables=tables)
    for obj, protocol in ((batch, AttentionBatch), (kv, KVBuffers), (tables, DecodeTablesView)):
        assert members(protocol), protocol
        missing = [name for name in members(protocol) if not hasattr(obj, name)]
        assert missing == [], (type(obj).__name__, missing)
