"""A real file system that fills up, turns read-only, or refuses us, in the middle of training.

The run lives on a size-limited tmpfs the test mounts (root needed: without it these tests
skip, except where ``RESUME_REQUIRE_MOUNT=1`` (CI) turns the skip into a failure). The kernel,
not a wrapper, says ENOSPC and EROFS. Permission denied: a training process running as
``nobody`` on a run directory it may no longer write.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch
from support.workloads import build_12mib_job, train_12mib_job

from resume import Coordinator, SaveFailedError
from resume.run import Run

MIB = 1 << 20


def _mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True, check=False)


@pytest.fixture
def small_fs(tmp_path):
    """A 20 MiB tmpfs; yields its path and a function that remounts it (options)."""
    where = tmp_path / "fs"
    where.mkdir()
    done = _mount("-t", "tmpfs", "-o", "size=20m", "tmpfs", str(where))
    if done.returncode != 0:
        message = f"cannot mount a tmpfs here (root needed): {done.stderr.strip()}"
        if os.environ.get("RESUME_REQUIRE_MOUNT") == "1":
            pytest.fail(message)
        pytest.skip(message)

    def remount(options: str) -> None:
        result = _mount("-o", f"remount,{options}", str(where))
        assert result.returncode == 0, result.stderr

    yield str(where), remount
    subprocess.run(["umount", "-l", str(where)], check=False)


def committed_at_2(where: str, **options) -> tuple[str, Coordinator, torch.nn.Module, torch.optim.Optimizer]:
    """A run on ``where`` whose first checkpoint (step 2) is committed."""
    run = os.path.join(where, "run")
    coord, model, opt = build_12mib_job(run, **options)
    coord.restore()
    train_12mib_job(coord, model, opt, until=2)
    return run, coord, model, opt


def used_bytes(path: str) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_a_file_system_that_fills_keeps_the_previous_checkpoint_and_training_goes_on(small_fs):
    where, remount = small_fs
    run, coord, model, opt = committed_at_2(where, on_save_failure="continue")
    assert coord.last_committed_step == 2
    used_after_one = used_bytes(where)

    # The save of step 4 cannot fit beside step 2: ENOSPC from the kernel, mid-write.
    train_12mib_job(coord, model, opt, until=4)
    assert coord.last_committed_step == 2 and coord.save_failures == 1
    assert Run.open(run).step_dirs() == [2]  # the partial step was removed...
    assert used_bytes(where) <= used_after_one + MIB  # ...and its room given back

    # Step 2 is intact, verifies deep and restores with the continuity check passing.
    assert Run.open(run).check(2, deep=True).committed
    again, _, _ = build_12mib_job(run, lease_ttl_s=None)
    again.restore()
    assert again.restored_from == 2
    again.close()

    # Room again: the next scheduled save commits, training never stopped.
    remount("size=64m")
    train_12mib_job(coord, model, opt, until=6)
    assert coord.last_committed_step == 6 and coord.save_failures == 0
    coord.close()
    assert Run.open(run).committed_steps() == [2, 6]


def test_a_full_file_system_stops_the_job_by_default_saying_how_many_bytes(small_fs):
    where, _ = small_fs
    run, coord, model, opt = committed_at_2(where)
    with pytest.raises(SaveFailedError, match=r"disk full \(or quota\) on ranks \[0\]: expected room for "
                       r"each rank's shards, about \d+ bytes for this one, actual no space left, \d+ bytes "
                       r"free now"):
        train_12mib_job(coord, model, opt, until=4)
    coord.close()
    run_ = Run.open(run)
    assert run_.committed_steps() == [2] and run_.step_dirs() == [2]
    assert run_.check(2, deep=True).committed


def test_read_only_storage_fails_the_save_clearly_and_the_next_save_after_a_remount_commits(small_fs):
    where, remount = small_fs
    run, coord, model, opt = committed_at_2(where, on_save_failure="continue", max_save_failures=3)
    remount("ro")
    try:
        train_12mib_job(coord, model, opt, until=4)
        assert coord.save_failures == 1 and coord.last_committed_step == 2
        assert Run.open(run).check(2, deep=True).committed
    finally:
        remount("rw,size=64m")
    train_12mib_job(coord, model, opt, until=6)
    assert coord.last_committed_step == 6
    coord.close()
    assert Run.open(run).committed_steps() == [2, 6]


def test_read_only_storage_with_the_default_policy_stops_naming_the_file_system_error(small_fs):
    where, remount = small_fs
    run, coord, model, opt = committed_at_2(where)
    remount("ro")
    try:
        with pytest.raises(SaveFailedError, match=r"step-000000004: save failed: .*Read-only file system"):
            train_12mib_job(coord, model, opt, until=4)
    finally:
        remount("rw")
        coord.close()
    assert Run.open(run).committed_steps() == [2]


SCRIPT = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {tests!r})
    from support.workloads import build_12mib_job, train_12mib_job

    run = sys.argv[1]
    coord, model, opt = build_12mib_job(run, on_save_failure="continue", lease_ttl_s=None)
    coord.restore()
    train_12mib_job(coord, model, opt, until=2)
    os.chmod(run, 0o555)                       # the run directory may no longer be written
    train_12mib_job(coord, model, opt, until=4)
    failures_at_4 = coord.save_failures
    os.chmod(run, 0o755)
    train_12mib_job(coord, model, opt, until=6)
    coord.close()
    print(json.dumps({{"failures_at_4": failures_at_4, "committed": coord.last_committed_step}}))
""")


@pytest.fixture
def open_dir():
    """A directory every user may write (pytest's own are private to root)."""
    path = tempfile.mkdtemp(prefix="resume-perm-")
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_permission_denied_keeps_the_previous_checkpoint_and_the_loop_decides(open_dir):
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to train as another user")
    home = open_dir
    run = os.path.join(home, "run")
    proc = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
         SCRIPT.format(tests=os.path.dirname(__file__)), run],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "HOME": home})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"failures_at_4": 1, "committed": 6}
    assert "Permission denied" in proc.stderr
    assert Run.open(run).committed_steps() == [2, 6]
