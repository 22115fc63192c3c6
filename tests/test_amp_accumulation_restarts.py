"""A trainer the project did not design (``support.amp_trainer``: accumulation over 4
micro-batches, fp16 autocast with a GradScaler and a forced overflow, an EMA, AdamW with two
groups, warm-up + cosine LambdaLR, StatefulDataLoader with 2 workers, DDP) on 2 real processes,
SIGKILLed mid-accumulation, right after an overflow and right after a save: every restart passes
the continuity check and the run ends bitwise where an uninterrupted one does (parameters,
moments, EMA, scaler state, loss and LR traces). Its 2-rank checkpoint continues on 1 rank with
twice the accumulation: the same samples in every update, the same LR and counters."""

from __future__ import annotations

import json
import multiprocessing as mp
import os

import pytest
import torch
from support import amp_trainer as at
from support.ranks import join_all
from support.shared import once
from support.traces import read_jsonl

from resume import Run

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

WORLD = 2


def _rank(rank: int, world: int, store: str, run: str, out: str, kill, accumulation: int,
          register: tuple[str, ...], until: int | None) -> None:
    import torch.distributed as dist
    from support.ranks import init_gloo

    from resume.errors import ResumeError

    init_gloo(rank, world, store)
    try:
        at.run_job(rank, world, run, out, kill, accumulation=accumulation, register=register, until=until)
    except ResumeError as e:  # the refusal, for the test to read
        with open(os.path.join(out, f"error-{rank}.txt"), "w") as f:
            f.write(f"{type(e).__name__}: {e}")
        raise SystemExit(3) from None
    finally:
        dist.destroy_process_group()


def launch(run: str, out: str, kill=None, *, world: int = WORLD, accumulation: int = 4,
           register: tuple[str, ...] = ("scaler", "ema"), until: int | None = None) -> list[int | None]:
    """One job of ``world`` processes; their exit codes (-9: killed, 3: refused)."""
    os.makedirs(out, exist_ok=True)
    ctx = mp.get_context("spawn")
    store = os.path.join(out, f"store-{len(os.listdir(out))}")
    procs = [ctx.Process(target=_rank, args=(r, world, store, run, out, kill, accumulation, register, until))
             for r in range(world)]
    return join_all(procs, timeout_s=300)


def read_final(out: str, rank: int) -> dict:
    with open(os.path.join(out, f"final-{rank}.json")) as f:
        return json.load(f)


def by_update(trace: list[dict]) -> dict[int, dict]:
    """The last record of each update (a restart redoes the updates after its checkpoint)."""
    return {e["update"]: {k: v for k, v in e.items() if k != "restored_from"} for e in trace}


def uninterrupted(tmp) -> dict:
    out = str(tmp / "out")
    assert launch(str(tmp / "run"), out) == [0] * WORLD
    return {"out": out, "run": str(tmp / "run"),
            "ranks": {r: (read_jsonl(os.path.join(out, f"trace-{r}.jsonl")), read_final(out, r))
                      for r in range(WORLD)}}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return once(tmp_path_factory, "amp-ref", uninterrupted)


def test_the_reference_run_overflows_accumulates_and_saves(reference):
    trace = by_update(reference["ranks"][0][0])
    assert sorted(trace) == list(range(1, at.UPDATES + 1))
    assert [u for u, e in trace.items() if not e["applied"]] == sorted(at.OVERFLOW)
    assert all(len(e["losses"]) == 4 and len(e["ids"]) == 4 * at.MICRO for e in trace.values())
    run = Run.open(reference["run"])
    manifest = run.read_manifest(run.committed_steps()[-1])
    assert manifest.train_state.updates_skipped == len(at.OVERFLOW)
    # A save records the whole next update: 4 micro-batches on each of the 2 ranks.
    earlier = run.read_manifest(3)
    assert earlier.expectation["next_batch"]["samples"] == 4 * at.MICRO * WORLD
    assert sorted(earlier.expectation["state_shown"]) == ["ema", "scaler"]
    assert earlier.expectation["state_shown"]["scaler"]["values"]["scale"] > 0


def test_killed_mid_accumulation_after_an_overflow_and_after_a_save_it_ends_bitwise_equal(reference, tmp_path):
    run, out = str(tmp_path / "run"), str(tmp_path / "out")
    # Saves at 3, 6, 9, 12; update 6 overflows. Killed after 2 of update 5's 4 micro-batches
    # (restores 3); right after update 6, its overflow and its save (restores 6: the backed-off
    # scale); right after update 9 and its save (restores 9).
    kills = [(5, 2), (6, 0), (9, 0)]
    for kill in kills:
        assert launch(run, out, kill) == [-9] * WORLD, kill
    assert launch(run, out) == [0] * WORLD
    for rank in range(WORLD):
        trace = read_jsonl(os.path.join(out, f"trace-{rank}.jsonl"))
        ref_trace, ref_final = reference["ranks"][rank]
        assert by_update(trace) == by_update(ref_trace)
        restored = [e["restored_from"] for e in trace]
        assert {3, 6, 9} <= set(restored)
        final = read_final(out, rank)
        for key in ("params", "moments", "ema", "scaler", "iteration"):
            assert final[key] == ref_final[key], key
        with open(os.path.join(out, f"log-{rank}.txt")) as f:
            log = f.read()
        assert log.count("continuity ok") == len(kills)
        assert "registered state ema, scaler" in log
        # Taking over the lease of a job that is gone is normal after a crash: not a WARNING.
        assert "WARNING resume: " not in "".join(line for line in log.splitlines(True) if "lease" in line)


def test_the_2_rank_checkpoint_continues_on_1_rank_with_twice_the_accumulation(reference, tmp_path):
    import shutil

    run, out = str(tmp_path / "run"), str(tmp_path / "out")
    shutil.copytree(reference["run"], run)
    for step in (12, 9):  # continue from step 6
        shutil.rmtree(os.path.join(run, f"step-{step:09d}"))
    shutil.rmtree(os.path.join(run, "journal"), ignore_errors=True)
    assert launch(run, out, world=1, accumulation=8) == [0]
    trace = by_update(read_jsonl(os.path.join(out, "trace-0.jsonl")))
    ref = [by_update(reference["ranks"][r][0]) for r in range(WORLD)]
    assert sorted(trace) == list(range(7, at.UPDATES + 1))
    for update, entry in trace.items():
        # The same samples in each update, the same LR, the same skipped updates.
        assert sorted(entry["ids"]) == sorted(ref[0][update]["ids"] + ref[1][update]["ids"]), update
        assert entry["lr"] == ref[0][update]["lr"] and entry["applied"] == ref[0][update]["applied"]
        # Micro-batch k of each rank is micro-batches 2k (rank 0's samples) and 2k + 1 (rank 1's)
        # here. The first update runs on the restored weights: its losses are bitwise the same;
        # after it the gradients are summed in another order, and the losses stay close.
        interleaved = [ref[r][update]["losses"][k] for k in range(4) for r in range(WORLD)]
        if update == 7:
            assert entry["losses"] == interleaved
        mine, theirs = (torch.tensor([float.fromhex(x) for x in losses]) for losses in (entry["losses"], interleaved))
        assert torch.allclose(mine, theirs, rtol=2e-2), (update, mine, theirs)
    with open(os.path.join(out, "log-0.txt")) as f:
        log = f.read()
    assert "continuity ok" in log and "registered state ema, scaler" in log


def test_left_unregistered_the_scaler_and_the_ema_are_named_and_a_missing_one_is_refused(reference, tmp_path):
    out = str(tmp_path / "out")
    assert launch(str(tmp_path / "run"), out, register=(), until=3) == [0] * WORLD
    with open(os.path.join(out, "log-0.txt")) as f:
        warnings = [line for line in f if line.startswith("WARNING") and "is not in the checkpoint" in line]
    assert len(warnings) == 2, warnings
    assert any("GradScaler" in w and "coord.register('scaler'" in w for w in warnings)
    assert any("AveragedModel" in w and "coord.register('ema'" in w for w in warnings)

    import shutil

    run = str(tmp_path / "copy")
    shutil.copytree(reference["run"], run)
    assert launch(run, str(tmp_path / "out2"), register=("scaler",)) == [3] * WORLD
    with open(os.path.join(str(tmp_path / "out2"), "error-0.txt")) as f:
        error = f.read()
    assert error.startswith("ContinuityError") and "state.ema" in error and "not registered" in error
