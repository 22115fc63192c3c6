"""Symbolic links, special files and odd entries in a run, as another job, another user or a
broken host leaves them (issue 13, items 1, 7 and 8).

Every case starts from a real run (steps 2 and 4, written by a real training loop) and an
``outside`` directory beside it: a secret file and another run's checkpoint. In every case

- nothing outside the run is read, written or deleted (``outside`` is compared, entry by
  entry, with its content and mtime, before and after);
- nothing hangs (each test has a timeout; the CLI and restore run in a subprocess with a
  timeout of their own) and memory stays bounded (the subprocess runs under an address-space
  limit, so reading /dev/zero to the end would fail it);
- ``resume verify`` exits 1 naming the file, with one-line errors and no traceback;
- restore passes over the damaged newest checkpoint to the previous one.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
from support.checkpoints import edit_manifest
from support.hostile import assert_problem, restore_in_subprocess, resume_cli
from support.workloads import trained

from resume.errors import OversizedFileError, UnsafePathError
from resume.run import Run
from resume.storage import SMALL_FILE_CAP, LocalStorage, is_damage

pytestmark = pytest.mark.timeout(180)

STEP2, STEP4 = "step-000000002", "step-000000004"
SHARD = "__0_0.distcp"
SECRET = "API_KEY=sk-live-0123456789abcdef"


# -- the run, the outside world, and what must stay as it is --------------------------------------


@pytest.fixture
def outside(trained_run, tmp_path):
    """A directory beside the run: a secret, and another run's committed steps 2 and 4. Yields
    its path; afterwards every entry must be as it was (content and mtime)."""
    root = tmp_path / "outside"
    root.mkdir()
    (root / "secret.txt").write_text(SECRET + "\n")
    for step in (STEP2, STEP4):
        shutil.copytree(os.path.join(trained_run, step), root / "other-run" / step)
    before = snapshot(str(root))
    yield str(root)
    assert snapshot(str(root)) == before


def snapshot(root: str) -> dict[str, tuple]:
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(d, name)
            st = os.lstat(path)
            content = None if name in dirs or os.path.islink(path) else Path(path).read_bytes()
            out[os.path.relpath(path, root)] = (st.st_mode, st.st_mtime_ns, content)
    return out


# -- the ways a hostile or broken neighbour leaves a file ------------------------------------------


def make_fifo(path: str, outside: str) -> None:
    os.unlink(path)
    os.mkfifo(path)


def link_dev_zero(path: str, outside: str) -> None:
    os.unlink(path)
    os.symlink("/dev/zero", path)


def link_passwd(path: str, outside: str) -> None:
    os.unlink(path)
    os.symlink("/etc/passwd", path)


def link_loop(path: str, outside: str) -> None:
    os.unlink(path)
    os.symlink(os.path.basename(path), path)  # ELOOP


def make_directory(path: str, outside: str) -> None:
    os.unlink(path)
    os.mkdir(path)  # EISDIR


SPECIAL = {"fifo": make_fifo, "dev_zero": link_dev_zero}
FILES = {"manifest": "manifest.json", "shard": SHARD, "rank_state": "rank-00000.json"}


@pytest.mark.parametrize("kind", SPECIAL.keys())
@pytest.mark.parametrize("name", FILES.keys())
def test_special_file_in_a_checkpoint_is_damage_verify_names_it_and_restore_falls_back(
        run_copy, outside, name, kind):
    path = os.path.join(run_copy, STEP4, FILES[name])
    SPECIAL[kind](path, outside)
    assert_problem(resume_cli("verify", run_copy), f"{STEP4}/{FILES[name]}")
    assert_problem(resume_cli("verify", "--deep", run_copy), f"{STEP4}/{FILES[name]}")
    listing = resume_cli("ls", run_copy)
    assert listing.returncode == 0 and "Traceback" not in listing.stderr, listing.stderr
    assert "broken" in listing.stdout, listing.stdout
    assert restore_in_subprocess(run_copy)["restored_from"] == 2


@pytest.mark.parametrize("kind", SPECIAL.keys())
def test_special_latest_is_a_problem_and_never_read(run_copy, outside, kind):
    SPECIAL[kind](os.path.join(run_copy, "LATEST"), outside)
    assert_problem(resume_cli("verify", run_copy), "LATEST", "expected a regular file")
    listing = resume_cli("ls", "--json", run_copy)
    assert listing.returncode == 0, listing.stderr
    assert json.loads(listing.stdout)["latest_hint"] is None
    assert restore_in_subprocess(run_copy)["restored_from"] == 4  # LATEST is a hint; restore never reads it


def test_latest_linked_to_a_secret_outside_is_refused_never_quoted(run_copy, outside):
    latest = os.path.join(run_copy, "LATEST")
    os.unlink(latest)
    os.symlink(os.path.join(outside, "secret.txt"), latest)
    proc = resume_cli("verify", run_copy)
    assert_problem(proc, "LATEST", "symbolic link")
    assert "sk-live" not in proc.stdout + proc.stderr
    proc = resume_cli("verify", "--json", run_copy)
    assert "sk-live" not in proc.stdout + proc.stderr


def test_garbage_latest_is_quoted_capped_and_printable(run_copy):
    with open(os.path.join(run_copy, "LATEST"), "w") as f:
        f.write("\x1b[31m" + "x" * 100_000)
    proc = resume_cli("verify", run_copy)
    assert_problem(proc, "LATEST", "expected a step number")
    assert "\x1b" not in proc.stderr and len(proc.stderr) < 1000, proc.stderr


def test_shard_linked_to_etc_passwd_fails_verify_deep_naming_it(run_copy, outside):
    link_passwd(os.path.join(run_copy, STEP4, SHARD), outside)
    proc = resume_cli("verify", "--deep", "--step", "4", run_copy)
    assert_problem(proc, f"{STEP4}/{SHARD}", "symbolic link")
    assert "root:" not in proc.stdout + proc.stderr
    assert restore_in_subprocess(run_copy)["restored_from"] == 2


@pytest.mark.parametrize("damage", [link_loop, make_directory], ids=["ELOOP", "EISDIR"])
@pytest.mark.parametrize("name", ["manifest", "shard"])
def test_loop_or_directory_is_damage_so_restore_falls_back_instead_of_try_again(run_copy, damage, name):
    damage(os.path.join(run_copy, STEP4, FILES[name]), "")
    assert_problem(resume_cli("verify", run_copy), f"{STEP4}/{FILES[name]}")
    outcome = restore_in_subprocess(run_copy)
    assert outcome.get("restored_from") == 2, outcome
    assert any(n.startswith(f"quarantine-{STEP4}-") for n in os.listdir(run_copy))


def test_over_long_name_in_a_manifest_is_damage_not_an_outage(run_copy):
    edit_manifest(os.path.join(run_copy, STEP4),
                  lambda body: body["files"].__setitem__("n" * 300, dict(body["files"][SHARD])))
    result = Run.open(run_copy).check(4)
    assert not result.committed and result.has_manifest and not result.unreadable, result
    assert "File name too long" in result.reason
    assert restore_in_subprocess(run_copy)["restored_from"] == 2


# -- step directories that are links: retention, quarantine -----------------------------------------


def link_step_into_other_run(run: str, step_dir: str, outside: str) -> str:
    """``run/step_dir`` replaced by a link to the other run's directory of the same name."""
    other = os.path.join(outside, "other-run", step_dir)
    shutil.rmtree(os.path.join(run, step_dir))
    os.symlink(other, os.path.join(run, step_dir))
    return other


def test_a_linked_step_directory_is_a_broken_checkpoint_not_an_outage(run_copy, outside):
    link_step_into_other_run(run_copy, STEP2, outside)
    result = Run.open(run_copy).check(2)
    assert not result.committed and result.has_manifest and not result.unreadable, result
    assert result.status == "broken" and "symbolic link" in result.reason


def test_retention_of_a_real_job_leaves_a_linked_step_and_its_target_alone(run_copy, outside):
    """The job keeps 2: its saves at 6 and 8 make 2 and 4 due for deletion. Step 2 is a link to
    another run's checkpoint (committed there): the link stays, and so does everything it
    points to (the fixture compares); step 4, a real one, goes."""
    link_step_into_other_run(run_copy, STEP2, outside)
    trained(run_copy, until=8, every=2, keep=2)
    names = sorted(os.listdir(run_copy))
    assert os.path.islink(os.path.join(run_copy, STEP2)), names
    assert STEP4 not in names and "step-000000008" in names, names


def test_quarantine_of_a_linked_step_moves_the_link_and_writes_nothing_outside(run_copy, outside):
    other = link_step_into_other_run(run_copy, STEP4, outside)
    outcome = restore_in_subprocess(run_copy)
    assert outcome.get("restored_from") == 2, outcome
    aside = [n for n in os.listdir(run_copy) if n.startswith(f"quarantine-{STEP4}-")]
    assert len(aside) == 1 and os.path.islink(os.path.join(run_copy, aside[0]))
    assert not os.path.exists(os.path.join(other, "QUARANTINED.txt"))


def test_verify_names_a_linked_step_directory(run_copy, outside):
    link_step_into_other_run(run_copy, STEP4, outside)
    assert_problem(resume_cli("verify", run_copy), STEP4, "symbolic link")


def test_a_fifo_named_as_the_newest_step_is_a_problem_and_never_waited_on(run_copy, outside):
    os.mkfifo(os.path.join(run_copy, "step-000000006"))
    assert_problem(resume_cli("verify", run_copy), "step-000000006", "a FIFO")
    assert restore_in_subprocess(run_copy)["restored_from"] == 4


# -- layout detection (item 8) ------------------------------------------------------------------------


def test_stray_megatron_tracker_in_a_native_run_does_not_hide_its_checkpoints(run_copy):
    with open(os.path.join(run_copy, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("4\n")
    proc = resume_cli("verify", run_copy)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert f"{STEP2}  ok" in proc.stdout and f"{STEP4}  ok" in proc.stdout
    assert json.loads(resume_cli("ls", "--json", run_copy).stdout)["layout"] == "resume"


# -- the storage primitives on their own --------------------------------------------------------------


def test_read_bytes_checks_the_size_before_reading(tmp_path):
    with open(tmp_path / "big", "wb") as f:
        f.truncate(1 << 40)  # sparse: reading it would take hours and a terabyte
    storage = LocalStorage(str(tmp_path))
    with pytest.raises(OversizedFileError, match="expected at most 1048576 bytes, actual 1099511627776"):
        storage.read_bytes("big", limit=SMALL_FILE_CAP)
    (tmp_path / "small").write_bytes(b"12\n")
    assert storage.read_bytes("small", limit=3) == b"12\n"
    with pytest.raises(OversizedFileError):
        storage.read_bytes("small", limit=2)


def test_no_link_below_the_root_is_followed_but_the_root_may_be_one(tmp_path):
    (tmp_path / "real" / "d").mkdir(parents=True)
    (tmp_path / "real" / "d" / "f").write_bytes(b"x")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "f").write_bytes(b"secret")
    os.symlink(tmp_path / "real", tmp_path / "root-link")
    os.symlink(tmp_path / "outside", tmp_path / "real" / "linked")
    storage = LocalStorage(str(tmp_path / "root-link"))
    assert storage.read_bytes("d/f") == b"x"
    for path in ("linked/f", "linked"):
        with pytest.raises(UnsafePathError, match="symbolic link"):
            storage.read_bytes(path)
    assert not storage.isdir("linked") and storage.exists("linked") and not storage.exists("linked/f")
    with pytest.raises(UnsafePathError):
        storage.listdir("linked")
    with pytest.raises(UnsafePathError):
        storage.write_bytes_atomic("linked/new", b"y")
    with pytest.raises(UnsafePathError, match="'..'"):
        storage.read_bytes("d/../../outside/f")
    with pytest.raises(UnsafePathError):
        storage.delete("linked/f")
    assert (tmp_path / "outside" / "f").read_bytes() == b"secret"


def test_delete_and_rename_act_on_a_link_never_its_target(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "manifest.json").write_bytes(b"{}")
    os.symlink(tmp_path / "target", tmp_path / "run" / "step")
    storage = LocalStorage(str(tmp_path / "run"))
    storage.rename("step", "aside")
    assert os.path.islink(tmp_path / "run" / "aside")
    storage.delete("aside")
    assert os.listdir(tmp_path / "run") == [] and os.listdir(tmp_path / "target") == ["manifest.json"]


def test_a_fifo_is_refused_without_waiting(tmp_path):
    os.mkfifo(tmp_path / "f")
    storage = LocalStorage(str(tmp_path))
    for read in (lambda: storage.read_bytes("f"), lambda: storage.open_read("f"), lambda: storage.size("f")):
        with pytest.raises(UnsafePathError, match="a FIFO"):
            read()


def test_damage_and_outages_are_told_apart():
    assert is_damage(UnsafePathError("x"))
    for code in (errno.ELOOP, errno.EISDIR, errno.ENOTDIR, errno.ENAMETOOLONG):
        assert is_damage(OSError(code, os.strerror(code)))
    for code in (errno.EIO, errno.ETIMEDOUT, errno.EACCES):
        assert not is_damage(OSError(code, os.strerror(code)))
