"""pytest plugin for .ci/run's fresh-machine step (issue 11): where megatron-core, torchtitan and
Slurm are absent, every test marked ``megatron``, ``torchtitan`` or ``slurm`` must be skipped, and
nothing may fail or error. A marked test that passes there does not need its dependency (take the mark off); an
unmarked one that needs it fails with an ImportError or a missing command.

    PYTHONPATH=.ci python -m pytest -p require_skips -n 0 tests/test_megatron_*.py tests/test_slurm_*.py

It refuses to start where megatron-core, torchtitan or Slurm is present, or where the environment
turns their absence into a failure (RESUME_REQUIRE_MEGATRON=1, RESUME_REQUIRE_TORCHTITAN=1, CI=true
for the Slurm tests).
"""

from __future__ import annotations

import importlib.util
import os
import shutil

import pytest

DEPENDENCY_MARKS = ("megatron", "slurm", "torchtitan")
SLURM_COMMANDS = ("sbatch", "srun", "scontrol", "sinfo", "squeue", "slurmctld", "slurmd")

_marked: list[str] = []
_outcomes: dict[str, str] = {}
_violations: list[str] = []


def _present_dependencies() -> list[str]:
    found = []
    try:  # megatron.core, as require_megatron imports it (pip may leave an empty megatron/ behind)
        spec = importlib.util.find_spec("megatron.core")
    except ModuleNotFoundError:
        spec = None
    if spec is not None:
        found.append(f"megatron-core ({spec.origin})")
    spec = importlib.util.find_spec("torchtitan")
    if spec is not None:
        found.append(f"torchtitan ({spec.origin})")
    found += [f"{c} ({shutil.which(c)})" for c in SLURM_COMMANDS if shutil.which(c)]
    if os.environ.get("RESUME_REQUIRE_MEGATRON") == "1":
        found.append("RESUME_REQUIRE_MEGATRON=1 (turns the Megatron skips into failures)")
    if os.environ.get("RESUME_REQUIRE_TORCHTITAN") == "1":
        found.append("RESUME_REQUIRE_TORCHTITAN=1 (turns the torchtitan skips into failures)")
    if os.environ.get("CI") == "true":
        found.append("CI=true (turns the Slurm skips into failures)")
    return found


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("numprocesses", None):  # xdist collects on its workers, not here
        raise pytest.UsageError("require_skips: expected one process (-n 0), actual "
                                f"-n {config.getoption('numprocesses')}")
    present = _present_dependencies()
    if present:
        raise pytest.UsageError("require_skips: expected no megatron-core, torchtitan or Slurm, actual "
                                + "; ".join(present))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    _marked.extend(i.nodeid for i in items if any(i.get_closest_marker(m) for m in DEPENDENCY_MARKS))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Per test, the worst of its phases: a failed setup or teardown is a failure too.
    if report.failed:
        _outcomes[report.nodeid] = "failed"
    elif report.skipped:
        _outcomes.setdefault(report.nodeid, "skipped")
    elif report.when == "call":
        _outcomes.setdefault(report.nodeid, "passed")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _marked:
        _violations.append(f"expected tests marked {' or '.join(DEPENDENCY_MARKS)}, actual none collected")
    for nodeid in _marked:
        outcome = _outcomes.get(nodeid, "not run")
        if outcome != "skipped":
            _violations.append(f"{nodeid}: expected skipped without its dependency, actual {outcome}")
    if _violations and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:
    skipped = sum(1 for n in _marked if _outcomes.get(n) == "skipped")
    terminalreporter.write_sep("=", f"require_skips: {skipped} of {len(_marked)} tests marked "
                               f"{' or '.join(DEPENDENCY_MARKS)} skipped")
    for line in _violations:
        terminalreporter.write_line(f"require_skips: {line}", red=True)
