import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def run_dir(tmp_path):
    return str(tmp_path / "run")


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
