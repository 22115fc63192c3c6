"""resume.run: step directory names, the commit check, discovery, opening and writing a run, retention.

Checkpoints are built by hand (files + a manifest written through Run), and
the damage helpers of support.checkpoints tear or corrupt them the ways a crash
or a bad disk does.
"""

from __future__ import annotations

import json

import pytest
from support.checkpoints import (
    DEFAULT_FILES,
    flip_stored_byte,
    make_manifest,
    state_at,
    truncate,
    write_checkpoint,
    write_torn_checkpoint,
)

from resume.errors import (
    CheckpointNotFoundError,
    ManifestError,
    NoValidCheckpointError,
    RunNotFoundError,
    UsageError,
)
from resume.run import LATEST, KeepPolicy, Run, parse_step_dirname, step_dirname
from resume.storage import LocalStorage


def make_run(tmp_path) -> Run:
    return Run.open(str(tmp_path / "run"), create=True)


# -- step directory names --------------------------------------------------------------------


def test_step_dirname_round_trips_and_ignores_other_names():
    assert step_dirname(200) == "step-000000200"
    assert parse_step_dirname("step-000000200") == 200
    assert parse_step_dirname(step_dirname(12345678901)) == 12345678901
    for other in ("step-200", "step-00000020x", "iter_0000200", "step-000000200.tmp", "LATEST"):
        assert parse_step_dirname(other) is None


# -- the commit check --------------------------------------------------------------------------


def test_check_reports_committed_checkpoint(tmp_path):
    run = make_run(tmp_path)
    written = write_checkpoint(run, 10)
    result = run.check(10)
    assert result.committed
    assert result.problems == []
    assert result.manifest.files == written.files
    assert result.manifest.train_state == state_at(10)
    assert run.is_committed(10)


def test_missing_manifest_is_uncommitted_with_reason(tmp_path):
    run = make_run(tmp_path)
    write_torn_checkpoint(run, 10)
    result = run.check(10)
    assert not result.committed
    assert result.manifest is None
    assert "manifest.json" in result.reason and "uncommitted" in result.reason
    assert "step-000000010" in result.reason


def test_unparsable_manifest_is_uncommitted_naming_the_file(tmp_path):
    run = make_run(tmp_path)
    write_checkpoint(run, 10)
    run.storage.write_bytes_atomic(run.step_path(10, "manifest.json"), b'{"schema": "resume.man')
    result = run.check(10)
    assert not result.committed
    assert run.storage.url(run.step_path(10, "manifest.json")) in result.reason
    assert "expected JSON" in result.reason


def test_listed_file_missing_is_a_problem_naming_the_file(tmp_path):
    run = make_run(tmp_path)
    write_checkpoint(run, 10)
    run.storage.delete(run.step_path(10, "model/shard-1.bin"))
    result = run.check(10)
    assert not result.committed
    assert result.manifest is not None
    assert len(result.problems) == 1
    problem = result.problems[0]
    assert "model/shard-1.bin" in problem and "missing" in problem
    assert f"{len(DEFAULT_FILES['model/shard-1.bin'])} bytes" in problem


def test_wrong_size_is_a_problem_naming_file_expected_and_actual(tmp_path):
    run = make_run(tmp_path)
    write_checkpoint(run, 10)
    truncate(run, 10, "model/shard-0.bin", keep=5)
    result = run.check(10)
    assert not result.committed
    assert len(result.problems) == 1
    problem = result.problems[0]
    expected = len(DEFAULT_FILES["model/shard-0.bin"])
    assert "model/shard-0.bin" in problem
    assert f"expected {expected}" in problem and "actual 5" in problem


def test_every_bad_file_is_listed_not_just_the_first(tmp_path):
    run = make_run(tmp_path)
    write_checkpoint(run, 10)
    truncate(run, 10, "model/shard-0.bin", keep=1)
    run.storage.delete(run.step_path(10, "rank-0.json"))
    problems = run.check(10).problems
    assert len(problems) == 2
    assert any("shard-0.bin" in p for p in problems) and any("rank-0.json" in p for p in problems)


def test_deep_check_catches_flipped_byte_that_keeps_the_size(tmp_path):
    run = make_run(tmp_path)
    written = write_checkpoint(run, 10)
    flip_stored_byte(run, 10, "model/shard-1.bin", offset=3)
    shallow = run.check(10, deep=False)
    assert shallow.committed
    deep = run.check(10, deep=True)
    assert not deep.committed
    assert deep.deep
    assert len(deep.problems) == 1
    problem = deep.problems[0]
    assert "model/shard-1.bin" in problem and "checksum" in problem
    assert written.files["model/shard-1.bin"].checksum in problem


def test_deep_check_reports_progress_over_every_byte(tmp_path):
    run = make_run(tmp_path)
    manifest = write_checkpoint(run, 10)
    seen: list[int] = []
    assert run.check(10, deep=True, progress=seen.append).committed
    assert sum(seen) == manifest.total_bytes


def test_manifest_step_different_from_directory_is_a_problem(tmp_path):
    run = make_run(tmp_path)
    write_checkpoint(run, 10)
    # A manifest for step 20 copied into step 10's directory.
    wrong = make_manifest(20)
    run.storage.write_bytes_atomic(run.step_path(10, "manifest.json"), wrong.to_json().encode())
    result = run.check(10)
    assert not result.committed
    assert "step: expected 10" in result.reason and "actual 20" in result.reason


def test_read_manifest_of_uncommitted_step_raises_checkpoint_not_found(tmp_path):
    run = make_run(tmp_path)
    write_torn_checkpoint(run, 10)
    with pytest.raises(CheckpointNotFoundError, match="step-000000010"):
        run.read_manifest(10)


# -- discovery ---------------------------------------------------------------------------------


def test_step_dirs_lists_only_step_directories_ascending(tmp_path):
    run = make_run(tmp_path)
    for step in (30, 10, 20):
        write_checkpoint(run, step)
    run.storage.makedirs("step-abc")
    run.storage.makedirs("iter_0000040")
    assert run.step_dirs() == [10, 20, 30]


def test_torn_newest_checkpoint_falls_back_to_previous(tmp_path):
    run = make_run(tmp_path)
    write_checkpoint(run, 10)
    write_checkpoint(run, 20)
    write_torn_checkpoint(run, 30)
    manifest, rejected = run.find_latest()
    assert manifest.step == 20
    assert [r.step for r in rejected] == [30]
    assert "uncommitted" in rejected[0].reason


def test_torn_and_corrupt_newest_fall_back_to_previous_with_deep_check(tmp_path):
    run = make_run(tmp_path)
    write_checkpoint(run, 10)
    write_checkpoint(run, 20)
    flip_stored_byte(run, 20, "rank-0.json")
    write_torn_checkpoint(run, 30)
    manifest, rejected = run.find_latest(deep=True)
    assert manifest.step == 10
    assert [r.step for r in rejected] == [30, 20]
    assert "checksum" in rejected[1].reason and "rank-0.json" in rejected[1].reason
    # Without deep, the same-size corruption is not seen.
    manifest, rejected = run.find_latest(deep=False)
    assert manifest.step == 20
    assert [r.step for r in rejected] == [30]


def test_discovery_trusts_manifests_not_the_latest_hint(tmp_path):
    run = make_run(tmp_path)
    write_checkpoint(run, 10)
    write_checkpoint(run, 20)
    run.storage.write_bytes_atomic(LATEST, b"10\n")
    assert run.find_latest()[0].step == 20
    run.storage.write_bytes_atomic(LATEST, b"999\n")
    assert run.latest_or_raise().step == 20


def test_find_latest_on_empty_run_returns_nothing(tmp_path):
    run = make_run(tmp_path)
    assert run.find_latest() == (None, [])


def test_latest_or_raise_on_empty_run_raises_checkpoint_not_found(tmp_path):
    run = make_run(tmp_path)
    with pytest.raises(CheckpointNotFoundError) as info:
        run.latest_or_raise()
    assert info.value.exit_code == 3
    assert isinstance(info.value, FileNotFoundError)
    assert run.url in str(info.value)


def test_latest_or_raise_with_only_invalid_steps_raises_no_valid_checkpoint(tmp_path):
    run = make_run(tmp_path)
    write_torn_checkpoint(run, 10)
    write_checkpoint(run, 20)
    truncate(run, 20, "model/shard-0.bin", keep=2)
    with pytest.raises(NoValidCheckpointError) as info:
        run.latest_or_raise()
    err = info.value
    assert not isinstance(err, FileNotFoundError)
    assert err.exit_code == 1
    message = str(err)
    assert "2 step directories" in message
    assert "step-000000010" in message and "step-000000020" in message


def test_manifest_for_missing_step_raises_checkpoint_not_found(tmp_path):
    run = make_run(tmp_path)
    write_checkpoint(run, 10)
    assert run.manifest_for(10).step == 10
    assert run.manifest_for(None).step == 10
    with pytest.raises(CheckpointNotFoundError, match="step-000000015"):
        run.manifest_for(15)


def test_committed_steps_excludes_torn_and_truncated(tmp_path):
    run = make_run(tmp_path)
    write_checkpoint(run, 10)
    write_torn_checkpoint(run, 20)
    write_checkpoint(run, 30)
    truncate(run, 30, "rank-0.json", keep=0)
    write_checkpoint(run, 40)
    assert run.committed_steps() == [10, 40]


# -- opening a run -------------------------------------------------------------------------------


def test_open_missing_run_raises_run_not_found(tmp_path):
    missing = str(tmp_path / "no-such-run")
    with pytest.raises(RunNotFoundError) as info:
        Run.open(missing)
    assert info.value.exit_code == 3
    assert isinstance(info.value, FileNotFoundError)
    assert missing in str(info.value)


def test_open_missing_memory_run_raises_run_not_found():
    with pytest.raises(RunNotFoundError):
        Run.open("memory://resume-unit-never-created-run")


def test_open_with_create_makes_the_directory(tmp_path):
    url = str(tmp_path / "new-run")
    run = Run.open(url, create=True)
    assert isinstance(run.storage, LocalStorage)
    assert Run.open(url).url == url


def test_run_on_fsspec_storage_commits_and_discovers(tmp_path):
    import uuid

    run = Run.open(f"memory://resume-unit-{uuid.uuid4().hex}", create=True)
    write_checkpoint(run, 10)
    write_checkpoint(run, 20)
    truncate(run, 20, "rank-0.json", keep=1)
    manifest, rejected = run.find_latest()
    assert manifest.step == 10
    assert [r.step for r in rejected] == [20]


# -- writing --------------------------------------------------------------------------------------


def test_write_manifest_updates_latest_hint(tmp_path):
    run = make_run(tmp_path)
    assert run.latest_hint() is None
    write_checkpoint(run, 10)
    assert run.latest_hint() == 10
    assert run.storage.read_bytes(LATEST) == b"10\n"
    write_checkpoint(run, 20)
    assert run.latest_hint() == 20


def test_write_manifest_stamps_created_at_and_is_readable_back(tmp_path):
    run = make_run(tmp_path)
    manifest = write_checkpoint(run, 10)
    assert manifest.created_at  # filled in by write_manifest
    assert run.read_manifest(10) == manifest


def test_latest_hint_ignores_garbage(tmp_path):
    run = make_run(tmp_path)
    run.storage.write_bytes_atomic(LATEST, b"not-a-number")
    assert run.latest_hint() is None


def test_run_info_round_trips_and_rejects_other_schemas(tmp_path):
    run = make_run(tmp_path)
    assert run.read_info() is None
    run.write_info({"fingerprint": "abc", "layout": {"dp": 2}})
    info = run.read_info()
    assert info["fingerprint"] == "abc" and info["schema"] == "resume.run"
    run.storage.write_bytes_atomic("run.json", b'{"schema": "other"}')
    with pytest.raises(ManifestError, match="run.json: schema"):
        run.read_info()
    run.storage.write_bytes_atomic("run.json", b"{nope")
    with pytest.raises(ManifestError, match="expected JSON"):
        run.read_info()


# -- retention ------------------------------------------------------------------------------------


@pytest.mark.parametrize("keep_last", [1, 0, -3])
def test_keep_last_below_two_is_a_usage_error(keep_last):
    with pytest.raises(UsageError) as info:
        KeepPolicy(keep_last=keep_last)
    assert info.value.exit_code == 2
    assert str(keep_last) in str(info.value)


def test_keep_every_below_one_is_a_usage_error():
    with pytest.raises(UsageError, match="keep_every"):
        KeepPolicy(keep_every=0)


def test_select_deletions_keeps_newest_k():
    policy = KeepPolicy(keep_last=3)
    assert policy.select_deletions([50, 10, 40, 20, 30]) == [10, 20]
    assert policy.select_deletions([10, 20, 30]) == []
    assert policy.select_deletions([]) == []


def test_select_deletions_keeps_multiples_of_keep_every():
    policy = KeepPolicy(keep_last=2, keep_every=100)
    steps = [50, 100, 150, 200, 250, 300, 350]
    assert policy.select_deletions(steps) == [50, 150, 250]


def test_retention_deletes_only_old_committed_checkpoints(tmp_path):
    run = make_run(tmp_path)
    write_torn_checkpoint(run, 5)        # old, no manifest: a crashed save's leftover, swept
    for step in (10, 20, 30, 40):
        write_checkpoint(run, step)
    write_torn_checkpoint(run, 50)       # newest, uncommitted: may be a save in progress
    (tmp_path / "run" / "step-000000007").write_text("a file, not a checkpoint")
    deleted = run.apply_retention(KeepPolicy(keep_last=2))
    assert deleted == [10, 20]
    assert run.step_dirs() == [7, 30, 40, 50]  # the stray file is not ours to delete
    assert run.committed_steps() == [30, 40]
    assert run.storage.exists(run.step_path(50, "model/shard-0.bin"))


def test_retention_never_deletes_when_too_few_committed(tmp_path):
    run = make_run(tmp_path)
    write_checkpoint(run, 10)
    write_torn_checkpoint(run, 20)
    write_torn_checkpoint(run, 30)
    assert run.apply_retention(KeepPolicy(keep_last=2)) == []
    assert run.step_dirs() == [10, 20, 30]
    assert run.find_latest()[0].step == 10


def test_retention_keeps_multiples_of_keep_every_forever(tmp_path):
    run = make_run(tmp_path)
    for step in (10, 20, 30, 40, 50):
        write_checkpoint(run, step)
    assert run.apply_retention(KeepPolicy(keep_last=2, keep_every=20)) == [10, 30]
    assert run.step_dirs() == [20, 40, 50]


def test_retention_reads_a_kept_manifest_again_when_its_bytes_change(tmp_path):
    """Retention keeps what it parsed, but only for the very same bytes: a kept checkpoint whose
    manifest was damaged since the last commit no longer counts as kept, so nothing older goes."""
    run = make_run(tmp_path)
    for step in (10, 20, 30):
        write_checkpoint(run, step)
    assert run.apply_retention(KeepPolicy(keep_last=2)) == [10]
    assert set(run._parsed) == {20, 30}  # parsed once, kept for the next commit
    parsed_20 = run._parsed[20][1]
    write_checkpoint(run, 40)
    # Unchanged bytes: the same object, not parsed again.
    assert run.read_manifest(20, reuse=True) is parsed_20
    path = run.manifest_path(30)
    body = json.loads(run.storage.read_bytes(path))
    body["train_state"]["samples_read"] = -1  # still JSON, no longer a valid manifest
    run.storage.write_bytes_atomic(path, json.dumps(body).encode())
    # 40 and the damaged 30 are not two kept checkpoints: 20 stays.
    assert run.apply_retention(KeepPolicy(keep_last=2)) == []
    assert run.step_dirs() == [20, 30, 40]
    assert run.read_manifest(20, reuse=True) is parsed_20


def test_retention_does_not_check_again_the_step_it_was_called_for(tmp_path, monkeypatch):
    run = make_run(tmp_path)
    for step in (10, 20, 30):
        write_checkpoint(run, step)
    checked = []
    check = Run.check
    monkeypatch.setattr(Run, "check", lambda self, step, **kw: checked.append(step) or check(self, step, **kw))
    assert run.apply_retention(KeepPolicy(keep_last=2), just_committed=30) == [10]
    assert checked == [20, 10]
    checked.clear()
    assert run.apply_retention(KeepPolicy(keep_last=2)) == []
    assert checked == [30, 20]
