"""The hook's side of hang detection (cluster/hangs.py, the Supervisor's hang path in
cluster/hook.py; issue 25): rank 0's progress as the hook reads it, the ranks' reports, the
suspect, and what the hook does about a hang. Clocks, sleeps, Slurm and srun are injected."""

from __future__ import annotations

import json
import os
import signal

import pytest
from resume.cluster.hangs import (
    Hang,
    HangWatch,
    RankReport,
    collect,
    find_suspects,
    hang_summary,
    parse_report,
    suspect_nodes,
)
from resume.cluster.hook import EXIT_CRASH_LOOP, HookConfig, Supervisor
from resume.cluster.slurm import Slurm, SlurmJob
from support.signals import handlers_restored
from support.traces import hook_events

from resume.storage import SMALL_FILE_CAP, open_storage
from resume.watchdog import HANG_ENV, HANGS, PROGRESS, REPORT_CAP, RUN_ENV, HangBounds, report_path

BOUNDS = HangBounds(floor_s=1.0, factor=5.0, first_s=100.0, beat_s=5.0, tick_s=1.0)
"""Start-up bound 100 s; a phase is a hang past its bound + 6 s (a beat and a tick)."""
HUGE_INT = "1" + "0" * 400
"""A JSON integer Python parses, too large for a float."""


class Clock:
    def __init__(self, t: float = 500.0) -> None:
        self.t = t
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += seconds


def progress_record(launch: int = 1, *, seq: int = 1, phase: str = "iteration", quiet_s: float = 0.0,
                    bound_s: float = 10.0, iteration: int | None = 7, what: str = "") -> dict:
    """Rank 0's progress as resume/watchdog.py writes it."""
    return {"launch": launch, "seq": seq, "iteration": iteration, "phase": phase,
            "phases": [{"phase": phase, "what": what, "quiet_s": quiet_s, "bound_s": bound_s}],
            "world_size": 2, "written_at": 1.7e9, "slowest": {}}


def write_progress(storage, record) -> None:
    storage.write_bytes_atomic(PROGRESS, record if isinstance(record, bytes) else json.dumps(record).encode())


@pytest.fixture
def storage(tmp_path):
    return open_storage(str(tmp_path / "run"))


# -- HangWatch.poll ----------------------------------------------------------------------------------


def test_a_program_that_never_wrote_progress_is_not_watched_at_its_start(storage):
    clock = Clock()
    watch = HangWatch(storage, launch=1, bounds=BOUNDS, clock=clock, expect_progress=False)
    clock.t += 10_000
    assert watch.poll() is None
    write_progress(storage, progress_record(1, seq=1, phase="start-up", quiet_s=0.0, bound_s=100.0))
    assert watch.poll() is None
    clock.t += 107
    assert watch.poll() is not None  # once it reports, its phases are watched


def test_without_progress_a_start_up_hang_comes_only_after_the_start_up_bound_and_a_beat(storage):
    clock = Clock()
    watch = HangWatch(storage, launch=1, bounds=BOUNDS, clock=clock)
    clock.t += 104.9
    assert watch.poll() is None
    clock.t += 0.2
    hang = watch.poll()
    assert hang is not None and (hang.phase, hang.bound_s, hang.iteration) == ("start-up", 100.0, None)
    assert hang.quiet_s == pytest.approx(105.1)


def test_another_launchs_progress_is_ignored(storage):
    clock = Clock()
    write_progress(storage, progress_record(launch=2, quiet_s=50.0, bound_s=10.0))
    watch = HangWatch(storage, launch=3, bounds=BOUNDS, clock=clock)
    clock.t += 60.0
    assert watch.poll() is None and watch.record is None  # as launch 2's, a hang long ago
    clock.t += 46.0
    assert watch.poll().phase == "start-up"


def test_a_new_seq_starts_the_quiet_time_again(storage):
    clock = Clock()
    watch = HangWatch(storage, launch=1, bounds=BOUNDS, clock=clock)
    write_progress(storage, progress_record(seq=1))
    assert watch.poll() is None
    clock.t += 15.0
    write_progress(storage, progress_record(seq=2))
    assert watch.poll() is None  # 15 s since seq 1, but seq 2 is new
    clock.t += 15.9
    assert watch.poll() is None
    clock.t += 0.2
    assert watch.poll() is not None


def test_a_phase_past_its_bound_a_beat_and_a_tick_is_a_hang(storage):
    clock = Clock()
    watch = HangWatch(storage, launch=1, bounds=BOUNDS, clock=clock)
    write_progress(storage, progress_record(phase="save", quiet_s=3.0, bound_s=10.0, iteration=40, what="x" * 300))
    assert watch.poll() is None
    clock.t += 12.9  # 15.9 s quiet: under 10 + 5 + 1
    assert watch.poll() is None
    clock.t += 0.2
    hang = watch.poll()
    assert isinstance(hang, Hang)
    assert (hang.phase, hang.bound_s, hang.iteration) == ("save", 10.0, 40)
    assert hang.quiet_s == pytest.approx(16.1) and len(hang.what) <= 80 + 3  # clip: the cut, then "..."


def test_the_start_up_is_measured_to_the_first_iterations_progress(storage):
    clock = Clock()
    watch = HangWatch(storage, launch=1, bounds=BOUNDS, clock=clock)
    write_progress(storage, progress_record(phase="restore", iteration=None))
    clock.t += 3.0
    watch.poll()
    assert watch.startup_s is None
    clock.t += 4.0
    write_progress(storage, progress_record(seq=2, phase="iteration"))
    watch.poll()
    assert watch.startup_s == 7.0


def test_disabled_bounds_never_see_a_hang(storage):
    clock = Clock()
    watch = HangWatch(storage, launch=1, bounds=HangBounds(enabled=False), clock=clock)
    write_progress(storage, progress_record(quiet_s=1e6))
    clock.t += 1e6
    assert watch.poll() is None


def test_a_rank_0_that_watches_nothing_is_never_a_hang(storage):
    clock = Clock()
    watch = HangWatch(storage, launch=1, bounds=BOUNDS, clock=clock)
    write_progress(storage, dict(progress_record(), phases=[]))  # detection off in the program
    clock.t += 1e6
    assert watch.poll() is None and watch.record is not None


HOSTILE_PROGRESS = [
    pytest.param(b"not json {", id="not-json"),
    pytest.param(b"\xff\xfe\x00garbage", id="not-utf8"),
    pytest.param(b"[1, 2, 3]", id="a-list"),
    pytest.param(b"[" * 100_000 + b"]" * 100_000, id="nested-too-deep"),
    pytest.param(json.dumps(dict(progress_record(quiet_s=1e5), pad="x" * SMALL_FILE_CAP)).encode(), id="huge"),
    pytest.param(json.dumps(progress_record()).replace('"quiet_s": 0.0', '"quiet_s": NaN').encode(), id="nan"),
    pytest.param(json.dumps(progress_record(bound_s=-10.0)).encode(), id="negative-bound"),
    pytest.param(json.dumps(progress_record(bound_s=0.0)).encode(), id="zero-bound"),
    pytest.param(json.dumps(progress_record(quiet_s=-1.0)).encode(), id="negative-quiet"),
    pytest.param(json.dumps(dict(progress_record(), phases={"phase": "iteration"})).encode(), id="phases-not-a-list"),
    pytest.param(json.dumps(dict(progress_record(), phases=progress_record()["phases"] * 1000)).encode(),
                 id="1000-phases"),
    pytest.param(json.dumps(dict(progress_record(), phases=[{"phase": 7, "quiet_s": 0, "bound_s": 1}])).encode(),
                 id="phase-not-a-string"),
    pytest.param(json.dumps(dict(progress_record(), phases=["iteration"])).encode(), id="phase-not-an-object"),
    pytest.param(json.dumps(dict(progress_record(), seq="1")).encode(), id="seq-a-string"),
    pytest.param(json.dumps(dict(progress_record(), launch="1")).encode(), id="launch-a-string"),
    pytest.param(json.dumps(dict(progress_record(), iteration="7")).encode(), id="iteration-a-string"),
    pytest.param(json.dumps(progress_record(bound_s=1e300)).replace("1e+300", HUGE_INT).encode(),
                 id="bound-too-large-for-a-float"),
]


@pytest.mark.parametrize("data", HOSTILE_PROGRESS)
def test_a_hostile_progress_record_is_no_record_and_never_raises(storage, data):
    clock = Clock()
    write_progress(storage, data)
    watch = HangWatch(storage, launch=1, bounds=BOUNDS, clock=clock)
    clock.t += 50.0
    assert watch.poll() is None and watch.record is None
    clock.t += 56.0  # as with no record at all: the start-up bound
    assert watch.poll().phase == "start-up"


@pytest.mark.parametrize("kind", ["directory", "symlink", "fifo"])
def test_a_progress_path_that_is_no_regular_file_is_no_record(storage, tmp_path, kind):
    clock = Clock()
    path = tmp_path / "run" / PROGRESS
    path.parent.mkdir(parents=True)
    if kind == "directory":
        path.mkdir()
    elif kind == "symlink":
        target = tmp_path / "elsewhere.json"
        target.write_text(json.dumps(progress_record(quiet_s=1e5)))
        path.symlink_to(target)
    else:
        os.mkfifo(path)
    watch = HangWatch(storage, launch=1, bounds=BOUNDS, clock=clock)
    clock.t += 50.0
    assert watch.poll() is None and watch.record is None


def test_a_hostile_record_after_a_good_one_keeps_the_good_ones_clock(storage):
    clock = Clock()
    watch = HangWatch(storage, launch=1, bounds=BOUNDS, clock=clock)
    write_progress(storage, progress_record(seq=4))
    watch.poll()
    write_progress(storage, b"{ torn")
    clock.t += 16.5
    hang = watch.poll()
    assert hang is not None and hang.phase == "iteration"  # a hang hidden behind a bad file is still one


# -- parse_report ------------------------------------------------------------------------------------


def report_bytes(rank: int, *, node: str = "n1", iteration: int | None = 7, phase: str = "iteration",
                 main: str = "torch/distributed/distributed_c10d.py", save: str | None = None,
                 **extra) -> bytes:
    """A rank's report as resume/watchdog.py writes it: a JSON line, then the stacks."""
    threads = {"MainThread": [[f"/site-packages/{main}", 10, "inner"], ["/train.py", 90, "main"]],
               "resume-watchdog": [["/resume/watchdog.py", 300, "_loop"]]}
    if save is not None:
        threads[f"resume-save-{rank}"] = [[f"/site-packages/{save}", 5, "write"]]
    head = {"rank": rank, "world_size": 4, "node": node, "iteration": iteration, "phase": phase,
            "quiet_s": 12.5, "last_progress_at": 1.7e9 + rank, "threads": threads, **extra}
    return json.dumps(head).encode() + b"\n--- thread MainThread (most recent call last) ---\n"


def test_a_report_as_the_watchdog_writes_it_is_read_back():
    report = parse_report(report_bytes(2, node="gpu7", iteration=40, phase="save"), rank=2)
    assert (report.rank, report.node, report.iteration, report.phase, report.quiet_s) == (2, "gpu7", 40, "save", 12.5)
    assert report.last_progress_at == 1.7e9 + 2
    assert report.waiting("save") and report.top("save").endswith(":10 in inner")


@pytest.mark.parametrize("data", [
    pytest.param(b"", id="empty"),
    pytest.param(b"not json\n", id="not-json"),
    pytest.param(b"\xff\xfe\n", id="not-utf8"),
    pytest.param(b"[1, 2]\n", id="a-list"),
    pytest.param(b'{"rank": 3}\n', id="another-rank"),
    pytest.param(b'{"node": "n1"}\n', id="no-rank"),
    pytest.param(b"[" * 100_000 + b"]" * 100_000 + b"\n", id="nested-too-deep"),
    pytest.param(b'{"rank": 1, "pad": "' + b"x" * REPORT_CAP + b'"}\n', id="first-line-past-the-cap"),
])
def test_a_report_that_is_not_one_is_no_answer(data):
    assert parse_report(data, rank=1) is None


@pytest.mark.parametrize("extra, check", [
    ({"threads": "MainThread"}, lambda r: r.threads == {}),
    ({"threads": {"MainThread": [["a.py", 1]]}}, lambda r: r.threads == {}),
    ({"threads": {"MainThread": "frames"}}, lambda r: r.threads == {}),
    ({"iteration": True}, lambda r: r.iteration is None),
    ({"iteration": "7"}, lambda r: r.iteration is None),
    ({"quiet_s": "long"}, lambda r: r.quiet_s == -1.0),
    ({"last_progress_at": None}, lambda r: r.last_progress_at == 0.0),
    ({"node": "n" * 10_000}, lambda r: len(r.node) <= 255 + 3),
    ({"phase": "p" * 10_000}, lambda r: len(r.phase) <= 40 + 3),
    ({"node": {"a": 1}}, lambda r: isinstance(r.node, str)),
    ({"threads": {"MainThread": [[{"f": 1}, None, []]]}}, lambda r: isinstance(r.top("iteration"), str)
     and not r.waiting("iteration")),
    pytest.param({"quiet_s": "HUGE"}, lambda r: r.quiet_s == -1.0, id="quiet-too-large-for-a-float"),
])
def test_a_hostile_report_is_read_as_a_safe_one(extra, check):
    data = report_bytes(1, **extra).replace(b'"HUGE"', HUGE_INT.encode())
    report = parse_report(data, rank=1)
    assert isinstance(report, RankReport) and report.rank == 1 and check(report)


# -- find_suspects -----------------------------------------------------------------------------------


def reports_of(**per_rank) -> dict[int, RankReport]:
    """``r0=dict(...)``: rank 0's report with those fields (report_bytes'), parsed."""
    out = {}
    for key, fields in per_rank.items():
        rank = int(key[1:])
        out[rank] = parse_report(report_bytes(rank, node=f"n{rank}", **fields), rank=rank)
    return out


C10D = "torch/distributed/distributed_c10d.py"
TRAIN = "examples/train.py"
SUSPECTS = [
    pytest.param(reports_of(r0={}, r1={}, r3={}), 4, "iteration", [2], "no report", id="a-rank-missing"),
    pytest.param({}, 4, "iteration", [], "no rank reported", id="no-report-at-all"),
    pytest.param(reports_of(r0={}, r1={}, r2={"iteration": 6}, r3={}), 4, "iteration", [2], "another iteration",
                 id="one-at-another-iteration"),
    pytest.param(reports_of(r0={}, r1={"phase": "save"}, r2={}, r3={}), 4, "iteration", [1], "another iteration",
                 id="one-in-another-phase"),
    pytest.param(reports_of(r0={}, r1={}, r2={}, r3={"main": TRAIN}), 4, "iteration", [3], "not waiting",
                 id="one-not-waiting-for-its-peers"),
    pytest.param(reports_of(r0={}, r1={"main": "torch/distributed/checkpoint/filesystem.py"}, r2={}, r3={}),
                 4, "iteration", [1], "not waiting", id="dcp-storage-io-is-not-waiting"),
    pytest.param(reports_of(r0={"main": "torch/autograd/graph.py"}, r1={"main": "python/threading.py"}), 2,
                 "iteration", [1], "not waiting", id="a-backward-held-by-ddp-is-waiting"),
    pytest.param(reports_of(r0={"main": TRAIN, "save": C10D}, r1={"main": TRAIN, "save": "resume/storage.py"},
                            r2={"main": TRAIN, "save": C10D}), 3, "save-background", [1], "not waiting",
                 id="the-background-save-thread-is-the-one-looked-at"),
    pytest.param(reports_of(r0={"main": TRAIN}, r1={"main": TRAIN}, r2={"main": "examples/data.py"}), 3,
                 "iteration", [2], "elsewhere", id="all-outside-one-elsewhere"),
    pytest.param(reports_of(r0={"iteration": 5}, r1={"iteration": 6}), 2, "iteration", [], "no single suspect",
                 id="a-tie-of-iterations"),
    pytest.param(reports_of(r0={"main": TRAIN}, r1={"main": "examples/data.py"}), 2, "iteration", [],
                 "no single suspect", id="a-tie-of-places"),
    pytest.param(reports_of(r0={}, r1={}, r2={}, r3={}), 4, "iteration", [], "no single suspect",
                 id="all-waiting-at-the-same-place"),
]


@pytest.mark.parametrize("reports, world, phase, suspects, why", SUSPECTS)
def test_the_suspect_is_the_rank_not_where_the_others_were(reports, world, phase, suspects, why):
    found, reason = find_suspects(reports, world, phase)
    assert found == suspects and why in reason


def test_a_windows_path_in_a_stack_is_read_like_a_posix_one():
    reports = reports_of(r0={"main": "torch\\distributed\\distributed_c10d.py"}, r1={"main": TRAIN})
    assert find_suspects(reports, 2, "iteration")[0] == [1]


def test_a_suspects_node_is_the_one_it_reported_else_srun_block_placement():
    reports = reports_of(r0={}, r1={}, r2={})
    reports[2].node = "gpu9"
    assert suspect_nodes([2, 3], reports, ["a", "b"], 2) == ["gpu9", "b"]
    assert suspect_nodes([7], reports, ["a", "b"], 2) == ["?"]


def test_the_hang_summary_names_phase_suspects_and_the_earliest_ranks():
    reports = reports_of(r0={}, r1={}, r2={"main": TRAIN}, r3={})
    suspects, why = find_suspects(reports, 4, "iteration")
    summary = hang_summary(Hang("iteration", 400.0, 300.0, 7), reports, suspects, why, ["n0", "n1", "n2", "n3"],
                           1, "/run/cluster/hangs/launch-1")
    assert (summary["suspects"], summary["suspect_nodes"], summary["reports"]) == ([2], ["n2"], 4)
    assert [e["rank"] for e in summary["earliest"]] == [0, 1, 2]
    assert "no progress in iteration for 400s (bound 300s)" in summary["reason"] and "not waiting" in summary["reason"]


# -- collect -----------------------------------------------------------------------------------------


def test_collect_asks_the_ranks_and_returns_at_once_when_all_reports_are_there(storage):
    clock = Clock()
    for rank in range(3):
        storage.write_bytes_atomic(report_path(1, rank), report_bytes(rank))
    reports = collect(storage, launch=1, world_size=3, clock=clock, sleep=clock.sleep, window_s=30.0)
    assert sorted(reports) == [0, 1, 2] and clock.sleeps == []
    assert storage.exists(f"{HANGS}/launch-1/dump")


def test_collect_waits_at_most_its_window_for_a_missing_rank(storage):
    clock = Clock()
    storage.write_bytes_atomic(report_path(1, 0), report_bytes(0))
    storage.write_bytes_atomic(report_path(1, 1), report_bytes(0))  # rank 0's report in rank 1's place
    started = clock.t
    reports = collect(storage, launch=1, world_size=2, clock=clock, sleep=clock.sleep, window_s=3.0, poll_s=0.5)
    assert sorted(reports) == [0]
    assert 3.0 <= clock.t - started <= 3.5 and all(s == 0.5 for s in clock.sleeps)


def test_collect_takes_a_report_that_arrives_while_it_waits(storage):
    clock = Clock()
    storage.write_bytes_atomic(report_path(1, 0), report_bytes(0))

    def sleep(seconds):
        clock.sleep(seconds)
        if len(clock.sleeps) == 2:
            storage.write_bytes_atomic(report_path(1, 1), report_bytes(1))

    reports = collect(storage, launch=1, world_size=2, clock=clock, sleep=sleep, window_s=30.0, poll_s=0.5)
    assert sorted(reports) == [0, 1] and len(clock.sleeps) == 2


def test_collect_survives_a_report_with_a_number_too_large_for_a_float(storage):
    clock = Clock()
    storage.write_bytes_atomic(report_path(1, 0), report_bytes(0).replace(b'"quiet_s": 12.5',
                                                                          b'"quiet_s": ' + HUGE_INT.encode()))
    reports = collect(storage, launch=1, world_size=1, clock=clock, sleep=clock.sleep, window_s=1.0)
    assert list(reports) == [0] and reports[0].quiet_s == -1.0


def test_collect_lists_once_per_look_reads_each_report_once_and_ignores_other_names(storage):
    clock = Clock()
    reads: list[str] = []
    real_read = storage.read_bytes

    def counting_read(path, **kw):
        reads.append(path)
        return real_read(path, **kw)

    storage.read_bytes = counting_read
    storage.write_bytes_atomic(report_path(1, 0), report_bytes(0))
    for junk in ("rank-7.txt", "rank-x.txt", "rank-.txt", "notes.txt", "rank-1.json"):
        storage.write_bytes_atomic(f"{HANGS}/launch-1/{junk}", report_bytes(1))
    reports = collect(storage, launch=1, world_size=2, clock=clock, sleep=clock.sleep, window_s=2.0, poll_s=0.5)
    assert sorted(reports) == [0]  # rank 1 never answered; rank 7 is past the world
    assert reads == [report_path(1, 0)]  # read once, though looked for at every poll; no missing file opened


# -- the hook: a hang ends the step, names the suspect, leaves its node out ------------------------------


class FakeSlurm(Slurm):
    """Slurm for the hook: the allocation, healthy nodes, one running step ``JOB.0`` for squeue."""

    def __init__(self, allocation):
        super().__init__(run=None, sleep=lambda s: None)
        self.allocation = list(allocation)
        self.calls: list[tuple] = []
        self.on_scancel = lambda step, sig: None

    def job_nodes(self, job_id):
        return list(self.allocation)

    def node_states(self, nodes):
        return {n: "allocated" for n in nodes}

    def node_addresses(self, nodes):
        return {n: "127.0.0.1" for n in nodes}

    def call(self, *args):
        self.calls.append(args)
        if args[0] == "squeue":
            job = args[args.index("-j") + 1]
            return f"{job}.batch\n{job}.extern\n{job}.0\n"
        if args[0] == "scancel":
            self.on_scancel(args[2], args[1].split("=", 1)[1])
        return ""


class HungStep:
    """srun over a hung job: writes the launch's progress (a phase long past its bound) and each rank's
    report as it starts; ignores the signals in ``ignores`` (a task in uninterruptible sleep ignores all)."""

    def __init__(self, storage, env, *, reports: dict[int, bytes], ignores=(signal.SIGTERM,), slurm=None,
                 survives_step_kill=False):
        launch = int(env["RESUME_LAUNCH"])
        write_progress(storage, progress_record(launch, quiet_s=400.0, bound_s=300.0))
        for rank, data in reports.items():
            storage.write_bytes_atomic(report_path(launch, rank), data)
        self.returncode = None
        self.signals: list[int] = []
        self.ignores = set(ignores)
        self.stderr = None
        if slurm is not None and not survives_step_kill:
            slurm.on_scancel = lambda step, sig: self._die(-signal.SIGKILL) if sig == "KILL" else None

    def _die(self, rc):
        self.returncode = rc

    def poll(self):
        return self.returncode

    def send_signal(self, sig):
        self.signals.append(sig)
        if sig not in self.ignores:
            self._die(-sig)


class DoneStep:
    stderr = None

    def __init__(self, rc=0):
        self.returncode = rc

    def poll(self):
        return self.returncode

    def send_signal(self, sig):
        pass


class HungStartup(DoneStep):
    """A step frozen before any rank watched (no progress, no report); TERM ends it."""

    def __init__(self):
        self.returncode = None

    def send_signal(self, sig):
        self.returncode = -sig


class Srun:
    """Plays srun: each launch makes the next scripted step from the launch's environment."""

    def __init__(self, steps):
        self.steps = list(steps)
        self.launches: list[dict] = []

    def __call__(self, cmd, env, **kwargs):
        self.launches.append({"cmd": cmd, "env": env})
        return self.steps.pop(0)(env)


def supervisor(tmp_path, nodes, steps, *, spares=0, crash_loop=3):
    clock = Clock()
    cfg = HookConfig(run_url=str(tmp_path / "run"), command=["train"], global_batch=8, spares=spares,
                     crash_loop=crash_loop, poll_s=0.5, hang=BOUNDS, hang_collect_s=5.0)
    slurm = FakeSlurm(nodes)
    srun = Srun(steps)
    sup = Supervisor(cfg, SlurmJob(job_id="42", nodes=list(nodes), restart_count=0), slurm, popen=srun,
                     clock=clock, sleep=clock.sleep, env={})
    return sup, slurm, srun


def nodelist(launch) -> list[str]:
    return next(a for a in launch["cmd"] if a.startswith("--nodelist=")).split("=", 1)[1].split(",")


def run_events(tmp_path) -> list[dict]:
    return hook_events(tmp_path / "run")


def rank1_not_waiting() -> dict[int, bytes]:
    return {0: report_bytes(0, node="n1"), 1: report_bytes(1, node="n2", main=TRAIN)}


def test_a_hang_names_the_suspect_kills_the_slurm_step_and_relaunches_without_its_node(tmp_path):
    storage = open_storage(str(tmp_path / "run"))
    holder: dict = {}
    sup, slurm, srun = supervisor(tmp_path, ["n1", "n2", "n3"], [
        lambda env: HungStep(storage, env, reports=rank1_not_waiting(), slurm=holder["slurm"]),
        lambda env: DoneStep(0)], spares=1)
    holder["slurm"] = slurm
    with handlers_restored():
        assert sup.run() == 0
    assert srun.launches[0]["env"][HANG_ENV] == BOUNDS.to_env()
    assert srun.launches[0]["env"][RUN_ENV] == str(tmp_path / "run")
    assert nodelist(srun.launches[0]) == ["n1", "n2"] and nodelist(srun.launches[1]) == ["n1", "n3"]
    evs = run_events(tmp_path)
    hang = next(e for e in evs if e["event"] == "hang")
    assert (hang["phase"], hang["suspects"], hang["suspect_nodes"], hang["reports"]) == ("iteration", [1], ["n2"], 2)
    assert "not waiting" in hang["reason"] and hang["stacks"].endswith(f"{HANGS}/launch-1")
    stops = [e["signal"] for e in evs if e["event"] == "stop_step"]
    assert stops == ["SIGTERM", "SIGKILL to the Slurm step"]
    assert ("scancel", "--signal=KILL", "42.0") in slurm.calls  # the srun step, not the batch or extern one
    assert not any(c[0] == "scancel" and c[2] != "42.0" for c in slurm.calls)
    assert next(e for e in evs if e["event"] == "hung_node_excluded")["nodes"] == ["n2"]
    assert [e["event"] for e in evs][-1] == "finished" and "step_unkillable" not in [e["event"] for e in evs]
    assert sup.excluded == ["n2"]


def test_without_a_free_spare_a_hang_relaunches_in_place(tmp_path):
    storage = open_storage(str(tmp_path / "run"))
    sup, slurm, srun = supervisor(tmp_path, ["n1", "n2"], [
        lambda env: HungStep(storage, env, reports=rank1_not_waiting(), ignores=()),
        lambda env: DoneStep(0)])
    with handlers_restored():
        assert sup.run() == 0
    assert nodelist(srun.launches[1]) == ["n1", "n2"]
    kinds = [e["event"] for e in run_events(tmp_path)]
    assert "hang_relaunch_in_place" in kinds and "hung_node_excluded" not in kinds
    assert [e["signal"] for e in run_events(tmp_path) if e["event"] == "stop_step"] == ["SIGTERM"]
    assert not any(c[0] == "scancel" for c in slurm.calls)


def test_hangs_at_the_same_committed_step_are_a_crash_loop(tmp_path):
    storage = open_storage(str(tmp_path / "run"))
    sup, _, srun = supervisor(tmp_path, ["n1", "n2"], [
        lambda env: HungStep(storage, env, reports=rank1_not_waiting(), ignores=())] * 3, crash_loop=3)
    with handlers_restored():
        assert sup.run() == EXIT_CRASH_LOOP
    evs = run_events(tmp_path)
    assert [e["event"] for e in evs].count("hang") == 3 and len(srun.launches) == 3
    assert evs[-1]["event"] == "crash_loop" and "hangs included" in evs[-1]["reason"]
    assert [f.get("hang") for f in sup.state.failures] == ["iteration"] * 3


def test_a_step_that_outlives_every_kill_is_said_and_the_hook_goes_on(tmp_path):
    storage = open_storage(str(tmp_path / "run"))
    holder: dict = {}
    sup, slurm, srun = supervisor(tmp_path, ["n1", "n2"], [
        lambda env: HungStep(storage, env, reports=rank1_not_waiting(), ignores=set(signal.Signals),
                             slurm=holder["slurm"], survives_step_kill=True),
        lambda env: DoneStep(0)])
    holder["slurm"] = slurm
    with handlers_restored():
        assert sup.run() == 0
    evs = run_events(tmp_path)
    assert [e["signal"] for e in evs if e["event"] == "stop_step"] == [
        "SIGTERM", "SIGKILL to the Slurm step", "SIGKILL"]
    unkillable = [i for i, e in enumerate(evs) if e["event"] == "step_unkillable"]
    assert len(unkillable) == 1
    assert [e["event"] for e in evs[unkillable[0]:]][-2:] == ["launch", "finished"]
    assert len(srun.launches) == 2


def test_a_start_up_that_never_reports_progress_is_a_hang_whose_suspects_are_the_silent_ranks(tmp_path):
    sup, _, srun = supervisor(tmp_path, ["n1", "n2", "n3"], [
        lambda env: HungStartup(),
        lambda env: DoneStep(0)], spares=1)
    sup.state.watched = True  # an earlier launch of this run wrote progress: silence is a hang
    with handlers_restored():
        assert sup.run() == 0
    hang = next(e for e in run_events(tmp_path) if e["event"] == "hang")
    assert hang["phase"] == "start-up" and hang["suspects"] == [] and hang["reports"] == 0
    assert nodelist(srun.launches[1]) == ["n1", "n2"]  # nobody to leave out: in place


@pytest.mark.parametrize("startup, watched, expected", [
    (12.5, True, (12.5, True)),
    (None, False, (None, False)),
    ("12", "true", (None, False)),       # strings are not what the hook wrote
    (-3, 1, (None, False)),              # a negative duration; 1 is not true
    (1e300, True, (None, True)),         # past any start-up
    (True, None, (None, False)),
])
def test_the_hooks_start_up_measure_and_watched_flag_survive_a_requeue_and_bad_values_are_dropped(
        storage, startup, watched, expected):
    from resume.cluster.hook_state import STATE, StateFile

    storage.write_bytes_atomic(STATE, json.dumps({"job": "7", "launches": 2, "startup_s": startup,
                                                  "watched": watched}).encode())
    state = StateFile(storage, "7").load()
    assert (state.startup_s, state.watched, state.launches) == (*expected, 2)
    StateFile(storage, "7").save(state)
    again = StateFile(storage, "8").load()  # a later job of the run keeps both
    assert (again.startup_s, again.watched) == expected


def test_stopping_a_step_for_sure_and_requeueing_fit_the_margin_kept_before_slurms_kill():
    """After USR1 the hook waits ``grace - STOP_MARGIN_S`` for the save; every stage of ending the
    step (each patience spent in full) and the requeue must fit in what is left."""
    from resume.cluster.grace import STOP_MARGIN_S
    from resume.cluster.hangs import STOP_STAGES
    from resume.cluster.hook import REQUEUE_S

    assert sum(patience for _, patience in STOP_STAGES) + REQUEUE_S <= STOP_MARGIN_S
