"""Every repository path and `resume.` module the documents and docstrings name exists, and the
README stays short with its Architecture near the top (issue 24)."""

from __future__ import annotations

import ast
import importlib
import io
import pathlib
import re
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "runbooks").glob("*.md"))]
SOURCE_DIRS = ("resume", "adapters", "cluster", "drill", "benchmarks", "examples")

# A repository path: one of the top-level folders, a slash, then at least one name character.
PATH = re.compile(r"(?<![\w./\-*:])((?:resume|adapters|cluster|drill|tests|runbooks|docs|benchmarks|examples|\.ci)"
                  r"/[\w./*-]*)")
# A dotted name under the package: a module, or an attribute of one (`resume.adapters.data.StatefulLoader`).
MODULE = re.compile(r"(?<![\w.\-/])(resume(?:\.[A-Za-z_]\w*)+)")
# A markdown link to a file of the repository, relative to the document (`[x](../runbooks/y.md#z)`).
LINK = re.compile(r"\]\((?!\w+://|#|mailto:)([^)#\s]+)")


def path_exists(token: str) -> bool:
    token = token.rstrip(".,;:-")
    if token.endswith("/"):
        token = token.rstrip("/")
    if "*" in token:
        return any(ROOT.glob(token))
    return (ROOT / token).exists()


def _module_source(name: str) -> pathlib.Path | None:
    """Where a `resume.` module's source lies (package-dir mapping of pyproject.toml)."""
    parts = name.split(".")
    top = {"adapters": "adapters", "cluster": "cluster", "drill": "drill"}
    base = ROOT / top[parts[1]] if len(parts) > 1 and parts[1] in top else ROOT / "resume"
    rest = parts[2:] if base.name != "resume" else parts[1:]
    path = base.joinpath(*rest) if rest else base
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _defines(source: pathlib.Path, attr: str) -> bool:
    """`attr` is bound at the top level of `source` (a def, class, assignment or import)."""
    tree = ast.parse(source.read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == attr:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == attr for t in targets):
                return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                (a.asname or a.name.split(".")[0]) == attr for a in node.names):
            return True
    return False


def name_exists(token: str) -> bool:
    """A module, or a module's attribute chain. A module that cannot import here (an optional
    dependency missing) is checked from its source: the first attribute must be defined there."""
    parts = token.split(".")
    for cut in range(len(parts), 0, -1):
        module, attrs = ".".join(parts[:cut]), parts[cut:]
        source = _module_source(module)
        if source is None:
            continue
        try:
            obj = importlib.import_module(module)
        except ImportError:
            return not attrs or _defines(source, attrs[0])
        for attr in attrs:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def missing_in(text: str, where: str, first_line: int = 1) -> list[str]:
    """`where:line: token` for every path or `resume.` name in `text` that does not exist."""
    missing = []
    for offset, line in enumerate(text.splitlines()):
        for token in PATH.findall(line):
            if token.rstrip("./") and not path_exists(token):
                missing.append(f"{where}:{first_line + offset}: {token.rstrip('.,;:')}")
        for token in MODULE.findall(line):
            if not name_exists(token):
                missing.append(f"{where}:{first_line + offset}: {token}")
    return missing


def broken_links(doc: pathlib.Path, text: str) -> list[str]:
    """`doc:line: target` for every relative markdown link of `doc` whose target does not exist."""
    where = doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc
    return [f"{where}:{n}: {target}" for n, line in enumerate(text.splitlines(), 1)
            for target in LINK.findall(line) if not (doc.parent / target).exists()]


# `Class.member` in backticks, e.g. `Run.find_latest`, `StepCommit.finalize`, `Coordinator.save()`.
MEMBER = re.compile(r"`([A-Z]\w*)\.([a-z_]\w*)")


def our_classes() -> dict[str, set[str]]:
    """Every class of resume/, adapters/, cluster/, drill/ with the members it defines or inherits
    from another class of ours (by base-class name)."""
    members: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    for folder in ("resume", "adapters", "cluster", "drill"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ClassDef):
                    continue
                names = members.setdefault(node.name, set())
                bases.setdefault(node.name, []).extend(b.id for b in node.bases if isinstance(b, ast.Name))
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        names.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        names.add(item.target.id)
                    elif isinstance(item, ast.Assign):
                        names.update(t.id for t in item.targets if isinstance(t, ast.Name))

    def all_members(name: str, seen: frozenset = frozenset()) -> set[str]:
        found = set(members.get(name, ()))
        for base in bases.get(name, ()):
            if base in members and base not in seen:
                found |= all_members(base, seen | {name})
        return found

    return {name: all_members(name) for name in members}


def missing_members(text: str, where: str, classes: dict[str, set[str]]) -> list[str]:
    """`where:line: Class.member` for every member named of one of our classes that it lacks."""
    return [f"{where}:{n}: {cls}.{member}" for n, line in enumerate(text.splitlines(), 1)
            for cls, member in MEMBER.findall(line) if cls in classes and member not in classes[cls]]


def docstrings_and_comments(path: pathlib.Path) -> list[tuple[int, str]]:
    """(first line, text) of every docstring and comment of a Python file."""
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                found.append((first.lineno, ast.get_source_segment(source, first) or ""))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            found.append((tok.start[0], tok.string))
    return found


def missing_everywhere() -> list[str]:
    missing = []
    classes = our_classes()
    for doc in DOCUMENTS:
        missing += missing_in(doc.read_text(), str(doc.relative_to(ROOT)))
        missing += broken_links(doc, doc.read_text())
        missing += missing_members(doc.read_text(), str(doc.relative_to(ROOT)), classes)
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for line, text in docstrings_and_comments(path):
                missing += missing_in(text, str(path.relative_to(ROOT)), line)
    return missing


def test_every_named_path_and_module_exists():
    missing = missing_everywhere()
    assert not missing, "named but not in the repository:\n" + "\n".join(missing)


def test_the_detector_catches_a_missing_path_and_module():
    text = ("Shards: `adapters/data.py` and adapters/no_such_file.py, see runbooks/slurm.md.\n"
            "The loader, resume.adapters.data.StatefulLoader; gone: resume.no_such_module.\n"
            "Not ours: s3://bucket/run42, RUN/step-000000200/manifest.json, resume-manifest.json.\n"
            "A missing document: docs/no-such-page.md; a glob: tests/test_docs*.py.\n"
            "An attribute that is not there: resume.adapters.data.NoSuchLoader\n")
    assert missing_in(text, "x.md", 10) == [
        "x.md:10: adapters/no_such_file.py",
        "x.md:11: resume.no_such_module",
        "x.md:13: docs/no-such-page.md",
        "x.md:14: resume.adapters.data.NoSuchLoader",
    ]


def test_a_documented_member_of_our_classes_must_exist():
    classes = our_classes()
    text = "`Run.find_latest` and `Run.no_such_method()`; `StepCommit.finalize`; `FileSystemWriter.finish`\n"
    assert missing_members(text, "x.md", classes) == ["x.md:1: Run.no_such_method"]


def test_a_link_is_resolved_from_its_document(tmp_path):
    doc = tmp_path / "docs" / "page.md"
    doc.parent.mkdir()
    (tmp_path / "runbooks").mkdir()
    (tmp_path / "runbooks" / "slurm.md").write_text("")
    text = "[ok](../runbooks/slurm.md#events) [gone](../runbooks/nope.md) [web](https://x.org/a.md) [here](#top)\n"
    assert broken_links(doc, text) == [f"{doc}:1: ../runbooks/nope.md"]


def test_docstrings_and_comments_are_what_is_scanned(tmp_path):
    source = tmp_path / "m.py"
    source.write_text('"""Module: see docs/absent.md."""\n\nx = "runbooks/not-scanned.md"  # cluster/absent.py\n\n\n'
                      'def f():\n    """Function:\n    tests/absent_test.py"""\n')
    found = [m for line, text in docstrings_and_comments(source) for m in missing_in(text, "m.py", line)]
    assert sorted(found) == ["m.py:1: docs/absent.md", "m.py:3: cluster/absent.py", "m.py:8: tests/absent_test.py"]


README_LINES = 300
ARCHITECTURE_BY = 120


def test_the_readme_is_short_with_its_architecture_near_the_top():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines, at most {README_LINES}"
    heading = [i + 1 for i, line in enumerate(lines) if line.strip() == "## Architecture"]
    assert heading, "README.md has no '## Architecture' heading"
    assert heading[0] <= ARCHITECTURE_BY, f"README.md: '## Architecture' at line {heading[0]}, not within {ARCHITECTURE_BY}"


@pytest.mark.parametrize("page", ["docs/design.md", "docs/performance.md", "docs/reliability.md",
                                  "docs/megatron.md", "docs/slurm.md"])
def test_the_readme_links_each_detail_page(page):
    assert (ROOT / page).is_file()
    assert f"({page})" in (ROOT / "README.md").read_text()
