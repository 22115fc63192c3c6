"""The update journal and the rewind on a Megatron run (issue 26), through Megatron's own train().

Each run is a fresh process (``support.megatron_train_loop``): the installed ``train_step``
writes rank 0's journal, each commit seals it (the manifest's ``journal``), the end of
``train()`` closes it. A rewind with a skip is refused (Megatron's data position cannot skip);
one without moves the later iterations to the abandoned branch, points Megatron's tracker at
the target, and the next launch resumes there, with the rewind carried in later manifests.
The first tests need no Megatron: ``MegatronUpdates`` and ``rewind_accepts`` on their own.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from support.cli import assert_one_line_error, resume
from support.megatron import require_megatron, saved_manifest

# The record's own rules run anywhere; the tests through Megatron's train() are marked megatron
# (they skip without megatron-core, which .ci/run's fresh-machine step checks).
pytestmark = [pytest.mark.multiprocess]

ITERATIONS, SAVE_INTERVAL, GBS = 8, 4, 4
OVERFLOW_AT = [3]  # optimizer.step() reports update_successful=False at iteration 3
NO_DROPOUT = ("--hidden-dropout", "0", "--attention-dropout", "0")
LONGER_DECAY = ("--lr-decay-samples", "480", "--override-opt_param-scheduler")


# -- without Megatron ---------------------------------------------------------------------------


class _Args:
    def __init__(self, it: int, *, clip: float = 0.0) -> None:
        self.curr_iteration, self.consumed_train_samples, self.global_batch_size = it - 1, (it - 1) * GBS, GBS
        self.clip_grad = clip


def _step(updates, it: int, *, loss, grad_norm, skipped: bool = False, clip: float = 0.0) -> None:
    lrs = updates.lrs(type("Opt", (), {"param_groups": [{"lr": 1e-3}, {"lr": 2e-3}]})())
    updates.record((loss, int(skipped), False, False, 0, grad_norm, None, 0), _Args(it, clip=clip), lrs,
                   skipped=skipped)


def _records(lines: list[bytes]) -> list[dict]:
    return [json.loads(line) for line in lines]


def test_records_are_written_one_step_late_and_hold_what_train_step_returned(tmp_path):
    import torch
    from resume.adapters.megatron.updates import MegatronUpdates

    from resume.storage import open_storage

    updates = MegatronUpdates(open_storage(str(tmp_path)))
    _step(updates, 1, loss={"lm loss": torch.tensor(2.5), "other": torch.tensor(9.0)}, grad_norm=3.0, clip=1.0)
    assert updates.journal.snapshot(1) == []  # the loss is read back when the next step is recorded
    _step(updates, 2, loss={"load balancing": torch.tensor([1.0, 3.0])}, grad_norm=None, skipped=True)
    _step(updates, 3, loss={}, grad_norm=float("nan"), clip=1.0)
    first, second, third = _records(updates.snapshot(3))
    assert first == {"it": 1, "ok": True, "at": 0, "n": GBS, "lr": [1e-3, 2e-3], "loss": 2.5, "grad_norm": 3.0,
                     "clipped": True}
    assert second == {"it": 2, "ok": False, "at": GBS, "n": GBS, "loss": 2.0}  # no LR, no norm: skipped
    assert third == {"it": 3, "ok": True, "at": 2 * GBS, "n": GBS, "lr": [1e-3, 2e-3], "grad_norm": "nan",
                     "clipped": False}


def test_a_seal_takes_each_record_once_and_a_second_save_of_a_step_keeps_its_segment(tmp_path):
    from resume.adapters.megatron.updates import MegatronUpdates

    from resume.storage import open_storage

    updates = MegatronUpdates(open_storage(str(tmp_path)))
    for it in (1, 2):
        _step(updates, it, loss={"lm loss": 1.0}, grad_norm=1.0)
    early = updates.snapshot(2)  # --async-save: the save of 2 is still in flight ...
    for it in (3, 4):
        _step(updates, it, loss={"lm loss": 1.0}, grad_norm=1.0)
    late = updates.snapshot(4)  # ... when the save of 4 takes its records
    first = updates.seal(2, early)
    second = updates.seal(4, late)
    assert (first["records"], second["records"], second["first"]) == (2, 2, 3)
    assert updates.seal(4, updates.snapshot(4)) == second
    updates.close()
    assert sorted(os.listdir(tmp_path / "journal")) == ["sealed-000000002.jsonl", "sealed-000000004.jsonl"]


def test_a_loop_that_never_feeds_the_journal_seals_nothing(tmp_path):
    from resume.adapters.megatron.updates import MegatronUpdates

    from resume.storage import open_storage

    updates = MegatronUpdates(open_storage(str(tmp_path)))
    updates.start(None, None)
    assert updates.seal(4, updates.snapshot(4)) is None
    updates.close()
    assert not os.path.exists(tmp_path / "journal")


@pytest.mark.parametrize(("accept", "changed", "accepted"), [
    (["lr_decay_steps"], {"lr_decay_steps": 480.0}, True),
    (["schedule"], {"lr_decay_steps": 480.0, "min_lr": 0.0}, True),
    (["lr"], {"max_lr": 5e-4}, True),
    (["lr"], {"lr_decay_steps": 480.0}, False),
    (["lr_decay_steps"], {"lr_decay_steps": 480.0, "min_lr": 0.0}, False),
    (["lr"], {}, False),
])
def test_a_rewind_accepts_a_schedule_change_only_when_it_names_every_changed_field(accept, changed, accepted):
    from resume.adapters.megatron.restart import rewind_accepts

    saved = {"init_lr": 0.0, "max_lr": 1e-3, "min_lr": 1e-5, "lr_warmup_steps": 8.0, "lr_decay_steps": 320.0,
             "lr_decay_style": "cosine", "wsd_decay_steps": None, "lr_wsd_decay_style": None}
    assert rewind_accepts({"n": 1, "accept": accept}, [saved], [{**saved, **changed}]) is accepted
    assert rewind_accepts(None, [saved], [{**saved, **changed}]) is False


# -- Megatron's train() ---------------------------------------------------------------------------


def _flags(save_dir: str, *extra: str) -> list[str]:
    from support.megatron_train_loop import argv_for

    return argv_for(save_dir, ITERATIONS, SAVE_INTERVAL, (*NO_DROPOUT, *extra))


def _journal(save_dir: str) -> dict[str, dict]:
    proc = resume("journal", save_dir, "--json")
    assert proc.returncode == 0, proc.stderr
    return {b["name"]: b for b in json.loads(proc.stdout)["branches"]}


def _tree(root: str) -> dict[str, bytes]:
    out = {}
    for top, _, names in os.walk(root):
        for name in names:
            path = os.path.join(top, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


@pytest.fixture(scope="module")
def journaled(tmp_path_factory):
    """8 iterations through Megatron's train(), saves at 4 and 8, an overflow skip at 3."""
    require_megatron()
    from support.megatron_train_loop import run_to_end

    tmp = str(tmp_path_factory.mktemp("megatron-journal"))
    save_dir = os.path.join(tmp, "save")
    result = run_to_end(tmp, "journaled", save_dir=save_dir, extra=_flags(save_dir), overflow_at=OVERFLOW_AT)
    assert result["iteration"] == ITERATIONS and result["last_committed"] == ITERATIONS, result
    return save_dir, result


@pytest.mark.megatron
def test_train_records_every_iteration_and_each_save_seals_them(journaled):
    from resume.checksum import checksum_bytes

    save_dir, result = journaled
    branches = _journal(save_dir)
    assert list(branches) == ["main"] and branches["main"]["problems"] == []
    records = branches["main"]["records"]
    assert [r["it"] for r in records] == list(range(1, ITERATIONS + 1))
    assert [r["ok"] for r in records] == [it not in OVERFLOW_AT for it in range(1, ITERATIONS + 1)]
    assert [(r["at"], r["n"]) for r in records] == [((it - 1) * GBS, GBS) for it in range(1, ITERATIONS + 1)]
    for r in records:
        assert r["loss"] == pytest.approx(result["losses"][str(r["it"] - 1)], rel=1e-5)  # 'lm loss'
        if r["ok"]:
            assert len(r["lr"]) == 2 and r["grad_norm"] > 0 and r["clipped"] is False  # --clip-grad 0
        else:  # the overflow: no update applied, no norm
            assert "lr" not in r and "grad_norm" not in r
    # The LR recorded is the one each update applied: what the save at 4 promised for 5 and 6.
    promised = saved_manifest(save_dir, 4)["expectation"]["lr_ahead"]
    assert [records[4]["lr"], records[5]["lr"]] == promised[:2]

    first, second = saved_manifest(save_dir, 4)["journal"], saved_manifest(save_dir, 8)["journal"]
    assert (first["step"], first["records"], first["first"]) == (4, 4, 1)
    assert (second["step"], second["records"], second["first"]) == (8, 4, 5)
    for entry in (first, second):
        with open(os.path.join(save_dir, entry["segment"]), "rb") as f:
            data = f.read()
        assert (len(data), checksum_bytes(data)) == (entry["size"], entry["checksum"])
    with open(os.path.join(save_dir, second["segment"]), "rb") as f:
        assert json.loads(f.readline())["prev"] == first  # the chain
    # The end of train() closed the journal: every record sealed, no open file left.
    assert sorted(os.listdir(os.path.join(save_dir, "journal"))) == ["sealed-000000004.jsonl",
                                                                      "sealed-000000008.jsonl"]


@pytest.mark.megatron
def test_with_async_save_each_commit_at_megatron_finalize_seals_the_records_up_to_its_iteration(tmp_path):
    require_megatron()
    from support.megatron_train_loop import run_to_end

    tmp = str(tmp_path)
    save_dir = os.path.join(tmp, "save")
    out = run_to_end(tmp, "async", save_dir=save_dir, extra=_flags(save_dir, "--async-save"))
    assert out["last_committed"] == ITERATIONS, out
    assert [r["it"] for r in _journal(save_dir)["main"]["records"]] == list(range(1, ITERATIONS + 1))
    entries = [saved_manifest(save_dir, step)["journal"] for step in (4, 8)]
    assert [(e["step"], e["first"], e["records"]) for e in entries] == [(4, 1, 4), (8, 5, 4)]


@pytest.mark.megatron
def test_a_rewind_with_a_skip_is_refused_naming_megatron_and_changes_nothing(journaled, tmp_path):
    save_dir = str(tmp_path / "save")
    shutil.copytree(journaled[0], save_dir)
    before = _tree(save_dir)
    proc = resume("rewind", save_dir, "--to", "4", "--skip-samples", "16:20", "--reason", "spike at 5")
    assert_one_line_error(proc, 1, "--skip-samples", "megatron-core", "Megatron's data position")
    assert _tree(save_dir) == before


@pytest.mark.megatron
def test_a_rewind_without_a_skip_resumes_at_its_target_and_carries_the_rewind(journaled, tmp_path):
    from support.megatron_train_loop import run_to_end

    reference_dir, reference = journaled
    tmp = str(tmp_path)
    save_dir = os.path.join(tmp, "save")
    shutil.copytree(reference_dir, save_dir)
    proc = resume("rewind", save_dir, "--to", "4", "--reason", "spike at 5")
    assert proc.returncode == 0, proc.stderr
    assert os.path.isdir(os.path.join(save_dir, "abandoned", "rewind-0001", "iter_0000008"))
    assert not os.path.exists(os.path.join(save_dir, "iter_0000008"))
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "4"

    resumed = run_to_end(tmp, "resumed", save_dir=save_dir, extra=_flags(save_dir))
    assert "error" not in resumed, resumed
    assert (resumed["loaded"], resumed["start_iteration"], resumed["iteration"]) == (4, 4, ITERATIONS)
    assert resumed["losses"] == {k: v for k, v in reference["losses"].items() if int(k) >= 4}
    assert resumed["params"] == reference["params"]
    (carried,) = saved_manifest(save_dir, 8)["rewinds"]
    assert (carried["n"], carried["to"], carried["from"], carried["reason"]) == (1, 4, 8, "spike at 5")

    branches = _journal(save_dir)
    assert list(branches) == ["main", "rewind 1"] and branches["rewind 1"]["abandoned"]
    main, abandoned = branches["main"]["records"], branches["rewind 1"]["records"]
    assert [r["it"] for r in main] == list(range(1, 9)) and [r["it"] for r in abandoned] == [5, 6, 7, 8]
    assert main[4:] == abandoned  # the same updates again: nothing changed but the run's history
    with open(os.path.join(save_dir, saved_manifest(save_dir, 8)["journal"]["segment"]), "rb") as f:
        assert json.loads(f.readline())["prev"] == saved_manifest(save_dir, 4)["journal"]


@pytest.mark.megatron
def test_a_rewind_accepting_the_decay_length_resumes_on_the_new_schedule(journaled, tmp_path):
    """Without the rewind the longer decay is refused before the first iteration; with one that
    accepts ``lr_decay_steps`` the run resumes at 4 on the new schedule (a higher LR)."""
    from support.megatron_train_loop import run_to_end

    tmp = str(tmp_path)
    save_dir = os.path.join(tmp, "save")
    shutil.copytree(journaled[0], save_dir)
    refused = run_to_end(tmp, "refused", save_dir=save_dir, extra=_flags(save_dir, *LONGER_DECAY))
    assert refused["error"]["item"] == "lr_ahead[+0]" and "lr_decay_steps" in refused["error"]["message"]

    proc = resume("rewind", save_dir, "--to", "4", "--accept", "lr_decay_steps", "--reason", "slower decay")
    assert proc.returncode == 0, proc.stderr
    resumed = run_to_end(tmp, "resumed", save_dir=save_dir, extra=_flags(save_dir, *LONGER_DECAY))
    assert "error" not in resumed, resumed
    assert (resumed["loaded"], resumed["iteration"]) == (4, ITERATIONS)
    branches = _journal(save_dir)
    main, abandoned = branches["main"]["records"][4:], branches["rewind 1"]["records"]
    assert all(new["lr"][0] > old["lr"][0] for new, old in zip(main, abandoned, strict=True))
    assert saved_manifest(save_dir, 8)["rewinds"][0]["accept"] == ["lr_decay_steps"]
