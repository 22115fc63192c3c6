"""The layers hold: the core (``resume/``) knows no adapter, cluster or framework.

Every module of ``resume/`` except the command line (the package ``resume/cli/``, the top
layer, which may reach every layer) is parsed with ``ast`` and must not:

- import ``resume.adapters``, ``resume.cluster`` or ``resume.drill``, anywhere in the
  module, absolutely or relatively: the edges import the core, never the reverse;
- import a framework (torch, Megatron) or click at module level: the core runs where
  neither is installed, and adapters hand it what it needs (``resume.comm.Comm``);
- name a cluster's environment variable (a string starting with ``SLURM_`` or
  ``TORCHELASTIC_``): ``cluster/`` reads the environment and passes the facts in;
- import click or ``resume.cli`` anywhere, inside functions too: the core is a library that
  the command line prints, and runs where click is not installed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[1] / "resume"
TOP_LAYER = "cli/"
"""The package of resume/ whose modules may import every layer (a path relative to resume/)."""
EDGES = ("resume.adapters", "resume.cluster", "resume.drill")
MODULE_LEVEL_ONLY_IN_EDGES = ("torch", "torchdata", "megatron", "transformer_engine", "click")
CLUSTER_ENV_PREFIXES = ("SLURM_", "TORCHELASTIC_")
ONLY_IN_THE_CLI = ("click", "resume.cli")
"""Imported by no module of resume/ outside resume/cli/, at any level."""


def _package(rel: str) -> str:
    """The package a module of resume/ lives in (relative imports are resolved against it)."""
    parts = ["resume", *Path(rel).parts[:-1]]
    return ".".join(parts)


def _imported(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """The absolute names an import statement brings in (``from a import b`` names ``a.b`` too)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        base = ".".join([*parent, *([node.module] if node.module else [])])
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def _is_under(name: str, roots: tuple[str, ...]) -> str | None:
    return next((root for root in roots if name == root or name.startswith(root + ".")), None)


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported: not inside a function, not under TYPE_CHECKING."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or _is_type_checking(node):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return found


def layering_violations(source: str, rel: str) -> list[str]:
    """Each leak of the module ``resume/<rel>`` as ``resume/<rel>:<line>: <what>``."""
    tree = ast.parse(source, filename=rel)
    package, where = _package(rel), f"resume/{rel}"
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            edges = {edge for name in _imported(node, package) if (edge := _is_under(name, EDGES))}
            found += [(node.lineno, f"imports {edge} (an edge; the core never imports one)")
                      for edge in sorted(edges)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.startswith(CLUSTER_ENV_PREFIXES):
            what = f"names the cluster's environment variable {node.value[:40]!r}"
            found.append((node.lineno, what + " (cluster/ reads the environment and passes the facts in)"))
    for node in _module_level_imports(tree):
        names = {root for name in _imported(node, package)
                 if (root := _is_under(name, MODULE_LEVEL_ONLY_IN_EDGES))}
        found += [(node.lineno, f"imports {root} at module level (only adapters and the CLI may)")
                  for root in sorted(names)]
    return [f"{where}:{line}: {what}" for line, what in sorted(found)]


def cli_violations(source: str, rel: str) -> list[str]:
    """Each import of click or of ``resume.cli`` in ``resume/<rel>``, at any level (inside a
    function, a class or under TYPE_CHECKING too), as ``resume/<rel>:<line>: <what>``."""
    tree = ast.parse(source, filename=rel)
    package, found = _package(rel), []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = {root for name in _imported(node, package) if (root := _is_under(name, ONLY_IN_THE_CLI))}
            found += [(node.lineno, f"imports {root} (only resume/cli/ may, at any level)") for root in sorted(names)]
    return [f"resume/{rel}:{line}: {what}" for line, what in sorted(found)]


def core_modules() -> list[Path]:
    """Every module of resume/ outside the command line (``TOP_LAYER``)."""
    modules = sorted(p for p in CORE.rglob("*.py") if not p.relative_to(CORE).as_posix().startswith(TOP_LAYER))
    assert len(modules) > 10 and (CORE / TOP_LAYER / "__init__.py").exists(), \
        f"expected the core's modules and the command line's package under {CORE}"
    return modules


def test_the_core_imports_no_edge_and_no_framework_and_reads_no_cluster_environment():
    violations = [v for p in core_modules()
                  for v in layering_violations(p.read_text(), p.relative_to(CORE).as_posix())]
    assert not violations, ("the core (resume/) leaks into other layers; move the knowledge to the edge "
                            "(adapters/, cluster/, drill/) or to resume/cli/:\n  " + "\n  ".join(violations))


def test_only_the_command_line_imports_click():
    violations = [v for p in core_modules() for v in cli_violations(p.read_text(), p.relative_to(CORE).as_posix())]
    assert not violations, ("click (and resume.cli) imported outside resume/cli/; return what is to be "
                            "printed and let resume/cli/ print it:\n  " + "\n  ".join(violations))


@pytest.mark.parametrize("source, what", [
    ("import click\n", "imports click"),
    ("def fail(message):\n    import click\n    click.echo(message, err=True)\n", "imports click"),
    ("class Report:\n    def show(self):\n        from click import echo\n", "imports click"),
    ("import click.testing as t\n", "imports click"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import click\n", "imports click"),
    ("def main():\n    from resume.cli import cli\n", "imports resume.cli"),
    ("def main():\n    from .cli.common import emit_json\n", "imports resume.cli"),
])
def test_the_click_check_catches_click_anywhere_outside_the_cli(source, what):
    found = cli_violations(source, "x.py")
    assert len(found) == 1 and what in found[0], found
    assert found[0].startswith("resume/x.py:") and 0 < int(found[0].split(":")[1]) <= source.count("\n")


@pytest.mark.parametrize("source", [
    "import clickhouse\n",
    "from resume.errors import error_details\nNAME = 'click'\n",
    "from resume.client import connect\n",
    '"""What ``resume.cli`` prints (it imports click; this module does not)."""\n',
])
def test_the_click_check_passes_what_the_core_may_do(source):
    assert cli_violations(source, "x.py") == []


@pytest.mark.parametrize("source, what", [
    ("from resume.adapters.torch_native import NativeTorchAdapter\n", "imports resume.adapters"),
    ("import resume.cluster.slurm\n", "imports resume.cluster"),
    ("from resume import drill\n", "imports resume.drill"),
    ("from .adapters import megatron_ckpt\n", "imports resume.adapters"),
    ("from . import cluster\n", "imports resume.cluster"),
    ("def load():\n    from .drill.runner import run_drill\n", "imports resume.drill"),
    ("import torch\n", "imports torch at module level"),
    ("import torch.distributed as dist\n", "imports torch at module level"),
    ("from megatron.core import parallel_state\n", "imports megatron at module level"),
    ("import click\n", "imports click at module level"),
    ("try:\n    import torch\nexcept ImportError:\n    torch = None\n", "imports torch at module level"),
    ("class A:\n    import torch\n", "imports torch at module level"),
    ("import os\nJOB = os.environ.get('SLURM_JOB_ID')\n", "'SLURM_JOB_ID'"),
    ("import os\ndef run_id():\n    return os.environ['TORCHELASTIC_RUN_ID']\n", "'TORCHELASTIC_RUN_ID'"),
])
def test_the_layering_check_names_each_kind_of_leak_with_its_line(source, what):
    found = layering_violations(source, "x.py")
    assert len(found) == 1 and what in found[0], found
    line = found[0].split(":")[1]
    assert found[0].startswith("resume/x.py:") and 0 < int(line) <= source.count("\n")


@pytest.mark.parametrize("source", [
    "from .run import Run\nfrom resume.errors import UsageError\nimport resume.storage\n",
    "def fingerprint(t):\n    import torch\n    return torch.sum(t)\n",  # only when a framework calls it
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n",
    '"""The job id: RESUME_JOB_ID, passed in by cluster/ (which reads SLURM_JOB_ID)."""\n',
    "from resume.adaptersx import y\nNAME = 'MY_SLURM_JOB'\n",
])
def test_the_layering_check_passes_what_the_core_may_do(source):
    assert layering_violations(source, "x.py") == []


def test_relative_imports_are_resolved_from_the_modules_own_package():
    assert layering_violations("from ..adapters import data\n", "sub/x.py") == [
        "resume/sub/x.py:1: imports resume.adapters (an edge; the core never imports one)"]
    assert layering_violations("from .adapters import data\n", "sub/x.py") == []  # resume.sub.adapters
