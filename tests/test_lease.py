"""One writer per run: the lease file, with an injected clock, in a coordinator and across processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict

import pytest
from support.workloads import Setup, build, train, with_coordinator_options

from resume import LeaseLostError, Run, RunBusyError, SaveFailedError
from resume.lease import LEASE_NAME, Holder, Lease, read_holder
from resume.storage import LocalStorage

HOST = socket.gethostname()
TTL = 60.0


class Clock:
    """Wall-clock seconds that move only when a test says so."""

    def __init__(self, now: float = 1_796_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def storage(tmp_path):
    return LocalStorage(str(tmp_path))


@pytest.fixture
def clock():
    return Clock()


def lease_for(storage, clock, job_id: str, ttl_s: float = TTL) -> Lease:
    return Lease(storage, ttl_s=ttl_s, job_id=job_id, clock=clock)


def write_holder(storage, **fields) -> Holder:
    """A lease file as another job would have written it."""
    holder = Holder(**{"job_id": "other", "host": HOST, "pid": os.getpid(), "token": "their-token",
                       "acquired_at": time.time(), "heartbeat_at": time.time(), "ttl_s": 120.0, **fields})
    storage.write_bytes_atomic(LEASE_NAME, json.dumps(asdict(holder)).encode())
    return holder


def dead_pid() -> int:
    """The pid of a process of ours that has ended (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


# -- the lease on its own -----------------------------------------------------------------


def test_acquire_writes_the_holder_and_its_heartbeat(storage, clock, tmp_path):
    lease = lease_for(storage, clock, "4242")
    lease.acquire()
    with open(tmp_path / LEASE_NAME) as f:
        body = json.load(f)
    assert body == {"job_id": "4242", "host": HOST, "pid": os.getpid(), "token": lease.token,
                    "acquired_at": clock.now, "heartbeat_at": clock.now, "ttl_s": TTL,
                    "pid_namespace": os.stat("/proc/self/ns/pid").st_ino}
    lease.check()  # ours: no error


def test_a_second_job_is_refused_with_a_message_naming_the_holder(storage, clock):
    first = lease_for(storage, clock, "4242")
    first.acquire()
    clock.now += 7
    with pytest.raises(RunBusyError) as refused:
        lease_for(storage, clock, "5151").acquire()
    message = str(refused.value)
    assert "\n" not in message
    assert (f"job 4242 (host {HOST}, pid {os.getpid()}), heartbeat 7 s ago, stale after 60 s"
            in message)
    assert "job 5151 refused" in message and message.startswith(storage.url(LEASE_NAME))
    assert refused.value.exit_code == 1
    assert read_holder(storage).token == first.token  # the refused job wrote nothing
    first.check()


def test_a_refreshed_lease_is_not_stale_however_old_it_is(storage, clock):
    first = lease_for(storage, clock, "4242")
    first.acquire()
    clock.now += TTL - 1
    first.refresh()
    clock.now += TTL - 1  # 2 ttl after acquire, ttl - 1 after the heartbeat
    with pytest.raises(RunBusyError, match=f"heartbeat {TTL - 1:.0f} s ago"):
        lease_for(storage, clock, "5151").acquire()


def test_a_lease_older_than_its_ttl_is_taken_over_and_the_old_holder_can_no_longer_commit(
        storage, clock):
    first = lease_for(storage, clock, "4242")
    first.acquire()
    clock.now += TTL  # exactly ttl old: still the first's
    with pytest.raises(RunBusyError):
        lease_for(storage, clock, "5151").acquire()
    clock.now += 1
    second = lease_for(storage, clock, "5151")
    second.acquire()
    assert read_holder(storage).job_id == "5151"
    with pytest.raises(LeaseLostError, match=r"expected this job's lease \(job 4242\), actual job 5151") as lost:
        first.check()
    assert isinstance(lost.value, SaveFailedError)
    # A late heartbeat of the first must not take the run back.
    with pytest.raises(LeaseLostError, match="job 5151"):
        first.refresh()
    assert read_holder(storage).token == second.token
    second.check()


def test_a_requeued_copy_of_the_same_job_takes_over_at_once(storage, clock):
    first = lease_for(storage, clock, "4242")
    first.acquire()
    clock.now += 1  # fresh heartbeat, live pid: only the job id lets it in
    requeued = lease_for(storage, clock, "4242")
    requeued.acquire()
    assert read_holder(storage).token == requeued.token
    with pytest.raises(LeaseLostError):
        first.check()


def test_a_holder_on_this_host_whose_process_is_gone_is_stale(storage, clock, caplog):
    pid = dead_pid()
    write_holder(storage, job_id="4242", pid=pid, heartbeat_at=clock.now)
    with caplog.at_level("INFO", logger="resume"):
        lease_for(storage, clock, "5151").acquire()
    assert read_holder(storage).job_id == "5151"
    # The normal case after a crash: one INFO line, no WARNING.
    [record] = [r for r in caplog.records if f"process {pid} on this host is gone" in r.getMessage()]
    assert record.levelname == "INFO"


def test_a_dead_pid_in_another_pid_namespace_of_this_host_says_nothing(storage, clock):
    """A container sharing this host's name: its pids are not ours to look up."""
    write_holder(storage, job_id="4242", pid=dead_pid(), heartbeat_at=clock.now,
                 pid_namespace=os.stat("/proc/self/ns/pid").st_ino + 1)
    with pytest.raises(RunBusyError, match="job 4242"):
        lease_for(storage, clock, "5151").acquire()


def test_the_job_id_survives_a_requeue_or_a_torchrun_restart(monkeypatch, storage):
    """The cluster layer names the job; the torch adapter hands that name to the lease."""
    import torch
    from resume.adapters.torch_native import NativeTorchAdapter
    from resume.cluster.environment import JobEnvironment

    assert JobEnvironment.from_env({}).job_id is None
    env = {"TORCHELASTIC_RUN_ID": "elastic-7"}
    assert JobEnvironment.from_env(env).job_id == "elastic-7"
    env["SLURM_JOB_ID"] = "4242"
    assert JobEnvironment.from_env(env).job_id == "4242"
    env["RESUME_JOB_ID"] = "mine"
    assert JobEnvironment.from_env(env).job_id == "mine"

    for name in ("RESUME_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    model = torch.nn.Linear(2, 2)
    adapter = NativeTorchAdapter(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert adapter.job_id == "4242"
    lease = Lease.take(storage, ttl_s=TTL, job_id=adapter.job_id)
    try:
        assert read_holder(storage).job_id == "4242"
    finally:
        lease.release()


def test_the_core_lease_reads_no_cluster_variable_only_resume_job_id_else_host_pid(monkeypatch, storage):
    for name in ("RESUME_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "elastic-7")
    assert Lease(storage).job_id == f"{socket.gethostname()}:{os.getpid()}"
    monkeypatch.setenv("RESUME_JOB_ID", "mine")
    assert Lease(storage).job_id == "mine"
    assert Lease(storage, job_id="5151").job_id == "5151"  # the caller's (the adapter's) first


def test_a_dead_pid_on_another_host_says_nothing_and_the_lease_holds(storage, clock):
    write_holder(storage, job_id="4242", host="n0017-elsewhere", pid=dead_pid(), heartbeat_at=clock.now)
    with pytest.raises(RunBusyError, match="host n0017-elsewhere"):
        lease_for(storage, clock, "5151").acquire()


def test_release_removes_our_lease_and_leaves_the_next_holders(storage, clock, tmp_path):
    first = lease_for(storage, clock, "4242")
    first.acquire()
    first.release()
    assert not os.path.exists(tmp_path / LEASE_NAME)

    first = lease_for(storage, clock, "4242")
    first.acquire()
    clock.now += TTL + 1
    second = lease_for(storage, clock, "5151")
    second.acquire()
    first.release()  # e.g. close() of the job that was taken over
    assert read_holder(storage).token == second.token


@pytest.mark.parametrize("body", [
    b"", b"{\"job_id\": \"4242\", \"host", b"[]", b"null", b"\xff\xfe",
    json.dumps({"job_id": "4242", "host": HOST}).encode(),                      # fields missing
    json.dumps({**asdict(Holder("4242", HOST, 1, "t", 0.0, 0.0, 120.0)),
                "heartbeat_at": "soon"}).encode(),                               # wrong type
    (b'{"job_id": "4242", "host": "n1", "pid": 913, "token": "t", "acquired_at": 0, '
     b'"heartbeat_at": NaN, "ttl_s": 120}'),                                    # never stale
    json.dumps({**asdict(Holder("4242", HOST, 1, "t", 0.0, 0.0, 120.0)), "pid": 0}).encode(),
], ids=["empty", "torn", "list", "null", "not-utf8", "missing", "wrong-type", "nan", "pid-0"])
def test_an_unreadable_lease_is_no_lease_and_says_so(storage, clock, caplog, body):
    # Our leases are written atomically, so this is a foreign or damaged file. Treating it as
    # none lets the run go on; a live holder it belonged to finds at its next heartbeat or
    # commit check that the lease is not its own and stops before committing (next test).
    storage.write_bytes_atomic(LEASE_NAME, body)
    with caplog.at_level("WARNING", logger="resume"):
        lease = lease_for(storage, clock, "5151")
        lease.acquire()
    assert read_holder(storage).token == lease.token
    assert f"{storage.url(LEASE_NAME)}: unreadable lease, treated as none" in caplog.text


def test_a_holder_whose_lease_file_was_damaged_stops_before_committing(storage, clock):
    lease = lease_for(storage, clock, "4242")
    lease.acquire()
    storage.write_bytes_atomic(LEASE_NAME, b"{")
    with pytest.raises(LeaseLostError, match="no readable lease file"):
        lease.check()


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_the_heartbeat_thread_keeps_a_short_lease_alive_and_stops_on_release(storage, tmp_path):
    lease = Lease(storage, ttl_s=2.0, job_id="4242")  # a beat every 0.5 s
    lease.acquire()
    acquired = read_holder(storage).heartbeat_at
    lease.start_heartbeat()
    thread = lease._thread
    beats = set()

    def beat_three_times() -> bool:
        beats.add(read_holder(storage).heartbeat_at)
        return len(beats - {acquired}) >= 3
    assert wait_until(beat_three_times, timeout=30)
    # Past the ttl since the acquire: still held, by its heartbeat alone.
    assert wait_until(lambda: time.time() > acquired + 2.5)
    with pytest.raises(RunBusyError, match="stale after 2 s"):
        Lease(storage, ttl_s=2.0, job_id="5151").acquire()
    lease.release()
    assert not thread.is_alive()
    time.sleep(1.0)  # two beat intervals
    assert not os.path.exists(tmp_path / LEASE_NAME)  # no late beat wrote it back


def test_the_heartbeat_stops_when_taken_over_and_does_not_write_over_the_new_holder(storage):
    lease = Lease(storage, ttl_s=0.2, job_id="4242")
    lease.acquire()
    lease.start_heartbeat()
    thread = lease._thread
    theirs = write_holder(storage, job_id="5151", token="their-token")
    assert wait_until(lambda: not thread.is_alive())
    assert read_holder(storage) == theirs
    with pytest.raises(LeaseLostError, match="job 5151"):
        lease.check()
    lease.release()
    assert read_holder(storage) == theirs


class FlakyStorage(LocalStorage):
    """Local storage whose writes fail with ``error`` while it is set (a storage outage)."""

    error: Exception | None = None

    def write_bytes_atomic(self, path: str, data: bytes) -> None:
        if self.error is not None:
            raise self.error
        super().write_bytes_atomic(path, data)


@pytest.mark.parametrize("error", [OSError(5, "Input/output error"),
                                   RuntimeError("the object store client gave up")],
                         ids=["oserror", "other"])
def test_the_heartbeat_survives_a_storage_outage(tmp_path, caplog, error):
    # A heartbeat thread that died would leave the lease to go stale under a live job,
    # and another job would take the run over from it.
    storage = FlakyStorage(str(tmp_path))
    lease = Lease(storage, ttl_s=0.2, job_id="4242")
    lease.acquire()
    with caplog.at_level("WARNING", logger="resume"):
        storage.error = error
        lease.start_heartbeat()
        assert wait_until(lambda: "heartbeat failed" in caplog.text)
        before = read_holder(storage).heartbeat_at
        storage.error = None
        assert wait_until(lambda: read_holder(storage).heartbeat_at > before)
    assert lease._thread.is_alive()
    lease.release()


def test_a_lease_acquired_again_after_it_was_lost_is_held_and_beats(storage):
    lease = Lease(storage, ttl_s=0.2, job_id="4242")
    lease.acquire()
    theirs = write_holder(storage, job_id="5151")
    with pytest.raises(LeaseLostError):
        lease.check()
    lease.release()
    assert read_holder(storage) == theirs
    storage.delete(LEASE_NAME)  # the other job ended and released it
    lease.acquire()
    lease.check()
    lease.start_heartbeat()
    before = read_holder(storage).heartbeat_at
    assert wait_until(lambda: read_holder(storage).heartbeat_at > before)
    lease.release()


def test_a_ttl_of_zero_is_refused():
    with pytest.raises(ValueError, match="lease ttl"):
        Lease(LocalStorage("/nonexistent"), ttl_s=0)


# -- in a coordinator (one process, a real model) ------------------------------------------


def committed_files(run: str) -> dict[str, bytes]:
    """Every file of the run but the lease, with its bytes."""
    out = {}
    for root, _, names in os.walk(run):
        for name in names:
            path = os.path.join(root, name)
            if name != LEASE_NAME:
                with open(path, "rb") as f:
                    out[os.path.relpath(path, run)] = f.read()
    return out


def test_a_second_job_is_refused_at_construction_and_the_run_is_untouched(run_dir, monkeypatch):
    monkeypatch.setenv("RESUME_JOB_ID", "job-A")
    first, parts = build(0, 1, run_dir, Setup(every=2))
    first.restore()
    train(first, parts, until=4)
    before = committed_files(run_dir)
    assert Run.open(run_dir).committed_steps() == [2, 4]

    monkeypatch.setenv("RESUME_JOB_ID", "job-B")
    with pytest.raises(RunBusyError, match=rf"actual job job-A \(host {HOST}, pid {os.getpid()}\).*"
                                           "job job-B refused"):
        build(0, 1, run_dir, Setup(every=2))
    assert committed_files(run_dir) == before
    assert read_holder(LocalStorage(run_dir)).job_id == "job-A"

    # The holder is not disturbed: it goes on committing, and close() frees the run.
    train(first, parts, until=6)
    assert Run.open(run_dir).committed_steps() == [2, 4, 6]
    first.close()
    assert not os.path.exists(os.path.join(run_dir, LEASE_NAME))
    second, _ = build(0, 1, run_dir, Setup(every=2))
    assert second.restore().iteration == 6
    second.close()


@pytest.mark.parametrize("on_save_failure", ["raise", "continue"])
def test_a_job_whose_lease_was_taken_over_commits_nothing(run_dir, monkeypatch, on_save_failure):
    monkeypatch.setenv("RESUME_JOB_ID", "job-A")
    coord, parts = build(0, 1, run_dir, Setup(every=2, on_save_failure=on_save_failure))
    coord.restore()
    train(coord, parts, until=2)
    # Another job decided this one was dead and took the run (its heartbeat is fresh).
    theirs = write_holder(LocalStorage(run_dir), job_id="job-B", host="n0099", pid=4321)
    with pytest.raises(LeaseLostError, match=r"job job-A\), actual job job-B \(host n0099") as lost:
        train(coord, parts, until=4)  # never tolerated, even with on_save_failure="continue"
    assert isinstance(lost.value, SaveFailedError)
    assert coord.iteration == 4 and coord.last_committed_step == 2
    run = Run.open(run_dir)
    assert run.committed_steps() == [2]
    assert not os.path.exists(run.storage.url(run.manifest_path(4)))
    coord.close()
    assert read_holder(LocalStorage(run_dir)) == theirs  # close() leaves the new holder's lease


def test_a_job_whose_lease_was_taken_over_leaves_the_new_holders_files_alone(run_dir, monkeypatch):
    monkeypatch.setenv("RESUME_JOB_ID", "job-A")
    coord, parts = build(0, 1, run_dir, Setup(every=2))
    coord.restore()
    train(coord, parts, until=2)
    write_holder(LocalStorage(run_dir), job_id="job-B", host="n0099", pid=4321)
    # job-B restored step 2 too and is writing step 4 now.
    os.makedirs(os.path.join(run_dir, "step-000000004"))
    theirs = os.path.join(run_dir, "step-000000004", "__0_0.distcp")
    with open(theirs, "wb") as f:
        f.write(b"job-B's shard, being written")
    with pytest.raises(LeaseLostError):
        train(coord, parts, until=4)
    with open(theirs, "rb") as f:
        assert f.read() == b"job-B's shard, being written"


def test_without_a_lease_ttl_no_lease_is_taken(run_dir, monkeypatch):
    with_coordinator_options(monkeypatch, lease_ttl_s=None)
    monkeypatch.setenv("RESUME_JOB_ID", "job-A")
    coord, parts = build(0, 1, run_dir, Setup(every=2))
    coord.restore()
    train(coord, parts, until=2)
    assert not os.path.exists(os.path.join(run_dir, LEASE_NAME))
    monkeypatch.setenv("RESUME_JOB_ID", "job-B")
    other, _ = build(0, 1, run_dir, Setup(every=2))  # nothing stops it: that is the point of None
    other.close()
    coord.close()
    assert Run.open(run_dir).committed_steps() == [2]


# -- separate processes ---------------------------------------------------------------------

JOB = textwrap.dedent("""\
    import json, logging, os, sys, time
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    run, wait_for, ready, until, then = sys.argv[1:]
    while wait_for != "-" and not os.path.exists(wait_for):
        time.sleep(0.02)
    from support.workloads import Setup, build, train
    coord, parts = build(0, 1, run, Setup(every=2))
    coord.restore()
    restored_from = coord.restored_from
    train(coord, parts, until=int(until))
    with open(ready + ".tmp", "w") as f:
        json.dump({"restored_from": restored_from, "iteration": coord.iteration}, f)
    os.replace(ready + ".tmp", ready)
    if then == "hold":
        time.sleep(120)
    elif then == "crash":
        os._exit(0)  # gone without close(): the lease stays, naming a process that is gone
    coord.close()
""")


def start_job(tmp_path, name: str, job_id: str, run: str, *, wait_for: str = "-", until: int,
              then: str) -> tuple[subprocess.Popen, str]:
    """A training job in its own process; it starts once ``wait_for`` exists (torch already imported)."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    tests = os.path.dirname(__file__)
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_JOB_ID", "RESUME_FAULT")}
    env.update(RESUME_JOB_ID=job_id, PYTHONPATH=os.pathsep.join(
        [tests, os.path.dirname(tests), env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    ready = str(tmp_path / f"{name}.ready")
    process = subprocess.Popen([sys.executable, str(script), run, wait_for, ready, str(until), then],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return process, ready


def wait_ready(process: subprocess.Popen, ready: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while not os.path.exists(ready):
        if process.poll() is not None:
            pytest.fail(f"job ended ({process.returncode}) before it was ready: {process.stderr.read()}")
        if time.monotonic() > deadline:
            pytest.fail(f"job not ready after {timeout} s")
        time.sleep(0.02)
    with open(ready) as f:
        return json.load(f)


def finish(process: subprocess.Popen, timeout: float = 30) -> str:
    _, err = process.communicate(timeout=timeout)
    return err


def test_two_processes_one_run_refusal_requeue_and_a_dead_holder(tmp_path):
    run = str(tmp_path / "run")
    processes = []
    try:
        # All four start now and import torch together; each waits for its cue.
        first, first_ready = start_job(tmp_path, "first", "job-A", run, until=2, then="hold")
        second, _ = start_job(tmp_path, "second", "job-B", run, wait_for=first_ready, until=2,
                              then="close")
        requeue, requeue_ready = start_job(tmp_path, "requeue", "job-A", run,
                                           wait_for=str(tmp_path / "go-requeue"), until=4, then="crash")
        third, third_ready = start_job(tmp_path, "third", "job-C", run,
                                       wait_for=str(tmp_path / "go-third"), until=6, then="close")
        processes = [first, second, requeue, third]

        assert wait_ready(first, first_ready) == {"restored_from": None, "iteration": 2}
        err = finish(second)
        assert second.returncode == 1, err
        assert "RunBusyError" in err and f"actual job job-A (host {HOST}, pid {first.pid})" in err
        assert Run.open(run).committed_steps() == [2]

        first.kill()  # SIGKILL: no close(), the lease names job-A, pid gone, heartbeat fresh
        first.wait()
        assert first.returncode == -9 and read_holder(LocalStorage(run)).pid == first.pid

        (tmp_path / "go-requeue").touch()  # the same job, requeued: takes over at once
        assert wait_ready(requeue, requeue_ready) == {"restored_from": 2, "iteration": 4}
        err = finish(requeue)
        assert requeue.returncode == 0, err
        assert "taking over the lease of this job's earlier copy" in err
        held = read_holder(LocalStorage(run))
        assert (held.job_id, held.pid) == ("job-A", requeue.pid)  # it crashed holding it

        (tmp_path / "go-third").touch()  # another job: the holder's process is gone
        assert wait_ready(third, third_ready) == {"restored_from": 4, "iteration": 6}
        err = finish(third)
        assert third.returncode == 0, err
        assert f"taking over a stale lease: job job-A (host {HOST}, pid {requeue.pid})" in err
        assert f"process {requeue.pid} on this host is gone" in err
        assert Run.open(run).committed_steps() == [2, 4, 6]
        assert not os.path.exists(os.path.join(run, LEASE_NAME))  # closed: released
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
