"""The drill's plan and its comparison, without running processes."""

from __future__ import annotations

import json

import pytest
from resume.drill.runner import DrillConfig, compare_runs, plan_kills

from resume import UsageError


@pytest.mark.parametrize("seed", range(20))
def test_each_kill_follows_a_checkpoint_committed_by_the_previous_resume(seed):
    cfg = DrillConfig(iterations=40, every=5, kills=3, seed=seed)
    kills = plan_kills(cfg)
    assert len(kills) == 3 and kills == sorted(kills)
    resumed_from = 0
    for k in kills:
        last_checkpoint = (k - 1) // cfg.every * cfg.every
        assert last_checkpoint > resumed_from          # a checkpoint the previous resume wrote
        assert (k - 1) % cfg.every != 0                 # killed after it, with work to replay
        assert k <= cfg.iterations
        resumed_from = last_checkpoint


def test_too_many_kills_is_a_usage_error():
    with pytest.raises(UsageError, match="--kills: expected 0..7"):
        DrillConfig(iterations=40, every=5, kills=8)


def _write(tmp_path, name, records, final):
    trace = tmp_path / f"{name}.trace"
    trace.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / f"{name}.json"
    out.write_text(json.dumps(final))
    return str(trace), str(out)


FINAL = {"params": {"w": "a"}, "moments": {"w.exp_avg": "b"}, "lrs": [0.1],
         "counters": {"iteration": 2, "samples_read": 16, "updates_successful": 2,
                      "updates_skipped": 0}}
RECORDS = [{"iteration": i, "loss": 1.0 / i, "lr": 0.1, "applied": True} for i in (1, 2)]


def test_identical_runs_match_on_every_row(tmp_path):
    ref = _write(tmp_path, "ref", RECORDS, FINAL)
    got = _write(tmp_path, "got", RECORDS[:1] + RECORDS, FINAL)
    rows = compare_runs(*ref, *got, iterations=2)
    assert all(r["match"] for r in rows)


def test_one_ulp_of_loss_or_a_different_replay_is_not_identical(tmp_path):
    ref = _write(tmp_path, "ref", RECORDS, FINAL)
    nudged = [dict(RECORDS[0]), dict(RECORDS[1], loss=0.5000000000000001)]
    rows = {r["item"]: r["match"] for r in compare_runs(*ref, *_write(tmp_path, "a", nudged, FINAL), 2)}
    assert rows["loss trace"] is False and rows["parameters"] is True
    replay = [dict(RECORDS[0], loss=0.9)] + RECORDS
    rows = {r["item"]: r["match"] for r in compare_runs(*ref, *_write(tmp_path, "b", replay, FINAL), 2)}
    assert rows["replayed iterations"] is False and rows["loss trace"] is True
    moved = dict(FINAL, moments={"w.exp_avg": "c"})
    rows = {r["item"]: r["match"] for r in compare_runs(*ref, *_write(tmp_path, "c", RECORDS, moved), 2)}
    assert rows["optimizer moments"] is False
