"""The ``resume`` command in a subprocess, as an operator runs it, and its one-line errors."""

from __future__ import annotations

import subprocess
import sys

RESUME = [sys.executable, "-m", "resume.cli"]


def resume(*args: str, timeout: float = 300, env: dict[str, str] | None = None,
           ) -> subprocess.CompletedProcess:
    """``resume ARGS...``; its exit code and output, whatever they are (``env``: the whole environment)."""
    return subprocess.run([*RESUME, *args], check=False, capture_output=True, text=True, timeout=timeout,
                          env=env)


def assert_one_line_error(proc: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    """Exit ``code``, only ``resume: error: ...`` lines on stderr (no traceback), each needle in them."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines and all(line.startswith("resume: error: ") for line in lines), proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)


def invoke(*args: str):
    """``resume ARGS...`` in this process (click's runner): its result, with stdout and stderr apart.

    Any exception but the command's own exit fails the test (a traceback is never an answer)."""
    from click.testing import CliRunner

    from resume.cli import cli

    result = CliRunner().invoke(cli, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result
