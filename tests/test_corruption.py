"""Every way a checkpoint can be torn, corrupted or tampered with.

For each damage done to the newest checkpoint of a real run (steps 2 and 4,
written by a real training loop through real torch.distributed.checkpoint):

- ``resume verify`` exits 1 with one line naming the file or the field;
- restore passes over it to step 2 and logs why;
- with step 2 damaged too, restore refuses to start from scratch
  (``NoValidCheckpointError``) unless ``allow_fresh_start``.

The ``LATEST`` hint is checked by a whole-run ``verify`` only; restore never
reads it (discovery trusts manifests).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from click.testing import CliRunner
from resume.adapters.megatron import MEGATRON_LAYOUT
from support.checkpoints import flip_byte, write_checkpoint
from support.cli import invoke
from support.workloads import Setup, build, train

from resume import NoValidCheckpointError, Run
from resume.cli import cli
from resume.storage import LocalStorage

STEP4 = "step-000000004"
SHARD = "__0_0.distcp"


# -- the run every test damages a copy of ---------------------------------------------------------


@pytest.fixture(scope="module")
def trained_run(trained_run) -> str:
    """conftest's run (steps 2 and 4, LATEST names 4), whose step 4 holds what the damage below expects."""
    assert sorted(os.listdir(os.path.join(trained_run, STEP4))) == [".metadata", SHARD, "index.resume",
                                                                    "manifest.json", "rank-00000.json"]
    return trained_run


# -- damage, the ways a crash, a bad disk or a tamperer does it ------------------------------------


def step_path(run: str, step: int, *parts: str) -> str:
    return os.path.join(run, f"step-{step:09d}", *parts)


def flip_shard_byte(run: str, step: int) -> None:
    """Silent corruption: same size, one byte different."""
    flip_byte(step_path(run, step, SHARD))


def truncate_shard(run: str, step: int) -> None:
    os.truncate(step_path(run, step, SHARD), os.path.getsize(step_path(run, step, SHARD)) // 2)


def delete_shard(run: str, step: int) -> None:
    os.unlink(step_path(run, step, SHARD))


def plant_file(run: str, step: int) -> None:
    with open(step_path(run, step, "evil.pt"), "wb") as f:
        f.write(b"not listed anywhere")


def delete_manifest(run: str, step: int) -> None:
    os.unlink(step_path(run, step, "manifest.json"))


def write_manifest_text(run: str, step: int, data: bytes) -> None:
    with open(step_path(run, step, "manifest.json"), "wb") as f:
        f.write(data)


def edit_manifest(edit: Callable[[dict], None]) -> Callable[[str, int], None]:
    """Damage that rewrites the manifest's JSON (still valid JSON)."""
    def damage(run: str, step: int) -> None:
        with open(step_path(run, step, "manifest.json")) as f:
            body = json.load(f)
        edit(body)
        write_manifest_text(run, step, json.dumps(body, indent=1).encode())
    return damage


def add_file_entry(path: str) -> Callable[[str, int], None]:
    return edit_manifest(lambda body: body["files"].update({path: {"size": 1, "checksum": "xxh3:00"}}))


def set_counter(name: str, delta: int) -> Callable[[str, int], None]:
    return edit_manifest(lambda body: body["train_state"].update({name: body["train_state"][name] + delta}))


def write_latest(run: str, text: str) -> None:
    with open(os.path.join(run, "LATEST"), "w") as f:
        f.write(text)


# -- how the outcome is observed -------------------------------------------------------------------


def verify(run: str, *args: str) -> tuple[int, str, str]:
    result = invoke("verify", run, *args)
    return result.exit_code, result.stdout, result.stderr


def assert_one_line_problem(run: str, args: tuple[str, ...], *needles: str) -> None:
    code, out, err = verify(run, *args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("resume: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, err)


def restore(run: str, *, allow_fresh_start: bool = False):
    coord, _ = build(0, 1, run, Setup(every=2))
    coord.settings.allow_fresh_start = allow_fresh_start
    try:
        coord.restore()
    finally:
        coord.close()
    return coord


@dataclass(frozen=True)
class Damage:
    damage: Callable[[str, int], None]
    needles: tuple[str, ...]
    """What the one-line ``verify`` error names (file or field, and what is wrong)."""
    log: str
    """What restore's log says about the step it passes over."""
    verify_args: tuple[str, ...] = ()
    damage_previous: Callable[[str, int], None] | None = None
    """How step 2 is damaged so that no good checkpoint is left (default: the same way)."""
    quarantined: bool = True
    """A broken checkpoint is moved aside by restore; a torn one (no manifest) stays."""
    extra: dict = field(default_factory=dict)


DAMAGES = {
    "flipped_byte": Damage(flip_shard_byte, (f"{STEP4}/{SHARD}", "checksum: expected"),
                           log="checksum", verify_args=("--deep",)),
    "truncated_shard": Damage(truncate_shard, (f"{STEP4}/{SHARD}", "size: expected"), log="size: expected"),
    "missing_shard": Damage(delete_shard, (f"{STEP4}/{SHARD}", "actual missing"), log="actual missing"),
    "extra_file": Damage(plant_file, (f"{STEP4}/evil.pt", "expected only the files the manifest lists",
                                      "unlisted file"), log="unlisted file"),
    # A save that never finished: not damage for a whole-run verify (see
    # test_torn_newest_with_a_good_previous_is_not_a_problem), but a problem
    # when that step is asked for.
    "manifest_missing": Damage(delete_manifest, (f"{STEP4}/manifest.json", "missing (uncommitted)"),
                               log="missing (uncommitted)", verify_args=("--step", "4"),
                               damage_previous=truncate_shard, quarantined=False),
    "manifest_not_json": Damage(lambda run, step: write_manifest_text(run, step, b'{"schema": "resume.'),
                                (f"{STEP4}/manifest.json", "expected JSON, actual unparsable"),
                                log="expected JSON"),
    "manifest_schema_version": Damage(edit_manifest(lambda body: body.update(schema_version=2)),
                                      (f"{STEP4}/manifest.json", "schema_version: expected 1, actual 2"),
                                      log="schema_version"),
    "manifest_path_parent": Damage(add_file_entry("../x"),
                                   (f"{STEP4}/manifest.json", "files: expected a path inside the step "
                                    + "directory, actual '../x'"), log="'../x'"),
    "manifest_path_absolute": Damage(add_file_entry("/etc/passwd"),
                                     (f"{STEP4}/manifest.json", "files: expected a path inside the step "
                                      + "directory, actual '/etc/passwd'"), log="'/etc/passwd'"),
    "counters_skipped": Damage(set_counter("updates_skipped", 1),
                               (f"{STEP4}/manifest.json", "iteration: expected updates_successful + "
                                + "updates_skipped = 5, actual 4"), log="updates_skipped"),
    "counters_samples": Damage(set_counter("samples_read", 1),
                               (f"{STEP4}/manifest.json", "samples_read: expected iteration x "
                                + "global_batch = 4 x 4 = 16, actual 17"), log="samples_read"),
}


# -- each damage: verify names it, restore passes over it, and refuses when nothing is left ----------


@pytest.mark.parametrize("case", DAMAGES.values(), ids=DAMAGES.keys())
def test_verify_names_the_damage_with_exit_1(run_copy, case):
    case.damage(run_copy, 4)
    assert_one_line_problem(run_copy, case.verify_args, *case.needles)


def test_flipped_byte_keeps_sizes_so_only_deep_verify_sees_it(run_copy):
    flip_shard_byte(run_copy, 4)
    code, out, err = verify(run_copy)
    assert code == 0, (out, err)
    assert_one_line_problem(run_copy, ("--deep", "--step", "4"), f"{STEP4}/{SHARD}", "checksum")


@pytest.mark.parametrize("case", DAMAGES.values(), ids=DAMAGES.keys())
def test_restore_passes_over_the_damaged_newest_then_refuses_when_none_is_left(run_copy, case, caplog):
    case.damage(run_copy, 4)
    with caplog.at_level("WARNING", logger="resume"):
        coord = restore(run_copy)
    assert coord.restored_from == 2 and coord.iteration == 2
    passed_over = [r.getMessage() for r in caplog.records if "passing over step-000000004" in r.getMessage()]
    assert len(passed_over) == 1 and case.log in passed_over[0], caplog.text
    names = os.listdir(run_copy)
    assert any(n.startswith(f"quarantine-{STEP4}-") for n in names) is case.quarantined, names
    assert (STEP4 in names) is not case.quarantined, names

    (case.damage_previous or case.damage)(run_copy, 2)
    with pytest.raises(NoValidCheckpointError, match="step-000000002.*allow_fresh_start"):
        restore(run_copy)
    coord = restore(run_copy, allow_fresh_start=True)
    assert coord.restored_from is None and coord.iteration == 0


def test_only_torn_step_directories_start_fresh_without_error(run_copy, caplog):
    """What the coordinator does today, asserted so that a change is deliberate: step
    directories that all lack a manifest are saves that never finished (the first save
    of a run crashed), so restore starts fresh, logging each one it passes over. Only a
    manifest that exists and is damaged makes it refuse (NoValidCheckpointError)."""
    delete_manifest(run_copy, 4)
    delete_manifest(run_copy, 2)
    with caplog.at_level("WARNING", logger="resume"):
        coord = restore(run_copy)
    assert coord.restored_from is None and coord.iteration == 0
    assert "passing over step-000000004" in caplog.text and "passing over step-000000002" in caplog.text


def test_torn_newest_with_a_good_previous_is_not_a_problem(run_copy):
    """A crash before the manifest write leaves the newest uncommitted and LATEST naming the
    previous one: a whole-run verify lists it as uncommitted and exits 0."""
    delete_manifest(run_copy, 4)
    write_latest(run_copy, "2\n")
    code, out, err = verify(run_copy)
    assert code == 0, (out, err)
    assert f"{STEP4}  uncommitted (ignored)" in out and "step-000000002  ok" in out


# -- LATEST: a hint that verify checks and restore ignores ----------------------------------------


def test_latest_naming_a_missing_step_is_a_problem(run_copy):
    write_latest(run_copy, "99\n")
    assert_one_line_problem(run_copy, (), "LATEST", "step-000000099", "expected a committed checkpoint",
                            "no such directory")
    assert restore(run_copy).restored_from == 4


def test_latest_garbage_is_a_problem_naming_its_text(run_copy):
    write_latest(run_copy, "banana\n")
    assert_one_line_problem(run_copy, (), "LATEST", "expected a step number", "'banana'")
    code, _, err = verify(run_copy, "--step", "4")  # LATEST is checked only for the whole run
    assert code == 0, err
    assert restore(run_copy).restored_from == 4


def test_latest_naming_a_torn_step_is_a_problem_and_restore_passes_over_it(run_copy, caplog):
    delete_manifest(run_copy, 4)  # LATEST still names step 4
    with open(os.path.join(run_copy, "LATEST")) as f:
        assert f.read().strip() == "4"
    assert_one_line_problem(run_copy, (), "LATEST", STEP4, "expected a committed checkpoint",
                            "uncommitted", "missing (uncommitted)")
    with caplog.at_level("WARNING", logger="resume"):
        assert restore(run_copy).restored_from == 2
    assert "passing over step-000000004" in caplog.text


def test_latest_naming_a_broken_step_is_a_note_beside_the_steps_own_problem(run_copy):
    """The broken step's own problem fails verify; LATEST adds a note, not a second error."""
    truncate_shard(run_copy, 4)
    assert_one_line_problem(run_copy, (), f"{STEP4}/{SHARD}", "size: expected")
    _, out, _ = verify(run_copy)
    assert f"LATEST  note: {run_copy}/LATEST: names {STEP4}, which is broken" in out


def test_latest_older_than_the_newest_committed_is_only_a_note(run_copy):
    write_latest(run_copy, "2\n")  # a crash between the manifest write and the LATEST update
    code, out, err = verify(run_copy)
    assert code == 0 and not err, (out, err)
    assert "LATEST  note:" in out and "older than the newest committed step-000000004" in out
    result = CliRunner().invoke(cli, ["verify", run_copy, "--json"])
    body = json.loads(result.stdout)
    assert result.exit_code == 0 and body["ok"] and body["pointer_problems"] == []
    assert len(body["pointer_notes"]) == 1


def test_latest_missing_is_fine(run_copy):
    os.unlink(os.path.join(run_copy, "LATEST"))
    code, out, err = verify(run_copy)
    assert code == 0, (out, err)


def test_latest_problem_in_json_output(run_copy):
    write_latest(run_copy, "99\n")
    result = CliRunner().invoke(cli, ["verify", run_copy, "--json"])
    body = json.loads(result.stdout)
    assert result.exit_code == 1 and body["ok"] is False
    assert len(body["pointer_problems"]) == 1 and "step-000000099" in body["pointer_problems"][0]
    assert all(s["committed"] for s in body["steps"])


def test_a_restore_that_moved_the_newest_aside_points_latest_at_the_one_it_loaded(run_copy):
    """After a restore passed over a broken newest, LATEST names the checkpoint it loaded,
    not the one moved aside: verify is clean at once, and after the next commit too."""
    flip_shard_byte(run_copy, 4)
    coord, parts = build(0, 1, run_copy, Setup(every=2))
    coord.restore()
    assert coord.restored_from == 2
    assert Run.open(run_copy).latest_hint() == 2
    code, out, err = verify(run_copy)
    assert code == 0, (out, err)
    train(coord, parts, until=4)
    coord.close()
    code, out, err = verify(run_copy, "--deep")
    assert code == 0, (out, err)


# -- the unlisted-entry check on hand-built checkpoints -------------------------------------------


def test_nested_listed_paths_count_their_directory_as_listed_but_a_planted_directory_does_not(tmp_path):
    run = Run.open(str(tmp_path / "run"), create=True)
    write_checkpoint(run, 3, {"model/shard-0.bin": b"w0", "model/sub/shard-1.bin": b"w1", "r.json": b"{}"})
    assert run.check(3).committed
    os.makedirs(os.path.join(run.url, run.dirname(3), "planted", "deeper"))
    result = run.check(3)
    planted = f"{run.url}/{run.dirname(3)}/planted"
    assert result.problems == [f"{planted}: expected only the files the manifest lists, actual an unlisted "
                               + "directory"]


def test_megatron_layout_ignores_its_own_manifest_and_refuses_a_planted_file(tmp_path):
    run = Run(LocalStorage(str(tmp_path / "save")), MEGATRON_LAYOUT)
    run.ensure_exists()
    write_checkpoint(run, 6, {".metadata": b"m", "__0_0.distcp": b"d", "common.pt": b"c"})
    assert run.layout.manifest_name in os.listdir(os.path.join(run.url, "iter_0000006"))
    assert run.check(6).committed
    with open(os.path.join(run.url, "iter_0000006", "extra.pt"), "wb") as f:
        f.write(b"x")
    assert ["iter_0000006/extra.pt" in p and "unlisted file" in p for p in run.check(6).problems] == [True]


class MarkerListingStorage(LocalStorage):
    """An object store with "directory marker" objects: a directory lists itself as an entry."""

    def listdir(self, path: str) -> list[str]:
        names = super().listdir(path)
        return sorted([*names, path.rsplit("/", 1)[-1]]) if path else names


def test_directory_marker_of_an_object_store_is_not_an_unlisted_entry(tmp_path):
    run = Run(MarkerListingStorage(str(tmp_path / "run")))
    run.ensure_exists()
    write_checkpoint(run, 3, {"shard.bin": b"w"})
    assert run.storage.listdir(run.dirname(3)) == ["manifest.json", "shard.bin", "step-000000003"]
    assert run.check(3).committed
