"""The save-failure policy (``on_save_failure``, ``max_save_failures``) in a coordinator: one process, a
real model, saves failed by fault injection (resume.faults)."""

from __future__ import annotations

import os

import pytest
from support.workloads import started, train, with_coordinator_options

from resume import ContinuityError, ResumeError, Run, SaveFailedError, faults

pytestmark = pytest.mark.usefixtures("faults_disarmed")


def run_entries(run_dir: str) -> list[str]:
    """The run's entries but the lease and the update journal (records of updates no save sealed)."""
    return sorted(n for n in os.listdir(run_dir) if n not in ("lease.json", "journal"))


@pytest.mark.parametrize("where", ["save.mid_shards", "save.after_shards"])
def test_continue_goes_on_past_a_failed_save_removes_it_and_the_next_save_commits(run_dir, caplog, where):
    faults.arm(f"{where}:enospc step=2")
    coord, parts = started(run_dir, every=2, on_save_failure="continue")
    with caplog.at_level("ERROR", logger="resume"):
        train(coord, parts, until=3)
    assert coord.iteration == 3 and coord.last_committed_step is None and coord.save_failures == 1
    assert "the save of step 2 failed (1 in a row, stopping at 3)" in caplog.text
    assert run_entries(run_dir) == ["run.json"]  # nothing of step 2 left behind
    train(coord, parts, until=5)
    assert coord.iteration == 5 and coord.save_failures == 0
    assert run_entries(run_dir) == ["LATEST", "run.json", "step-000000004"]
    assert Run.open(run_dir).check(4, deep=True).committed
    coord.close()


def test_continue_stops_at_the_max_save_failures_th_failure_in_a_row(run_dir, monkeypatch):
    with_coordinator_options(monkeypatch, max_save_failures=2)
    # No step filter: a fault fires at the hit-th save that passes its point.
    faults.arm("save.after_shards:enospc hit=1; save.after_shards:enospc hit=2")
    coord, parts = started(run_dir, every=2, on_save_failure="continue")
    with pytest.raises(ResumeError, match=r"No space left on device \(injected at save.after_shards "
                                          r"\(rank 0, step 4\)\)") as stopped:
        train(coord, parts, until=10)
    assert isinstance(stopped.value, (SaveFailedError, OSError))
    assert coord.iteration == 4 and coord.save_failures == 2
    assert run_entries(run_dir) == ["run.json"]


def test_a_save_that_succeeds_resets_the_failures_in_a_row(run_dir, monkeypatch):
    with_coordinator_options(monkeypatch, max_save_failures=2)
    faults.arm("save.after_shards:enospc hit=1; save.after_shards:eio hit=3; save.after_shards:eio hit=5")
    coord, parts = started(run_dir, every=2, on_save_failure="continue")
    train(coord, parts, until=11)  # saves at 2 (fails), 4, 6 (fails), 8, 10 (fails)
    assert coord.iteration == 11 and coord.save_failures == 1
    assert Run.open(run_dir).committed_steps() == [4, 8]


def test_raise_stops_at_the_first_failed_save(run_dir):
    faults.arm("save.mid_shards:enospc step=2")
    coord, parts = started(run_dir, every=2)  # on_save_failure="raise" is the default
    with pytest.raises(SaveFailedError, match="disk full"):
        train(coord, parts, until=10)
    assert coord.iteration == 2 and coord.save_failures == 0
    assert run_entries(run_dir) == ["run.json"]


def test_a_requested_save_that_fails_always_raises(run_dir):
    faults.arm("save.after_shards:eio step=3")
    coord, parts = started(run_dir, every=4, on_save_failure="continue")
    train(coord, parts, until=2)
    coord.request_save()
    with pytest.raises(ResumeError, match="Input/output error"):
        train(coord, parts, until=10)
    assert coord.iteration == 3


def continuity_error(*args, **kwargs):
    raise ContinuityError("optimizer[0].moments", "saved", "changed", "a bug in the training script")


def adapter_bug(*args, **kwargs):
    raise KeyError("a bug in the adapter")


@pytest.mark.parametrize("fail, kind", [(continuity_error, ContinuityError), (adapter_bug, ResumeError)],
                         ids=["continuity", "bug"])
def test_continue_never_tolerates_a_failure_that_is_not_storage_trouble(run_dir, fail, kind):
    coord, parts = started(run_dir, every=2, on_save_failure="continue")
    coord.adapter.save_shards = fail
    with pytest.raises(kind) as raised:
        train(coord, parts, until=10)
    assert not isinstance(raised.value, (SaveFailedError, OSError))
    assert coord.iteration == 2 and coord.save_failures == 0
    assert run_entries(run_dir) == ["run.json"]


def test_raise_stops_after_a_failed_background_save(run_dir):
    faults.arm("save.after_shards:enospc step=2")
    coord, parts = started(run_dir, every=2, async_save=True)
    assert coord.async_save
    with pytest.raises((SaveFailedError, OSError)):
        train(coord, parts, until=6)
    assert coord.iteration <= 4


def test_continue_counts_failed_background_saves_in_a_row(run_dir, monkeypatch):
    with_coordinator_options(monkeypatch, max_save_failures=2)
    faults.arm("save.after_shards:enospc hit=1; save.after_shards:enospc hit=2")
    coord, parts = started(run_dir, every=2, async_save=True, on_save_failure="continue")
    # The save of step 2 fails in the background, is counted at 4; that of 4 at 6: the 2nd in a row.
    with pytest.raises((SaveFailedError, OSError)):
        train(coord, parts, until=10)
    assert coord.iteration == 6 and coord.save_failures == 2
