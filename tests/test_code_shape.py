"""The product's code stays readable in pieces: narrow classes, short functions, small adapter protocols.

Over resume/, adapters/, cluster/ and drill/ (benchmarks and tests are not product code):

- no class has more than ``MAX_METHODS`` methods (properties included): a class that wide does several jobs;
- no function is longer than ``MAX_LINES`` lines, docstring included, except the tables in ``TABLES``;
- every class of ``resume/adapter.py`` (the adapter contract's protocols) has at most ``MAX_PROTOCOL_METHODS``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("resume", "adapters", "cluster", "drill")
MAX_METHODS = 25
MAX_LINES = 50
MAX_PROTOCOL_METHODS = 10
CONTRACT = "resume/adapter.py"
TABLES = {
    "cluster/reference.py:figures": "the reference run's figures, one entry each: a table, read as one",
}
"""Functions allowed past MAX_LINES (``path:name`` -> why)."""


def _methods(node: ast.ClassDef) -> list[str]:
    return [f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]


def shape_violations(source: str, path: str) -> list[str]:
    """Each class too wide and each function too long in one module, as ``path:line: what``."""
    found = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.ClassDef):
            limit = MAX_PROTOCOL_METHODS if path == CONTRACT else MAX_METHODS
            if len(_methods(node)) > limit:
                found.append(f"{path}:{node.lineno}: class {node.name} has {len(_methods(node))} methods "
                             f"(at most {limit}{' in the adapter contract' if path == CONTRACT else ''})")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_LINES and f"{path}:{node.name}" not in TABLES:
                found.append(f"{path}:{node.lineno}: function {node.name} is {length} lines (at most {MAX_LINES})")
    return found


def product_files() -> list[Path]:
    return [p for folder in PRODUCT for p in sorted((REPO / folder).rglob("*.py"))]


def test_no_class_is_too_wide_and_no_function_too_long():
    files = product_files()
    assert len(files) > 40 and (REPO / CONTRACT).exists(), f"expected the product's modules under {REPO}"
    found = [v for p in files for v in shape_violations(p.read_text(), p.relative_to(REPO).as_posix())]
    assert not found, "split these (one job per class, phases into helpers):\n  " + "\n  ".join(found)


def test_the_exempt_tables_exist_and_are_still_long():
    """An exemption whose function is gone or got short is stale: remove it."""
    for where in TABLES:
        path, name = where.split(":")
        tree = ast.parse((REPO / path).read_text())
        lengths = [n.end_lineno - n.lineno + 1 for n in ast.walk(tree)
                   if isinstance(n, ast.FunctionDef) and n.name == name]
        assert lengths and max(lengths) > MAX_LINES, f"{where}: exemption no longer needed"


def _class(name: str, methods: int) -> str:
    return f"class {name}:\n" + "".join(f"    def m{i}(self):\n        pass\n" for i in range(methods))


@pytest.mark.parametrize("source, path, what", [
    (_class("Wide", MAX_METHODS + 1), "resume/x.py", "class Wide has 26 methods (at most 25)"),
    (_class("ShardIO", MAX_PROTOCOL_METHODS + 1), CONTRACT, "class ShardIO has 11 methods (at most 10 in the"),
    ("def long():\n" + "    x = 1\n" * MAX_LINES, "cluster/x.py", "function long is 51 lines (at most 50)"),
    ("class A:\n    def long(self):\n" + "        x = 1\n" * MAX_LINES, "adapters/x.py", "function long is 51"),
])
def test_the_shape_check_names_what_is_too_big(source, path, what):
    found = shape_violations(source, path)
    assert len(found) == 1 and what in found[0] and found[0].startswith(f"{path}:"), found


@pytest.mark.parametrize("source, path", [
    (_class("Narrow", MAX_METHODS), "resume/x.py"),
    (_class("Protocol", MAX_PROTOCOL_METHODS), CONTRACT),
    ("def short():\n" + "    x = 1\n" * (MAX_LINES - 1), "resume/x.py"),
    ("def figures():\n" + "    x = 1\n" * MAX_LINES, "cluster/reference.py"),
])
def test_the_shape_check_passes_what_fits(source, path):
    assert shape_violations(source, path) == []
