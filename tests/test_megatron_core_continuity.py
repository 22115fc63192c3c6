"""Continuity around real Megatron-Core checkpoints: dist_checkpointing on 2 gloo ranks at TP2,
reloaded at TP1, with our manifest beside Megatron's files."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from support.checkpoints import flip_byte
from support.megatron import require_megatron
from support.ranks import run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.megatron]

SAVED_AT = 7
SKIPPED = frozenset({4})


def _save_tp2(rank: int, world: int, save_dir: str) -> dict:
    from megatron.core import parallel_state
    from resume.adapters.megatron import MegatronRecorder
    from support import megatron_core_run as w

    model = w.setup(tp=2)
    args = w.make_args(tp=2, dp=1)
    scheduler = w.build_scheduler(args)
    recorder = MegatronRecorder(save_dir)
    w.train(args, scheduler, recorder, SAVED_AT, skip_at=SKIPPED)
    w.save(save_dir, SAVED_AT, model, args, scheduler)
    manifest = recorder.after_save(SAVED_AT, args, scheduler, scheduler.optimizer)
    weights = w.full_weights(model)
    if rank == 0:
        torch.save(weights, os.path.join(save_dir, "..", "weights-tp2.pt"))
    parallel_state.destroy_model_parallel()
    return {"manifest": json.loads(manifest.to_json()) if manifest else None}


def _load_tp1(rank: int, world: int, save_dir: str, overrides: dict, scheduler_mode: str) -> dict:
    from megatron.core import parallel_state
    from resume.adapters.megatron import MegatronRecorder
    from support import megatron_core_run as w

    from resume.errors import ContinuityError

    model = w.setup(tp=1, seed=999)
    args = w.make_args(tp=1, dp=world, **overrides)
    scheduler = w.build_scheduler(args, override=scheduler_mode == "override")
    recorder = MegatronRecorder(save_dir)
    out: dict = {}
    try:
        step = recorder.before_load(args)
        iteration = w.load(save_dir, step, model, args, scheduler) if scheduler_mode != "not_loaded" \
            else _load_model_only(w, save_dir, step, model, args)
        recorder.after_load(iteration, args, scheduler, scheduler.optimizer)
        out["iteration"] = iteration
        saved = torch.load(os.path.join(save_dir, "..", "weights-tp2.pt"))
        out["weights_equal"] = all(torch.equal(t, saved[n]) for n, t in w.full_weights(model).items())
        # Training goes on: the next update gets the LR the manifest promised.
        w.train(args, scheduler, recorder, 1, start=iteration)
        out["lr_next"] = scheduler.optimizer.param_groups[0]["lr"]
    except ContinuityError as e:
        out["error"] = {"item": e.item, "expected": e.expected, "actual": e.actual, "message": str(e)}
    parallel_state.destroy_model_parallel()
    dist.barrier()
    return out


def _load_model_only(w, save_dir, step, model, args):
    """A loader that forgets the scheduler's state (the bug the check must catch)."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()},
                                     os.path.join(save_dir, f"iter_{step:07d}"))
    model.load_state_dict(loaded["model"])
    args.consumed_train_samples = loaded["args"].consumed_train_samples
    return int(loaded["iteration"])


@pytest.fixture(scope="module")
def tp2_save(tmp_path_factory):
    require_megatron()
    save_dir = str(tmp_path_factory.mktemp("mega") / "save")
    os.makedirs(save_dir)
    results = run_ranks(_save_tp2, 2, save_dir)
    return save_dir, results[0]["manifest"]


def test_manifest_beside_megatron_files_counts_the_skipped_update(tp2_save):
    save_dir, manifest = tp2_save
    assert sorted(os.listdir(save_dir)) == ["iter_0000007", "latest_checkpointed_iteration.txt"]
    names = set(os.listdir(os.path.join(save_dir, "iter_0000007")))
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "metadata.json", "resume-manifest.json"} <= names
    assert set(manifest["files"]) == names - {"resume-manifest.json"}
    assert manifest["train_state"] == {"iteration": 7, "samples_read": 7 * 16, "updates_successful": 6,
                                       "updates_skipped": 1, "samples_skipped": 0, "tokens_read": None,
                                       "tokens_in_loss": None}
    assert manifest["expectation"]["next_batch"]["ids"] == list(range(112, 128))
    assert manifest["topology"]["tensor_parallel"] == 2
    assert len(manifest["expectation"]["rng"]) == 2


def test_reload_at_tp1_passes_the_check_and_continues_with_the_promised_lr(tp2_save):
    save_dir, manifest = tp2_save
    out = run_ranks(_load_tp1, 1, save_dir, {}, "plain")[0]
    assert "error" not in out, out
    assert out["iteration"] == 7 and out["weights_equal"] is True
    assert out["lr_next"] == manifest["expectation"]["lr_ahead"][1][0]


def test_reload_at_tp1_dp2_passes_the_check(tp2_save):
    save_dir, _ = tp2_save
    outs = run_ranks(_load_tp1, 2, save_dir, {}, "plain")
    assert [o.get("iteration") for o in outs] == [7, 7], outs
    assert all(o["weights_equal"] for o in outs)


def test_changed_lr_decay_samples_is_named_with_both_lrs_before_loading(tp2_save):
    save_dir, manifest = tp2_save
    out = run_ranks(_load_tp1, 1, save_dir, {"lr_decay_samples": 3200}, "plain")[0]
    assert out["error"]["item"] == "lr_ahead[+0]", out
    assert out["error"]["expected"] == manifest["expectation"]["megatron"]["lr_schedule_ahead"][0]
    assert out["error"]["actual"] != out["error"]["expected"]
    assert "--lr-decay" in out["error"]["message"]


def test_scheduler_state_not_loaded_is_caught_after_loading(tp2_save):
    save_dir, _ = tp2_save
    out = run_ranks(_load_tp1, 1, save_dir, {}, "not_loaded")[0]
    assert out["error"]["item"] == "scheduler.position", out
    assert out["error"]["actual"] == 0


def test_changed_global_batch_is_named(tp2_save):
    save_dir, _ = tp2_save
    out = run_ranks(_load_tp1, 1, save_dir, {"global_batch_size": 32}, "plain")[0]
    assert out["error"]["item"] == "config.global_batch", out
    assert (out["error"]["expected"], out["error"]["actual"]) == ("16", "32")


# -- the choice before Megatron loads (one process, the recorder alone) ---------------------------------


def _before_load(save_dir: str, **overrides) -> int | None:
    from resume.adapters.megatron import MegatronRecorder
    from support import megatron_core_run as w

    return MegatronRecorder(save_dir, lease_ttl_s=None).before_load(w.make_args(**overrides))


def test_ckpt_step_loads_the_checkpoint_it_names_and_a_missing_one_is_refused(tp2_save):
    from resume.errors import CheckpointNotFoundError

    save_dir, _ = tp2_save
    assert _before_load(save_dir, ckpt_step=SAVED_AT) == SAVED_AT
    with pytest.raises(CheckpointNotFoundError, match=r"iter_0000005: expected the checkpoint --ckpt-step "
                       r"names, actual missing"):
        _before_load(save_dir, ckpt_step=5)


def test_a_recorded_checkpoint_whose_files_fail_is_no_fresh_start(tp2_save, tmp_path):
    """Every checkpoint with a manifest failed: refused, naming it and why, never a silent restart
    from scratch (and a pinned one is not exchanged for another)."""
    import shutil

    from resume.errors import NoValidCheckpointError

    save_dir, _ = tp2_save
    copy = str(tmp_path / "save")
    shutil.copytree(save_dir, copy)
    flip_byte(os.path.join(copy, f"iter_{SAVED_AT:07d}", "__1_0.distcp"))
    for pinned in (None, SAVED_AT):
        with pytest.raises(NoValidCheckpointError, match=r"expected a checkpoint whose files verify, actual "
                           r"none \(iter_0000007: .*__1_0.distcp: checksum: expected"):
            _before_load(copy, ckpt_step=pinned)
