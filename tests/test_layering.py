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

Over the whole product (``resume/``, ``adapters/``, ``cluster/``, ``drill/``), the import
graph (every import: lazy and type-only ones too) has no circle, ``resume.adapters``
never imports ``resume.cluster``, and no module takes another module's private name.
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


# -- The import graph of the whole product: resume/, adapters/, cluster/, drill/ ------------------------------

REPO = CORE.parent
PACKAGES = {"resume": "resume", "adapters": "resume.adapters", "cluster": "resume.cluster", "drill": "resume.drill"}
"""Each folder of the repository and the package it installs as (pyproject.toml's package-dir)."""


def module_name(folder: str, rel: Path) -> str:
    """``adapters/dcp/io.py`` -> ``resume.adapters.dcp.io``; a package's ``__init__.py`` is the package."""
    parts = [p for p in rel.with_suffix("").parts if p != "__init__"]
    return ".".join([PACKAGES[folder], *parts])


def product_modules(root: Path = REPO) -> dict[str, tuple[str, str]]:
    """Every module of the product: its dotted name -> (path relative to the repository, source)."""
    found = {}
    for folder in PACKAGES:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root / folder)
            found[module_name(folder, rel)] = (f"{folder}/{rel.as_posix()}", path.read_text())
    return found


def _all_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import of a module: at module level, inside a function, under ``if TYPE_CHECKING:``. A lazy or
    type-only import hides a circle from Python, not from a reader: both modules still need each other."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def import_edges(name: str, path: str, source: str, known: set[str]) -> list[tuple[int, str, str | None]]:
    """(line, module imported, name taken from it or None) for each of our modules that ``name`` imports.

    ``from pkg import mod`` (a submodule) is an edge to the submodule, not to the package's ``__init__``:
    Python runs the package first, but it is already being imported by then, as for every submodule."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    edges = []
    for node in _all_imports(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            edges += [(node.lineno, alias.name, None) for alias in node.names if alias.name in known]
            continue
        base = _imported(node, package)[0]
        for alias in node.names:
            if f"{base}.{alias.name}" in known:
                edges.append((node.lineno, f"{base}.{alias.name}", None))
            elif base in known:
                edges.append((node.lineno, base, alias.name))
    return [(line, target, taken) for line, target, taken in edges if target != name]


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            component.append(v)
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def graph_violations(modules: dict[str, tuple[str, str]]) -> list[str]:
    """Import circles, ``resume.adapters`` importing ``resume.cluster``, and private names taken across modules."""
    known, graph, found = set(modules), {}, []
    for name, (path, source) in modules.items():
        edges = import_edges(name, path, source, known)
        graph[name] = {target for _, target, _ in edges}
        for line, target, taken in edges:
            if name.startswith("resume.adapters") and _is_under(target, ("resume.cluster",)):
                found.append(f"{path}:{line}: imports {target} (the adapters never import the cluster layer; "
                             "the cluster passes the facts in)")
            if taken and taken.startswith("_") and not taken.startswith("__"):
                found.append(f"{path}:{line}: imports {target}'s private name {taken} "
                             "(make it public where it belongs, or move it)")
    found += [f"import circle: {' <-> '.join(cycle)}" for cycle in import_cycles(graph)]
    return found


def test_the_product_has_no_import_circle_no_adapter_to_cluster_import_and_no_private_name_across_modules():
    modules = product_modules()
    assert {"resume", "resume.adapters", "resume.cluster", "resume.drill"} <= set(modules), sorted(modules)[:5]
    violations = graph_violations(modules)
    assert not violations, "the import graph breaks the layering:\n  " + "\n  ".join(violations)


def _modules(**sources: str) -> dict[str, tuple[str, str]]:
    """Synthetic modules for the check's own tests: ``resume__run="..."`` is ``resume/run.py``."""
    made = {}
    for key, source in sources.items():
        parts = key.split("__")
        folder, rest = parts[0], parts[1:]
        is_package = rest[-1:] == ["init"]
        rel = Path(*rest[:-1], "__init__.py") if is_package else Path(*rest).with_suffix(".py")
        made[module_name(folder, rel)] = (f"{folder}/{rel.as_posix()}", source)
    return made


@pytest.mark.parametrize("sources, what", [
    ({"resume__a": "from .b import x\n", "resume__b": "from .a import y\n"},
     "import circle: resume.a <-> resume.b"),
    ({"resume__a": "def f():\n    from resume import b\n", "resume__b": "import resume.a\n"},
     "import circle: resume.a <-> resume.b"),  # a lazy import is an edge too
    ({"resume__a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
      "resume__b": "from .a import A\n"}, "import circle: resume.a <-> resume.b"),  # and a type-only one
    ({"adapters__megatron__init": "from .ckpt import LAYOUT\n",
      "adapters__megatron__ckpt": "from resume.adapters.megatron import install\n"},
     "import circle: resume.adapters.megatron <-> resume.adapters.megatron.ckpt"),
    ({"adapters__torch_native": "from resume.cluster.environment import JobEnvironment\n",
      "cluster__environment": "X = 1\n"},
     "adapters/torch_native.py:1: imports resume.cluster.environment (the adapters never import"),
    ({"adapters__x": "def f():\n    import resume.cluster.slurm\n", "cluster__slurm": "X = 1\n"},
     "adapters/x.py:2: imports resume.cluster.slurm"),
    ({"adapters__adopt": "from .megatron import _config\n", "adapters__megatron": "_config = 1\n"},
     "adapters/adopt.py:1: imports resume.adapters.megatron's private name _config"),
    ({"cluster__hook": "from resume.run import _utc\n", "resume__run": "_utc = 1\n"},
     "cluster/hook.py:1: imports resume.run's private name _utc"),
])
def test_the_graph_check_names_each_kind_of_violation(sources, what):
    found = graph_violations(_modules(**sources))
    assert len(found) == 1 and what in found[0], found


@pytest.mark.parametrize("sources", [
    {"resume__a": "from . import b\n", "resume__b": "X = 1\n", "resume__init": "from .a import b\n"},
    {"cluster__hook": "from resume.adapters.megatron import LAYOUT\n", "adapters__megatron": "LAYOUT = 1\n"},
    {"adapters__x": "from torch.distributed.checkpoint.state_dict import _get_fqns\n"},  # not ours
    {"resume__a": "from .b import __version__\n", "resume__b": "__version__ = '1'\n"},
])
def test_the_graph_check_passes_what_the_layers_may_do(sources):
    assert graph_violations(_modules(**sources)) == []
