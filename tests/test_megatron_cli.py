"""resume verify, ls and inspect on a Megatron save directory written by megatron.training;
bad input and a planted pickle."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from support.checkpoints import CodeRunningPickle, flip_byte, plant_metadata_pickle
from support.cli import assert_one_line_error, resume


# Only the tests on `save` (written by megatron.training) need megatron-core; they are marked
# `megatron` one by one, the others read our own code and run without it (.ci/run checks that
# the marked ones skip where megatron-core is absent).
@pytest.fixture
def save(megatron_save, tmp_path):
    copy = str(tmp_path / "save")
    shutil.copytree(megatron_save[0], copy)
    return copy


@pytest.mark.megatron
@pytest.mark.multiprocess
def test_ls_reports_the_three_counters_of_each_megatron_checkpoint(save):
    proc = resume("ls", save, "--json")
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout)
    assert body["layout"] == "megatron" and body["latest_hint"] == 6
    counters = {c["step"]: (c["status"], c["train_state"]["iteration"], c["train_state"]["samples_read"],
                            c["train_state"]["updates_successful"], c["train_state"]["updates_skipped"])
                for c in body["checkpoints"]}
    assert counters == {4: ("committed", 4, 16, 3, 1), 6: ("committed", 6, 24, 4, 2)}
    # Megatron's own sample counters beside ours (one --iterations-to-skip iteration by 6).
    assert {c["step"]: c["framework_counters"] for c in body["checkpoints"]} == {
        4: {"consumed_train_samples": 16, "skipped_train_samples": 0},
        6: {"consumed_train_samples": 24, "skipped_train_samples": 4}}
    text = resume("ls", save).stdout
    # header, two checkpoints each with Megatron's counters, the lease line
    assert "committed" in text and text.count("\n") == 6, text
    assert "megatron: consumed_train_samples 24, skipped_train_samples 4" in text
    assert text.splitlines()[-1].startswith("lease: ")


@pytest.mark.megatron
@pytest.mark.multiprocess
def test_verify_deep_passes_and_inspect_shows_counters_and_next_batch(save):
    proc = resume("verify", save, "--deep")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "iter_0000006  ok (checksums)" in proc.stdout
    assert "megatron: consumed_train_samples 24, skipped_train_samples 4" in proc.stdout  # Megatron's own
    proc = resume("inspect", save)
    assert proc.returncode == 0, proc.stderr
    assert "updates 4 successful / 2 skipped" in proc.stdout
    assert "consumed_train_samples 24, skipped_train_samples 4" in proc.stdout
    assert "[24, 25, 26, 27]" in proc.stdout
    assert "megatron-core" in proc.stdout


@pytest.mark.megatron
@pytest.mark.multiprocess
def test_a_flipped_byte_in_a_shard_fails_verify_naming_the_file(save):
    flip_byte(os.path.join(save, "iter_0000006", "__0_0.distcp"), offset=1000)
    assert resume("verify", save).returncode == 0  # sizes still right
    assert_one_line_error(resume("verify", save, "--deep"), 1, "iter_0000006/__0_0.distcp", "checksum")


@pytest.mark.megatron
@pytest.mark.multiprocess
def test_megatron_state_that_contradicts_the_manifest_fails_verify(save):
    path = os.path.join(save, "iter_0000006", "resume-manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["train_state"].update(updates_successful=5, updates_skipped=1)  # still iteration 6
    with open(path, "w") as f:
        json.dump(manifest, f)
    assert_one_line_error(resume("verify", save, "--step", "6"), 1, "updates_successful: expected 5 "
                          "(manifest), actual 4 (Megatron's state)")


@pytest.mark.megatron
@pytest.mark.multiprocess
def test_tracker_pointing_at_a_missing_iteration_is_named(save):
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("9")
    assert_one_line_error(resume("verify", save), 1, "latest_checkpointed_iteration.txt",
                          "iter_0000009/", "actual missing")


@pytest.mark.megatron
@pytest.mark.multiprocess
def test_legacy_torch_format_is_named(save):
    legacy = os.path.join(save, "iter_0000008", "mp_rank_00")
    os.makedirs(legacy)
    with open(os.path.join(legacy, "model_optim_rng.pt"), "wb") as f:
        f.write(b"legacy")
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("8")
    assert_one_line_error(resume("verify", save), 1, "iter_0000008", "legacy torch format",
                          "--ckpt-format torch_dist")


def test_not_a_megatron_save_or_empty_is_nothing_there(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    assert_one_line_error(resume("ls", str(tmp_path)), 3, "expected checkpoints, actual none")


@pytest.mark.megatron
@pytest.mark.multiprocess
def test_planted_metadata_pickle_runs_nothing_and_is_named(save, tmp_path):
    marker = tmp_path / "code-ran"
    plant_metadata_pickle(os.path.join(save, "iter_0000006"), str(marker), manifest="resume-manifest.json")
    proc = resume("verify", save, "--deep", "--step", "6")
    assert_one_line_error(proc, 1, "iter_0000006/.metadata", "posix.system", "refused")
    assert not marker.exists()


def test_common_state_reader_calls_nothing_from_the_pickle(tmp_path):
    """Megatron's common state is a torch.save blob; ours reads it as data: a planted global
    becomes an inert record, plain values come through."""
    import argparse
    import io

    import torch
    from resume.adapters.megatron.common import Opaque, common_state_from_dict, unpickle_torch_save

    marker = tmp_path / "code-ran"
    args = argparse.Namespace(global_batch_size=8, consumed_train_samples=40,
                              hook=CodeRunningPickle(f"touch {marker}"))
    buf = io.BytesIO()
    torch.save([{"args": args, "iteration": 5, "checkpoint_version": 3.0,
                 "opt_param_scheduler": {"num_steps": 32}}], buf)
    common = unpickle_torch_save(buf.getvalue(), source="planted")
    assert not marker.exists()
    assert isinstance(common[0]["args"]["hook"], Opaque)
    state = common_state_from_dict(common, source="planted")
    assert state.counters().to_dict()["updates_skipped"] == 1  # 5 iterations, 32 / 8 = 4 successful


def test_settings_resume_cannot_record_are_refused_up_front():
    import argparse

    from resume.adapters.megatron import check_supported

    from resume.errors import UsageError

    check_supported(argparse.Namespace(async_save=True, rampup_batch_size=None))  # committed at finalize
    for name, value, flag in (("rampup_batch_size", [16, 16, 1000], "--rampup-batch-size"),
                              ("save_retain_interval", 1000, "--save-retain-interval")):
        with pytest.raises(UsageError, match=flag):
            check_supported(argparse.Namespace(**{name: value}))


def test_train_step_results_are_counted_except_a_checkpoint_and_exit_return(tmp_path):
    from resume.adapters.megatron import MegatronRecorder, count_train_step

    recorder = MegatronRecorder(str(tmp_path / "save"))
    count_train_step(recorder, ({}, 0, False, False, 0, 1.0, 0, None))   # applied
    count_train_step(recorder, ({}, 1, False, False, 0, None, 0, None))  # skipped update
    count_train_step(recorder, ({}, True, True, True, 16, None, None, None))  # rerun: save and exit
    assert recorder._skipped_since == 1
