"""megatron.training's real --async-save with resume installed: the manifest is written when
Megatron finalizes the save, never before; a job killed in between leaves that iteration
uncommitted, and a restart loads the last finalized one (support/megatron_async.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from support.cli import resume
from support.megatron import saved_manifest
from support.ranks import run_ranks

# Marked one by one: the tests that read our own code run without megatron-core too (.ci/run's
# fresh-machine step requires every marked test to skip there).

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """The save directory and the notes of support.megatron_async.killed_job, SIGKILLed (in its
    own session, with its checkpoint worker) after its save at 5 was written, not finalized."""
    from support.megatron import require_megatron

    require_megatron()
    root = tmp_path_factory.mktemp("megatron-async")
    save_dir, out = str(root / "save"), str(root / "seen.json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "support.megatron_async", save_dir, out], cwd=TESTS,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the job's session: it and its checkpoint worker
        _, stderr = proc.communicate()
        pytest.fail(f"the async-save job did not end in 180 s: {stderr[-4000:]}")
    assert proc.returncode == -signal.SIGKILL, stderr[-4000:]
    with open(out) as f:
        seen = json.load(f)
    assert "error" not in seen, seen["error"]
    return save_dir, seen


@pytest.mark.megatron
@pytest.mark.multiprocess
def test_manifest_is_written_when_megatron_finalizes_the_save_not_when_the_files_are_written(killed):
    _, seen = killed
    for moment in ("2 scheduled", "2 written", "3 scheduled, 2 pending"):
        assert not seen[moment]["manifest"] and seen[moment]["committed"] == [], moment
    written = seen["2 written"]
    assert "__0_0.distcp" in written["files"] and written["tracker"] is None  # Megatron's own finalize is due too
    after = seen["finalized"]
    assert after["2"]["manifest"] and after["3"]["manifest"] and after["3"]["committed"] == [2, 3]
    assert after["3"]["tracker"] == "3"


@pytest.mark.megatron
@pytest.mark.multiprocess
def test_each_manifest_records_the_iteration_saved_not_the_moment_it_was_finalized(killed):
    """2 and 3 were finalized at iteration 4: their counters, next batch and LR are their own."""
    save_dir, seen = killed
    lr_at = seen["finalized"]["lr_at"]
    for iteration in (2, 3):
        m = saved_manifest(save_dir, iteration)
        assert m["train_state"]["iteration"] == iteration
        assert m["train_state"]["samples_read"] == 4 * iteration
        assert m["expectation"]["next_batch"]["ids"] == list(range(4 * iteration, 4 * iteration + 4))
        assert m["expectation"]["lr_ahead"][0][0] == lr_at[str(iteration)]
    assert seen["finalized"]["consumed_now"] == 16


@pytest.mark.megatron
@pytest.mark.multiprocess
def test_the_manifest_lists_the_complete_files_and_verify_checks_their_checksums(killed):
    save_dir, _ = killed
    for iteration in (2, 3):
        d = os.path.join(save_dir, f"iter_{iteration:07d}")
        listed = set(saved_manifest(save_dir, iteration)["files"])
        assert listed == set(os.listdir(d)) - {"resume-manifest.json"}
        assert {".metadata", "metadata.json", "__0_0.distcp"} <= listed
    proc = resume("verify", "--deep", save_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.megatron
@pytest.mark.multiprocess
def test_a_job_killed_before_the_finalize_leaves_that_iteration_uncommitted(killed):
    """Killed after the worker wrote iter_0000005 and before Megatron finalized it: no manifest,
    not committed for resume nor for Megatron's tracker; 2 and 3, finalized before, stay committed."""
    from resume.adapters.megatron import MEGATRON_LAYOUT

    from resume.run import Run

    save_dir, seen = killed
    assert seen["5 written"]["files"] and not seen["5 written"]["manifest"]
    assert not os.path.exists(os.path.join(save_dir, "iter_0000005", "resume-manifest.json"))
    assert Run.open(save_dir, layout=MEGATRON_LAYOUT).committed_steps() == [2, 3]
    proc = resume("verify", "--json", save_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = {s["step"]: s for s in json.loads(proc.stdout)["steps"]}
    assert not steps[5]["committed"] and steps[3]["committed"] and steps[2]["committed"]


@pytest.mark.megatron
@pytest.mark.multiprocess
def test_restart_loads_the_last_finalized_save_and_commits_its_own_at_the_end(killed, tmp_path):
    import shutil

    save_dir, _ = killed
    copy = str(tmp_path / "save")
    shutil.copytree(save_dir, copy)
    out = run_ranks(_restart, 1, copy)[0]
    assert out["loaded"] == 3 and out["iteration"] == 3  # continuity checked: counters, LR, batch, RNG
    assert out["consumed"] == 5 * 4
    assert not out["before_finalize"]["manifest"] and out["after_finalize"]["committed"] == [2, 3, 5]
    assert saved_manifest(copy, 5)["train_state"]["iteration"] == 5
    proc = resume("verify", "--deep", copy)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.megatron
@pytest.mark.multiprocess
def test_restart_after_a_kill_before_the_first_finalize_starts_fresh(killed, tmp_path):
    """A copy holding only what a job killed before its first finalize leaves: iter_0000005
    written by the worker, no manifest, no tracker. Nothing is loaded; the torn files are
    written over by the next save of 5 and committed."""
    import shutil

    save_dir, _ = killed
    copy = tmp_path / "save"
    copy.mkdir()
    shutil.copytree(os.path.join(save_dir, "iter_0000005"), copy / "iter_0000005")
    out = run_ranks(_restart, 1, str(copy))[0]
    assert out["loaded"] is None and out["iteration"] == 0
    assert out["after_finalize"]["committed"] == [5]
    proc = resume("verify", "--deep", str(copy))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _restart(rank: int, world: int, save_dir: str) -> dict:
    from support.megatron_async import restart_and_save

    return restart_and_save(rank, world, save_dir)


def test_the_commit_goes_on_the_request_that_carries_megatrons_finalize_functions():
    """With distillation Megatron schedules the checkpoint request with no finalize functions, then
    a logits request carrying them all: the commit goes with them, never on the empty one."""
    import types

    from resume.adapters.megatron.asyncsave import AsyncCommits

    scheduled = []
    commits = AsyncCommits(scheduled.append, lambda **kw: None)
    commit = object()
    commits._armed = commit

    def request(fns):
        return types.SimpleNamespace(finalize_fns=fns, add_finalize_fn=fns.append)

    empty, carrying = request([]), request(["megatron's"])
    commits.schedule_async_save(empty)
    commits.schedule_async_save(carrying)
    assert scheduled == [empty, carrying] and empty.finalize_fns == []
    assert carrying.finalize_fns == ["megatron's", commit] and commits._armed is None


def test_waiting_for_a_commit_finalizes_only_when_that_iteration_is_pending():
    from resume.adapters.megatron.asyncsave import AsyncCommits

    calls = []
    commits = AsyncCommits(lambda request: None, lambda **kw: calls.append(kw))
    commits.pending = [2, 3]
    commits.maybe_wait_for_commit(4)
    assert calls == []
    commits.maybe_wait_for_commit(3)
    assert calls == [{"blocking": True}]


def _request(rank: int, world: int, save_dir: str) -> dict:
    from support.megatron_async import request_answered_after_commit

    return request_answered_after_commit(rank, world, save_dir)


@pytest.mark.megatron
@pytest.mark.multiprocess
def test_a_resume_save_request_is_answered_only_once_its_async_save_is_committed(tmp_path):
    """The answer names a step only when its manifest exists: the requested save is finalized,
    waiting, before the answer (without that, the commit would come at a later finalize)."""
    from support.megatron import require_megatron

    require_megatron()
    out = run_ranks(_request, 1, str(tmp_path / "save"))[0]
    assert out["answer"]["step"] == 2 and out["answer"]["error"] is None, out["answer"]
    assert out["at_answer"]["manifest"] and out["at_answer"]["committed"] == [2], out["at_answer"]
    assert out["stop"] is False
