"""The command line against real runs: the drill's run, torn and corrupt checkpoints,
bad input, and ``resume save`` against a job that is training right now."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from support.checkpoints import flip_byte
from support.cli import assert_one_line_error, invoke, resume
from support.ports import free_port

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def drilled(tmp_path_factory):
    """One real drill (2 ranks, 2 SIGKILLs); its run directory, copied per test."""
    run = str(tmp_path_factory.mktemp("drill") / "run")
    proc = resume("drill", "--run", run, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    return run, result


@pytest.fixture
def run_copy(drilled, tmp_path):
    run = str(tmp_path / "run")
    shutil.copytree(drilled[0], run)
    return run


def test_drill_is_identical_and_kills_twice(drilled):
    _, result = drilled
    assert result["identical"] is True
    assert len(result["kills"]) == 2 and result["kills"][0] < result["kills"][1]
    assert {r["item"] for r in result["rows"]} >= {"parameters", "optimizer moments", "lr trace",
                                                     "loss trace", "counters"}
    assert all(r["match"] for r in result["rows"])


def test_verify_deep_passes_on_the_drill_run(run_copy):
    proc = resume("verify", run_copy, "--deep", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] and report["deep"]
    assert [s["step"] for s in report["steps"]] == [30, 35, 40]


def test_verify_deep_names_the_shard_with_one_flipped_byte(run_copy):
    flip_byte(os.path.join(run_copy, "step-000000035", "__1_0.distcp"))
    shallow = resume("verify", run_copy)
    assert shallow.returncode == 0  # sizes are right: only the checksums can tell
    proc = resume("verify", run_copy, "--deep")
    assert_one_line_error(proc, 1, "step-000000035/__1_0.distcp", "checksum: expected xxh3:")


def test_deleted_newest_manifest_shows_uncommitted_and_restore_uses_the_previous(run_copy, tmp_path):
    os.unlink(os.path.join(run_copy, "step-000000040", "manifest.json"))
    proc = resume("ls", run_copy, "--json")
    assert proc.returncode == 0
    rows = {c["step"]: c for c in json.loads(proc.stdout)["checkpoints"]}
    assert rows[40]["committed"] is False and "manifest.json: missing" in rows[40]["reason"]
    assert rows[35]["committed"] is True
    human = resume("ls", run_copy).stdout
    assert any(line.split()[:2] == ["40", "uncommitted"] for line in human.splitlines())

    # A real restore (2 ranks, the drill's own job) falls back to step 35 and
    # replaces the torn step 40 with a committed one.
    trace = tmp_path / "trace.jsonl"
    rc = launch_worker(run_copy, iterations=40, every=5, trace=str(trace), final=str(tmp_path / "f.json"))
    assert rc == [0, 0]
    first = json.loads(trace.read_text().splitlines()[0])
    assert first["restored_from"] == 35 and first["iteration"] == 36
    assert json.loads(resume("ls", run_copy, "--json").stdout)["checkpoints"][-1]["committed"]


def test_inspect_shows_counters_and_expectation(run_copy):
    proc = resume("inspect", run_copy, "--json")
    assert proc.returncode == 0
    manifest = json.loads(proc.stdout)
    assert manifest["step"] == 40
    assert manifest["train_state"]["updates_skipped"] == 2
    assert manifest["train_state"]["samples_read"] == 40 * 8
    assert len(manifest["expectation"]["lr_ahead"]) >= 2
    assert manifest["expectation"]["next_batch"]["samples"] == 8
    human = resume("inspect", run_copy, "--step", "30")
    assert human.returncode == 0 and "iteration 30" in human.stdout


@pytest.fixture
def changed_run(tmp_path, monkeypatch):
    """A real run restarted once with another peak LR (accepted through RESUME_ACCEPT_CHANGES),
    with the program's own values in coord.user: checkpoints 3 (before) and 6 (after)."""
    from support.workloads import Setup, build, train

    from resume.changes import ACCEPT_ENV

    run = str(tmp_path / "run")
    monkeypatch.delenv(ACCEPT_ENV, raising=False)
    coord, parts = build(0, 1, run, Setup(every=3, peak_lr=1e-2))
    coord.restore()
    coord.user["stage"] = "warmup"
    train(coord, parts, until=3)
    coord.close()
    monkeypatch.setenv(ACCEPT_ENV, "lr")
    coord, parts = build(0, 1, run, Setup(every=3, peak_lr=2e-2))
    coord.restore()
    assert coord.user == {"stage": "warmup"}
    coord.user = {"stage": "main", "curriculum": 0.5}
    train(coord, parts, until=6)
    coord.close()
    return run


def test_inspect_shows_the_users_values_and_the_accepted_changes(changed_run):
    proc = resume("inspect", changed_run, "--json")
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads(proc.stdout)
    assert manifest["step"] == 6
    assert manifest["user"] == {"stage": "main", "curriculum": 0.5}
    assert manifest["changes"] == [
        {"step": 3, "item": "optimizer[0].group[0].initial_lr", "from": 0.01, "to": 0.02},
        {"step": 3, "item": "schedule[0].base_lrs", "from": [0.01], "to": [0.02]}]

    human = resume("inspect", changed_run)
    assert human.returncode == 0, human.stderr
    lines = human.stdout.splitlines()
    assert '  user          {"curriculum": 0.5, "stage": "main"}' in lines
    assert "  changes       2" in lines
    assert "    step 3        optimizer[0].group[0].initial_lr: 0.01 -> 0.02" in lines
    assert "    step 3        schedule[0].base_lrs: [0.01] -> [0.02]" in lines

    before = resume("inspect", changed_run, "--step", "3")
    assert '  user          {"stage": "warmup"}' in before.stdout.splitlines()
    assert "  changes       none" in before.stdout.splitlines()
    assert json.loads(resume("inspect", changed_run, "--step", "3", "--json").stdout)["changes"] == []


def test_inspect_shows_a_hand_edited_change_on_one_quoted_line(changed_run):
    """A manifest is untrusted input: an item with control characters is quoted, a long value cut."""
    def edit(text: str) -> str:
        body = json.loads(text)
        body["changes"] = [{"step": 3, "item": "x\x1b[2Jy\nz", "from": list(range(100)), "to": None}]
        return json.dumps(body)

    _rewrite_manifest(changed_run, 6, edit)
    proc = resume("inspect", changed_run)
    assert proc.returncode == 0, proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith("    step 3"))
    assert "\x1b" not in line and '"x\\u001b[2Jy\\nz"' in line
    assert line.endswith("... -> null") and len(line) < 200


# -- bad input ------------------------------------------------------------------------------


def test_missing_run_exits_3_naming_it(tmp_path):
    missing = str(tmp_path / "nope")
    for cmd in ("ls", "verify", "inspect"):
        assert_one_line_error(resume(cmd, missing), 3, missing, "expected an existing directory")


def test_empty_run_exits_3(tmp_path):
    for cmd in ("ls", "verify", "inspect"):
        assert_one_line_error(resume(cmd, str(tmp_path)), 3, "expected")


def test_step_that_does_not_exist_exits_3(run_copy):
    assert_one_line_error(resume("inspect", run_copy, "--step", "7"), 3, "step-000000007")
    assert_one_line_error(resume("verify", run_copy, "--step", "7"), 3, "step-000000007")


def _rewrite_manifest(run: str, step: int, mutate) -> str:
    path = os.path.join(run, f"step-{step:09d}", "manifest.json")
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(mutate(text))
    return path


def test_manifest_that_is_not_json_is_named(run_copy):
    path = _rewrite_manifest(run_copy, 40, lambda t: t[: len(t) // 2])
    assert_one_line_error(resume("verify", run_copy, "--step", "40"), 1, path, "expected JSON")
    assert_one_line_error(resume("inspect", run_copy, "--step", "40"), 1, path, "expected JSON")


def test_unknown_schema_version_is_named(run_copy):
    def bump(text: str) -> str:
        body = json.loads(text)
        body["schema_version"] = 99
        return json.dumps(body)

    path = _rewrite_manifest(run_copy, 40, bump)
    assert_one_line_error(resume("verify", run_copy), 1, path, "schema_version: expected 1, actual 99")


def test_listed_file_missing_or_wrong_size_is_named(run_copy):
    os.unlink(os.path.join(run_copy, "step-000000030", "rank-00001.json"))
    with open(os.path.join(run_copy, "step-000000035", "__0_0.distcp"), "ab") as f:
        f.write(b"x")
    proc = resume("verify", run_copy)
    assert_one_line_error(proc, 1, "step-000000030/rank-00001.json: expected a file of",
                          "actual missing", "step-000000035/__0_0.distcp: size: expected")


def test_usage_error_exits_2():
    proc = resume("verify")
    assert proc.returncode == 2
    assert resume("drill", "--kills", "99").returncode == 2


# -- verify and inspect agree -----------------------------------------------------------------


def _grow(step: int, rel: str = "__0_0.distcp"):
    """A listed file one byte longer: the step fails the commit check (broken)."""
    def damage(run: str) -> None:
        with open(os.path.join(run, f"step-{step:09d}", rel), "ab") as f:
            f.write(b"x")
    return damage


def _drop_manifests(*steps: int):
    """Saves that never finished: no manifest (uncommitted), every step if none named. LATEST,
    written after a manifest, names the newest step left committed, or is not there."""
    def damage(run: str) -> None:
        left = []
        for name in sorted(os.listdir(run)):
            if name.startswith("step-") and (not steps or int(name[5:]) in steps):
                os.unlink(os.path.join(run, name, "manifest.json"))
            elif name.startswith("step-"):
                left.append(int(name[5:]))
        os.unlink(os.path.join(run, "LATEST"))
        if left:
            _write_latest(run, max(left))
    return damage


def _one_lr_ahead(run: str) -> None:
    """Committed, but verify's schedule check fails: one LR ahead recorded instead of >= 2."""
    def cut(text: str) -> str:
        body = json.loads(text)
        body["expectation"]["lr_ahead"] = body["expectation"]["lr_ahead"][:1]
        return json.dumps(body)
    _rewrite_manifest(run, 40, cut)


def _write_latest(run: str, step: int) -> None:
    with open(os.path.join(run, "LATEST"), "w") as f:
        f.write(f"{step}\n")


def _empty(run: str) -> None:
    shutil.rmtree(run)
    os.makedirs(run)


def _megatron_save_without_manifests(run: str, *, tracker: bool = True) -> None:
    """A Megatron-LM save directory (tracker, one torch_dist iteration whose .metadata does not
    read) that resume never recorded; without the tracker, a save Megatron did not finish."""
    _empty(run)
    os.makedirs(os.path.join(run, "iter_0000004"))
    for rel, text in (("latest_checkpointed_iteration.txt", "4"), ("iter_0000004/.metadata", "m"),
                      ("iter_0000004/__0_0.distcp", "d"),
                      ("iter_0000004/metadata.json", '{"sharded_backend": "torch_dist"}')):
        if tracker or rel != "latest_checkpointed_iteration.txt":
            with open(os.path.join(run, rel), "w") as f:
                f.write(text)


EXIT_CODE_STATES = {
    # state: (damage to the drill's run (steps 30, 35, 40, all committed), arguments, the exit code)
    "sound": (lambda run: None, (), 0),
    "newest_broken": (_grow(40), (), 1),
    "older_broken": (_grow(30), (), 1),
    "every_step_broken": (lambda run: [_grow(s)(run) for s in (30, 35, 40)], (), 1),
    "newest_uncommitted": (_drop_manifests(40), (), 0),
    "no_committed_checkpoint": (_drop_manifests(), (), 3),
    "newest_schedule_short": (_one_lr_ahead, (), 1),
    "latest_names_a_missing_step": (lambda run: _write_latest(run, 99), (), 1),
    "empty_run": (_empty, (), 3),
    "megatron_save_unreadable_without_manifest": (_megatron_save_without_manifests, (), 1),
    "megatron_save_unfinished": (lambda run: _megatron_save_without_manifests(run, tracker=False), (), 3),
    "step_missing": (lambda run: None, ("--step", "7"), 3),
    "step_sound_newer_broken": (_grow(40), ("--step", "30"), 0),
    "step_broken": (_grow(30), ("--step", "30"), 1),
    "step_uncommitted": (_drop_manifests(30), ("--step", "30"), 1),
}


@pytest.mark.parametrize("state", EXIT_CODE_STATES)
def test_inspect_exits_with_the_code_verify_gives_for_the_same_state(run_copy, state):
    damage, args, expected = EXIT_CODE_STATES[state]
    damage(run_copy)
    codes, errors = {}, {}
    for command in (["verify"], ["inspect"], ["verify", "--json"], ["inspect", "--json"]):
        result = invoke(*command, run_copy, *args)
        codes[" ".join(command)], errors[" ".join(command)] = result.exit_code, result.stderr
    assert codes == dict.fromkeys(codes, expected), codes
    assert errors["inspect"] == errors["verify"] and bool(errors["verify"]) == (expected != 0), errors


# -- resume save against a running job -------------------------------------------------------


def start_worker(run: str, *, iterations: int, every: int, trace: str, final: str,
                 ranks: int = 2) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(ranks):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "resume.drill.worker", "--run", run, "--iterations", str(iterations),
             "--every", str(every), "--skip", "3", "--trace", trace, "--final", final],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    return procs


def wait_until_training(trace, procs, iterations: int = 3, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (trace.exists() and trace.read_text().count("\n") >= iterations):
        assert time.monotonic() < deadline, "training did not start"
        assert all(p.poll() is None for p in procs), procs[0].stderr.read()
        time.sleep(0.2)


@contextlib.contextmanager
def training_job(tmp_path):
    """A 2-rank job training "forever" without periodic saves; SIGKILLed at the end if still alive."""
    run, trace = str(tmp_path / "run"), tmp_path / "trace.jsonl"
    procs = start_worker(run, iterations=1_000_000, every=0, trace=str(trace),
                         final=str(tmp_path / "f.json"))
    try:
        wait_until_training(trace, procs)
        yield run, trace, procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()


def launch_worker(run: str, **kwargs) -> list[int]:
    procs = start_worker(run, **kwargs)
    return [p.wait(timeout=240) for p in procs]


def test_resume_save_commits_at_the_next_boundary_of_a_running_job(tmp_path):
    with training_job(tmp_path) as (run, _, procs):
        proc = resume("save", run, "--timeout", "120", "--json", timeout=180)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        answer = json.loads(proc.stdout)
        step = answer["step"]
        assert step >= 3 and answer["train_state"]["iteration"] == step
        listing = json.loads(resume("ls", run, "--json").stdout)["checkpoints"]
        assert [(c["step"], c["committed"]) for c in listing] == [(step, True)]
        assert resume("verify", run, "--deep").returncode == 0
        # --stop: the job saves once more, then leaves its loop by itself.
        stop = resume("save", run, "--stop", "--timeout", "120", "--json", timeout=180)
        assert stop.returncode == 0 and json.loads(stop.stdout)["step"] > step
        assert [p.wait(timeout=120) for p in procs] == [0, 0]


def test_resume_save_times_out_with_exit_4_when_no_job_runs(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    proc = resume("save", str(run), "--timeout", "1")
    assert_one_line_error(proc, 4, "within 1s")
    assert os.listdir(run / "control") == []  # the request was withdrawn


def test_signal_on_one_rank_saves_on_all_ranks_at_the_same_iteration_then_stops(tmp_path):
    with training_job(tmp_path) as (run, trace, procs):
        procs[1].send_signal(signal.SIGUSR1)  # rank 1 only: the ranks must agree
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    last = json.loads(trace.read_text().splitlines()[-1])["iteration"]
    listing = json.loads(resume("ls", run, "--json").stdout)["checkpoints"]
    assert [(c["step"], c["committed"]) for c in listing] == [(last, True)]
    assert resume("verify", run, "--deep").returncode == 0


def test_hand_edited_expectation_is_a_one_line_error(run_copy):
    def break_lr(text: str) -> str:
        body = json.loads(text)
        body["expectation"]["lr_ahead"] = 5
        return json.dumps(body)

    path = _rewrite_manifest(run_copy, 40, break_lr)
    assert_one_line_error(resume("inspect", run_copy, "--step", "40"), 1, path,
                          "expectation.lr_ahead: expected a list of lists of numbers")
    assert_one_line_error(resume("verify", run_copy, "--step", "40"), 1, "expectation.lr_ahead")


def test_unknown_url_scheme_is_a_usage_error_and_a_file_is_not_a_run(tmp_path):
    assert_one_line_error(resume("ls", "nosuchproto://bucket/run"), 2, "nosuchproto://bucket/run")
    f = tmp_path / "file"
    f.write_text("x")
    assert_one_line_error(resume("ls", str(f)), 3, "actual not a directory")


def test_ls_names_the_job_holding_the_run_lease(run_copy):
    from resume.lease import Lease
    from resume.storage import LocalStorage

    proc = resume("ls", run_copy)
    assert proc.returncode == 0 and "lease: none (no job is writing this run)" in proc.stdout
    Lease(LocalStorage(run_copy), job_id="4242", ttl_s=120).acquire()
    proc = resume("ls", run_copy)
    assert proc.returncode == 0
    assert f"lease: job 4242 (host {socket.gethostname()}, pid {os.getpid()}), heartbeat" in proc.stdout
    assert "holder gone" not in proc.stdout  # this process holds it
    body = json.loads(resume("ls", run_copy, "--json").stdout)
    assert body["lease"]["job_id"] == "4242" and body["lease"]["ttl_s"] == 120
    assert body["lease"]["stale_because"] is None


def test_ls_says_when_the_lease_holder_is_gone(run_copy):
    from resume.lease import Lease
    from resume.storage import LocalStorage

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lease = Lease(LocalStorage(run_copy), job_id="4343", ttl_s=120)
    lease.acquire()
    path = os.path.join(run_copy, "lease.json")
    with open(path) as f:
        body = json.load(f)
    body["pid"] = dead.pid  # a job that died without releasing its lease
    with open(path, "w") as f:
        json.dump(body, f)
    proc = resume("ls", run_copy)
    assert proc.returncode == 0
    assert f"holder gone: process {dead.pid} on this host is gone (the next job takes the lease over)" in proc.stdout
    assert json.loads(resume("ls", run_copy, "--json").stdout)["lease"]["stale_because"].startswith("process")
