"""Soak: randomised save/kill/restore cycles, a third of them on an S3-compatible server behind a
proxy that fails 5% of requests (503 SlowDown, connection resets).

Each job arms one fault at a random point of the commit protocol, on a random rank, with a
random action (SIGKILL mostly; an exception, ENOSPC or EIO otherwise) and a random save-failure
policy, then restores and trains on. After every job: the restore loaded the newest checkpoint
that passed the deep check before the job (never a torn one), and no checkpoint was lost except
by retention. A run continues until a job reaches the end; its state must equal the
uninterrupted run's. ``benchmarks/soak.py`` runs the same loop for longer.
"""

from __future__ import annotations

import pytest
from support.crash_jobs import soak, uninterrupted
from support.s3 import FaultProxy, S3Server, s3_env

pytestmark = pytest.mark.multiprocess

CYCLES = 50


@pytest.fixture(scope="module")
def faulty_s3(tmp_path_factory):
    server = S3Server(str(tmp_path_factory.mktemp("soak-s3") / "data"))
    server.start()
    server.make_bucket("soak")
    proxy = FaultProxy(server, rate=0.05, seed=3).start()
    mp = pytest.MonkeyPatch()
    for k, v in s3_env(proxy.endpoint).items():  # for the checks this process makes
        mp.setenv(k, v)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    yield proxy
    mp.undo()
    proxy.stop()
    server.stop()


@pytest.mark.timeout(1200)  # about 5 minutes on a 2-core machine; the default is 300 s per test
def test_fifty_random_crash_cycles_lose_nothing_and_end_where_an_uninterrupted_run_ends(
        tmp_path, tmp_path_factory, faulty_s3):
    lines = []
    report = soak(CYCLES, root=str(tmp_path), seed=2026, s3=("s3://soak", s3_env(faulty_s3.endpoint)),
                  reference=uninterrupted(tmp_path_factory), log=lines.append)
    print(report.table())
    assert report.cycles >= CYCLES
    assert report.lost == 0, lines
    assert report.torn_loads == 0, lines
    assert report.mismatched_finals == 0, lines
    # The loop really crashed saves, at many points, and used both stores and the proxy's faults.
    assert sum(report.faults.values()) >= CYCLES // 2, report.table()
    assert len({point for point, _ in report.faults}) >= 6, report.table()
    assert report.campaigns >= 4 and report.restores.get("newest", 0) >= CYCLES // 3, report.table()
    assert faulty_s3.counts["slowdown"] + faulty_s3.counts["reset"] > 0, faulty_s3.counts
