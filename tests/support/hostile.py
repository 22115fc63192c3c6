"""Running ``resume`` against hostile files: the CLI and a job's restore in subprocesses under
an address-space limit and a timeout, and their one-line refusals. (Files replaced as an
attacker who also rewrites the manifest would: ``support.checkpoints.replace_listed_file``.)"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

ADDRESS_SPACE = 6 << 30
"""The subprocesses' address-space limit: torch's import needs about 3 GiB of it; reading
/dev/zero or inflating a bomb into memory would pass it within seconds."""
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def resume_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``resume ARGS`` in a subprocess under the address-space limit and a timeout."""
    return subprocess.run([sys.executable, "-m", "resume.cli", *args], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=limited, check=False)


RESTORE = """
import json, sys
sys.path.insert(0, {tests!r})
from support.workloads import Setup, build
from resume.errors import ResumeError
coord, _ = build(0, 1, {run!r}, Setup(every=2))
try:
    coord.restore()
    print(json.dumps({{"restored_from": coord.restored_from}}))
except ResumeError as e:
    print(json.dumps({{"error": type(e).__name__, "message": str(e)}}))
finally:
    coord.close()
"""


def restore_in_subprocess(run: str, timeout: float = 150) -> dict:
    """A job's restore of ``run`` in a subprocess: {"restored_from": step} or {"error": class,
    "message": ...}, with "log" (its stderr); any other exception fails the test."""
    proc = subprocess.run([sys.executable, "-c", RESTORE.format(tests=TESTS, run=run)], capture_output=True,
                          text=True, timeout=timeout, preexec_fn=limited, check=False)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]) | {"log": proc.stderr}


def assert_problem(proc: subprocess.CompletedProcess, *needles: str, code: int = 1) -> None:
    """Exit ``code``, one-line errors only (no traceback), each needle in them."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines and all(line.startswith("resume: error: ") for line in lines), proc.stderr
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)
