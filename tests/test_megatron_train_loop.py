"""resume installed inside Megatron's real training loop (megatron.training.training.train()) on CPU.

Each run is a fresh process (support.megatron_train_loop): Megatron parses its arguments,
loads through ``training.load_checkpoint`` and trains with its own ``train()``, so the
installed ``train_step`` and ``checkpoint_and_decide_exit`` wrappers run where Megatron
calls them: ``--save-interval``, an overflow reported by ``optimizer.step()``, a
``resume save`` request, ``--exit-signal-handler``, a SIGKILL and the restart after it.

Dropout is off: on CPU it draws from the CPU generator, which the DataLoader that
``pretrain()`` builds after the load also draws from; on a GPU dropout uses the CUDA
generators and a resumed run equals an uninterrupted one with dropout too.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from support.megatron import require_megatron

pytestmark = [pytest.mark.megatron, pytest.mark.multiprocess]

ITERATIONS, SAVE_INTERVAL = 8, 4
OVERFLOW_AT = [3]  # optimizer.step() reports update_successful=False at iteration 3
NO_DROPOUT = ("--hidden-dropout", "0", "--attention-dropout", "0")


def _flags(save_dir: str, *extra: str, save_interval: int = SAVE_INTERVAL) -> list[str]:
    from support.megatron_train_loop import argv_for

    return argv_for(save_dir, ITERATIONS, save_interval, (*NO_DROPOUT, *extra))


def _train_state(save_dir: str, iteration: int) -> dict:
    with open(os.path.join(save_dir, f"iter_{iteration:07d}", "resume-manifest.json")) as f:
        return json.load(f)["train_state"]


def _committed(save_dir: str) -> list[int]:
    from resume.adapters.megatron import MEGATRON_LAYOUT

    from resume.run import Run

    return Run.open(save_dir, layout=MEGATRON_LAYOUT).committed_steps()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run of 8 iterations through train(), saves at 4 and 8, one overflow at 3."""
    require_megatron()
    from support.megatron_train_loop import run_to_end

    tmp = str(tmp_path_factory.mktemp("megatron-loop"))
    save_dir = os.path.join(tmp, "reference")
    result = run_to_end(tmp, "reference", save_dir=save_dir, extra=_flags(save_dir), overflow_at=OVERFLOW_AT)
    return save_dir, result


def test_save_interval_in_train_commits_a_manifest_at_each_save(reference):
    save_dir, result = reference
    assert result["iteration"] == ITERATIONS and result["exit_code"] is None, result
    assert _committed(save_dir) == [4, 8]
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "8"
    assert result["last_committed"] == 8


def test_overflow_skip_reported_by_optimizer_step_is_counted_by_the_installed_train_step(reference):
    """The count the train_step wrapper keeps is cross-checked with Megatron's state at each save
    (an InvariantError would fail the run); the manifests carry it."""
    save_dir, result = reference
    first, last = _train_state(save_dir, 4), _train_state(save_dir, 8)
    assert (first["iteration"], first["samples_read"], first["updates_successful"],
            first["updates_skipped"]) == (4, 16, 3, 1)
    assert (last["iteration"], last["samples_read"], last["updates_successful"],
            last["updates_skipped"]) == (8, 32, 7, 1)
    assert result["scheduler_steps"] == 7 * 4  # Megatron stepped the scheduler on applied updates only


def test_sigkill_after_a_save_resumes_in_train_as_if_never_interrupted(reference, tmp_path):
    """Killed during iteration 6 (the save at 4 committed, 5 done and lost); a fresh process
    loads 4 with the continuity check and ends with the uninterrupted run's losses and weights."""
    from support.megatron_train_loop import kill_when_holding, run_to_end

    _, expected = reference
    tmp = str(tmp_path)
    save_dir = os.path.join(tmp, "save")
    rc = kill_when_holding(tmp, "killed", save_dir=save_dir, extra=_flags(save_dir), overflow_at=OVERFLOW_AT,
                           hold_at=5)
    assert rc == -9
    assert _committed(save_dir) == [4]

    resumed = run_to_end(tmp, "resumed", save_dir=save_dir, extra=_flags(save_dir))
    assert "error" not in resumed, resumed
    assert resumed["loaded"] == 4 and resumed["start_iteration"] == 4 and resumed["start_consumed"] == 16
    assert resumed["iteration"] == ITERATIONS
    assert resumed["losses"] == {k: v for k, v in expected["losses"].items() if int(k) >= 4}
    assert resumed["params"] == expected["params"]
    # The skip before the kill is still counted after it: the count restarts from the manifest.
    assert _train_state(save_dir, 8) == _train_state(reference[0], 8)


def test_changed_lr_decay_samples_is_refused_before_the_first_iteration(reference, tmp_path):
    save_dir = str(tmp_path / "save")
    shutil.copytree(reference[0], save_dir)
    from support.megatron_train_loop import run_to_end

    out = run_to_end(str(tmp_path), "changed", save_dir=save_dir,
                     extra=_flags(save_dir, "--lr-decay-samples", "480"))
    assert out["error"]["type"] == "ContinuityError", out
    assert out["error"]["item"] == "lr_ahead[+0]"
    assert out["error"]["expected"] != out["error"]["actual"]
    assert out["losses"] == {} and "iteration" not in out  # train() never ran an iteration
    assert _committed(save_dir) == [4, 8]


def test_resume_save_request_and_exit_signal_are_handled_inside_train(tmp_path):
    """A `resume save` request posted during iteration 2 is picked up by the installed
    checkpoint_and_decide_exit at the end of it and answered with the committed step; SIGTERM
    during iteration 3 makes train() save at 3 and exit (--exit-signal-handler)."""
    require_megatron()
    from support.megatron_train_loop import run_to_end

    tmp = str(tmp_path)
    save_dir = os.path.join(tmp, "save")
    out = run_to_end(tmp, "signalled", save_dir=save_dir,
                     extra=_flags(save_dir, "--exit-signal-handler", save_interval=100),
                     request_at=1, sigterm_at=2)
    assert out["exit_code"] == 0 and out["iteration"] is None, out  # train() called sys.exit(0)
    assert sorted(out["losses"]) == ["0", "1", "2"]  # no iteration after the signal
    with open(os.path.join(tmp, "signalled.json.request")) as f:  # written when it was posted
        request_id = json.load(f)["request_id"]
    with open(os.path.join(save_dir, "control", request_id + ".result")) as f:
        answer = json.load(f)
    assert answer["step"] == 2 and answer["error"] is None
    assert _committed(save_dir) == [2, 3]
    assert _train_state(save_dir, 3)["samples_read"] == 12


def test_pretrain_itself_runs_with_resume_installed_and_commits_each_save(reference, tmp_path):
    """Megatron's pretrain() (initialize, setup_model_and_optimizer with its load, the data
    iterators, train()) with the stand-ins named in support.megatron_train_loop: manifests at
    4 and 8, and the same losses as the train() run until its overflow at iteration 3 changed
    the weights (same seed, same data, same model)."""
    from support.megatron_train_loop import run_to_end

    tmp = str(tmp_path)
    save_dir = os.path.join(tmp, "save")
    out = run_to_end(tmp, "pretrain", save_dir=save_dir, entry="pretrain",
                     extra=_flags(save_dir, "--distributed-backend", "gloo", "--eval-interval", "1000"))
    assert out["loaded"] is None and out["last_committed"] == 8 and out["consumed"] == 32
    assert _committed(save_dir) == [4, 8]
    assert (_train_state(save_dir, 8)["updates_successful"], _train_state(save_dir, 8)["updates_skipped"]) == (8, 0)
    expected = reference[1]["losses"]
    # Losses of 0-based iterations 0..2 agree; the skipped update of iteration 3 (1-based)
    # shows from the next one on.
    assert [out["losses"][str(i)] for i in range(3)] == [expected[str(i)] for i in range(3)]
    assert out["losses"]["3"] != expected["3"]
