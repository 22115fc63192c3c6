import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def run_dir(tmp_path):
    return str(tmp_path / "run")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> str:
    """A real run (one process, real DCP) with committed steps 2 and 4, LATEST naming 4: one per
    module; tests damage their own copy (run_copy)."""
    from support.workloads import trained

    from resume.run import Run

    run = str(tmp_path_factory.mktemp("trained") / "run")
    trained(run, until=4, every=2)
    assert Run.open(run).committed_steps() == [2, 4]
    return run


@pytest.fixture
def run_copy(trained_run, tmp_path) -> str:
    """This test's own copy of its module's trained_run."""
    run = str(tmp_path / "run")
    shutil.copytree(trained_run, run)
    return run


@pytest.fixture
def faults_disarmed():
    """No fault left armed, nor a rank and step set, for the tests after this one (resume.faults
    is process-wide state)."""
    from resume import faults

    faults.disarm()
    yield
    faults.disarm()
    faults.set_context(rank=0, step=None)


@pytest.fixture(scope="session")
def megatron_save(tmp_path_factory):
    """A Megatron save directory written by megatron.training's own save_checkpoint with resume
    installed (iterations 4 and 6). Tests that change it work on a copy."""
    from support.megatron import require_megatron
    from support.ranks import run_ranks

    require_megatron()
    save_dir = str(tmp_path_factory.mktemp("megatron") / "save")
    from support.megatron_training_run import train_and_save

    result = run_ranks(train_and_save, 1, save_dir)[0]
    assert result["recorder_url"] == save_dir
    return save_dir, result
