"""The Slurm boundary and the requeue hook's decisions, with Slurm and srun injected.

The same hook runs against a real Slurm in tests/test_slurm_cluster.py.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading

import pytest
from resume.cluster.crash_loop import CrashLoopPolicy
from resume.cluster.grace import grace_budget, recent_save_times
from resume.cluster.hook import EXIT_CRASH_LOOP, HookConfig, Supervisor
from resume.cluster.slurm import (
    NotInAllocationError,
    Slurm,
    SlurmError,
    SlurmJob,
    parse_nodelist,
)
from resume.cluster.template import SbatchTemplate
from support.cli import assert_one_line_error, resume
from support.ports import free_port
from support.signals import handlers_restored
from support.traces import hook_events

from resume.checksum import checksum_bytes
from resume.control import answer_request, pending_requests
from resume.errors import UsageError
from resume.manifest import FileEntry, Manifest
from resume.run import Run
from resume.state import TrainState


@pytest.mark.parametrize("text, nodes", [
    ("n1", ["n1"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("n[1-2,5],login", ["n1", "n2", "n5", "login"]),
    ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
    ("rack1-n[1,3]", ["rack1-n1", "rack1-n3"]),
    ("a[1-2]b,c", ["a1b", "a2b", "c"]),
])
def test_node_lists_expand(text, nodes):
    assert parse_nodelist(text) == nodes


@pytest.mark.parametrize("text", ["n[1-", "n[3-1]", "n[a-b]"])
def test_bad_node_lists_are_usage_errors(text):
    with pytest.raises(UsageError, match="node list"):
        parse_nodelist(text)


def test_outside_an_allocation_is_exit_7():
    with pytest.raises(NotInAllocationError) as info:
        SlurmJob.from_env({})
    assert info.value.exit_code == 7
    job = SlurmJob.from_env({"SLURM_JOB_ID": "12", "SLURM_JOB_NODELIST": "n[1-2]",
                             "SLURM_RESTART_COUNT": "2", "SLURM_NTASKS_PER_NODE": "4(x2)"})
    assert (job.job_id, job.nodes, job.restart_count, job.tasks_per_node) == ("12", ["n1", "n2"], 2, 4)


def test_slurm_commands_are_retried_a_bounded_number_of_times():
    calls, sleeps = [], []

    def flaky(args, **kwargs):
        calls.append(args)
        if len(calls) < 3:
            raise subprocess.TimeoutExpired(args, kwargs["timeout"])
        return subprocess.CompletedProcess(args, 0, "ok\n", "")

    assert Slurm(run=flaky, sleep=sleeps.append, attempts=3).call("scontrol", "ping") == "ok\n"
    assert len(calls) == 3 and sleeps == [2.0, 4.0]

    def broken(args, **kwargs):
        return subprocess.CompletedProcess(args, 1, "", "slurm_load_jobs error: Unable to contact\n")

    with pytest.raises(SlurmError, match="Unable to contact.*after 2 tries"):
        Slurm(run=broken, sleep=lambda s: None, attempts=2).call("scontrol", "show", "job")


# -- the hook ------------------------------------------------------------------------------


class FakeSlurm(Slurm):
    def __init__(self, states=None, allocation=None):
        super().__init__(run=None, sleep=lambda s: None)
        self.states = states or {}
        self.allocation = allocation or []
        self.calls = []

    def job_nodes(self, job_id):
        return list(self.allocation)

    def node_states(self, nodes):
        return {n: self.states.get(n, "allocated") for n in nodes}

    def node_addresses(self, nodes):
        return {n: "127.0.0.1" for n in nodes}

    def call(self, *args):
        self.calls.append(args)
        return ""


class FakeStep:
    def __init__(self, rc, on_start=None, run_forever=False, stderr=b""):
        self.rc = rc
        self.returncode = None
        self.run_forever = run_forever
        self.signals = []
        self.stderr = io.BytesIO(stderr)
        if on_start:
            on_start()

    def poll(self):
        if self.run_forever and not self.signals:
            return None
        self.returncode = self.rc if not self.signals else -self.signals[-1]
        return self.returncode

    def send_signal(self, sig):
        self.signals.append(sig)


class Launcher:
    """Plays srun: each launch returns the next scripted step."""

    def __init__(self, steps):
        self.steps = list(steps)
        self.launches = []

    def __call__(self, cmd, env, **kwargs):
        self.launches.append({"cmd": cmd, "env": env})
        return self.steps.pop(0)()


def hook(tmp_path, nodes, launcher, *, spares=0, states=None, **kw):
    cfg = HookConfig(run_url=str(tmp_path / "run"), command=["train"], global_batch=8, spares=spares,
                     poll_s=0.01, **kw)
    job = SlurmJob(job_id="42", nodes=nodes, restart_count=0)
    slurm = FakeSlurm(states, allocation=list(nodes))
    return Supervisor(cfg, job, slurm, popen=launcher, sleep=lambda s: None), slurm


def commit_checkpoint(run, step, *, timing=None):
    """A committed checkpoint of one file, as the training would leave it."""
    run.storage.write_bytes_atomic(run.step_path(step, "x"), b"x")
    run.write_manifest(Manifest(step=step, train_state=TrainState(iteration=step, updates_successful=step,
                                                                samples_read=8 * step),
                                files={"x": FileEntry(1, checksum_bytes(b"x"))}, timing=timing or {}))


def events(tmp_path):
    return hook_events(tmp_path / "run")


def nodelist(launch):
    return next(a for a in launch["cmd"] if a.startswith("--nodelist=")).split("=", 1)[1].split(",")


def answer_first_request(run_dir: str, step: int, *, commit: bool, answered: list | None = None) -> None:
    """The training job's rank 0: sees the request at a boundary, commits (or not), answers."""
    run = Run.open(run_dir, create=True)
    for _ in range(500):
        requests = pending_requests(run)
        if requests:
            if commit:
                commit_checkpoint(run, step)
            answer_request(run, requests[0], step=step)
            if answered is not None:
                answered.append(requests[0])
            return
        threading.Event().wait(0.01)


def usr1_soon(answer) -> None:
    """An answering job in a thread, and Slurm's USR1 to this process 50 ms from now."""
    threading.Thread(target=answer, daemon=True).start()
    threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGUSR1)).start()


def test_finished_training_exits_0_without_requeue(tmp_path):
    launcher = Launcher([lambda: FakeStep(0)])
    sup, slurm = hook(tmp_path, ["n1", "n2"], launcher)
    assert sup.run() == 0
    assert [e["event"] for e in events(tmp_path)] == ["start", "launch", "finished"]
    assert not any(c[:2] == ("scontrol", "requeue") for c in slurm.calls)
    assert launcher.launches[0]["cmd"][:4] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1"]
    assert launcher.launches[0]["env"]["MASTER_ADDR"] == "127.0.0.1"


def test_failed_node_is_replaced_by_a_spare_inside_the_allocation(tmp_path):
    launcher = Launcher([lambda: FakeStep(1), lambda: FakeStep(0)])
    sup, _ = hook(tmp_path, ["n1", "n2", "n3"], launcher, spares=1, states={"n2": "down*"})
    assert sup.run() == 0
    assert nodelist(launcher.launches[0]) == ["n1", "n2"]
    assert nodelist(launcher.launches[1]) == ["n1", "n3"]
    kinds = [e["event"] for e in events(tmp_path)]
    assert kinds == ["start", "launch", "nodes_failed", "relaunch_on_spares", "launch", "finished"]
    assert json.loads((tmp_path / "run" / "cluster" / "hook.json").read_text())["bad_nodes"] == ["n2"]


def test_without_a_spare_the_job_shrinks_to_the_next_valid_size(tmp_path):
    launcher = Launcher([lambda: FakeStep(1), lambda: FakeStep(0)])
    sup, _ = hook(tmp_path, ["n1", "n2", "n3", "n4"], launcher, states={"n3": "down"})
    assert sup.run() == 0
    assert nodelist(launcher.launches[1]) == ["n1", "n2"]  # 3 healthy: 3 does not divide 8
    shrink = next(e for e in events(tmp_path) if e["event"] == "shrink")
    assert (shrink["from_dp"], shrink["to_dp"]) == (4, 2)
    assert launcher.launches[1]["env"]["RESUME_DP"] == "2"


def test_no_valid_size_left_requeues_excluding_the_bad_nodes(tmp_path):
    launcher = Launcher([lambda: FakeStep(1)])
    sup, slurm = hook(tmp_path, ["n1"], launcher, states={"n1": "drained"})
    assert sup.run() == 0
    # A plain requeue: Slurm allocates no drained node (requeuehold would TERM the hook).
    assert slurm.calls == [("scontrol", "requeue", "42")]
    assert events(tmp_path)[-1]["event"] == "requeue_excluding"


def test_the_same_failure_again_and_again_stops_the_requeueing(tmp_path):
    launcher = Launcher([lambda: FakeStep(1)] * 3)
    sup, slurm = hook(tmp_path, ["n1", "n2"], launcher, crash_loop=3)
    assert sup.run() == EXIT_CRASH_LOOP
    assert [e["event"] for e in events(tmp_path)].count("step_failed") == 2
    assert events(tmp_path)[-1]["event"] == "crash_loop"
    assert not any("requeue" in c[1] for c in slurm.calls)


def test_failures_with_progress_in_between_are_not_a_crash_loop(tmp_path):
    run_dir = tmp_path / "run"

    def commit_a_checkpoint():
        run = Run.open(str(run_dir), create=True)
        commit_checkpoint(run, len(run.step_dirs()) + 1)

    steps = [lambda: FakeStep(1, on_start=commit_a_checkpoint)] * 4 + [lambda: FakeStep(0)]
    sup, _ = hook(tmp_path, ["n1", "n2"], Launcher(steps), crash_loop=3)
    assert sup.run() == 0


def test_usr1_saves_through_the_control_area_then_requeues(tmp_path):
    answered = []
    step = FakeStep(0, run_forever=True)

    def start():
        usr1_soon(lambda: answer_first_request(str(tmp_path / "run"), 17, commit=True, answered=answered))
        return step

    with handlers_restored():
        sup, slurm = hook(tmp_path, ["n1", "n2"], Launcher([start]), grace_s=30, step_exit_s=0.05)
        sup.sleep = lambda s: threading.Event().wait(min(s, 0.01))
        assert sup.run() == 0
    assert answered and answered[0].stop is True
    kinds = [e["event"] for e in events(tmp_path)]
    assert kinds[:4] == ["start", "launch", "signal", "saved"]
    assert kinds[-1] == "requeued"
    assert ("scontrol", "requeue", "42") in slurm.calls
    assert step.signals == [signal.SIGTERM]  # it did not leave by itself in 0.05 s


def test_an_answer_naming_an_uncommitted_step_is_not_a_save(tmp_path):
    """A forged answer (or one for a save that never committed) is not taken: no "saved"."""
    def start():
        usr1_soon(lambda: answer_first_request(str(tmp_path / "run"), 17, commit=False))
        return FakeStep(0, run_forever=True)

    with handlers_restored():
        sup, _ = hook(tmp_path, ["n1", "n2"], Launcher([start]), grace_s=1, step_exit_s=0.05)
        sup.sleep = lambda s: threading.Event().wait(min(s, 0.01))
        assert sup.run() == 0
    kinds = [e["event"] for e in events(tmp_path)]
    assert "saved" not in kinds and "save_failed" in kinds
    failed = next(e for e in events(tmp_path) if e["event"] == "save_failed")
    assert "step 17: expected a committed checkpoint" in failed["reason"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("plant", ["fifo", "link", "directory", "wrong types", "huge", "not json"])
def test_a_state_file_that_is_not_the_hooks_is_ignored_with_a_warning(tmp_path, capsys, plant):
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"bad_nodes": ["n1"], "launches": 7}))
    state = tmp_path / "run" / "cluster" / "hook.json"
    state.parent.mkdir(parents=True)
    if plant == "fifo":
        os.mkfifo(state)
    elif plant == "link":
        state.symlink_to(outside)
    elif plant == "directory":
        state.mkdir()
    elif plant == "wrong types":
        state.write_text(json.dumps({"bad_nodes": "n1", "failures": [{"exit_code": "x"}], "launches": 1e300}))
    elif plant == "huge":
        state.write_text(json.dumps({"bad_nodes": ["n" * 100] * 20000}))
    else:
        state.write_text("[" * 100_000)
    sup, _ = hook(tmp_path, ["n1", "n2"], Launcher([]))
    assert (sup.state.bad_nodes, sup.state.failures, sup.state.launches) == ([], [], 0)
    assert "hook.json" in capsys.readouterr().out
    assert json.loads(outside.read_text())["launches"] == 7


@pytest.mark.timeout(30)
@pytest.mark.parametrize("plant", ["link", "fifo", "huge"])
def test_an_event_log_that_is_not_ours_is_moved_aside_and_never_written_through(tmp_path, monkeypatch, plant):
    outside = tmp_path / "someone-elses.log"
    outside.write_text("theirs\n")
    log = tmp_path / "run" / "cluster" / "events.jsonl"
    log.parent.mkdir(parents=True)
    if plant == "link":
        log.symlink_to(outside)
    elif plant == "fifo":
        os.mkfifo(log)
    else:
        monkeypatch.setattr("resume.cluster.events.EVENTS_CAP", 1000)
        log.write_text("x" * 1001)
    sup, _ = hook(tmp_path, ["n1", "n2"], Launcher([lambda: FakeStep(0)]))
    assert sup.run() == 0
    assert outside.read_text() == "theirs\n"
    assert [e["event"] for e in events(tmp_path)] == ["start", "launch", "finished"]
    aside = [p for p in log.parent.iterdir() if p.name.startswith("events.jsonl.aside-")]
    assert len(aside) == 1


def test_grace_budget_comes_from_measured_saves(tmp_path):
    sup, _ = hook(tmp_path, ["n1"], Launcher([]))
    assert grace_budget(sup.rundir) == 300.0  # nothing measured yet
    assert sup._save_wait() == 270.0  # 30 s of it are for stopping the step and requeueing
    commit_checkpoint(sup.rundir, 5, timing={"save_s": 20.0})
    assert grace_budget(sup.rundir) == 100.0  # 2 x 20 + 30 to reach a boundary + 30 to stop
    assert sup._save_wait() == 70.0


def test_grace_given_on_the_command_line_is_the_budget(tmp_path):
    sup, _ = hook(tmp_path, ["n1"], Launcher([]), grace_s=240)
    commit_checkpoint(sup.rundir, 5, timing={"save_s": 500.0})
    assert grace_budget(sup.rundir, override=240) == 240.0
    assert sup._save_wait() == 210.0


def test_grace_budget_measures_only_the_newest_committed_saves(tmp_path):
    run = Run.open(str(tmp_path / "run"), create=True)
    commit_checkpoint(run, 1, timing={"save_s": 1000.0})  # older than the recent five: not read
    for step, save_s in ((2, 10.0), (3, 40.0), (4, "slow"), (5, 20.0)):
        commit_checkpoint(run, step, timing={"save_s": save_s})
    commit_checkpoint(run, 6, timing={"manifest_s": 0.1})  # Megatron's: measured nothing
    run.storage.write_bytes_atomic(run.step_path(7, "x"), b"x")  # torn: no manifest
    assert recent_save_times(run) == [20.0, 40.0, 10.0]
    assert grace_budget(run) == 2 * 40.0 + 60


def test_grace_budget_of_unreadable_storage_is_the_default(tmp_path):
    run = Run.open(str(tmp_path / "run"), create=True)
    commit_checkpoint(run, 5, timing={"save_s": 20.0})

    def down(path=""):
        raise OSError("storage down")

    run.storage.listdir = down
    assert grace_budget(run) == 300.0


@pytest.mark.parametrize("steps, stops", [
    ([], False),
    ([5, 5], False),                  # not yet the limit
    ([5, 5, 5], True),                # three in a row, no new checkpoint
    ([None, None, None], True),       # nothing ever committed
    ([4, 5, 5], False),               # progress within the last three
    ([5, 5, 5, 6], False),            # progress since: the loop is broken
    ([3, 4, 6, 6, 6], True),
])
def test_crash_loop_policy_stops_after_the_limit_without_progress(steps, stops):
    failures = [{"exit_code": 1, "committed_step": s} for s in steps]
    assert CrashLoopPolicy(3).should_stop(failures) is stops


def test_crash_loop_limit_must_be_positive():
    with pytest.raises(UsageError, match="crash loop"):
        CrashLoopPolicy(0)


def test_template_has_the_directives_the_hook_relies_on():
    script = SbatchTemplate(run_url="/ckpt/run42", command=["python", "train.py", "--x", "a b"],
                            nodes=648, tasks_per_node=8, nodes_per_replica=8, spares=8,
                            global_batch=1920, grace_s=240, time="24:00:00").render()
    for directive in ("--requeue", "--no-kill", "--signal=B:USR1@240", "--open-mode=append",
                      "--nodes=648", "--ntasks-per-node=8", "--time=24:00:00"):
        assert f"#SBATCH {directive}\n" in script
    assert "resume.cli slurm run --run /ckpt/run42 --global-batch 1920" in script
    assert script.rstrip().endswith("-- python train.py --x 'a b'")
    assert "\nexec " in script


def test_nodes_recorded_bad_are_used_again_once_healthy(tmp_path):
    first = Launcher([lambda: FakeStep(1), lambda: FakeStep(0)])
    sup, _ = hook(tmp_path, ["n1", "n2", "n3", "n4"], first, states={"n3": "down"})
    assert sup.run() == 0
    assert nodelist(first.launches[1]) == ["n1", "n2"]
    # Requeued later, n3 repaired: the job grows back to 4.
    again = Launcher([lambda: FakeStep(0)])
    sup2, _ = hook(tmp_path, ["n1", "n2", "n3", "n4"], again, states={"n3": "idle"})
    assert sup2.run() == 0
    assert nodelist(again.launches[0]) == ["n1", "n2", "n3", "n4"]
    assert any(e["event"] == "nodes_back" and e["nodes"] == ["n3"] for e in events(tmp_path))


def test_missing_slurm_commands_are_exit_6():
    from resume.cluster.slurm import SlurmMissingError

    with pytest.raises(SlurmMissingError, match="scontrol, srun, sinfo") as info:
        Slurm(which=lambda name: None).check_installed()
    assert info.value.exit_code == 6


def test_slurm_run_outside_an_allocation_exits_7_with_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = resume("slurm", "run", "--run", str(tmp_path), "--global-batch", "8", "--", "true",
                  env=env, timeout=60)
    assert proc.returncode == 7
    assert proc.stderr.strip().startswith("resume: error: SLURM_JOB_ID") and "\n" not in proc.stderr.strip()


def test_a_hook_that_dies_takes_its_step_down(tmp_path):
    step = FakeStep(0, run_forever=True)
    sup, _ = hook(tmp_path, ["n1"], Launcher([lambda: step]))

    def explode(seconds):
        raise KeyboardInterrupt

    sup.sleep = explode
    with pytest.raises(KeyboardInterrupt):
        sup.run()
    assert step.signals == [signal.SIGTERM]


def test_term_that_reaches_the_step_first_is_a_requeue_not_a_failure(tmp_path):
    holder = {}

    def start():
        step = FakeStep(137)  # killed by the same preemption
        holder["sup"]._signal = signal.SIGTERM  # ... whose TERM the hook also got
        return step

    sup, slurm = hook(tmp_path, ["n1", "n2"], Launcher([start]))
    holder["sup"] = sup
    assert sup.run() == 0
    kinds = [e["event"] for e in events(tmp_path)]
    assert "step_failed" not in kinds and kinds[-2:] == ["step_ended", "requeued"]
    assert ("scontrol", "requeue", "42") in slurm.calls


def test_an_unanswered_save_request_is_withdrawn_so_the_requeued_run_does_not_stop(tmp_path):
    def start():
        step = FakeStep(0, run_forever=True)
        holder["sup"]._signal = signal.SIGUSR1
        return step

    holder = {}
    sup, _ = hook(tmp_path, ["n1"], Launcher([start]), grace_s=31, step_exit_s=0.0)
    holder["sup"] = sup
    clock = iter(range(10_000))
    sup.clock = lambda: float(next(clock))
    assert sup.run() == 0
    assert pending_requests(Run.open(str(tmp_path / "run"))) == []
    assert any(e["event"] == "save_failed" for e in events(tmp_path))


def test_stale_hook_requests_are_withdrawn_at_start_but_operators_are_kept(tmp_path):
    from resume.control import post_save_request

    run = Run.open(str(tmp_path / "run"), create=True)
    post_save_request(run, stop=True, reason="slurm hook: SIGUSR1")
    mine = post_save_request(run, reason="resume save")
    sup, _ = hook(tmp_path, ["n1"], Launcher([lambda: FakeStep(0)]))
    assert sup.run() == 0
    assert [r.request_id for r in pending_requests(run)] == [mine.request_id]


def test_hardware_failures_do_not_count_towards_a_crash_loop(tmp_path):
    launcher = Launcher([lambda: FakeStep(1)] * 3 + [lambda: FakeStep(0)])
    sup, slurm = hook(tmp_path, ["n1", "n2", "n3", "n4", "n5"], launcher, spares=4, crash_loop=3)
    bad = iter([{"n1": "down"}, {"n1": "down", "n2": "down*"}, {"n1": "down", "n2": "down*", "n3": "idle*"}])
    slurm.node_states = lambda nodes: {n: s for n, s in next(bad).items()} | {
        n: "allocated" for n in nodes if n not in ("n1", "n2", "n3")}
    assert sup.run() == 0
    assert json.loads((tmp_path / "run" / "cluster" / "hook.json").read_text())["bad_nodes"] == [
        "n1", "n2", "n3"]


def test_exit_signal_mode_signals_the_step_and_waits_for_the_committed_manifest(tmp_path):
    """Megatron-LM with --exit-signal-handler: the hook forwards the signal to the step (srun
    passes it to every task) and counts the save only once our manifest is committed."""
    save_dir = tmp_path / "run"

    class MegatronStep(FakeStep):
        """Saves iteration 12 and exits 0 when it gets SIGTERM; the manifest lands a bit later."""

        def send_signal(self, sig):
            super().send_signal(sig)
            if sig == signal.SIGTERM:
                (save_dir / "iter_0000012").mkdir(parents=True)
                (save_dir / "iter_0000012" / "__0_0.distcp").write_bytes(b"shard")
                (save_dir / "latest_checkpointed_iteration.txt").write_text("12")
                # The hook opened the save directory in Megatron's layout (--exit-signal).
                sup.rundir.write_manifest(Manifest(step=12, train_state=TrainState(
                    iteration=12, samples_read=96, updates_successful=11, updates_skipped=1),
                    files={"__0_0.distcp": FileEntry(5, checksum_bytes(b"shard"))}))

        def poll(self):
            return 0 if self.signals else None

    step = MegatronStep(0)

    def start():
        threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGUSR1)).start()
        return step

    with handlers_restored():
        sup, slurm = hook(tmp_path, ["n1", "n2"], Launcher([start]), grace_s=30, step_exit_s=0.05,
                          exit_signal="SIGTERM")
        sup.sleep = lambda s: threading.Event().wait(min(s, 0.01))
        assert sup.run() == 0
    saved = next(e for e in events(tmp_path) if e["event"] == "saved")
    assert saved["step"] == 12 and "SIGTERM" in saved["reason"]
    assert (save_dir / "iter_0000012" / "resume-manifest.json").is_file()  # Megatron's layout
    assert step.signals[0] == signal.SIGTERM
    assert not (save_dir / "control").exists() or not os.listdir(save_dir / "control")
    assert ("scontrol", "requeue", "42") in slurm.calls


def test_exit_signal_must_be_a_signal_name(tmp_path):
    with pytest.raises(UsageError, match="--exit-signal"):
        HookConfig(run_url=str(tmp_path), command=["train"], global_batch=8, exit_signal="SIGNOPE")


def test_template_passes_the_exit_signal_to_the_hook():
    from resume.cluster.template import SbatchTemplate

    script = SbatchTemplate(run_url="/ckpt/run", command=["python", "pretrain_gpt.py"], nodes=2,
                            global_batch=8, exit_signal="SIGTERM").render()
    assert "--exit-signal SIGTERM -- python pretrain_gpt.py" in script


# -- accepted changes carried by the hook ------------------------------------------------------


def accepting_hook(tmp_path, launcher, accept, env):
    cfg = HookConfig(run_url=str(tmp_path / "run"), command=["train"], global_batch=8, poll_s=0.01,
                     accept_changes=accept)
    job = SlurmJob(job_id="42", nodes=["n1", "n2"], restart_count=1)
    return Supervisor(cfg, job, FakeSlurm(allocation=job.nodes), popen=launcher, sleep=lambda s: None, env=env)


def test_accepted_changes_reach_every_launch_of_the_step_added_to_the_environments(tmp_path):
    from resume.changes import ACCEPT_ENV, AcceptChanges

    launcher = Launcher([lambda: FakeStep(1), lambda: FakeStep(0)])  # a failure, then a relaunch
    sup = accepting_hook(tmp_path, launcher, ("weight_decay", "optimizer[1]", "eps"),
                         {"PATH": "/bin", ACCEPT_ENV: "eps, betas"})
    assert sup.run() == 0
    assert len(launcher.launches) == 2
    for launch in launcher.launches:
        assert launch["env"][ACCEPT_ENV] == "eps,betas,weight_decay,optimizer[1]"
        assert launch["env"]["PATH"] == "/bin"
        # What the training's Coordinator makes of it.
        assert AcceptChanges.parse(None, env=launch["env"]).accepts("optimizer[1].group[0].momentum")
    assert [e.get(ACCEPT_ENV) for e in events(tmp_path) if e["event"] == "launch"] == [
        "eps,betas,weight_decay,optimizer[1]"] * 2


def test_without_accept_change_the_environment_passes_through_untouched(tmp_path):
    from resume.changes import ACCEPT_ENV

    launcher = Launcher([lambda: FakeStep(0), lambda: FakeStep(0)])
    assert accepting_hook(tmp_path, launcher, (), {"PATH": "/bin"}).run() == 0
    assert ACCEPT_ENV not in launcher.launches[0]["env"]
    assert accepting_hook(tmp_path, launcher, (), {ACCEPT_ENV: "betas"}).run() == 0
    assert launcher.launches[1]["env"][ACCEPT_ENV] == "betas"
    assert all(ACCEPT_ENV not in e for e in events(tmp_path))


@pytest.mark.parametrize("name", ["a b", "weight_decay,eps", "optimizer[x]", ".eps", "lr;true"])
def test_a_bad_accept_change_name_is_a_usage_error(tmp_path, name):
    with pytest.raises(UsageError, match="--accept-change") as info:
        HookConfig(run_url=str(tmp_path), command=["train"], global_batch=8,
                   accept_changes=("weight_decay", name))
    assert info.value.exit_code == 2


def test_a_bad_name_already_in_the_environment_stops_the_hook_before_any_launch(tmp_path):
    from resume.changes import ACCEPT_ENV

    launcher = Launcher([lambda: FakeStep(0)])
    with pytest.raises(UsageError, match=f"{ACCEPT_ENV} in the environment.*'a b'"):
        accepting_hook(tmp_path, launcher, ("eps",), {ACCEPT_ENV: "a b"})
    assert launcher.launches == []


def test_template_passes_accepted_changes_to_the_hook():
    script = SbatchTemplate(run_url="/ckpt/run", command=["python", "train.py"], nodes=2, global_batch=8,
                            accept_changes=("weight_decay", "optimizer[1]")).render()
    assert "--accept-change weight_decay --accept-change 'optimizer[1]' -- python train.py" in script
    assert "RESUME_ACCEPT_CHANGES" not in script  # the hook sets it for the step, at every launch


def test_slurm_template_command_writes_accept_change_and_refuses_a_bad_name(tmp_path):
    from click.testing import CliRunner

    from resume.cli import cli

    base = ["slurm", "template", "--run", str(tmp_path / "run"), "--nodes", "2", "--global-batch", "8",
            "--grace", "120"]
    ok = CliRunner().invoke(cli, [*base, "--accept-change", "lr", "--accept-change", "schedule[0].T_max",
                                  "--", "python", "train.py"])
    assert ok.exit_code == 0, ok.output
    assert "--accept-change lr --accept-change 'schedule[0].T_max' -- python train.py" in ok.output
    bad = CliRunner().invoke(cli, [*base, "--accept-change", "weight decay", "--", "python", "train.py"])
    assert bad.exit_code == 2
    assert "--accept-change" in bad.output and "'weight decay'" in bad.output


def test_slurm_run_with_a_bad_accept_change_exits_2_before_looking_for_slurm(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = resume("slurm", "run", "--run", str(tmp_path), "--global-batch", "8", "--accept-change", "a b",
                  "--", "true", env=env, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().startswith("resume: error: slurm run: --accept-change")
    assert "'a b'" in proc.stderr and "\n" not in proc.stderr.strip()


def test_the_template_refuses_a_grace_that_does_not_fit_the_time_limit_and_warns_about_a_large_one(tmp_path):
    base = ["slurm", "template", "--run", str(tmp_path / "run"), "--nodes", "2", "--global-batch", "8"]
    command = ["--", "python", "train.py"]
    # No --grace, nothing measured: the 300 s default does not fit 3 minutes.
    refused = resume(*base, "--time", "3", *command)
    assert_one_line_error(refused, 2, "expected less than the time limit (180 s, --time 3), actual 300 s")
    given = resume(*base, "--time", "3", "--grace", "200", *command)
    assert_one_line_error(given, 2, "--grace: expected less than the time limit (180 s")
    large = resume(*base, "--time", "8", *command)  # 300 s of 480 s
    assert large.returncode == 0 and "--signal=B:USR1@300" in large.stdout
    assert "more than half of the time limit (480 s)" in large.stderr
    fine = resume(*base, "--time", "1-00:00", *command)
    assert fine.returncode == 0 and fine.stderr == ""
    unlimited = resume(*base, "--time", "UNLIMITED", *command)
    assert unlimited.returncode == 0 and unlimited.stderr == ""
    bad = resume(*base, "--time", "soon", *command)
    assert_one_line_error(bad, 2, "--time: expected a Slurm time limit")


@pytest.mark.parametrize(("text", "seconds"), [("3", 180), ("3:30", 210), ("1:00:00", 3600), ("2-0", 172800),
                                               ("1-2:03", 93780), ("1-02:03:04", 93784)])
def test_slurm_time_limits_in_every_form_slurm_takes(text, seconds):
    from resume.cluster.grace import slurm_time_s

    assert slurm_time_s(text) == seconds


def test_job_output_lines_name_the_nodes_the_step_and_the_exit_code_and_events_have_milliseconds(tmp_path, capsys):
    run = Run.open(str(tmp_path / "run"), create=True)
    commit_checkpoint(run, 6)
    launcher = Launcher([lambda: FakeStep(1), lambda: FakeStep(0)])
    sup, _ = hook(tmp_path, ["n1", "n2", "n3"], launcher, spares=1, states={"n2": "down*"})
    assert sup.run() == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("resume slurm: ")]
    assert "resume slurm: launch [launch=1 dp=2 nodes=n1,n2 tasks=2 committed_step=6]" in lines[1]
    assert any(line.startswith("resume slurm: nodes_failed [nodes=n2 committed_step=6 exit_code=1]")
               for line in lines)
    assert lines[-1].startswith("resume slurm: finished [nodes=n1,n3 committed_step=6 exit_code=0]")
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", e["at"]) for e in events(tmp_path))


def test_every_task_of_the_step_starts_through_the_shim_that_sets_torchruns_variables(tmp_path):
    launcher = Launcher([lambda: FakeStep(0)])
    sup, _ = hook(tmp_path, ["n1", "n2"], launcher)
    assert sup.run() == 0
    assert launcher.launches[0]["cmd"][-5:] == [sys.executable, "-m", "resume.cluster.task", "--", "train"]


@pytest.mark.parametrize(("slurm", "expected"), [
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2",
      "SLURM_NODEID": "2", "SLURM_NNODES": "4"},
     {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "2", "NNODES": "4"}),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "2(x1),1"},
     {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}),
    ({}, {}),
])
def test_torchruns_variables_come_from_sruns(slurm, expected):
    from resume.cluster.task import torchrun_env

    assert torchrun_env(slurm) == expected


def test_the_task_shim_runs_the_command_with_the_variables_init_process_group_reads(tmp_path):
    env = {**os.environ, "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0",
           "SLURM_NTASKS_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env.pop("RANK", None)
    script = ("import torch.distributed as dist; dist.init_process_group('gloo'); "
              "print(dist.get_rank(), dist.get_world_size()); dist.destroy_process_group()")
    proc = subprocess.run([sys.executable, "-m", "resume.cluster.task", "--", sys.executable, "-c", script],
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "1"]
    missing = subprocess.run([sys.executable, "-m", "resume.cluster.task", "--", "no-such-command-here"],
                             capture_output=True, text=True, timeout=60, check=False)
    assert missing.returncode == 127 and missing.stderr.startswith("resume: error: no-such-command-here")


def test_a_node_removed_from_the_job_counts_as_failed_even_back_in_service(tmp_path):
    """Slurm removes a downed node from a --no-kill job and (ReturnToService=2) returns it to
    service at once: it is healthy to sinfo but no longer the job's. The hook follows the job."""
    sup, slurm = None, None

    def node_fails():
        slurm.allocation = ["n1", "n3"]  # n2 left the job; sinfo says it is idle again
        return FakeStep(1)

    launcher = Launcher([node_fails, lambda: FakeStep(0)])
    sup, slurm = hook(tmp_path, ["n1", "n2", "n3"], launcher, spares=1, crash_loop=1)
    assert sup.run() == 0
    assert nodelist(launcher.launches[0]) == ["n1", "n2"] and nodelist(launcher.launches[1]) == ["n1", "n3"]
    kinds = [e["event"] for e in events(tmp_path)]
    assert kinds == ["start", "launch", "nodes_removed", "relaunch_on_spares", "launch", "finished"]
    assert next(e for e in events(tmp_path) if e["event"] == "nodes_removed")["nodes"] == ["n2"]


def test_a_launch_slurm_refuses_is_replanned_not_counted_as_a_crash(tmp_path, capfd):
    refused = b"srun: error: Unable to create step for job 42: Requested node configuration is not available\n"
    launcher = Launcher([lambda: FakeStep(1, stderr=refused)] * 2 + [lambda: FakeStep(0)])
    sup, _ = hook(tmp_path, ["n1", "n2"], launcher, crash_loop=2)  # two crashes would stop the job
    assert sup.run() == 0
    kinds = [e["event"] for e in events(tmp_path)]
    assert kinds.count("launch_refused") == 2 and "step_failed" not in kinds and "crash_loop" not in kinds
    assert kinds[-1] == "finished"
    assert "Unable to create step" in capfd.readouterr().err  # srun's words reach the job output


def test_refused_launches_in_a_row_requeue_the_job_elsewhere(tmp_path):
    refused = b"srun: error: Unable to create step for job 42: Requested node configuration is not available\n"
    launcher = Launcher([lambda: FakeStep(1, stderr=refused)] * 3)
    sup, slurm = hook(tmp_path, ["n1", "n2"], launcher)
    assert sup.run() == 0
    assert [e["event"] for e in events(tmp_path)][-1] == "requeue_excluding"
    assert ("scontrol", "requeue", "42") in slurm.calls


@pytest.mark.parametrize(("line", "nodes"), [
    ("JobId=42 JobName=train JobState=RUNNING NodeList=n[1,3] BatchHost=n1 NumNodes=2", ["n1", "n3"]),
    ("JobId=42 JobState=PENDING NodeList=(null) NumNodes=3", []),
])
def test_the_jobs_current_nodes_come_from_scontrol_show_job(line, nodes):
    calls = []

    def run(args, **kwargs):
        calls.append(args)
        return subprocess.CompletedProcess(args, 0, stdout=line + "\n", stderr="")

    assert Slurm(run=run).job_nodes("42") == nodes
    assert calls == [["scontrol", "show", "job", "-o", "42"]]


def commit_complete(run, step):
    """The run's last checkpoint, as a Coordinator with total_iterations=step commits it."""
    run.storage.write_bytes_atomic(run.step_path(step, "x"), b"x")
    run.write_manifest(Manifest(step=step, train_state=TrainState(iteration=step, updates_successful=step,
                                                                samples_read=8 * step),
                                files={"x": FileEntry(1, checksum_bytes(b"x"))}, complete=True))


@pytest.mark.parametrize("complete", [True, False])
def test_a_time_limit_signal_as_a_complete_run_ends_finishes_the_job_without_requeue(tmp_path, complete):
    run_dir = str(tmp_path / "run")

    def ends_as_the_signal_comes():
        run = Run.open(run_dir, create=True)
        (commit_complete if complete else commit_checkpoint)(run, 12)
        os.kill(os.getpid(), signal.SIGUSR1)  # Slurm's time-limit warning, as the step exits 0
        return FakeStep(0)

    with handlers_restored():
        sup, slurm = hook(tmp_path, ["n1", "n2"], Launcher([ends_as_the_signal_comes]), grace_s=30)
        assert sup.run() == 0
    last = events(tmp_path)[-1]
    if complete:
        assert last["event"] == "finished" and last["committed_step"] == 12
        assert not any(c[:2] == ("scontrol", "requeue") for c in slurm.calls)
    else:  # exit 0 without the run's end is a stop (a save-and-stop), not the end: requeued
        assert last["event"] == "requeued" and ("scontrol", "requeue", "42") in slurm.calls
