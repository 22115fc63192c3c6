"""Adopting a run that Megatron saved without resume: `resume megatron adopt`, then restarts
with resume installed, all through Megatron's own train() (support.megatron_train_loop).

The run before adoption is Megatron alone: 8 iterations of 12 (it exits at 8), saves at 4 and 8,
no manifest.
Its log (``--log-interval 1``) is what an operator matches a refusal against: Megatron
prints, at iteration N, the LR after that iteration's update.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
from support.cli import resume
from support.megatron import require_megatron

pytestmark = [pytest.mark.megatron, pytest.mark.multiprocess]

SAVE_INTERVAL = 4
NO_DROPOUT = ("--hidden-dropout", "0", "--attention-dropout", "0")


def _flags(save_dir: str, *extra: str, iterations: int = 12) -> list[str]:
    from support.megatron_train_loop import argv_for

    return argv_for(save_dir, iterations, SAVE_INTERVAL, (*NO_DROPOUT, *extra))


@pytest.fixture(scope="module")
def megatron_alone(tmp_path_factory):
    """Megatron's train() with nothing of ours installed; its save directory and its log."""
    require_megatron()
    from support.megatron_train_loop import run_to_end

    tmp = str(tmp_path_factory.mktemp("megatron-alone"))
    save_dir = os.path.join(tmp, "alone")
    # Sized for 12 iterations (the restarts' arguments must match: Megatron derives the weight-decay
    # schedule from the run's length), stopped by Megatron itself at 8 (--exit-interval saves and exits).
    result = run_to_end(tmp, "alone", save_dir=save_dir, extra=_flags(save_dir, "--exit-interval", "8"),
                        install=False)
    with open(os.path.join(tmp, "alone.log")) as f:
        log = f.read()
    return save_dir, result, log


def _copy(megatron_alone, tmp_path) -> str:
    copy = str(tmp_path / "save")
    shutil.copytree(megatron_alone[0], copy)
    return copy


def _manifest(save: str, iteration: int) -> dict:
    with open(os.path.join(save, f"iter_{iteration:07d}", "resume-manifest.json")) as f:
        return json.load(f)


def _logged_lr(log: str, iteration: int) -> str:
    """The 'learning rate' Megatron's training_log printed at ``iteration``."""
    for line in log.splitlines():
        m = re.search(r"iteration\s+(\d+)/\s*\d+ \|.*learning rate: (\S+) \|", line)
        if m and int(m.group(1)) == iteration:
            return m.group(2)
    raise AssertionError(f"no log line for iteration {iteration}")


def test_before_adoption_the_saves_are_unrecorded_and_sound(megatron_alone, tmp_path):
    save = _copy(megatron_alone, tmp_path)
    assert not os.path.exists(os.path.join(save, "iter_0000008", "resume-manifest.json"))
    body = json.loads(resume("ls", save, "--json").stdout)
    assert [(c["step"], c["status"], c["train_state"]["updates_successful"]) for c in body["checkpoints"]] == [
        (4, "unrecorded", 4), (8, "unrecorded", 8)]
    proc = resume("verify", save, "--deep")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "iter_0000008  unrecorded (no resume manifest)" in proc.stdout and "no checksums" in proc.stdout


def test_adopt_then_restart_passes_the_continuity_check_and_trains_on(megatron_alone, tmp_path):
    from support.megatron_train_loop import run_to_end

    save = _copy(megatron_alone, tmp_path)
    proc = resume("megatron", "adopt", save)
    assert proc.returncode == 0, proc.stderr
    assert "iter_0000008: adopted" in proc.stdout
    manifest = _manifest(save, 8)
    counters = {k: manifest["train_state"][k] for k in ("iteration", "samples_read", "updates_successful",
                                                        "updates_skipped")}
    assert counters == {"iteration": 8, "samples_read": 32, "updates_successful": 8, "updates_skipped": 0}
    assert manifest["expectation"]["megatron"]["adopted"]["by"] == "resume megatron adopt"
    assert resume("verify", save, "--deep").returncode == 0
    # Adopting again writes nothing; the manifest is never replaced.
    again = resume("megatron", "adopt", save)
    assert again.returncode == 0 and "already recorded" in again.stdout

    out = run_to_end(str(tmp_path), "after", save_dir=save, extra=_flags(save))
    assert "error" not in out, out
    assert out["loaded"] == 8 and out["start_iteration"] == 8 and out["iteration"] == 12
    after = _manifest(save, 12)
    assert after["train_state"]["updates_successful"] == 12 and "adopted" not in after["expectation"]["megatron"]
    # The first save after the restart records every param group and the RNG again.
    assert after["expectation"]["rng"] and len(after["expectation"]["lr_ahead"][0]) >= 1


def test_adopted_save_with_a_changed_schedule_is_refused_naming_the_iteration_of_megatrons_log(
        megatron_alone, tmp_path):
    from support.megatron_train_loop import run_to_end

    _, _, log = megatron_alone
    save = _copy(megatron_alone, tmp_path)
    assert resume("megatron", "adopt", save, "--iteration", "4").returncode == 0
    out = run_to_end(str(tmp_path), "changed", save_dir=save,
                     extra=_flags(save, "--lr-decay-samples", "480"))
    err = out["error"]
    assert err["type"] == "ContinuityError" and err["item"] == "lr_ahead[+0]", err
    # At iteration 4 (4 successful updates) the checkpoint's LR is the one Megatron logged at
    # iteration 4; the message says so (not "update 5", the numbering of updates).
    assert "Megatron logs at iteration 4" in err["message"]
    assert f"{err['expected']:.6E}" == _logged_lr(log, 4)
    assert f"{err['actual']:.6E}" != _logged_lr(log, 4)
    assert out.get("iteration") is None  # no iteration ran


def test_a_damaged_save_is_not_adopted_and_nothing_is_written(megatron_alone, tmp_path):
    from support.checkpoints import flip_byte

    save = _copy(megatron_alone, tmp_path)
    flip_byte(os.path.join(save, "iter_0000008", "__0_0.distcp"), offset=_tensor_data_offset(save, 8))
    proc = resume("megatron", "adopt", save, "--iteration", "8")
    assert proc.returncode == 1 and "__0_0.distcp" in proc.stderr and "CRC-32" in proc.stderr, proc.stderr
    assert not os.path.exists(os.path.join(save, "iter_0000008", "resume-manifest.json"))
    # Without --iteration the newest good one is adopted, and the damaged one named.
    proc = resume("megatron", "adopt", save)
    assert proc.returncode == 0 and "iter_0000004: adopted" in proc.stdout, proc.stdout + proc.stderr
    assert "passed over" in proc.stdout and "CRC-32" in proc.stdout


def _tensor_data_offset(save: str, iteration: int) -> int:
    """An offset inside the data of a tensor record (not its zip headers)."""
    from support.megatron_records import tensor_data_offset

    return tensor_data_offset(os.path.join(save, f"iter_{iteration:07d}"))


def test_restart_without_adoption_passes_over_a_cut_save_for_the_newest_sound_one(megatron_alone, tmp_path):
    """Nothing adopted: Megatron loads its tracker's save without the continuity check; one whose
    files do not match its .metadata is passed over (Megatron would fail inside its load)."""
    from support.megatron_train_loop import log_tail, run_to_end

    save = _copy(megatron_alone, tmp_path)
    data = os.path.join(save, "iter_0000008", "__0_0.distcp")
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    out = run_to_end(str(tmp_path), "cut", save_dir=save, extra=_flags(save))
    assert "error" not in out, out
    assert out["loaded"] is None and out["start_iteration"] == 4 and out["iteration"] == 12
    log = log_tail(str(tmp_path), "cut", 400)
    assert "passing over iter_0000008 (no resume manifest)" in log and "truncated" in log
