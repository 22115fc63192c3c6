"""The runbooks name only commands and flags that exist."""

from __future__ import annotations

import pathlib
import re
import shlex

import pytest
from click.testing import CliRunner

from resume.cli import cli

ROOT = pathlib.Path(__file__).parent.parent
# The runbooks, the README and the documents it links (docs/): every command any of them names.
RUNBOOKS = sorted((ROOT / "runbooks").glob("*.md")) + [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def resume_commands():
    for path in RUNBOOKS:
        text = path.read_text()
        blocks = re.findall(r"```(?:sh)?\n(.*?)```", text, flags=re.DOTALL) + re.findall(r"`(resume [^`]+)`", text)
        for block in blocks:
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("#", 1)[0].strip()
                if line.startswith("resume "):
                    yield str(path.relative_to(ROOT)), line


def split(line: str) -> tuple[list[str], list[str]]:
    words = shlex.split(line)[1:]
    words = words[: words.index("--")] if "--" in words else words
    path = []
    group = cli
    for w in words:
        sub = getattr(group, "commands", {}).get(w)
        if sub is None:
            break
        path.append(w)
        group = sub
    flags = [w.split("=", 1)[0] for w in words if w.startswith("--")]
    return path, flags


CASES = sorted(set(resume_commands()))


def test_the_runbooks_name_resume_commands():
    assert len(CASES) > 15


@pytest.mark.parametrize("source, line", CASES)
def test_runbook_command_and_flags_exist(source, line):
    path, flags = split(line)
    assert path, f"{source}: {line}: not a resume command"
    help_text = CliRunner().invoke(cli, [*path, "--help"]).output
    for flag in flags:
        assert re.search(rf"(^|[\s,]){re.escape(flag)}\b", help_text, flags=re.MULTILINE), \
            f"{source}: {line}: {flag} is not an option of resume {' '.join(path)}"


# Every refusal a restart can meet, as its message names it (resume.coordinator, resume.changes,
# resume.continuity): the runbook for refused restarts explains each.
REFUSALS = ["config.", "optimizers", "optimizer[i].class", "param_groups", "optimizer[i].group[j].<field>",
            "schedule[i].<key>", "lr_ahead[+k]", "optimizer[i].moments", "optimizer.steps",
            "scheduler[i].position", "next_batch.ids", "next_batch.digest", "rng (rank r)",
            "lr at the first update", "lr applied at the first update", "lr after the first update",
            "draw its batches through coord.batches()", "accept_changes", "NoValidCheckpointError",
            "RunBusyError", "UnsafeCheckpointError", "RESUME_ACCEPT_CHANGES", "coord.peek()"]


@pytest.mark.parametrize("item", REFUSALS)
def test_the_restart_runbook_covers_every_refusal(item):
    text = (pathlib.Path(__file__).parent.parent / "runbooks" / "restart-refused.md").read_text()
    assert item in text
