"""The run's end (``total_iterations``): the last update saves a checkpoint marked complete,
``batches()`` yields nothing after it, also right after a restore at the end, and the README's
loop trains exactly to the end whether it starts fresh, mid-run or at the end."""

from __future__ import annotations

import json

import pytest
from support.cli import resume
from support.workloads import Setup, build, next_token_loss, param_digests, with_coordinator_options

from resume import Run, UsageError
from resume.manifest import MANIFEST_NAME


def readme_loop(run: str, monkeypatch, *, total: int, stop_after: int | None = None) -> tuple[list[int], dict]:
    """The README's loop, as written (no iteration check of its own), for a job that may be
    killed after ``stop_after`` iterations (its coordinator is then abandoned unclosed)."""
    with_coordinator_options(monkeypatch, total_iterations=total)
    coord, parts = build(0, 1, run, Setup(every=4))
    coord.restore()
    seen = []
    for batch in coord.batches():
        loss = next_token_loss(parts["ddp"], batch["tokens"])
        loss.backward()
        parts["opt"].step()
        parts["sched"].step()
        parts["opt"].zero_grad()
        coord.update()
        seen.append(coord.iteration)
        if stop_after is not None and len(seen) >= stop_after:
            break
        if coord.should_stop:
            break
    coord.close()
    return seen, param_digests(parts["model"])


def manifest(run: str, step: int) -> dict:
    with open(f"{run}/step-{step:09d}/{MANIFEST_NAME}") as f:
        return json.load(f)


def test_the_last_update_saves_a_complete_checkpoint_and_nothing_trains_past_it(tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    seen, _ = readme_loop(run, monkeypatch, total=6)
    assert seen == [1, 2, 3, 4, 5, 6]
    assert Run.open(run).committed_steps() == [4, 6]  # 6 is not a multiple of every=4: saved as the end
    assert manifest(run, 6)["complete"] is True and manifest(run, 4)["complete"] is False
    again, _ = readme_loop(run, monkeypatch, total=6)  # restarted at the end: the loop body never runs
    assert again == []
    assert Run.open(run).committed_steps() == [4, 6]


def test_restarted_mid_run_the_loop_ends_where_an_uninterrupted_one_does(tmp_path, monkeypatch):
    _, straight = readme_loop(str(tmp_path / "straight"), monkeypatch, total=7)
    run = str(tmp_path / "run")
    first, _ = readme_loop(run, monkeypatch, total=7, stop_after=5)  # committed 4; 5 is lost
    assert first == [1, 2, 3, 4, 5]
    second, digests = readme_loop(run, monkeypatch, total=7)
    assert second == [5, 6, 7] and digests == straight


def test_a_larger_total_at_a_restart_trains_on(tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    readme_loop(run, monkeypatch, total=4)
    more, _ = readme_loop(run, monkeypatch, total=6)
    assert more == [5, 6] and manifest(run, 6)["complete"] is True


def test_ls_and_inspect_mark_the_complete_checkpoint(tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    readme_loop(run, monkeypatch, total=6)
    listing = resume("ls", run)
    assert listing.returncode == 0 and "run complete at step 6" in listing.stdout
    body = json.loads(resume("ls", run, "--json").stdout)
    assert [c["complete"] for c in body["checkpoints"]] == [False, True]
    inspected = resume("inspect", run)
    assert inspected.returncode == 0 and "complete      yes (the run's last checkpoint)" in inspected.stdout


@pytest.mark.parametrize("total", [0, -3, 2.5, True])
def test_a_total_that_is_not_a_count_of_iterations_is_a_usage_error(tmp_path, total):
    from resume.config import CoordinatorConfig

    with pytest.raises(UsageError, match="total_iterations: expected >= 1 iterations"):
        CoordinatorConfig(global_batch=4, total_iterations=total)
