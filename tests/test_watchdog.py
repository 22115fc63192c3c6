"""Hang detection inside a rank (resume/watchdog.py, issue 25): the bounds, the phases a rank
records, what its watchdog reports and when, rank 0's progress for the hook; and the phases a
real Coordinator drives. Every clock is injected: nothing here sleeps."""

from __future__ import annotations

import json
import math
import threading

import pytest
from resume.cluster.hangs import HangWatch, parse_progress, parse_report
from support.workloads import Setup, build, train, with_coordinator_options

from resume import coordinator as coordinator_module
from resume.errors import UsageError
from resume.storage import open_storage
from resume.watchdog import HANG_ENV, HANGS, PROGRESS, HangBounds, Progress, Watchdog, report_path


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class CountingStorage:
    """A real LocalStorage that counts what is written where."""

    def __init__(self, root: str) -> None:
        self.inner = open_storage(root)
        self.writes: list[str] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def write_bytes_atomic(self, path: str, data: bytes) -> None:
        self.writes.append(path)
        self.inner.write_bytes_atomic(path, data)


BOUNDS = HangBounds(floor_s=1.0, factor=5.0, first_s=100.0, startup_s=50.0, beat_s=5.0, tick_s=1.0)
"""Small numbers the tests can reason about: floor 1 s, 5 x the slowest, start-up 50 s, first 100 s."""


def watchdog(tmp_path, bounds: HangBounds = BOUNDS, *, rank: int = 1, storage=True) -> tuple[Watchdog, Clock]:
    clock = Clock()
    w = Watchdog(bounds, rank=rank, world_size=4, launch=3, node="n7", clock=clock,
                 wall=lambda: 1_700_000_000.0 + clock.t)
    if storage:
        w.storage = CountingStorage(str(tmp_path / "run"))
    return w, clock


def iterations(w: Watchdog, clock: Clock, durations: list[float], *, first: int = 1) -> int:
    """``update()`` calls ``durations`` apart (the first one at the clock's time); the last iteration."""
    w.progress.progress(first)
    w.progress.synced()
    for i, dt in enumerate(durations, start=first + 1):
        clock.advance(dt)
        w.progress.progress(i)
        w.progress.synced()
    return first + len(durations)


# -- HangBounds ------------------------------------------------------------------------------------


def test_a_measured_phases_bound_is_factor_times_its_slowest():
    assert HangBounds(floor_s=10.0, factor=5.0).bound(4.0) == 20.0


def test_the_floor_wins_over_a_short_measured_phase():
    assert HangBounds(floor_s=300.0, factor=5.0).bound(2.0) == 300.0


def test_before_anything_is_measured_the_bound_is_first_s_never_below_the_floor():
    assert HangBounds(floor_s=10.0, first_s=600.0).bound(None) == 600.0
    assert HangBounds(floor_s=900.0, first_s=600.0).bound(None) == 900.0


def test_the_start_up_bound_is_startup_s_else_first_s_never_below_the_floor():
    assert HangBounds(floor_s=10.0, first_s=600.0, startup_s=120.0).startup() == 120.0
    assert HangBounds(floor_s=10.0, first_s=600.0).startup() == 600.0
    assert HangBounds(floor_s=200.0, first_s=600.0, startup_s=120.0).startup() == 200.0


def test_merged_replaces_only_the_fields_given():
    base = HangBounds(floor_s=10.0, factor=3.0, first_s=600.0)
    merged = base.merged(startup_s=42.0, factor=None)
    assert (merged.startup_s, merged.factor, merged.floor_s, merged.first_s) == (42.0, 3.0, 10.0, 600.0)
    assert base.merged(startup_s=None) == base
    with pytest.raises(UsageError, match="floor_s"):
        base.merged(floor_s=-1.0)


@pytest.mark.parametrize("bounds", [
    HangBounds(),
    HangBounds(floor_s=60.0, factor=3.0, first_s=900.0, startup_s=450.5, beat_s=2.0, tick_s=0.25),
    HangBounds(floor_s=0.5, factor=1.0, first_s=10.0, beat_s=0.5, tick_s=0.1),
])
def test_bounds_cross_to_the_ranks_through_the_environment_unchanged(bounds):
    assert HangBounds.from_env({HANG_ENV: bounds.to_env()}) == bounds


def test_off_disables_and_no_setting_is_the_defaults():
    assert HangBounds(enabled=False).to_env() == "off"
    assert HangBounds.from_env({HANG_ENV: "off"}).enabled is False
    assert HangBounds.from_env({}) == HangBounds()
    assert HangBounds.from_env({HANG_ENV: "  "}) == HangBounds()


def test_bounds_of_any_precision_cross_to_the_ranks_unchanged():
    bounds = HangBounds(startup_s=1234.5678, floor_s=61.234567)
    assert HangBounds.from_env({HANG_ENV: bounds.to_env()}) == bounds


@pytest.mark.parametrize("fields, named", [
    ({"floor_s": 0}, "floor_s"),
    ({"floor_s": float("nan")}, "floor_s"),
    ({"factor": 0.5}, "factor"),
    ({"first_s": -1.0}, "first_s"),
    ({"beat_s": "5"}, "beat_s"),
    ({"tick_s": True}, "tick_s"),
    ({"startup_s": 0.0}, "startup_s"),
    ({"startup_s": float("nan")}, "startup_s"),
])
def test_a_bad_bound_is_a_usage_error_naming_the_field(fields, named):
    with pytest.raises(UsageError, match=named):
        HangBounds(**fields)


def test_a_startup_bound_that_is_not_a_number_is_a_usage_error():
    with pytest.raises(UsageError, match="startup_s"):
        HangBounds(startup_s="600")


@pytest.mark.parametrize("text, named", [
    ("floor=abc", "floor"),
    ("bogus=1", "bogus"),
    ("floor=10,", "''"),
    ("factor=0.5", "factor"),
    ("startup=-1", "startup_s"),
    ("tick=nan", "tick_s"),
])
def test_a_bad_hook_setting_is_a_usage_error_naming_it(text, named):
    with pytest.raises(UsageError, match=named):
        HangBounds.from_env({HANG_ENV: text})


# -- the bounds of a rank's phases -------------------------------------------------------------------


def test_the_iteration_bound_comes_from_the_slowest_measured_iteration(tmp_path):
    w, clock = watchdog(tmp_path)
    iterations(w, clock, [2.0, 3.0, 1.0])
    assert w.progress.slowest["iteration"] == 3.0
    assert w.bound_of("iteration") == 15.0
    assert w.open_phases() == [{"phase": "iteration", "what": "", "since": clock.t, "bound_s": 15.0}]


def test_the_first_iterations_after_a_start_have_the_start_up_bound(tmp_path):
    w, clock = watchdog(tmp_path)
    assert w.progress.phase == "start-up" and w.bound_of("start-up") == 50.0
    with w.phase("restore", measure="restore"):
        clock.advance(2.0)
    w.progress.progress(1)  # the first update(): nothing measured yet (compilation, warm caches)
    assert w.bound_of("iteration") == 50.0
    clock.advance(40.0)
    assert w.check() == []  # far past any factor x 2 s: still the start-up's bound
    clock.advance(11.0)
    assert [p["phase"] for p in w.check()] == ["iteration"]


def test_the_save_bound_comes_from_measured_saves_and_the_restored_manifests_save_time(tmp_path):
    w, clock = watchdog(tmp_path)
    assert w.bound_of("save") == 100.0  # nothing measured: first_s
    w.measured_save_s = 6.0  # the restored manifest's save time
    assert w.bound_of("save") == 30.0 and w.bound_of("save-background") == 30.0
    with w.phase("save", measure="save"):
        clock.advance(8.0)
    assert w.progress.slowest["save"] == 8.0
    assert w.bound_of("save") == 40.0
    w.progress.background(True)
    clock.advance(12.0)
    w.progress.background(False)
    assert w.bound_of("save") == 60.0 and w.bound_of("save-background") == 60.0


def test_a_background_save_has_its_own_clock_beside_the_loops(tmp_path):
    w, clock = watchdog(tmp_path)
    last = iterations(w, clock, [1.0, 1.0])  # iteration bound: max(1, 5 x 1) = 5
    w.measured_save_s = 2.0  # background bound: 10
    w.progress.background(True)
    started = clock.t
    for _ in range(6):  # the loop goes on, each iteration well inside its bound
        clock.advance(1.0)
        last += 1
        w.progress.progress(last)
        w.progress.synced()
        assert w.check() == []
    phases = {p["phase"]: p for p in w.open_phases()}
    assert phases["save-background"]["since"] == started and phases["save-background"]["bound_s"] == 10.0
    clock.advance(4.5)  # background 10.5 s > 10; the iteration only 4.5 s < 5
    assert [p["phase"] for p in w.check()] == ["save-background"]
    w.progress.background(False)
    assert w.progress.slowest["save-background"] == 10.5
    assert [p["phase"] for p in w.open_phases()] == ["iteration"]


def test_a_declared_phase_is_not_a_hang_before_its_seconds_and_is_one_after(tmp_path):
    w, clock = watchdog(tmp_path)
    iterations(w, clock, [1.0, 1.0])  # iteration bound 5 s
    with w.expect(100.0, "evaluation"):
        clock.advance(99.0)
        assert w.check() == []
        clock.advance(2.0)
        reported = w.check()
    assert [(p["phase"], p["what"], p["bound_s"]) for p in reported] == [("declared", "evaluation", 100.0)]
    assert w.progress.phase == "iteration"  # the with block went back to the loop's phase


def test_a_declared_phase_called_plainly_lasts_until_the_next_update(tmp_path):
    w, clock = watchdog(tmp_path)
    last = iterations(w, clock, [1.0, 1.0])
    w.expect(30.0, "data-set rebuild")
    clock.advance(29.0)
    assert w.check() == [] and w.progress.phase == "declared"
    w.progress.progress(last + 1)
    assert w.progress.phase == "iteration"
    assert w.progress.slowest["iteration"] == 1.0, "the declared time counted as an iteration"


def test_a_declared_phase_is_never_shorter_than_the_floor(tmp_path):
    w, _ = watchdog(tmp_path, HangBounds(floor_s=300.0))
    with w.expect(10.0):
        assert w.open_phases()[0]["bound_s"] == 300.0


@pytest.mark.parametrize("seconds", [0, -5.0, float("nan"), True, "60"])
def test_a_declared_phase_needs_positive_seconds(tmp_path, seconds):
    w, _ = watchdog(tmp_path)
    with pytest.raises(UsageError, match="seconds"):
        w.expect(seconds)


# -- what a rank reports, and when ----------------------------------------------------------------


def test_a_phase_is_reported_once_not_at_every_tick_and_the_next_instance_again(tmp_path):
    w, clock = watchdog(tmp_path)
    last = iterations(w, clock, [1.0, 1.0])
    clock.advance(5.5)
    assert len(w.check()) == 1
    clock.advance(1.0)
    assert w.check() == [] and w.reports == 1
    w.progress.progress(last + 1)  # it moved on, then hangs again: a new instance
    clock.advance(9.0)  # 5 x the slowest (now 6.5 s): 32.5 s
    assert w.check() == []
    clock.advance(24.0)
    assert len(w.check()) == 1 and w.reports == 2


def test_the_report_starts_with_a_json_line_naming_where_the_rank_was_then_every_threads_stack(tmp_path):
    w, clock = watchdog(tmp_path)
    last = iterations(w, clock, [1.0, 2.0])
    clock.advance(10.5)
    w.check()
    data = (tmp_path / "run" / report_path(3, 1)).read_bytes()
    head, _, body = data.partition(b"\n")
    rec = json.loads(head)
    assert (rec["rank"], rec["world_size"], rec["launch"], rec["node"]) == (1, 4, 3, "n7")
    assert (rec["phase"], rec["iteration"], rec["quiet_s"], rec["bound_s"]) == ("iteration", last, 10.5, 10.0)
    assert rec["last_progress_at"] == pytest.approx(1_700_000_000.0 + clock.t - 10.5)
    assert "MainThread" in rec["threads"]
    assert rec["threads"]["MainThread"][0][2] == "thread_frames"  # innermost first
    assert b"--- thread MainThread (most recent call last) ---" in body
    assert b"test_watchdog.py" in body
    report = parse_report(data, rank=1)  # what the hook reads back
    assert report is not None and (report.phase, report.iteration, report.node) == ("iteration", last, "n7")


def test_a_rank_quiet_for_half_its_bound_reports_only_when_the_hook_asks(tmp_path):
    w, clock = watchdog(tmp_path)
    iterations(w, clock, [2.0, 2.0])  # bound 10 s
    clock.advance(4.0)
    w.storage.write_bytes_atomic(f"{HANGS}/launch-3/dump", b"{}\n")
    assert w.check() == []  # quiet 4 s: under half
    clock.advance(2.0)
    assert [p["phase"] for p in w.check()] == ["iteration"]
    assert (tmp_path / "run" / report_path(3, 1)).exists()


def test_a_rank_quiet_for_half_its_bound_stays_silent_without_the_hooks_request(tmp_path):
    w, clock = watchdog(tmp_path)
    iterations(w, clock, [2.0, 2.0])
    clock.advance(9.0)
    # Another launch's request is not this one's.
    w.storage.write_bytes_atomic(f"{HANGS}/launch-2/dump", b"{}\n")
    assert w.check() == []
    assert not (tmp_path / "run" / report_path(3, 1)).exists()


def test_without_a_run_a_hang_is_logged_and_nothing_written(tmp_path, caplog):
    w, clock = watchdog(tmp_path, storage=False)
    iterations(w, clock, [1.0, 1.0])
    clock.advance(6.0)
    with caplog.at_level("ERROR", logger="resume"):
        assert len(w.check()) == 1
    assert "no progress in iteration" in caplog.text and "not kept (no run)" in caplog.text


# -- rank 0's progress for the hook ------------------------------------------------------------------


def test_only_rank_0_with_the_heartbeat_set_writes_its_progress(tmp_path):
    for rank, heartbeat in ((0, False), (1, True)):
        w, clock = watchdog(tmp_path, rank=rank)
        w.heartbeat = heartbeat
        iterations(w, clock, [1.0])
        w.check()
        assert PROGRESS not in w.storage.writes
    w, clock = watchdog(tmp_path, rank=0)
    w.heartbeat = True
    iterations(w, clock, [1.0])
    w.check()
    assert w.storage.writes == [PROGRESS]


def test_progress_is_written_when_it_changed_and_at_most_every_beat(tmp_path):
    w, clock = watchdog(tmp_path, rank=0)
    w.heartbeat = True
    last = iterations(w, clock, [1.0])
    w.check()
    assert w.storage.writes.count(PROGRESS) == 1
    clock.advance(20.0)
    w.check()  # nothing changed: nothing written, however long ago the last write
    assert w.storage.writes.count(PROGRESS) == 1
    w.progress.progress(last + 1)
    clock.advance(1.0)
    w.progress.progress(last + 2)
    w.check()  # changed, and the last write was 21 s ago
    assert w.storage.writes.count(PROGRESS) == 2
    for i in range(3, 7):  # changed at every tick, within one beat of the last write
        clock.advance(1.0)
        w.progress.progress(last + i)
        w.check()
    assert w.storage.writes.count(PROGRESS) == 2
    clock.advance(1.5)
    w.progress.progress(last + 7)
    w.check()
    assert w.storage.writes.count(PROGRESS) == 3


def test_rank_0s_progress_is_what_the_hook_reads_and_close_writes_it_without_phases(tmp_path):
    w, clock = watchdog(tmp_path, rank=0)
    w.heartbeat = True
    last = iterations(w, clock, [2.0, 2.0])
    w.progress.background(True)
    clock.advance(3.0)
    w.check()
    rec = parse_progress((tmp_path / "run" / PROGRESS).read_bytes(), 3)
    assert rec is not None and (rec["iteration"], rec["phase"], rec["world_size"]) == (last, "iteration", 4)
    assert [(p["phase"], p["quiet_s"], p["bound_s"]) for p in rec["phases"]] == [
        ("iteration", 3.0, 10.0), ("save-background", 3.0, 100.0)]
    assert rec["slowest"] == {"iteration": 2.0}
    watch = HangWatch(w.storage.inner, launch=3, bounds=BOUNDS, clock=clock)
    assert watch.poll() is None and watch.record["seq"] == w.progress.seq
    w.close()
    rec = json.loads((tmp_path / "run" / PROGRESS).read_bytes())
    assert (rec["phase"], rec["phases"]) == ("closed", [])


def test_with_detection_off_nothing_is_reported_and_rank_0_tells_the_hook_nothing_is_watched(tmp_path):
    w, clock = watchdog(tmp_path, HangBounds(enabled=False, floor_s=1.0), rank=0)
    w.heartbeat = True
    iterations(w, clock, [1.0, 1.0])
    w.storage.write_bytes_atomic(f"{HANGS}/launch-3/dump", b"{}\n")
    clock.advance(1e6)
    assert w.check() == [] and w.reports == 0
    rec = parse_progress((tmp_path / "run" / PROGRESS).read_bytes(), 3)
    assert rec is not None and rec["phases"] == [] and rec["phase"] == "iteration"


# -- the loop's times ------------------------------------------------------------------------------------


def test_take_times_gives_median_and_slowest_since_the_last_call_then_starts_again():
    clock = Clock()
    p = Progress(clock)
    p.progress(1)
    for dt in (3.0, 1.0, 2.0, 4.0):
        p.synced()
        clock.advance(dt)
        p.progress(2)
    assert p.take_times() == {"count": 4, "median_s": 3.0, "max_s": 4.0}  # the upper median of 4
    assert p.take_times() == {"count": 0}


def test_an_iterations_time_is_its_own_not_the_wait_at_the_boundary():
    clock = Clock()
    p = Progress(clock)
    p.progress(1)
    clock.advance(5.0)  # the boundary's agreement (a collective) took 5 s
    p.synced()
    clock.advance(2.0)
    p.progress(2)
    assert p.take_times()["max_s"] == 2.0
    assert p.slowest["iteration"] == 7.0  # the bound's measure: update() to update()


def test_the_time_spent_in_a_save_is_no_iterations_time():
    clock = Clock()
    p = Progress(clock)
    p.progress(1)
    p.synced()
    clock.advance(1.0)
    p.progress(2)
    p.synced()
    token = p.enter("save")  # update() 2 saves at its boundary
    clock.advance(100.0)
    p.leave(token, measure="save")
    clock.advance(1.5)
    p.progress(3)  # its iteration began inside the save: not measured
    p.synced()
    clock.advance(2.0)
    p.progress(4)
    assert p.slowest == {"iteration": 2.0, "save": 100.0}
    assert p.take_times() == {"count": 2, "median_s": 2.0, "max_s": 2.0}


# -- the thread ----------------------------------------------------------------------------------------


def test_the_watchdog_thread_runs_only_when_enabled_and_stops():
    off = Watchdog(HangBounds(enabled=False))
    off.start()
    assert off._thread is None
    on = Watchdog(HangBounds(tick_s=0.01))
    on.start()
    thread = on._thread
    assert thread is not None and thread.name == "resume-watchdog" and thread.daemon and thread.is_alive()
    on.stop()
    assert not thread.is_alive() and on._thread is None


# -- a real Coordinator drives the phases ----------------------------------------------------------------


@pytest.fixture
def own_watchdog(monkeypatch):
    """This test's process watchdog: a fresh one, so that no other test's bounds or measures leak in."""
    w = Watchdog(HangBounds.from_env({}))
    monkeypatch.setattr(coordinator_module, "process_watchdog", lambda: w)
    yield w
    w.stop()


def test_a_coordinator_records_restore_save_iteration_and_closed(run_dir, own_watchdog):
    seen: dict[str, list[str]] = {"load": [], "save": []}
    coord, parts = build(0, 1, run_dir, Setup(every=3))
    coord.restore()  # a fresh start
    train(coord, parts, until=3)  # a checkpoint to restore
    coord.close()
    assert own_watchdog.progress.phase == "closed"

    coord, parts = build(0, 1, run_dir, Setup(every=3))
    assert coord.watchdog is own_watchdog and own_watchdog.progress.phase == "start-up"
    assert own_watchdog._thread is not None and own_watchdog._thread.is_alive()
    adapter = coord.adapter
    load, save = adapter.load_shards, adapter.save_shards

    def observed_load(*args, **kwargs):
        seen["load"].append(own_watchdog.progress.phase)
        return load(*args, **kwargs)

    def observed_save(*args, **kwargs):
        seen["save"].append(own_watchdog.progress.phase)
        return save(*args, **kwargs)

    adapter.load_shards, adapter.save_shards = observed_load, observed_save
    coord.restore()
    assert coord.restored_from == 3 and seen["load"] == ["restore"]
    assert "restore" in own_watchdog.progress.slowest
    saved = own_watchdog.measured_save_s
    assert saved is not None and math.isfinite(saved)  # the restored manifest's save time
    train(coord, parts, until=5)
    assert own_watchdog.progress.phase == "iteration" and own_watchdog.progress.iteration == 5
    train(coord, parts, until=6)  # saves at 6
    assert seen["save"] == ["save"] and own_watchdog.progress.phase == "iteration"
    assert "save" in own_watchdog.progress.slowest
    coord.close()
    assert own_watchdog.progress.phase == "closed" and own_watchdog._thread is None


def test_a_background_save_is_watched_on_its_own_clock_until_it_commits(run_dir, own_watchdog):
    coord, parts = build(0, 1, run_dir, Setup(every=3, async_save=True))
    coord.restore()
    inside = threading.Event()
    release = threading.Event()
    write = coord.adapter.write_staged
    phases_inside: list[list[str]] = []

    def held_write(*args, **kwargs):
        phases_inside.append([p["phase"] for p in own_watchdog.open_phases()])
        inside.set()
        release.wait(30)
        return write(*args, **kwargs)

    coord.adapter.write_staged = held_write
    train(coord, parts, until=3)  # the save at 3 goes to the background
    assert inside.wait(30)
    assert own_watchdog.progress.background_since is not None
    release.set()
    coord.maybe_wait_for_save()
    assert phases_inside == [["iteration", "save-background"]]
    assert own_watchdog.progress.background_since is None
    assert "save-background" in own_watchdog.progress.slowest
    coord.close()


def test_a_later_coordinator_without_bounds_gets_the_defaults_not_an_earlier_ones(tmp_path, monkeypatch, own_watchdog):
    with_coordinator_options(monkeypatch, hang=HangBounds(enabled=False))
    first, _ = build(0, 1, str(tmp_path / "a"), Setup())
    first.close()
    with_coordinator_options(monkeypatch, hang=None)
    second, _ = build(0, 1, str(tmp_path / "b"), Setup())
    try:
        assert second.watchdog.bounds == HangBounds()
        assert second.watchdog._thread is not None
    finally:
        second.close()


def test_a_later_coordinator_on_another_run_reports_into_its_own_run(tmp_path, own_watchdog):
    first, _ = build(0, 1, str(tmp_path / "a"), Setup())
    first.close()
    second, _ = build(0, 1, str(tmp_path / "b"), Setup())
    try:
        assert second.watchdog.storage.url(PROGRESS) == second.run.storage.url(PROGRESS)
    finally:
        second.close()
