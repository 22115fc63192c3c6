"""The coordinator in one process (no process group), with real DCP and a real model."""

from __future__ import annotations

import json
import os

import pytest
import torch
from resume.adapters.torch_native import NativeTorchAdapter
from support.checkpoints import flip_byte
from support.workloads import Setup, build, train, trained

from resume import ContinuityError, Coordinator, NoValidCheckpointError, Run, UsageError


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(run_dir, caplog):
    trained(run_dir, until=6, every=3)
    flip_byte(os.path.join(run_dir, "step-000000006", "__0_0.distcp"))
    coord, parts = build(0, 1, run_dir, Setup(every=3))
    with caplog.at_level("WARNING", logger="resume"):
        coord.restore()
    assert coord.restored_from == 3
    assert "step-000000006" in caplog.text and "checksum" in caplog.text
    # The corrupt one is moved aside (kept, never deleted) and step 6 is written anew.
    quarantined = [n for n in os.listdir(run_dir) if n.startswith("quarantine-step-000000006")]
    assert len(quarantined) == 1
    assert os.path.exists(os.path.join(run_dir, quarantined[0], "__0_0.distcp"))
    train(coord, parts, until=6)
    run = Run.open(run_dir)
    assert run.committed_steps() == [3, 6] and run.check(6, deep=True).committed


def test_no_valid_checkpoint_refuses_a_silent_fresh_start(run_dir):
    trained(run_dir, until=6, every=3)
    for step in (3, 6):
        os.unlink(os.path.join(run_dir, f"step-{step:09d}", "rank-00000.json"))
    coord, _ = build(0, 1, run_dir, Setup(every=3))
    with pytest.raises(NoValidCheckpointError, match="none valid.*allow_fresh_start"):
        coord.restore()
    coord.settings.allow_fresh_start = True
    state = coord.restore()
    assert state.iteration == 0 and coord.restored_from is None


def test_uncommitted_leftover_of_the_same_step_is_replaced(run_dir):
    trained(run_dir, until=7, every=3)
    step6 = os.path.join(run_dir, "step-000000006")
    os.unlink(os.path.join(step6, "manifest.json"))  # a save of step 6 that never committed
    with open(os.path.join(step6, "junk.tmp"), "w") as f:
        f.write("half-written")
    coord, parts = build(0, 1, run_dir, Setup(every=3))
    coord.restore()
    assert coord.restored_from == 3
    train(coord, parts, until=7)
    assert not os.path.exists(os.path.join(step6, "junk.tmp"))
    assert Run.open(run_dir).committed_steps() == [3, 6]


def test_a_damaged_checkpoint_of_the_step_being_saved_is_moved_aside_not_deleted(run_dir):
    coord = trained(run_dir, until=6, every=3)
    step6 = os.path.join(run_dir, "step-000000006")
    shard = next(os.path.join(step6, n) for n in sorted(os.listdir(step6)) if n.endswith(".distcp"))
    with open(shard, "r+b") as f:
        f.truncate(10)  # damaged, with its manifest: evidence an operator may want
    coord.last_committed_step = None  # as after a restart that passed over it and reached 6 again
    coord.save()
    run = Run.open(run_dir)
    assert run.committed_steps() == [3, 6]
    moved = [n for n in os.listdir(run_dir) if n.startswith("quarantine-step-000000006-")]
    assert len(moved) == 1
    with open(os.path.join(run_dir, moved[0], "QUARANTINED.txt")) as f:
        reason = f.read()
    assert "size: expected" in reason and ".distcp" in reason


def test_storage_that_refuses_a_read_stops_the_restore_and_moves_nothing(run_dir, monkeypatch):
    import errno

    from resume.errors import StorageError
    from resume.storage import LocalStorage

    trained(run_dir, until=6, every=3)
    size, sizes = LocalStorage.size, LocalStorage.sizes

    def eio_on_step6(self, path):
        if path.startswith("step-000000006/"):
            raise OSError(errno.EIO, "Input/output error")
        return size(self, path)

    def eio_listing_step6(self, path):  # the commit check lists a directory's sizes first
        if path.startswith("step-000000006"):
            raise OSError(errno.EIO, "Input/output error")
        return sizes(self, path)
    monkeypatch.setattr(LocalStorage, "size", eio_on_step6)
    monkeypatch.setattr(LocalStorage, "sizes", eio_listing_step6)
    coord, _ = build(0, 1, run_dir, Setup(every=3))
    with pytest.raises(StorageError, match=r"step-000000006: expected readable storage, actual .*"
                       r"Input/output error \(nothing passed over or moved; try again\)"):
        coord.restore()
    coord.close()
    monkeypatch.undo()
    assert sorted(os.listdir(run_dir)) == ["LATEST", "journal", "run.json", "step-000000003", "step-000000006"]
    assert Run.open(run_dir).committed_steps() == [3, 6]


def test_update_reported_applied_without_an_optimizer_step_is_caught(run_dir):
    coord, _ = build(0, 1, run_dir, Setup())
    coord.restore()
    next(iter(coord.batches()))
    with pytest.raises(ContinuityError, match=r"optimizer\[0\]\.steps.*did not step"):
        coord.update(applied=True)


def test_request_save_commits_at_the_next_boundary(run_dir):
    coord, parts = build(0, 1, run_dir, Setup(every=0))
    coord.restore()
    train(coord, parts, until=2)
    coord.request_save()
    train(coord, parts, until=3)
    assert Run.open(run_dir).committed_steps() == [3]
    assert not coord.should_stop
    coord.request_save(stop=True)
    train(coord, parts, until=10)
    assert coord.should_stop and coord.iteration == 4
    assert Run.open(run_dir).committed_steps() == [3, 4]


def test_retention_keeps_the_newest_and_every_mth(run_dir):
    coord, parts = build(0, 1, run_dir, Setup(every=1))
    coord.retention = type(coord.retention)(keep_last=2, keep_every=4)
    coord.restore()
    train(coord, parts, until=9)
    assert Run.open(run_dir).committed_steps() == [4, 8, 9]


def test_lr_changed_between_restore_and_the_first_update_is_caught(run_dir):
    trained(run_dir, until=3, every=3)
    coord, parts = build(0, 1, run_dir, Setup(every=3))
    coord.restore()
    parts["opt"].param_groups[0]["lr"] = 0.5
    with pytest.raises(ContinuityError, match="lr at the first update"):
        next(iter(coord.batches()))


def test_manifest_records_counters_and_expectation(run_dir):
    trained(run_dir, until=3, every=3)
    with open(os.path.join(run_dir, "step-000000003", "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["train_state"]["iteration"] == 3
    e = manifest["expectation"]
    assert len(e["lr_ahead"]) == 3 and e["optimizer_steps"] == [3]
    assert e["next_batch"]["samples"] == 4 and len(e["rng"]) == 1
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp", "index.resume", "rank-00000.json"}


def test_bad_configuration_is_a_usage_error(run_dir):
    _, parts = build(0, 1, run_dir, Setup())
    adapter = NativeTorchAdapter(parts["model"], parts["opt"], parts["sched"], [])
    with pytest.raises(UsageError, match="keep: expected >= 2"):
        Coordinator(run_dir, adapter, global_batch=4, keep=1)
    with pytest.raises(UsageError, match="global_batch"):
        Coordinator(run_dir, adapter, global_batch=0)
    with pytest.raises(UsageError, match="lr_lookahead"):
        Coordinator(run_dir, adapter, global_batch=4, lr_lookahead=1)


@pytest.mark.parametrize("scheme", ["local", "memory"])
def test_fsspec_run_url_saves_and_restores_through_the_fsspec_path(tmp_path, scheme):
    run = f"local://{tmp_path}/run" if scheme == "local" else f"memory://resume-test-{os.getpid()}/run"
    coord = trained(run, until=5, every=2)
    assert type(coord.run.storage).__name__ == "FsspecStorage"
    assert coord.run.committed_steps() == [2, 4]
    assert coord.run.check(4, deep=True).committed
    coord2, parts = build(0, 1, run, Setup(every=2))
    coord2.restore()
    assert coord2.restored_from == 4
    train(coord2, parts, until=6)
    coord2.close()
    assert coord2.run.committed_steps() == [2, 4, 6]


def test_a_first_save_that_never_committed_does_not_block_a_fresh_start(run_dir):
    os.makedirs(os.path.join(run_dir, "step-000000003"))  # killed during the very first save
    coord, parts = build(0, 1, run_dir, Setup(every=3))
    assert coord.restore().iteration == 0
    train(coord, parts, until=3)
    assert Run.open(run_dir).committed_steps() == [3]


def test_junk_in_the_control_area_does_not_stop_training(run_dir, caplog):
    coord, parts = build(0, 1, run_dir, Setup(every=0))
    os.makedirs(os.path.join(run_dir, "control", "save-x.request"))  # a directory, not a file
    coord.restore()
    with caplog.at_level("WARNING", logger="resume"):
        train(coord, parts, until=3)
    assert coord.iteration == 3


def test_stray_file_named_like_a_step_is_reported_not_fatal(run_dir):
    trained(run_dir, until=3, every=3)
    with open(os.path.join(run_dir, "step-000000099"), "w") as f:
        f.write("not a directory")
    coord, _ = build(0, 1, run_dir, Setup(every=3))
    coord.restore()
    assert coord.restored_from == 3


def test_each_call_to_batches_starts_the_next_pass_over_finite_data(run_dir):
    _, parts = build(0, 1, run_dir, Setup())

    class Epoch:
        """Four batches per pass, like a DataLoader over a finite data set."""

        def __iter__(self):
            for i in range(4):
                yield {"ids": torch.tensor([i]), "x": torch.zeros(1)}

    adapter = NativeTorchAdapter(parts["model"], parts["opt"], parts["sched"], Epoch())
    coord = Coordinator(run_dir, adapter, global_batch=1, every=0, handle_signals=False)
    coord.restore()
    counts = []
    for _ in range(3):
        n = 0
        for _batch in coord.batches():
            parts["opt"].step()
            parts["sched"].step()
            coord.update(applied=True)
            n += 1
        counts.append(n)
    coord.close()
    assert counts == [4, 4, 4]


def test_config_with_tuples_and_int_keys_survives_a_restart(run_dir):
    extra = {"betas": (0.9, 0.95), "layers": {1: "attn"}}
    trained(run_dir, until=2, every=2, extra=extra)
    coord, _ = build(0, 1, run_dir, Setup(every=2, extra=extra))
    coord.restore()
    assert coord.restored_from == 2


def test_async_save_stages_then_commits_in_the_background_and_close_waits(run_dir):
    """The loop goes on after the copy; what is written is the state at the save, not later."""
    import torch
    from resume.adapters.torch_native import NativeTorchAdapter

    from resume.run import Run

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = [{"x": torch.randn(4, 64), "ids": torch.arange(4 * i, 4 * i + 4)} for i in range(12)]

    class Data:
        def __init__(self):
            self.pos = 0

        def __iter__(self):
            while self.pos < len(data):
                self.pos += 1
                yield data[self.pos - 1]

        def state_dict(self):
            return {"pos": self.pos}

        def load_state_dict(self, state):
            self.pos = state["pos"]

    adapter = NativeTorchAdapter(model, opt, None, Data())
    coord = Coordinator(run_dir, adapter, global_batch=4, every=3, async_save=True, handle_signals=False)
    coord.restore()
    saved_weights = {}
    for batch in coord.batches():
        model(batch["x"]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if coord.iteration + 1 == 3:
            saved_weights = {k: v.clone() for k, v in model.state_dict().items()}
        coord.update()
        if coord.iteration == 5:
            break
    coord.close()  # waits for the save of iteration 3
    assert coord.last_committed_step == 3
    run = Run.open(run_dir)
    assert run.committed_steps() == [3]
    assert "stall_s" in run.read_manifest(3).timing
    # A fresh coordinator loads what iteration 3 had, though the model moved on while it was written.
    model2 = torch.nn.Linear(64, 64)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    coord2 = Coordinator(run_dir, NativeTorchAdapter(model2, opt2, None, Data()), global_batch=4, every=3,
                         handle_signals=False)
    coord2.restore()
    assert coord2.restored_from == 3
    assert all(torch.equal(model2.state_dict()[k], v) for k, v in saved_weights.items())


def test_a_disk_that_fills_mid_save_keeps_the_previous_checkpoint_and_says_how_much(run_dir, monkeypatch):
    import errno

    import torch
    from resume.adapters.dcp import filesystem as dcp_io
    from resume.adapters.torch_native import NativeTorchAdapter

    from resume.errors import SaveFailedError
    from resume.run import Run

    # 2048 x 2048: past torch.save's 8 MiB buffer, the zip writer re-raises ENOSPC as a RuntimeError.
    model = torch.nn.Linear(2048, 2048)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # The loop below draws no batches: no data (a loader it drew around would be refused).
    coord = Coordinator(run_dir, NativeTorchAdapter(model, opt, None, None), global_batch=1, every=0,
                        handle_signals=False)
    coord.restore()
    model(torch.randn(2, 2048)).sum().backward()
    opt.step()
    coord.update()
    assert coord.save() == 1
    coord.update(applied=False)
    write = dcp_io._HashingSink.write
    budget = {"left": 20_000_000}

    def fills_up(self, b):
        budget["left"] -= len(b)
        if budget["left"] < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, b)
    monkeypatch.setattr(dcp_io._HashingSink, "write", fills_up)
    with pytest.raises(SaveFailedError, match=r"disk full \(or quota\) on ranks \[0\]: expected room for "
                       r"each rank's shards, about \d+ bytes"):
        coord.save()
    monkeypatch.undo()
    run = Run.open(run_dir)
    assert run.committed_steps() == [1]
    assert run.step_dirs() == [1]  # the partial step was removed: its room is free again
    manifest, rejected = run.find_latest(deep=True)
    assert manifest.step == 1 and rejected == []


def test_zstd_compressed_shards_restore_bitwise(run_dir):
    import torch
    from resume.adapters.torch_native import NativeTorchAdapter

    from resume.errors import UsageError

    def build(compression):
        torch.manual_seed(0)
        model = torch.nn.Linear(128, 128)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, opt, Coordinator(run_dir, NativeTorchAdapter(model, opt, None, None, compression=compression),
                                       global_batch=1, every=0, handle_signals=False)

    model, opt, coord = build("zstd")
    coord.restore()
    model(torch.randn(2, 128)).sum().backward()
    opt.step()
    coord.update()
    coord.save()
    import os

    step = os.path.join(run_dir, "step-000000001")
    assert os.path.getsize(os.path.join(step, "__0_0.distcp")) < 128 * 129 * 4 * 3  # compressed
    model2, opt2, coord2 = build(None)  # any reader decompresses: it is recorded in the metadata
    coord2.restore()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    assert opt2.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])
    with pytest.raises(UsageError, match="compression"):
        NativeTorchAdapter(model, opt, None, [], compression="lz4")
