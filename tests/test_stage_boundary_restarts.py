"""A speed-run-shaped trainer (AdamW + Muon, an embedding untied from the head at a stage
boundary, a hand-set LR, one skipped update) on 2 real processes, SIGKILLed before, at and
after the boundary: every restart passes the continuity check and the run ends bitwise where
an uninterrupted one does (parameters, moments, loss trace, LR trace)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pathlib

import pytest
from support import staged_trainer as st
from support.ranks import join_all
from support.shared import once
from support.traces import read_jsonl

pytestmark = pytest.mark.multiprocess

WORLD = 2


def _rank(rank: int, world: int, store: str, run: str, out: str, kill_at: int | None) -> None:
    import torch.distributed as dist
    from support.ranks import init_gloo

    init_gloo(rank, world, store)
    try:
        st.run_job(rank, world, run, out, kill_at)
    finally:
        dist.destroy_process_group()


def launch(run: str, out: str, kill_at: int | None = None) -> list[int | None]:
    """One job of WORLD processes; their exit codes (-9: killed)."""
    os.makedirs(out, exist_ok=True)
    ctx = mp.get_context("spawn")
    store = os.path.join(out, f"store-{len(os.listdir(out))}")
    procs = [ctx.Process(target=_rank, args=(r, WORLD, store, run, out, kill_at)) for r in range(WORLD)]
    return join_all(procs, timeout_s=240)


def read_trace(out: str, rank: int) -> list[dict]:
    return read_jsonl(os.path.join(out, f"trace-{rank}.jsonl"))


def read_final(out: str, rank: int) -> dict:
    with open(os.path.join(out, f"final-{rank}.json")) as f:
        return json.load(f)


def by_iteration(trace: list[dict]) -> dict[int, dict]:
    """The last record of each iteration (a restart redoes the iterations after its checkpoint)."""
    return {e["iteration"]: {k: v for k, v in e.items() if k != "restored_from"} for e in trace}


def uninterrupted(tmp) -> dict[int, tuple[list[dict], dict]]:
    out = str(tmp / "out")
    assert launch(str(tmp / "run"), out) == [0] * WORLD
    return {r: (read_trace(out, r), read_final(out, r)) for r in range(WORLD)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return once(tmp_path_factory, "staged-ref", uninterrupted)


# Checkpoints at 3, 6, 9, 12. Iteration 2 is skipped, so the 5th successful update is
# iteration 6: the untie happens at the start of iteration 7, the first after checkpoint 6.
KILLS = {
    "before": (5, 3),  # killed at 5: restores 3 (stage 0); the untie happens on the way again
    "at": (7, 6),      # killed right after the untie: restores 6 (stage 0, taken at the boundary);
                       # the untie happens in the first iteration after the restart
    "after": (10, 9),  # killed at 10: restores 9 (stage 1, built from coord.peek())
}


@pytest.mark.parametrize("name", sorted(KILLS))
def test_killed_around_the_untie_ends_bitwise_like_an_uninterrupted_run(tmp_path, reference, name):
    kill_at, expect_restored = KILLS[name]
    run, out1, out2 = str(tmp_path / "run"), str(tmp_path / "job1"), str(tmp_path / "job2")
    assert launch(run, out1, kill_at=kill_at) == [-9] * WORLD
    codes = launch(run, out2)
    logs = [pathlib.Path(out2, f"log-{r}.txt").read_text() for r in range(WORLD)]
    assert codes == [0] * WORLD, logs
    for rank in range(WORLD):
        ref_trace, ref_final = reference[rank]
        first, second = read_trace(out1, rank), read_trace(out2, rank)
        assert {e["restored_from"] for e in second} == {expect_restored}
        assert second[0]["iteration"] == expect_restored + 1
        combined = by_iteration(first) | by_iteration(second)
        expected = by_iteration(ref_trace)
        # Loss, LR of every group, batch ids and stage, iteration by iteration; the iterations
        # the killed job did past its checkpoint were the same as the ones redone.
        assert combined == expected
        for e in first:
            assert by_iteration([e])[e["iteration"]] == expected[e["iteration"]]
        final = read_final(out2, rank)
        assert final["params"] == ref_final["params"]
        assert final["moments"] == ref_final["moments"]
        assert final["stage"] == 1 and final["iteration"] == st.ITERATIONS
    _journal_is_what_the_trainer_did(run, reference[0][0], lost=range(expect_restored + 1, kill_at + 1))
    if name == "at":
        # The param group the untie adds in the first update is named in the log, not refused.
        added = [line for line in logs[0].splitlines() if "param groups added since the checkpoint" in line]
        assert added and "optimizer[0].group[2] 'embed'" in added[0]


def _journal_is_what_the_trainer_did(run: str, trace: list[dict], *, lost: range) -> None:
    """The update journal holds, for every iteration, what rank 0's trainer did: applied or
    skipped, the LR it set by hand on every group of both optimizers (the untie's new group
    included), its loss; the iterations the kill lost are kept as a lost branch."""
    from resume.journal import read_journal
    from resume.run import Run

    r = Run.open(run)
    view = read_journal(r.storage, r.read_manifest(r.committed_steps()[-1]).journal, source=run)
    expected = by_iteration(trace)
    # Sealed up to the last checkpoint (12); the updates after it are still open (no save at the end).
    main = {rec["it"]: rec for b in view.branches if b.name in ("main", "unsealed") for rec in b.records}
    assert [rec["it"] for rec in view.main.records] == list(range(1, 13)) and not view.main.problems
    assert sorted(main) == list(range(1, st.ITERATIONS + 1))
    for it, rec in main.items():
        assert rec["ok"] == (it not in st.SKIP) and rec["loss"] == float.fromhex(expected[it]["loss"])
        assert rec.get("lr") == ([float.fromhex(x) for x in expected[it]["lr"]] if rec["ok"] else None)
        assert rec["ids"] == expected[it]["ids"] and rec["at"] == (it - 1) * st.GLOBAL_BATCH
    lost_records = [rec for b in view.branches if b.name.startswith("lost") for rec in b.records]
    assert [rec["it"] for rec in lost_records] == list(lost)
    assert all(rec["loss"] == main[rec["it"]]["loss"] for rec in lost_records)


def test_a_stage_one_checkpoint_restored_into_stage_zero_code_names_the_structure(tmp_path):
    """Without peek(): the program builds stage 0 while the checkpoint holds stage 1. A
    ContinuityError names the optimizer and group; the checkpoint is not called corrupt."""
    run, out = str(tmp_path / "run"), str(tmp_path / "job1")
    assert launch(run, out, kill_at=10) == [-9] * WORLD
    result = _restore_without_peek(run)
    assert result["error"] == "ContinuityError", result
    assert "optimizer[0].param_groups (AdamW)" in result["item"]
    assert "3 groups" in result["message"] and "2 groups" in result["message"]
    assert "peek" in result["message"]
    from resume.run import Run

    assert Run.open(run).committed_steps() == [3, 6, 9]  # nothing moved to quarantine
    assert not [n for n in os.listdir(run) if n.startswith("quarantine")]


def _restore_without_peek(run: str) -> dict:
    from support.ranks import run_ranks

    return run_ranks(_restore_stage_zero, WORLD, run)[0]


def _restore_stage_zero(rank: int, world: int, run: str) -> dict:
    from resume import ContinuityError, ResumeError

    trainer = st.Trainer(rank, world, run)
    try:
        trainer.coord.restore()
    except ContinuityError as e:
        return {"error": "ContinuityError", "item": e.item, "message": str(e)}
    except ResumeError as e:
        return {"error": type(e).__name__, "message": str(e)}
    finally:
        trainer.coord.close()
    return {"error": None}
