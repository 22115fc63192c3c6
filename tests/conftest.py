import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# pytest-xdist runs the tests on one worker per core (pyproject.toml: addopts -n auto). The tests
# of a module named here run on one worker, in order, as one unit: they share one fixed resource,
# or read one expensive module fixture that another worker would compute again. Other modules'
# tests go one at a time to whichever worker is free. (xdist's own xdist_group mark does not
# group under pytest 9, whose nodeid no longer reads the _nodeid that xdist rewrites.)
ONE_WORKER = {
    "test_slurm_cluster.py": "one Slurm cluster on fixed ports and one runtime directory",
    "test_cli.py": "drilled: a drill with two SIGKILLs",
    "test_continuity_after_restart.py": "outcomes: every scenario on 2 and on 4 ranks",
    "test_torchdata_stateful_loader.py": "outcome: every job of the module",
    "test_torchtitan.py": "runs: three torchtitan jobs",
    "test_megatron_adopt.py": "megatron_alone: a Megatron run without resume",
    "test_megatron_async_save.py": "killed: a Megatron async-save job",
    "test_megatron_core_continuity.py": "tp2_save: a tensor-parallel Megatron-Core save",
    "test_megatron_journal.py": "journaled: Megatron's train() with the journal",
    "test_megatron_train_loop.py": "reference: Megatron's train() to the end",
    "test_megatron_unrecorded.py": "saves: Megatron saves without resume",
}
# Handed out first, in this order (the longest stretches: the Slurm tests one after another, the
# soak, the crash matrix), so that no worker starts one as the others run out of work; then the
# other units in collection order.
FIRST = ("test_slurm_cluster.py", "test_soak.py", "test_crash_matrix.py")


def _unit(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return module if os.path.basename(module) in ONE_WORKER else nodeid


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With ``--dist load`` (what ``-n`` alone gives): units of work as ``_unit`` cuts them, handed
    out in collection order."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    config.option.loadscopereorder = False  # the order is FIRST's, then the collection's
    return Units(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") is not None:  # each worker collects the same order
        items.sort(key=lambda item: FIRST.index(item.path.name) if item.path.name in FIRST else len(FIRST))


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
