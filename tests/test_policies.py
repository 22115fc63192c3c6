"""resume.policy and resume.commit on their own: the save decision, failure tolerance, retention's
choice, and one step's commit (prepare, finalize, abandon) on a real local run."""

from __future__ import annotations

import os

import pytest

from resume.commit import StepCommit
from resume.config import CoordinatorConfig
from resume.control import SaveRequest
from resume.errors import LeaseLostError, SaveFailedError, StorageError, UsageError
from resume.manifest import Manifest
from resume.policy import DecisionContext, EveryN, KeepPolicy, OnRequest, OnSignal, SaveFailureTolerance
from resume.run import Run
from resume.state import TrainState

DECIDE = EveryN(5) | OnRequest() | OnSignal()


@pytest.mark.parametrize("ctx, save, stop, scheduled_only", [
    (DecisionContext(4), False, False, False),
    (DecisionContext(5), True, False, True),
    (DecisionContext(5, requested=True), True, False, False),
    (DecisionContext(3, requests=(SaveRequest("a"),)), True, False, False),
    (DecisionContext(3, requests=(SaveRequest("a", stop=True),)), True, True, False),
    (DecisionContext(3, stop=True), True, True, False),
    (DecisionContext(10, stop=True), True, True, False),
])
def test_the_save_decision_composes_its_reasons(ctx, save, stop, scheduled_only):
    decision = DECIDE(ctx)
    assert (decision.save, decision.stop, decision.scheduled_only) == (save, stop, scheduled_only)


def test_every_zero_saves_only_when_asked():
    decide = EveryN(0) | OnRequest()
    assert not decide(DecisionContext(100)).save and decide(DecisionContext(7, requested=True)).save
    with pytest.raises(UsageError, match="every: expected >= 0"):
        EveryN(-1)


def test_failure_tolerance_bears_storage_trouble_up_to_the_limit_in_a_row():
    tolerance = SaveFailureTolerance("continue", 3)
    assert tolerance.tolerate(SaveFailedError("disk full"), 10)
    assert tolerance.tolerate(OSError(28, "ENOSPC"), 20)
    assert not tolerance.tolerate(SaveFailedError("disk full"), 30)  # the 3rd in a row stops
    tolerance.succeeded()
    assert tolerance.failures == 0 and tolerance.tolerate(StorageError("EIO"), 40)
    assert not tolerance.tolerate(LeaseLostError("taken over"), 50)  # never tolerated
    assert not SaveFailureTolerance("raise").tolerate(SaveFailedError("disk full"), 10)
    with pytest.raises(UsageError, match="on_save_failure"):
        SaveFailureTolerance("ignore")


def test_keep_policy_keeps_the_newest_and_every_mth():
    policy = KeepPolicy(keep_last=2, keep_every=4)
    assert policy.select_deletions([1, 2, 3, 4, 5, 6, 7, 8, 9]) == [1, 2, 3, 5, 6, 7]
    assert policy.keeps(3, newer_committed=1) and not policy.keeps(3, newer_committed=2)


def test_the_coordinator_settings_are_checked_at_construction():
    with pytest.raises(UsageError, match="expected settings among .* actual also \\['evry'\\]"):
        CoordinatorConfig.from_settings({"global_batch": 8, "evry": 5})
    with pytest.raises(UsageError, match="keep: expected >= 2"):
        CoordinatorConfig(global_batch=8, keep=1)
    with pytest.raises(UsageError, match="config: expected JSON"):
        CoordinatorConfig(global_batch=8, config={"seed": object()})
    assert CoordinatorConfig(global_batch=8, config={"pair": (1, 2)}).recorded_config()["pair"] == [1, 2]


# -- one step's commit -----------------------------------------------------------------------------


def committed(run: Run, step: int, files: dict[str, bytes]) -> None:
    commit = StepCommit(run, step)
    assert commit.prepare() is False
    records = commit.write(None, lambda: _write(run, step, files))
    state = TrainState(iteration=step, updates_successful=step, samples_read=step)
    commit.finalize([records], Manifest(step=step, train_state=state, files={}))


def _write(run: Run, step: int, files: dict[str, bytes]) -> list[str]:
    for name, body in files.items():
        run.storage.write_bytes_atomic(f"{run.dirname(step)}/{name}", body)
    return list(files)


def test_a_commit_writes_the_manifest_last_and_points_latest(tmp_path):
    run = Run.open(str(tmp_path / "run"), create=True)
    committed(run, 3, {"a.bin": b"abc"})
    assert run.check(3, deep=True).committed and run.latest_hint() == 3
    assert StepCommit(run, 3).prepare() is True  # already committed: nothing to write


def test_prepare_removes_a_leftover_and_moves_a_damaged_checkpoint_aside(tmp_path):
    run = Run.open(str(tmp_path / "run"), create=True)
    committed(run, 2, {"a.bin": b"abc"})
    committed(run, 4, {"a.bin": b"abc"})
    with open(tmp_path / "run" / run.dirname(4) / "a.bin", "wb") as f:
        f.write(b"abcd")  # damaged: moved aside, never deleted
    os.makedirs(tmp_path / "run" / run.dirname(6))
    (tmp_path / "run" / run.dirname(6) / "half").write_bytes(b"x")  # a leftover: removed
    assert StepCommit(run, 4).prepare() is False
    assert StepCommit(run, 6).prepare() is False
    assert [n for n in os.listdir(tmp_path / "run") if n.startswith("quarantine-step-000000004")]
    assert os.listdir(tmp_path / "run" / run.dirname(6)) == []
    assert run.latest_hint() == 2  # the hint never names what was moved aside


def test_abandon_removes_what_a_failed_save_left_but_never_a_committed_step(tmp_path):
    run = Run.open(str(tmp_path / "run"), create=True)
    committed(run, 2, {"a.bin": b"abc"})
    StepCommit(run, 2).abandon()
    assert run.check(2).committed
    failed = StepCommit(run, 3)
    failed.prepare()
    _write(run, 3, {"a.bin": b"abc"})
    failed.abandon()
    assert not os.path.exists(tmp_path / "run" / run.dirname(3))
