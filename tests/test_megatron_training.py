"""megatron.training's real save_checkpoint/load_checkpoint at world size 1, with resume installed:
our manifest beside each save, the counters Megatron does not keep, the continuity check on load."""

from __future__ import annotations

import json
import os

import pytest
from support.checkpoints import flip_byte, plant_metadata_pickle
from support.megatron import saved_manifest
from support.ranks import run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.megatron]



def _resume(rank: int, world: int, save_dir: str, extra: list[str]) -> dict:
    from resume.adapters.megatron import install
    from support import megatron_training_run as m

    from resume.errors import ContinuityError, ResumeError

    recorder = install()  # as a launch script does: before Megatron has parsed its arguments
    args, model, optimizer, scheduler = m.fresh(save_dir, tuple(extra))
    try:
        iteration = m.load(args, model, optimizer, scheduler)
    except ContinuityError as e:
        return {"error": {"item": e.item, "expected": e.expected, "actual": e.actual, "message": str(e)}}
    except ResumeError as e:
        return {"error": {"type": type(e).__name__, "message": str(e)}}
    expected = recorder.loaded.manifest.expectation
    it = m.train(args, model, optimizer, scheduler, recorder, until=iteration + 1, start=iteration)
    return {"iteration": iteration, "ckpt_step_after": args.ckpt_step,
            "consumed": args.consumed_train_samples, "lr_applied": optimizer.param_groups[0]["lr"],
            "promised": expected["lr_ahead"][1][0], "next_ids": expected["next_batch"]["ids"], "it": it}


@pytest.fixture
def trained(megatron_save):
    return megatron_save


def test_each_megatron_save_gets_a_manifest_with_the_three_counters(trained):
    save_dir, result = trained
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "6"
    first, second = saved_manifest(save_dir, 4), saved_manifest(save_dir, 6)
    # One overflow skip by iteration 4: successful = iteration - 1.
    assert (first["train_state"]["iteration"], first["train_state"]["updates_successful"],
            first["train_state"]["updates_skipped"]) == (4, 3, 1)
    # Plus one --iterations-to-skip iteration by 6.
    assert (second["train_state"]["updates_successful"], second["train_state"]["updates_skipped"]) == (4, 2)
    assert second["train_state"]["samples_read"] == 6 * 4
    assert second["expectation"]["next_batch"]["ids"] == [24, 25, 26, 27]
    assert second["expectation"]["lr_ahead"][0][0] == result["lr_now"]
    listed = set(second["files"])
    on_disk = set(os.listdir(os.path.join(save_dir, "iter_0000006"))) - {"resume-manifest.json"}
    assert listed == on_disk and ".metadata" in listed


def test_resume_checks_and_continues_with_the_recorded_batch_and_lr(trained):
    save_dir, _ = trained
    out = run_ranks(_resume, 1, save_dir, [])[0]
    assert "error" not in out, out
    assert out["iteration"] == 6 and out["consumed"] == 24 + 4
    assert out["lr_applied"] == out["promised"]
    assert out["next_ids"] == [24, 25, 26, 27]


def test_changed_lr_decay_samples_is_a_continuity_error_naming_both_lrs(trained):
    save_dir, _ = trained
    out = run_ranks(_resume, 1, save_dir, ["--lr-decay-samples", "480"])[0]
    err = out["error"]
    assert err["item"] == "lr_ahead[+0]"
    recorded = saved_manifest(save_dir, 6)["expectation"]["megatron"]["lr_schedule_ahead"][0]
    assert err["expected"] == recorded and err["actual"] != recorded
    assert str(recorded) in err["message"] and str(err["actual"]) in err["message"]


def test_override_scheduler_flag_does_not_hide_the_change(trained):
    """With --override-opt_param-scheduler Megatron would silently take the new length."""
    save_dir, _ = trained
    out = run_ranks(_resume, 1, save_dir, ["--lr-decay-samples", "480", "--override-opt_param-scheduler"])[0]
    assert out["error"]["item"] == "lr_ahead[+0]"


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(trained, tmp_path):
    import shutil

    save_dir, _ = trained
    copy = str(tmp_path / "save")
    shutil.copytree(save_dir, copy)
    flip_byte(os.path.join(copy, "iter_0000006", "__0_0.distcp"))
    out = run_ranks(_resume, 1, copy, [])[0]
    assert "error" not in out, out
    assert out["iteration"] == 4 and out["consumed"] == 16 + 4
    assert out["ckpt_step_after"] in (None, 0)  # the choice does not outlive the load


def test_planted_pickle_is_refused_before_megatron_unpickles_it(trained, tmp_path):
    """Megatron reads .metadata with plain pickle; resume reads it first, with an allow-list."""
    import shutil

    save_dir, _ = trained
    copy = str(tmp_path / "save")
    shutil.copytree(save_dir, copy)
    marker = tmp_path / "code-ran"
    plant_metadata_pickle(os.path.join(copy, "iter_0000006"), str(marker), manifest="resume-manifest.json")
    out = run_ranks(_resume, 1, copy, [])[0]
    assert out["error"]["type"] == "UnsafeCheckpointError", out
    assert "posix.system" in out["error"]["message"] and "refused" in out["error"]["message"]
    assert not marker.exists()


def _save_on_request_and_on_signal(rank: int, world: int, save_dir: str) -> dict:
    """The two ways a save is asked of a running Megatron job: `resume save` (a request under
    control/, answered after the manifest commits) and Megatron's --exit-signal-handler."""
    import os
    import signal

    from resume.adapters.megatron import MEGATRON_LAYOUT, install
    from support import megatron_training_run as m

    from resume.control import post_save_request
    from resume.run import Run

    args, model, optimizer, scheduler = m.fresh(save_dir, ("--exit-signal-handler",))
    from megatron.training import training  # after fresh(): needs the typing.override alias
    recorder = install(control_poll_s=0.0)
    m.load(args, model, optimizer, scheduler)
    it = m.train(args, model, optimizer, scheduler, recorder, until=2, start=0)
    run = Run.open(save_dir, create=True, layout=MEGATRON_LAYOUT)
    request = post_save_request(run, stop=False, reason="test")
    exit_after_request = training.checkpoint_and_decide_exit(model, optimizer, scheduler, it, 0.0, {}, None)
    with open(os.path.join(save_dir, "control", request.request_id + ".result")) as f:
        answer = json.load(f)
    it = m.train(args, model, optimizer, scheduler, recorder, until=3, start=it)
    os.kill(os.getpid(), signal.SIGTERM)  # Megatron's handler only sets a flag
    exit_after_signal = training.checkpoint_and_decide_exit(model, optimizer, scheduler, it, 0.0, {}, None)
    return {"answer": answer, "exit_after_request": exit_after_request,
            "exit_after_signal": exit_after_signal, "committed": run.committed_steps()}


def test_resume_save_request_and_exit_signal_both_commit_a_manifest(tmp_path):
    out = run_ranks(_save_on_request_and_on_signal, 1, str(tmp_path / "save"))[0]
    assert out["answer"]["step"] == 2 and out["answer"]["error"] is None
    assert out["exit_after_request"] is False
    assert out["exit_after_signal"] is True
    assert out["committed"] == [2, 3]


def test_a_file_the_manifest_does_not_list_is_passed_over_before_megatron_reads_it(trained, tmp_path):
    """Megatron would load a planted common.pt; the manifest lists every file that belongs, so
    the commit check fails for that iteration and the restart loads the one before it."""
    import shutil

    save_dir, _ = trained
    copy = str(tmp_path / "save")
    shutil.copytree(save_dir, copy)
    with open(os.path.join(copy, "iter_0000006", "common.pt"), "wb") as f:
        f.write(b"planted")
    out = run_ranks(_resume, 1, copy, [])[0]
    assert "error" not in out and out["iteration"] == 4, out
