"""A crash at every point of the commit protocol, on rank 0 and on another rank, on local storage
and on an S3-compatible server on loopback; then a restart.

Each case: two gloo ranks train and save every 2 iterations; the save of step 6 is killed
(SIGKILL) at the point, on the rank; the other rank is killed half a second later (as Slurm
ends the step). The test then reads the run as an operator would (every checksum), and a
fresh job restarts. The restart must load the newest checkpoint that was complete at the
crash (never a torn one), its continuity check must pass, no checkpoint committed before the
crash may be lost, and training on to the end must give exactly the state of a run that was
never interrupted.
"""

from __future__ import annotations

import uuid

import pytest
from support.crash_jobs import UNTIL, committed_deep, run_job, uninterrupted
from support.s3 import S3Server, s3_env

from resume.faults import POINTS, RANK0_POINTS
from resume.run import Run

pytestmark = pytest.mark.multiprocess

CRASH_STEP = 6
CASES = [(p, 0) for p in POINTS] + [(p, 1) for p in POINTS if p not in RANK0_POINTS]


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    import s3fs

    server = S3Server(str(tmp_path_factory.mktemp("s3") / "data"))
    server.start()
    server.make_bucket("crash")
    mp = pytest.MonkeyPatch()
    for k, v in s3_env(server.endpoint).items():
        mp.setenv(k, v)
    s3fs.S3FileSystem.clear_instance_cache()  # no client of another test's endpoint
    yield server
    mp.undo()
    server.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's final state."""
    return uninterrupted(tmp_path_factory)


def run_url(storage: str, tmp_path, request) -> tuple[str, dict]:
    """A fresh run's URL, and the environment its processes need (forked, they do not
    inherit the test's)."""
    if storage == "s3":
        server = request.getfixturevalue("s3_server")
        return f"s3://crash/{uuid.uuid4().hex[:12]}", s3_env(server.endpoint)
    return str(tmp_path / "run"), {}


@pytest.mark.parametrize("storage", ["local", "s3"])
@pytest.mark.parametrize(("point", "rank"), CASES, ids=[f"{p}@rank{r}" for p, r in CASES])
def test_a_crash_at_any_point_loses_nothing_and_the_restart_continues_exactly(
        point, rank, storage, tmp_path, request, reference):
    url, env = run_url(storage, tmp_path, request)
    # Retention runs in the save of step 6 only when it has something to delete.
    keep = 2 if point == "retention.mid_delete" else 10
    crashed = run_job(url, keep=keep, env=env, fault=f"{point}:kill rank={rank} step={CRASH_STEP}")
    assert crashed.codes[rank] == -9, f"the fault did not fire: {crashed!s}"
    assert crashed.final == [None, None], "a rank went on past the crash"

    committed = committed_deep(url)  # what an operator finds: complete, every checksum right
    saved_before = set(range(2, CRASH_STEP, 2))
    survivors = saved_before if keep == 10 else set(sorted(saved_before)[-1:])
    assert survivors <= committed, f"committed before the crash, lost: {survivors - committed}"
    newest = max(committed)

    restarted = run_job(url, keep=keep, env=env)
    assert restarted.codes == [0, 0], str(restarted)
    # The newest complete checkpoint, on every rank; never a torn one (the deep check above
    # passed for it), and the continuity check passed (restore returned).
    assert restarted.restored == [newest, newest]
    for rank_final, rank_reference in zip(restarted.final, reference):
        assert rank_final["iteration"] == UNTIL
        assert rank_final["params"] == rank_reference["params"]
        assert rank_final["moments"] == rank_reference["moments"]

    after = committed_deep(url)
    assert max(after) == UNTIL
    if keep == 10:
        assert committed <= after, f"lost after the restart: {committed - after}"
    run = Run.open(url)
    # Nothing torn stays behind the newest checkpoint: a crashed save's leftover of a later
    # step is replaced when that step is saved again, a half-deleted one is swept by retention.
    assert [s for s in run.step_dirs() if s not in after] == []


# -- four ranks: the gather to rank 0 and its commit, killed on rank 0 and on the last rank -------

FOUR = 4
FOUR_CASES = [("save.after_shards", 3), ("save.after_gather", 3), ("save.after_gather", 0),
              ("save.before_manifest", 0), ("save.after_manifest", 0), ("retention.mid_delete", 0)]


@pytest.fixture(scope="module")
def reference_on_four(tmp_path_factory):
    return uninterrupted(tmp_path_factory, world=FOUR)


@pytest.mark.parametrize(("point", "rank"), FOUR_CASES, ids=[f"{p}@rank{r}" for p, r in FOUR_CASES])
def test_four_ranks_a_crash_in_the_commit_loses_nothing_and_the_restart_continues_exactly(
        point, rank, tmp_path, reference_on_four):
    """Each rank sends its part to rank 0 alone, which assembles, commits and applies retention;
    at restore rank 0 vets DCP's metadata and compares the continuity check for all. Killed at
    each point of that path, on four ranks, nothing committed is lost and the restart goes on
    exactly as the run that was never interrupted."""
    url = str(tmp_path / "run")
    keep = 2 if point == "retention.mid_delete" else 10
    crashed = run_job(url, world=FOUR, keep=keep, fault=f"{point}:kill rank={rank} step={CRASH_STEP}")
    assert crashed.codes[rank] == -9, f"the fault did not fire: {crashed!s}"
    committed = committed_deep(url)
    saved_before = set(range(2, CRASH_STEP, 2))
    survivors = saved_before if keep == 10 else set(sorted(saved_before)[-1:])
    assert survivors <= committed, f"committed before the crash, lost: {survivors - committed}"
    restarted = run_job(url, world=FOUR, keep=keep)
    assert restarted.codes == [0] * FOUR, str(restarted)
    assert restarted.restored == [max(committed)] * FOUR
    for rank_final, rank_reference in zip(restarted.final, reference_on_four):
        assert rank_final["iteration"] == UNTIL
        assert rank_final["params"] == rank_reference["params"]
        assert rank_final["moments"] == rank_reference["moments"]
    assert max(committed_deep(url)) == UNTIL
