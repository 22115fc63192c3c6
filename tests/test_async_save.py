"""Asynchronous save on 2 gloo ranks: the background write runs on a group of its own while
training goes on; what commits is the state at the save; a restart loads it and passes the check."""

from __future__ import annotations

import pytest
from support.ranks import run_ranks

pytestmark = pytest.mark.multiprocess


def _train(rank: int, world: int, run: str) -> dict:
    from support.workloads import Setup, build, moment_digests, param_digests, train

    coord, parts = build(rank, world, run, Setup(every=3, async_save=True))
    coord.restore()
    train(coord, parts, until=6, skip={2})  # the save of 6 starts here, in the background
    at_save = {"params": param_digests(parts["model"]), "moments": moment_digests(parts["opt"])}
    train(coord, parts, until=8)  # training goes on while it is written
    coord.close()  # waits for it
    return {**at_save, "committed": coord.last_committed_step}


def _restore(rank: int, world: int, run: str) -> dict:
    from support.workloads import Setup, build, moment_digests, param_digests

    coord, parts = build(rank, world, run, Setup(every=3))
    coord.restore()
    coord.close()
    return {"restored": coord.restored_from, "params": param_digests(parts["model"]),
            "moments": moment_digests(parts["opt"])}


def test_async_save_commits_the_state_at_the_save_and_restores(tmp_path):
    run = str(tmp_path / "run")
    saved = run_ranks(_train, 2, run)
    assert [s["committed"] for s in saved] == [6, 6]
    restored = run_ranks(_restore, 2, run)
    assert [r["restored"] for r in restored] == [6, 6]
    for before, after in zip(saved, restored):
        assert after["params"] == before["params"] and after["moments"] == before["moments"]
