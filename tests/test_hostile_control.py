"""Control files and the lease are data, not trust (issue 13, items 5 and 6).

Anyone who can write a run can drop files into ``control/`` or rewrite ``lease.json``.
A bad request is ignored with one warning and never keeps a real one from being
served; polling never blocks (a FIFO or a ``/dev/zero`` link is refused, not read);
an answer counts only when it names the request and a committed step; a lease
cannot lock a run out with a clock in the future, a huge ttl or an impossible pid.
Every case runs under a timeout; the command line runs in a subprocess under an
address-space limit and never prints a traceback.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict

import pytest
from support.checkpoints import write_checkpoint
from support.hostile import limited, resume_cli
from support.ports import free_port
from support.traces import read_jsonl

from resume.control import (
    REQUEST_SUFFIX,
    RESULT_SUFFIX,
    ControlArea,
    SaveRequest,
    answer_request,
    pending_requests,
    post_save_request,
    wait_for_answer,
)
from resume.errors import SaveFailedError, SaveTimeoutError, UsageError
from resume.lease import LEASE_NAME, MAX_TTL_S, Holder, Lease, read_holder
from resume.run import CONTROL, Run
from resume.storage import SMALL_FILE_CAP, LocalStorage, join

pytestmark = pytest.mark.timeout(60)

HOST = socket.gethostname()
TEN_YEARS = 10 * 365 * 86400.0


@pytest.fixture
def run(tmp_path) -> Run:
    return Run.open(str(tmp_path / "run"), create=True)


def control_path(run: Run, name: str) -> str:
    os.makedirs(run.storage.url(CONTROL), exist_ok=True)
    return run.storage.url(join(CONTROL, name))


def plant(run: Run, name: str, data: bytes) -> None:
    with open(control_path(run, name), "wb") as f:
        f.write(data)


def plant_whole(run: Run, name: str, data: bytes) -> None:
    """``plant``, but a reader sees the old file or the whole new one: a forger that rewrites its
    answer every few milliseconds must not be read half-written (that is another test's case)."""
    tmp = control_path(run, f".forging-{name}")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, control_path(run, name))


def plant_fifo(run: Run, name: str) -> None:
    os.mkfifo(control_path(run, name))


def plant_dev_zero(run: Run, name: str) -> None:
    os.symlink("/dev/zero", control_path(run, name))


class FakeTime:
    def __init__(self) -> None:
        self.now = 1000.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def warnings_about(caplog, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and needle in r.getMessage()]


# -- requests: a bad one is ignored, the real ones are served ------------------------------


HOSTILE_REQUESTS = {
    "stop-no.request": lambda run, name: plant(run, name, b'{"stop": "no"}'),
    "stop-one.request": lambda run, name: plant(run, name, b'{"stop": 1}'),
    "deep.request": lambda run, name: plant(run, name, b"[" * 100_000),
    "oversize.request": lambda run, name: plant(run, name, b" " * SMALL_FILE_CAP + b"{}"),
    "list.request": lambda run, name: plant(run, name, b"[]"),
    "unknown-field.request": lambda run, name: plant(run, name, b'{"stop": false, "run": "rm -rf /"}'),
    "long-reason.request": lambda run, name: plant(run, name, json.dumps({"reason": "x" * 10_000}).encode()),
    "not-utf8.request": lambda run, name: plant(run, name, b"\xff\xfe{}"),
    "fifo.request": plant_fifo,
    "zero.request": plant_dev_zero,
    "a b.request": lambda run, name: plant(run, name, b"{}"),
    "-dash.request": lambda run, name: plant(run, name, b"{}"),
    "x" * 120 + ".request": lambda run, name: plant(run, name, b"{}"),
    ".request": lambda run, name: plant(run, name, b"{}"),
    "line\nbreak.request": lambda run, name: plant(run, name, b"{}"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_REQUESTS))
def test_a_hostile_request_is_ignored_with_a_warning_and_the_real_one_is_served(run, name, caplog):
    HOSTILE_REQUESTS[name](run, name)
    real = post_save_request(run, stop=False, reason="resume save")
    started = time.monotonic()
    assert pending_requests(run) == [SaveRequest(real.request_id, stop=False, reason="resume save")]
    assert time.monotonic() - started < 5  # never blocks, never reads a megabyte twice
    [warning] = warnings_about(caplog, "save request ignored")
    assert "\n" not in warning


def test_stop_no_does_not_stop_the_job_but_stop_true_does(run):
    plant(run, "save-1-a.request", b'{"stop": "no"}')
    plant(run, "save-1-b.request", b'{"stop": true, "reason": "slurm hook: SIGUSR1"}')
    assert pending_requests(run) == [SaveRequest("save-1-b", stop=True, reason="slurm hook: SIGUSR1")]


def test_a_bad_request_is_warned_about_once_not_at_every_poll(run, caplog):
    plant_fifo(run, "x.request")
    plant(run, "y.request", b"[" * 100_000)
    area = ControlArea(run, poll_s=0.0)
    for _ in range(20):
        assert area.poll() == []
    assert len(warnings_about(caplog, "x.request")) == 1
    assert len(warnings_about(caplog, "y.request")) == 1
    # Removed and dropped in again: a new file, warned about again.
    os.unlink(control_path(run, "x.request"))
    assert area.poll() == []
    plant(run, "x.request", b'{"stop": "yes"}')
    assert area.poll() == []
    assert len(warnings_about(caplog, "x.request")) == 2


def test_a_request_replaced_by_a_fifo_after_listing_does_not_block_the_poll(run, monkeypatch):
    real = post_save_request(run)
    listdir = run.storage.listdir

    def swap_then_list(path):
        names = listdir(path)
        os.unlink(control_path(run, real.request_id + REQUEST_SUFFIX))
        plant_fifo(run, real.request_id + REQUEST_SUFFIX)
        return names

    monkeypatch.setattr(run.storage, "listdir", swap_then_list)
    assert ControlArea(run, poll_s=0.0).poll() == []


def test_a_control_area_that_is_a_link_is_warned_about_once(run, tmp_path, caplog):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "save-1-a.request").write_text('{"stop": true}')
    os.symlink(elsewhere, run.storage.url(CONTROL))
    area = ControlArea(run, poll_s=0.0)
    assert [area.poll() for _ in range(5)] == [[]] * 5  # nothing read through the link
    assert len(warnings_about(caplog, "cannot read save requests")) == 1


# -- answers: they count only when they name the request and a committed step ---------------


def wait(run: Run, request: SaveRequest, *, check=True, timeout: float = 3.0) -> int:
    t = FakeTime()
    return wait_for_answer(run, request, timeout=timeout, clock=t.clock, sleep=t.sleep,
                           check=run.check if check else None)


def test_the_jobs_answer_names_the_request_and_the_step(run):
    request = post_save_request(run)
    answer_request(run, request, step=7)
    body = json.loads(run.storage.read_bytes(join(CONTROL, request.request_id + RESULT_SUFFIX)))
    assert body["request_id"] == request.request_id and body["step"] == 7 and body["error"] is None


def test_an_answer_naming_a_committed_step_is_taken(run):
    write_checkpoint(run, 12)
    request = post_save_request(run)
    answer_request(run, request, step=12)
    assert wait(run, request) == 12
    assert not run.storage.exists(join(CONTROL, request.request_id + RESULT_SUFFIX))


@pytest.mark.parametrize("state", ["missing", "torn"])
def test_an_answer_naming_an_uncommitted_step_is_not_a_commit(run, state, caplog):
    if state == "torn":
        write_checkpoint(run, 12, commit=False)
    request = post_save_request(run)
    answer_request(run, request, step=12)
    with pytest.raises(SaveTimeoutError, match="an answer was ignored: .*step 12: expected a committed"):
        wait(run, request)
    assert len(warnings_about(caplog, "answer ignored")) == 1  # once, not at every poll


def forged_answers(request_id: str) -> dict[str, bytes]:
    return {
        "no id (an older job)": b'{"step": 5, "error": null}',
        "another id": json.dumps({"request_id": "save-1-other", "step": 5, "error": None}).encode(),
        "step as a string": json.dumps({"request_id": request_id, "step": "5", "error": None}).encode(),
        "step as a boolean": json.dumps({"request_id": request_id, "step": True, "error": None}).encode(),
        "negative step": json.dumps({"request_id": request_id, "step": -1, "error": None}).encode(),
        "neither step nor error": json.dumps({"request_id": request_id, "step": None, "error": None}).encode(),
        "huge step": f'{{"request_id": "{request_id}", "step": {"9" * 4000}, "error": null}}'.encode(),
        "deep nesting": b"[" * 100_000,
        "not JSON": b"committed!",
        "a list": b"[5]",
        "unknown field": json.dumps({"request_id": request_id, "step": 5, "error": None, "x": 1}).encode(),
        "oversize": b" " * SMALL_FILE_CAP + b"{}",
    }


@pytest.mark.parametrize("kind", sorted(forged_answers("save-1-x")))
def test_a_forged_answer_is_ignored_and_the_wait_times_out(run, kind):
    write_checkpoint(run, 5)  # even a committed step: the answer is not this request's
    request = post_save_request(run)
    plant(run, request.request_id + RESULT_SUFFIX, forged_answers(request.request_id)[kind])
    with pytest.raises(SaveTimeoutError, match="an answer was ignored"):
        wait(run, request)


@pytest.mark.parametrize("plant_special", [plant_fifo, plant_dev_zero], ids=["fifo", "dev-zero"])
def test_a_special_file_as_the_answer_times_out_on_time(run, plant_special):
    request = post_save_request(run)
    plant_special(run, request.request_id + RESULT_SUFFIX)
    started = time.monotonic()
    with pytest.raises(SaveTimeoutError):
        wait_for_answer(run, request, timeout=1.0, poll=0.1, check=run.check)
    assert time.monotonic() - started < 5


def test_the_real_answer_replacing_a_forged_one_is_taken(run):
    write_checkpoint(run, 9)
    request = post_save_request(run)
    plant(run, request.request_id + RESULT_SUFFIX, b'{"step": 9}')
    t = FakeTime()

    def job_answers(seconds: float) -> None:
        t.sleep(seconds)
        answer_request(run, request, step=9)

    assert wait_for_answer(run, request, timeout=10, clock=t.clock, sleep=job_answers, check=run.check) == 9


def test_the_jobs_error_is_one_bounded_line(run):
    request = post_save_request(run)
    answer_request(run, request, step=None, error="rank 3: disk full\nTraceback ...\n" + "x" * 10_000)
    with pytest.raises(SaveFailedError) as info:
        wait(run, request)
    message = str(info.value)
    assert "\n" not in message and "rank 3: disk full" in message and len(message) < 3000


# -- resume save in a subprocess: forged answers never make it say "committed" ---------------


@contextlib.contextmanager
def forger(run: Run, body_for):
    """Answers every request that appears, with ``body_for(request_id)`` (bytes)."""
    stop = threading.Event()

    def forge() -> None:
        while not stop.wait(0.05):
            with contextlib.suppress(FileNotFoundError):
                for name in os.listdir(run.storage.url(CONTROL)):
                    if name.endswith(REQUEST_SUFFIX):
                        request_id = name.removesuffix(REQUEST_SUFFIX)
                        with contextlib.suppress(OSError):
                            plant_whole(run, request_id + RESULT_SUFFIX, body_for(request_id))

    thread = threading.Thread(target=forge, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@pytest.mark.parametrize("kind", ["uncommitted step", "no id", "garbage", "deep nesting"])
def test_resume_save_with_no_job_and_a_forged_answer_times_out_with_exit_4(run, kind):
    bodies = {
        "uncommitted step": lambda rid: json.dumps({"request_id": rid, "step": 40, "error": None}).encode(),
        "no id": lambda rid: b'{"step": 40, "error": null}',
        "garbage": lambda rid: b'{"step": {"a": [1, 2]}, "error": 7}',
        "deep nesting": lambda rid: b"[" * 100_000,
    }
    with forger(run, bodies[kind]):
        proc = resume_cli("save", run.url, "--timeout", "3")
    assert proc.returncode == 4, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and "committed" not in proc.stdout
    assert proc.stderr.splitlines()[-1].startswith("resume: error: ")
    assert "an answer was ignored" in proc.stderr


def test_resume_save_with_a_forged_error_answer_fails_in_one_line(run):
    with forger(run, lambda rid: json.dumps({"request_id": rid, "step": None,
                                            "error": "boom\n" * 300}).encode()):
        proc = resume_cli("save", run.url, "--timeout", "5")
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    [line] = [line for line in proc.stderr.splitlines() if line.strip()]
    assert line.startswith("resume: error: ") and "boom boom" in line


# -- the lease: no clock, ttl or pid locks a run out ------------------------------------------


class Clock:
    def __init__(self, now: float = 1_796_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def write_holder(storage, clock, **fields) -> Holder:
    holder = Holder(**{"job_id": "other", "host": "n0099", "pid": 913, "token": "their-token",
                       "acquired_at": clock.now, "heartbeat_at": clock.now, "ttl_s": 120.0, **fields})
    storage.write_bytes_atomic(LEASE_NAME, json.dumps(asdict(holder)).encode())
    return holder


@pytest.fixture
def storage(tmp_path):
    return LocalStorage(str(tmp_path))


def test_a_heartbeat_ten_years_ahead_is_stale_and_the_warning_names_the_skew(storage, caplog):
    clock = Clock()
    write_holder(storage, clock, heartbeat_at=clock.now + TEN_YEARS)
    lease = Lease(storage, ttl_s=60, job_id="mine", clock=clock)
    lease.acquire()
    assert read_holder(storage).job_id == "mine"
    [warning] = warnings_about(caplog, "taking over a stale lease")
    assert f"heartbeat {TEN_YEARS:.0f} s in the future" in warning and "clock" in warning


def test_a_heartbeat_ahead_by_less_than_the_ttl_still_holds_and_says_so(storage):
    from resume.errors import RunBusyError

    clock = Clock()
    write_holder(storage, clock, heartbeat_at=clock.now + 30)
    with pytest.raises(RunBusyError, match="heartbeat 30 s in the future"):
        Lease(storage, ttl_s=60, job_id="mine", clock=clock).acquire()


@pytest.mark.parametrize("ttl", [1e300, MAX_TTL_S * 2])
def test_a_foreign_lease_with_a_huge_ttl_is_stale(storage, caplog, ttl):
    clock = Clock()
    write_holder(storage, clock, ttl_s=ttl)
    Lease(storage, ttl_s=60, job_id="mine", clock=clock).acquire()
    assert read_holder(storage).job_id == "mine"
    assert any("above the longest allowed" in w for w in warnings_about(caplog, "stale lease"))


@pytest.mark.parametrize("ttl", [1e300, MAX_TTL_S + 1, float("inf"), float("nan"), 0, -5])
def test_our_own_ttl_is_bounded(storage, ttl):
    with pytest.raises(UsageError, match="lease ttl"):
        Lease(storage, ttl_s=ttl)


def test_a_ttl_of_one_day_is_allowed(storage):
    Lease(storage, ttl_s=MAX_TTL_S, job_id="mine").acquire()


@pytest.mark.parametrize("pid", [1 << 40, 1 << 23, 1 << 62])
def test_an_impossible_pid_on_this_host_is_not_a_live_process(storage, caplog, pid):
    clock = Clock()
    write_holder(storage, clock, host=HOST, pid=pid)
    Lease(storage, ttl_s=60, job_id="mine", clock=clock).acquire()
    assert any(f"process {pid} on this host is gone" in w for w in warnings_about(caplog, "stale lease"))


def test_a_coordinator_starts_beside_a_lease_with_pid_two_to_the_forty(run_dir, monkeypatch):
    from support.workloads import Setup, build

    os.makedirs(run_dir)
    write_holder(LocalStorage(run_dir), Clock(time.time()), host=HOST, pid=1 << 40)
    monkeypatch.setenv("RESUME_JOB_ID", "job-A")
    coord, _ = build(0, 1, run_dir, Setup(every=2))
    try:
        assert read_holder(LocalStorage(run_dir)).job_id == "job-A"
    finally:
        coord.close()


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "oversize", "deep nesting"])
def test_a_lease_file_that_is_not_one_is_no_lease_and_never_hangs(storage, caplog, kind):
    path = storage.url(LEASE_NAME)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        os.symlink("/dev/zero", path)
    else:
        with open(path, "wb") as f:
            f.write(b" " * (SMALL_FILE_CAP + 1) if kind == "oversize" else b"[" * 100_000)
    assert read_holder(storage) is None
    assert warnings_about(caplog, "unreadable lease, treated as none")
    lease = Lease(storage, ttl_s=60, job_id="mine")
    lease.acquire()  # the special file is replaced by our lease, nothing written through a link
    assert read_holder(storage).job_id == "mine" and not os.path.islink(path)
    with open("/dev/zero", "rb") as f:
        assert f.read(4) == b"\0" * 4


# -- a running job with hostile files in control/ ----------------------------------------------


def start_worker(run: str, trace: str, final: str) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "resume.drill.worker", "--run", run, "--iterations", "1000000",
             "--every", "0", "--skip", "3", "--trace", trace, "--final", final],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            preexec_fn=limited))  # noqa: PLW1509 - only setrlimit, no lock taken
    return procs


def trace_iterations(trace) -> list[int]:
    return [record["iteration"] for record in read_jsonl(trace, missing_ok=True)]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_running_job_with_a_fifo_in_control_still_saves_on_request_and_on_sigterm(tmp_path):
    run = Run.open(str(tmp_path / "run"), create=True)
    # Dropped in before the job's first poll: each froze or stopped the job before.
    plant_fifo(run, "x.request")
    plant_dev_zero(run, "zero.request")
    plant(run, "deep.request", b"[" * 100_000)
    plant(run, "save-1-no.request", b'{"stop": "no"}')
    trace = tmp_path / "trace.jsonl"
    procs = start_worker(run.url, str(trace), str(tmp_path / "final.json"))
    try:
        deadline = time.monotonic() + 120
        while len(trace_iterations(trace)) < 5:
            assert time.monotonic() < deadline, "the job did not get past its first polls"
            assert all(p.poll() is None for p in procs), procs[0].stderr.read()
            time.sleep(0.2)
        saved = resume_cli("save", run.url, "--timeout", "120", "--json", timeout=180)
        assert saved.returncode == 0, saved.stdout + saved.stderr
        step = json.loads(saved.stdout)["step"]
        assert Run.open(run.url).is_committed(step)
        assert all(p.poll() is None for p in procs)  # {"stop": "no"} stopped nothing
        for p in procs:  # a preemption: every rank gets SIGTERM
            p.send_signal(signal.SIGTERM)
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    last = trace_iterations(trace)[-1]
    assert Run.open(run.url).committed_steps()[-1] == last > step  # saved at the stop iteration
    errors = procs[0].stderr.read()
    assert "Traceback" not in errors
    for name in ("x.request", "zero.request", "deep.request", "save-1-no.request"):
        assert len([line for line in errors.splitlines() if name in line]) <= 1, errors  # not at every poll


def test_a_coordinator_with_a_ttl_of_1e300_is_a_usage_error(run_dir, monkeypatch):
    from support.workloads import Setup, build, with_coordinator_options

    with_coordinator_options(monkeypatch, lease_ttl_s=1e300)
    with pytest.raises(UsageError, match="lease ttl"):
        build(0, 1, run_dir, Setup(every=2))
    assert not os.path.exists(os.path.join(run_dir, LEASE_NAME))


def test_a_lease_of_a_holder_that_died_is_taken_over_with_one_info_line(storage, caplog):
    clock = Clock()
    write_holder(storage, clock, heartbeat_at=clock.now - 600)  # a node that crashed ten minutes ago
    with caplog.at_level(logging.INFO, logger="resume"):
        Lease(storage, ttl_s=60, job_id="mine", clock=clock).acquire()
    assert read_holder(storage).job_id == "mine"
    assert not warnings_about(caplog, "lease")
    [line] = [r.getMessage() for r in caplog.records if "taking over a stale lease" in r.getMessage()]
    assert "heartbeat 600 s old" in line and "\n" not in line


def test_a_lease_path_that_is_a_directory_is_one_line_refusal_not_a_traceback(storage, tmp_path, caplog):
    from resume.errors import RunBusyError

    os.makedirs(os.path.join(str(tmp_path), LEASE_NAME, "inside"))
    with caplog.at_level(logging.INFO, logger="resume"), \
            pytest.raises(RunBusyError, match=r"lease\.json: expected the run's lease file or none, actual a "
                                              r"directory") as refused:
        Lease(storage, ttl_s=60, job_id="mine", clock=Clock()).acquire()
    assert "\n" not in str(refused.value) and refused.value.exit_code == 1
    assert os.path.isdir(os.path.join(str(tmp_path), LEASE_NAME, "inside"))  # nothing of it removed
