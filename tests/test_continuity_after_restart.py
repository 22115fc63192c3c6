"""The continuity check, on 2 real processes (gloo, DDP, torch.distributed.checkpoint).

One job trains and checkpoints; then each scenario rebuilds the job the way a
restarted job gets it wrong and must be refused with ContinuityError naming
the item, before a single update.
"""

from __future__ import annotations

import dataclasses

import pytest
from support.ranks import run_ranks
from support.workloads import Setup, build, restore_outcome, train

pytestmark = pytest.mark.multiprocess

SCENARIOS = {
    "unchanged": Setup(),
    "scheduler_longer": Setup(total_updates=40),
    "scheduler_other_peak": Setup(peak_lr=2e-2),
    "moments_not_loaded": Setup(drop_optimizer_state=True),
    "loader_restarted_at_epoch_start": Setup(stateless_loader=True),
    "seed_changed": Setup(seed=1),
    "seed_changed_undeclared": Setup(sampler_seed=7),
    "global_batch_changed": Setup(global_batch=8),
}


def scenarios(rank: int, world: int, tmp: str) -> dict:
    results = {}
    for name, setup in SCENARIOS.items():
        run = f"{tmp}/{name}"
        # Phase 1: the job as it ran before the failure (for the stateless
        # loader, the same loader ran then too: it simply cannot be restored).
        before = Setup(stateless_loader=setup.stateless_loader,
                       declare_seed=setup.declare_seed)
        coord, parts = build(rank, world, run, before)
        coord.restore()
        train(coord, parts, until=7, skip={2})
        coord.close()
        # Phase 2: the restarted job.
        coord, _ = build(rank, world, run, setup)
        results[name] = restore_outcome(coord)
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def outcomes(request, tmp_path_factory):
    """Each scenario's outcome, the same on every rank: on 2 ranks, and on 4, where rank 0
    alone receives the parts of the continuity check, compares and sends its verdict."""
    tmp = str(tmp_path_factory.mktemp("continuity"))
    per_rank = run_ranks(scenarios, request.param, tmp)
    assert all(r == per_rank[0] for r in per_rank), "ranks disagreed on the outcome"
    return per_rank[0]


def test_unchanged_restart_passes_the_check(outcomes):
    assert outcomes["unchanged"] == "ok@6"


def test_scheduler_rebuilt_with_another_length_is_caught(outcomes):
    assert outcomes["scheduler_longer"] == "schedule[0].lr_lambdas"


def test_scheduler_rebuilt_with_another_peak_is_caught(outcomes):
    assert outcomes["scheduler_other_peak"] == "optimizer[0].group[0].initial_lr"


def test_optimizer_moments_not_loaded_are_caught(outcomes):
    assert outcomes["moments_not_loaded"].startswith("optimizer[0].moments")


def test_loader_restarted_at_epoch_start_is_caught(outcomes):
    assert outcomes["loader_restarted_at_epoch_start"] == "next_batch.ids"


def test_changed_seed_is_caught_by_config(outcomes):
    assert outcomes["seed_changed"] == "config.seed"


def test_changed_data_seed_is_caught_by_next_batch(outcomes):
    assert outcomes["seed_changed_undeclared"] == "next_batch.ids"


def test_changed_global_batch_is_caught(outcomes):
    assert outcomes["global_batch_changed"] == "config.global_batch"


def skip_steps_scheduler(rank: int, world: int, tmp: str) -> str:
    coord, parts = build(rank, world, f"{tmp}/run", Setup())
    coord.restore()
    try:
        train(coord, parts, until=6, skip={4}, step_scheduler_on_skip=True)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    finally:
        coord.close()
    return "no error"


def test_skipped_update_that_stepped_the_scheduler_is_caught(tmp_path):
    outcome = run_ranks(skip_steps_scheduler, 2, str(tmp_path))
    for message in outcome:
        assert message.startswith("ContinuityError: continuity check failed: scheduler[0].position")
        assert "stepped on an update reported as skipped" in message


def resume_matches_uninterrupted(rank: int, world: int, tmp: str) -> dict:
    # Uninterrupted reference.
    ref, ref_parts = build(rank, world, f"{tmp}/ref", Setup(every=0))
    ref.restore()
    ref_trace = train(ref, ref_parts, until=10, skip={5})
    ref.close()
    # Interrupted after iteration 7 (checkpoint at 6), resumed in fresh objects.
    coord, parts = build(rank, world, f"{tmp}/run", Setup())
    coord.restore()
    first = train(coord, parts, until=7, skip={5})
    coord.close()
    coord, parts = build(rank, world, f"{tmp}/run", Setup())
    coord.restore()
    restored = coord.restored_from
    rest = train(coord, parts, until=10, skip={5})
    coord.close()
    return {"ref": ref_trace, "first": first, "rest": rest, "restored_from": restored,
            "state": coord.state.to_dict(), "ref_state": ref.state.to_dict()}


def test_resumed_run_continues_exactly_where_it_stopped(tmp_path):
    for out in run_ranks(resume_matches_uninterrupted, 2, str(tmp_path)):
        assert out["restored_from"] == 6
        assert out["rest"][0]["iteration"] == 7
        assert out["first"][:6] + out["rest"] == out["ref"]  # ids, loss and LR, bitwise
        assert out["first"][6] == out["rest"][0]             # the replayed iteration
        assert out["state"] == out["ref_state"]
        assert out["state"]["updates_skipped"] == 1


def test_setup_defaults_are_what_phase_one_used():
    # Guard for the scenarios above: only the named knob differs from the default.
    base = dataclasses.asdict(Setup())
    for name, setup in SCENARIOS.items():
        diff = {k for k, v in dataclasses.asdict(setup).items() if base[k] != v}
        assert len(diff) <= 1, (name, diff)


def failing_save_on_rank_1(rank: int, world: int, tmp: str) -> dict:
    from resume.adapters.torch_native import NativeTorchAdapter

    class FailsOnRank1(NativeTorchAdapter):
        def state_dict(self):
            if self.comm.rank == 1:
                raise OSError(28, "No space left on device")
            return super().state_dict()

    coord, parts = build(rank, world, f"{tmp}/run", Setup(every=2))
    coord.adapter.__class__ = FailsOnRank1
    coord.restore()
    try:
        train(coord, parts, until=2)
    except Exception as e:  # noqa: BLE001
        outcome = f"{type(e).__name__}: {e}"
    else:
        outcome = "no error"
    finally:
        coord.close()
    import torch.distributed as dist

    from resume import Run

    dist.barrier()  # rank 0 has cleaned up after the failed save
    run = Run.open(f"{tmp}/run")
    return {"outcome": outcome, "committed": run.committed_steps(), "dirs": run.step_dirs()}


def test_a_save_failing_on_one_rank_fails_on_every_rank_and_commits_nothing(tmp_path):
    for out in run_ranks(failing_save_on_rank_1, 2, str(tmp_path)):
        assert out["outcome"].startswith("SaveFailedError: ")
        assert "rank 1: OSError" in out["outcome"] and "No space left" in out["outcome"]
        assert out["committed"] == [] and out["dirs"] == []  # the partial step was removed


def bad_rank_state_on_rank_1(rank: int, world: int, tmp: str) -> str:
    import torch.distributed as dist

    run = f"{tmp}/run"
    coord, parts = build(rank, world, run, Setup(every=3))
    coord.restore()
    train(coord, parts, until=3)
    coord.close()
    dist.barrier()
    if rank == 0:
        path = f"{run}/step-000000003/rank-00001.json"
        with open(path) as f:
            text = f.read()
        with open(path, "w") as f:
            f.write(text.replace("{", "[", 1))
    dist.barrier()
    coord, _ = build(rank, world, run, Setup(every=3))
    coord.settings.verify_on_restore = False  # so that only the content can fail, on rank 1 alone
    return restore_outcome(coord)


def test_a_bad_file_on_one_rank_fails_the_restore_on_every_rank_without_hanging(tmp_path):
    outcomes = run_ranks(bad_rank_state_on_rank_1, 2, str(tmp_path))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0].startswith("ManifestError: restore of step-000000003 failed on 1 of 2 ranks")
    assert "rank-00001.json: expected JSON" in outcomes[0]


def io_error_on_rank_1(rank: int, world: int, tmp: str) -> dict:
    import errno

    import torch.distributed as dist

    run = f"{tmp}/run"
    coord, parts = build(rank, world, run, Setup(every=3))
    coord.restore()
    train(coord, parts, until=7)
    coord.close()
    dist.barrier()
    coord, _ = build(rank, world, run, Setup(every=3))
    if rank == 1:
        def unreadable(path):
            raise OSError(errno.EIO, "Input/output error", path)
        coord.run.storage.open_read = unreadable
    outcome = restore_outcome(coord)
    import os
    return {"outcome": outcome, "listing": sorted(os.listdir(run))}


def test_storage_read_errors_during_restore_fail_loudly_and_move_nothing(tmp_path):
    for out in run_ranks(io_error_on_rank_1, 2, str(tmp_path)):
        assert out["outcome"].startswith("StorageError: checksum verification failed on 1 of 2 ranks")
        assert "Input/output error" in out["outcome"]
        assert [n for n in out["listing"] if n.startswith("step-")] == ["step-000000003", "step-000000006"]
