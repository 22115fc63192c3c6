"""Unit tests for resume.control: save requests from outside the job.

Time is a fake clock that only the fake sleep advances, so no test sleeps and
a timeout is reached exactly.
"""

from __future__ import annotations

import json

import pytest

from resume.control import (
    REQUEST_SUFFIX,
    RESULT_SUFFIX,
    SaveRequest,
    answer_request,
    pending_requests,
    post_save_request,
    wait_for_answer,
)
from resume.errors import SaveFailedError, SaveTimeoutError
from resume.run import CONTROL, Run
from resume.storage import join


class FakeTime:
    """A monotonic clock advanced only by ``sleep``; ``on_sleep`` runs after each sleep."""

    def __init__(self, start: float = 1000.0, on_sleep=None) -> None:
        self.now = start
        self.sleeps: list[float] = []
        self.on_sleep = on_sleep

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds
        if self.on_sleep is not None:
            self.on_sleep(len(self.sleeps))


@pytest.fixture
def run(tmp_path) -> Run:
    return Run.open(str(tmp_path / "run"), create=True)


def request_path(request: SaveRequest) -> str:
    return join(CONTROL, request.request_id + REQUEST_SUFFIX)


def result_path(request: SaveRequest) -> str:
    return join(CONTROL, request.request_id + RESULT_SUFFIX)


def test_no_control_directory_means_no_pending_requests(run):
    assert pending_requests(run) == []


def test_posted_request_is_seen_as_pending(run):
    request = post_save_request(run, stop=True, reason="slurm USR1")
    assert pending_requests(run) == [SaveRequest(request.request_id, stop=True, reason="slurm USR1")]
    body = json.loads(run.storage.read_bytes(request_path(request)))
    assert body["stop"] is True and body["reason"] == "slurm USR1"


def test_several_requests_are_all_pending_with_their_stop_flags(run):
    a = post_save_request(run, stop=False)
    b = post_save_request(run, stop=True)
    assert a.request_id != b.request_id
    pending = {r.request_id: r.stop for r in pending_requests(run)}
    assert pending == {a.request_id: False, b.request_id: True}


def test_pending_requests_skips_half_written_and_foreign_files(run):
    good = post_save_request(run)
    run.storage.write_bytes_atomic(join(CONTROL, "save-torn" + REQUEST_SUFFIX), b'{"stop": tr')
    run.storage.write_bytes_atomic(join(CONTROL, "README"), b"not a request")
    run.storage.write_bytes_atomic(join(CONTROL, "save-old" + RESULT_SUFFIX), b'{"step": 1}')
    assert pending_requests(run) == [SaveRequest(good.request_id, stop=False, reason="resume save")]


def test_answer_writes_result_and_removes_request(run):
    request = post_save_request(run)
    answer_request(run, request, step=200)
    assert pending_requests(run) == []
    assert not run.storage.exists(request_path(request))
    body = json.loads(run.storage.read_bytes(result_path(request)))
    assert body["step"] == 200 and body["error"] is None


def test_wait_for_answer_returns_the_committed_step_and_cleans_up(run):
    request = post_save_request(run)
    answer_request(run, request, step=300)
    t = FakeTime()
    assert wait_for_answer(run, request, timeout=10, clock=t.clock, sleep=t.sleep) == 300
    assert t.sleeps == []
    assert not run.storage.exists(result_path(request))


def test_wait_for_answer_polls_until_the_answer_arrives(run):
    request = post_save_request(run)

    def job_answers_on_third_poll(n_sleeps: int) -> None:
        if n_sleeps == 3:
            answer_request(run, request, step=400)

    t = FakeTime(on_sleep=job_answers_on_third_poll)
    waits: list[float] = []
    step = wait_for_answer(run, request, timeout=60, poll=2.0, clock=t.clock, sleep=t.sleep,
                           on_wait=waits.append)
    assert step == 400
    assert t.sleeps == [2.0, 2.0, 2.0]
    assert waits == [60.0, 58.0, 56.0]


def test_wait_for_answer_times_out_and_withdraws_the_request(run):
    request = post_save_request(run)
    t = FakeTime()
    with pytest.raises(SaveTimeoutError) as info:
        wait_for_answer(run, request, timeout=5, poll=2.0, clock=t.clock, sleep=t.sleep)
    err = info.value
    assert err.exit_code == 4
    assert isinstance(err, TimeoutError)
    assert "5s" in str(err) and run.url in str(err)
    # It waited the whole timeout, never longer, without sleeping for real.
    assert t.sleeps == [2.0, 2.0, 1.0]
    assert t.now == pytest.approx(1005.0)
    # A job that comes back later must not save for a caller who has gone.
    assert not run.storage.exists(request_path(request))
    assert pending_requests(run) == []


def test_wait_for_answer_with_zero_timeout_checks_once(run):
    request = post_save_request(run)
    t = FakeTime()
    with pytest.raises(SaveTimeoutError):
        wait_for_answer(run, request, timeout=0, clock=t.clock, sleep=t.sleep)
    assert t.sleeps == []


def test_answer_with_error_raises_save_failed(run):
    request = post_save_request(run)
    answer_request(run, request, step=None, error="rank 3: disk full")
    t = FakeTime()
    with pytest.raises(SaveFailedError) as info:
        wait_for_answer(run, request, timeout=10, clock=t.clock, sleep=t.sleep)
    assert info.value.exit_code == 1
    assert "rank 3: disk full" in str(info.value)
    assert request.request_id in str(info.value)
    assert not run.storage.exists(result_path(request))
