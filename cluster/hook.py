"""The requeue hook: ``resume slurm run [options] -- <launch command>``.

It is the batch script's main process (``exec``-ed by the sbatch script that
``resume slurm template`` writes). It starts the training step with ``srun``
and supervises it:

- USR1 (time limit ahead) or TERM (preemption): ask the job to save and stop
  through the run's control area, wait for the commit within the grace budget
  (measured save times recorded in the run), let the step end, requeue.
- the step fails: find the allocation's nodes that Slurm reports bad, record
  them in the run, relaunch inside the allocation on spare nodes when enough
  are healthy; otherwise on the next valid data-parallel size (global batch
  kept); otherwise requeue (Slurm allocates no node it reports bad).
- crash loop (``CrashLoopPolicy``): K failures in a row with no new committed
  checkpoint stop the requeueing, loudly, with exit code 5.
- the step ends with 0: training finished (or was asked to stop), exit 0.

Every decision is a JSON line in ``RUN/cluster/events.jsonl`` with its reason.
State that must survive requeues (bad nodes, recent failures) lives in
``RUN/cluster/hook.json``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from resume.adapters.megatron_ckpt import MEGATRON_LAYOUT  # and registers it: detect_layout knows it

from resume.changes import ACCEPT_ENV, AcceptChanges
from resume.control import pending_requests, post_save_request, wait_for_answer, withdraw_request
from resume.errors import EXIT_CRASH_LOOP, EXIT_UNRECOVERABLE, ResumeError, UsageError
from resume.run import CheckResult, Run, detect_layout, utc_now
from resume.storage import SMALL_FILE_CAP, is_damage
from resume.text import clip, parse_json, short

from .crash_loop import CrashLoopPolicy
from .grace import STOP_MARGIN_S, grace_budget
from .layout import valid_dp_sizes
from .slurm import Slurm, SlurmError, SlurmJob, is_bad_state

__all__ = ["EXIT_CRASH_LOOP", "EXIT_UNRECOVERABLE", "HookConfig", "Supervisor"]

EVENTS = "cluster/events.jsonl"
STATE = "cluster/hook.json"
TASK = (sys.executable, "-m", "resume.cluster.task", "--")
"""Every task of the step starts through this: torchrun's variables from srun's (cluster/task.py)."""
EVENTS_CAP = 64 << 20
"""Bytes: a longer event log is moved aside and a new one begun."""
STEP_REFUSED = b"Unable to create step"
"""What srun says when Slurm will not start the step on the nodes asked (one left the job)."""
MAX_REFUSALS = 3
"""Refused launches in a row that end this allocation (the job is requeued elsewhere)."""


@dataclass(frozen=True, kw_only=True)
class HookConfig:
    run_url: str
    """The run the training writes (its control area carries the save request)."""
    command: list[str]
    """The training command srun starts on every task."""
    global_batch: int
    """Kept across a shrink: only data-parallel sizes that divide it are used."""
    micro_batch: int = 1
    nodes_per_replica: int = 1
    """Nodes one model replica spans (TP x CP x PP / GPUs per node)."""
    tasks_per_node: int = 1
    spares: int = 0
    """Nodes of the allocation held back as hot spares."""
    crash_loop: int = 3
    """This many step failures in a row without a new checkpoint stop the requeueing."""
    grace_s: float | None = None
    """Seconds from USR1/TERM to Slurm's kill (the template's --grace); default: the grace
    budget of the run's measured save times (``resume.cluster.grace``)."""
    step_exit_s: float = 60.0
    """After the save, how long the step may take to leave by itself before it is stopped."""
    poll_s: float = 0.5
    exit_signal: str | None = None
    """Ask for the save with this signal to the step instead of a save request: for Megatron-LM
    with --exit-signal-handler (it saves and exits on it). The hook then waits for a manifest
    newer than the last one, i.e. "committed", not "Megatron's tracker file changed"."""
    accept_changes: tuple[str, ...] = ()
    """Changed settings the training may accept at its restarts (resume.changes names): added
    to ``RESUME_ACCEPT_CHANGES`` in the step's environment, at every launch and requeue."""

    def __post_init__(self) -> None:
        if not self.command:
            raise UsageError("slurm run: expected a launch command after --, actual none")
        try:
            object.__setattr__(self, "accept_changes", AcceptChanges.parse(self.accept_changes, env={}).names)
        except UsageError as e:
            raise UsageError(f"slurm run: --accept-change: {e}") from None
        for name in ("global_batch", "micro_batch", "nodes_per_replica", "tasks_per_node", "crash_loop"):
            if getattr(self, name) < 1:
                raise UsageError(f"slurm run: --{name.replace('_', '-')}: expected >= 1, "
                                 f"actual {getattr(self, name)}")
        if self.exit_signal is not None:
            try:
                signal.Signals[self.exit_signal if self.exit_signal.startswith("SIG")
                               else "SIG" + self.exit_signal]
            except KeyError:
                raise UsageError(f"slurm run: --exit-signal: expected a signal name such as SIGTERM, "
                                 f"actual {self.exit_signal!r}") from None
        if self.global_batch % self.micro_batch:
            raise UsageError(f"slurm run: --global-batch: expected a multiple of --micro-batch "
                             f"{self.micro_batch}, actual {self.global_batch}")

    def valid_dp(self, max_dp: int) -> list[int]:
        return valid_dp_sizes(global_batch=self.global_batch, micro_batch=self.micro_batch, max_dp=max_dp)


@dataclass
class HookState:
    bad_nodes: list[str] = field(default_factory=list)
    failures: list[dict] = field(default_factory=list)
    launches: int = 0


def _state_problem(body: Any) -> str | None:
    """What is wrong with the hook's state file ``body`` (parsed JSON), or None."""
    if not isinstance(body, dict):
        return f"expected an object, actual {short(body)}"
    nodes, failures, launches = body.get("bad_nodes", []), body.get("failures", []), body.get("launches", 0)
    if not (isinstance(nodes, list) and len(nodes) <= _MAX_NODES
            and all(isinstance(n, str) and 0 < len(n) <= 255 for n in nodes)):
        return f"bad_nodes: expected a list of node names, actual {short(nodes)}"
    if not (isinstance(failures, list) and all(_is_failure(f) for f in failures)):
        return ("failures: expected a list of {at, exit_code, committed_step} records, actual "
                f"{short(failures)}")
    if type(launches) is not int or not 0 <= launches < 1 << 31:
        return f"launches: expected a count >= 0, actual {short(launches)}"
    return None


def _is_failure(record: Any) -> bool:
    def small_int(v: Any) -> bool:
        return type(v) is int and -(1 << 63) <= v < 1 << 63
    return (isinstance(record, dict) and isinstance(record.get("at", ""), str)
            and (record.get("exit_code") is None or small_int(record.get("exit_code")))
            and (record.get("committed_step") is None or small_int(record.get("committed_step"))))


_MAX_NODES = 100_000

_SHOWN = ("launch", "dp", "from_dp", "to_dp", "nodes", "tasks", "signal", "step", "committed_step", "exit_code")
"""The fields an event's line on the job output shows, in this order."""


def _fact(value: Any) -> str:
    if isinstance(value, list):
        shown = ",".join(map(str, value[:16]))
        return shown + (f",…(+{len(value) - 16})" if len(value) > 16 else "")
    return str(value)


class _StepEnded(Exception):
    pass


class Supervisor:
    def __init__(self, cfg: HookConfig, job: SlurmJob, slurm: Slurm, *,
                 popen: Callable[..., Any] = subprocess.Popen,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 env: Mapping[str, str] | None = None) -> None:
        self.cfg = cfg
        self.job = job
        self.allocation = list(job.nodes)
        """The job's nodes as Slurm holds them now (``_follow_allocation``), in the job's order."""
        self.slurm = slurm
        self.popen = popen
        self._refusals = 0  # launches Slurm refused in a row
        self._refused = threading.Event()
        self._relay: threading.Thread | None = None
        self.clock = clock
        self.sleep = sleep
        self.env = dict(os.environ if env is None else env)
        self.accept_env = self._accept_env()
        # With --exit-signal the run is a Megatron save directory, which may
        # still be empty at the first start; otherwise detected (again) as it fills.
        self.rundir = Run.open(cfg.run_url, create=True,
                               layout=MEGATRON_LAYOUT if cfg.exit_signal else None)
        self.state = self._load_state()
        self.crash_loop = CrashLoopPolicy(cfg.crash_loop)
        self._signal: int | None = None
        full = (len(job.nodes) - cfg.spares) // cfg.nodes_per_replica
        valid = cfg.valid_dp(full)
        if not valid:
            raise UsageError(f"slurm run: layout: expected at least {cfg.nodes_per_replica + cfg.spares} "
                             f"nodes ({cfg.nodes_per_replica} per replica + {cfg.spares} spares), "
                             f"actual {len(job.nodes)}")
        self.planned_dp = valid[0]

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> int:
        self._install_handlers()
        self.event("start", restart_count=self.job.restart_count, nodes=self.job.nodes,
                   planned_dp=self.planned_dp, bad_nodes=self.state.bad_nodes)
        self._forget_recovered_nodes()
        self._withdraw_stale_requests()
        while True:
            self._follow_allocation()
            chosen = self._choose_nodes()
            if chosen is None:
                return self._requeue_elsewhere("not enough healthy nodes for any valid data-parallel size")
            dp, nodes = chosen
            proc = self._launch(dp, nodes)
            try:
                outcome = self._supervise(proc)
            except BaseException:
                # Never leave the step running unsupervised: if the hook dies, so does it.
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                raise
            if outcome == "signal" or self._signal is not None:
                # Preemption signals the hook and the step together: a step that
                # ended first is not a failure to relaunch, it is a requeue.
                return self._save_stop_requeue(proc)
            rc = proc.returncode
            if rc == 0:
                self.event("finished", exit_code=0, nodes=nodes, committed_step=self._committed_quietly(),
                           reason="the training step exited 0: no requeue")
                self.state.failures.clear()
                self._save_state()
                return 0
            verdict = self._after_failure(rc, nodes)
            if verdict is not None:
                return verdict

    # -- decisions --------------------------------------------------------------------------

    def _choose_nodes(self) -> tuple[int, list[str]] | None:
        healthy = [n for n in self.allocation if n not in self.state.bad_nodes]
        fits = len(healthy) // self.cfg.nodes_per_replica
        valid = self.cfg.valid_dp(min(fits, self.planned_dp))
        if not valid:
            return None
        dp = valid[0]
        nodes = healthy[: dp * self.cfg.nodes_per_replica]
        lost = [n for n in self.job.nodes if n not in healthy]
        if lost:
            if dp == self.planned_dp:
                reason = f"nodes {lost} (bad or no longer in the job) replaced by spares inside the allocation"
                self.event("relaunch_on_spares", dp=dp, nodes=nodes, reason=reason)
            else:
                reason = (f"{len(healthy)} healthy nodes hold no {self.planned_dp} replicas: the next "
                          f"valid data-parallel size keeping global batch {self.cfg.global_batch}")
                self.event("shrink", from_dp=self.planned_dp, to_dp=dp, nodes=nodes, reason=reason)
        return dp, nodes

    def _follow_allocation(self) -> list[str]:
        """The job's nodes as Slurm has them now (``scontrol show job``); the nodes it removed,
        which count as failed for the rest of this allocation, even back in service."""
        try:
            current = set(self.slurm.job_nodes(self.job.job_id))
        except SlurmError as e:
            self.event("allocation_unknown", reason=f"{e}: the last known nodes are used")
            return []
        if not current:  # a running job holds nodes: a listing without any says nothing
            self.event("allocation_unknown", reason="scontrol lists no node for the job: the last known "
                                                    "nodes are used")
            return []
        removed = [n for n in self.allocation if n not in current]
        if removed:
            self.allocation = [n for n in self.allocation if n in current]
            self.event("nodes_removed", nodes=removed, reason="Slurm removed them from the job (a node "
                       "failure): not used again in this allocation, even if back in service")
        return removed

    def _forget_recovered_nodes(self) -> None:
        """Nodes recorded bad that Slurm now reports healthy are used again (growing back)."""
        if not self.state.bad_nodes:
            return
        try:
            states = self.slurm.node_states(self.state.bad_nodes)
        except SlurmError as e:
            self.event("node_states_unknown", reason=str(e))
            return
        back = [n for n in self.state.bad_nodes if n in states and not is_bad_state(states[n])]
        if back:
            self.state.bad_nodes = [n for n in self.state.bad_nodes if n not in back]
            self._save_state()
            self.event("nodes_back", nodes=back, reason="Slurm reports them healthy again")

    def _after_failure(self, rc: int, nodes: list[str]) -> int | None:
        if set(self._follow_allocation()) & set(nodes):
            return None  # a node of the step left the job: re-planned, not a crash of the training
        if self._step_refused():
            self._refusals += 1
            self.event("launch_refused", exit_code=rc, nodes=nodes, refusals=self._refusals,
                       reason="Slurm refused to create the step (srun: Unable to create step): "
                              "re-planned on the job's current nodes, not counted as a crash")
            if self._refusals >= MAX_REFUSALS:
                return self._requeue_elsewhere(f"Slurm refused {self._refusals} launches in a row")
            return None
        self._refusals = 0
        committed = self._latest_committed()
        try:
            states = self.slurm.node_states(self.job.nodes)
        except SlurmError as e:
            states = {}
            self.event("node_states_unknown", reason=str(e))
        bad = sorted(n for n in nodes if is_bad_state(states.get(n, "")))
        if bad:
            # Hardware: not the job's fault, so not part of a crash loop.
            self.state.bad_nodes = sorted(set(self.state.bad_nodes) | set(bad))
            self._save_state()
            self.event("nodes_failed", exit_code=rc, nodes=bad, states={n: states[n] for n in bad},
                       committed_step=committed, reason="the step failed and Slurm reports these nodes bad")
            return None
        self.state.failures.append({"at": utc_now(), "exit_code": rc, "committed_step": committed})
        self._save_state()
        if self.crash_loop.should_stop(self.state.failures):
            limit = self.crash_loop.limit
            self.event("crash_loop", failures=limit, committed_step=committed,
                       reason=f"{limit} failures in a row on healthy nodes without a new "
                              f"checkpoint (last committed step {committed}); not requeueing")
            return EXIT_CRASH_LOOP
        self.event("step_failed", exit_code=rc, nodes=nodes, committed_step=committed,
                   reason="the step failed on healthy nodes: relaunch in place")
        return None

    def _save_stop_requeue(self, proc: Any) -> int:
        name = signal.Signals(self._signal).name if self._signal else "signal"
        # Everything (save, stop, requeue) must fit before Slurm's kill: the
        # lead time is the template's --grace; STOP_MARGIN_S of it is for stopping.
        started = self.clock()
        lead = self.cfg.grace_s
        save_wait = self._save_wait()
        self.event("signal", signal=name, save_wait_s=save_wait, lead_s=lead,
                   reason="time limit ahead or preemption: save, stop, requeue")
        saved = False
        if proc.poll() is not None:
            self.event("save_skipped", exit_code=proc.returncode,
                       reason="the step had already ended: requeue from the last checkpoint")
        elif self.cfg.exit_signal is not None:
            saved = self._save_by_exit_signal(proc, save_wait)
        else:
            saved = self._save_by_request(proc, name, save_wait)
        spent = self.clock() - started
        exit_wait = self.cfg.step_exit_s if lead is None else \
            max(0.0, min(self.cfg.step_exit_s, lead - spent - STOP_MARGIN_S / 2))
        self._stop_step(proc, wait_s=exit_wait if saved else 0.0)
        self.state.failures.clear()
        complete = self._complete_step() if proc.poll() == 0 else None
        if complete is not None:  # the run ended as the signal came: nothing left to train
            self._save_state()
            self.event("finished", exit_code=0, committed_step=complete,
                       reason=f"the run is complete (step {complete} is its last) and the step exited 0: "
                              f"no requeue after {name}")
            return 0
        return self._requeue("requeued", reason=f"after {name}")

    def _save_by_request(self, proc: Any, name: str, save_wait: float) -> bool:
        """A save request under the run's control area; the job answers after its commit."""
        request = post_save_request(self.rundir, stop=True, reason=f"slurm hook: {name}")
        saved = False

        def watch(remaining: float) -> None:
            if proc.poll() is not None:
                raise _StepEnded()

        try:
            # An answer counts only for a step the run holds committed (one may be forged).
            step = wait_for_answer(self.rundir, request, timeout=save_wait, poll=self.cfg.poll_s,
                                   clock=self.clock, sleep=self.sleep, on_wait=watch,
                                   check=self._check)
            saved = True
            self.event("saved", step=step, reason="checkpoint committed after the signal")
        except _StepEnded:
            self.event("save_skipped", exit_code=proc.returncode,
                       reason="the step ended before it answered the save request")
        except ResumeError as e:
            self.event("save_failed", reason=str(e))
        finally:
            if not saved:  # a stale stop request would end the requeued run early
                withdraw_request(self.rundir, request)
        return saved

    def _save_by_exit_signal(self, proc: Any, save_wait: float) -> bool:
        """Megatron's --exit-signal-handler: signal the step, wait for a newer committed manifest.

        srun forwards the signal to every task; Megatron agrees across ranks at the
        next iteration, saves, and exits. The wait ends at the commit (our manifest
        beside Megatron's files), not at Megatron's tracker file.
        """
        sig = self.cfg.exit_signal or "SIGTERM"
        before = self._latest_committed()
        proc.send_signal(signal.Signals[sig if sig.startswith("SIG") else "SIG" + sig])
        deadline = self.clock() + save_wait
        while True:
            latest = self._newer_committed(before)
            if latest is not None:
                self.event("saved", step=latest, reason=f"checkpoint committed after {sig} to the step")
                return True
            if proc.poll() is not None:
                self.event("save_skipped", exit_code=proc.returncode,
                           reason=f"the step ended after {sig} without a new committed checkpoint")
                return False
            if self.clock() >= deadline:
                self.event("save_failed", reason=f"no checkpoint newer than {before} committed within "
                                                 f"{save_wait:.0f}s of {sig}")
                return False
            self.sleep(self.cfg.poll_s)

    def _requeue_elsewhere(self, reason: str) -> int:
        """A plain requeue: the nodes recorded bad are down, drained or failing, which Slurm
        does not allocate, so the requeued job starts on others.

        No ExcNodeList: Slurm refuses it while the job runs ("Job is no longer pending
        execution"), and once set it would keep a repaired node out of every later start
        of this job, so the job could not grow back. (requeuehold would TERM this very hook.)
        The event keeps its name, ``requeue_excluding``, for the runbooks' greps.
        """
        return self._requeue("requeue_excluding", nodes=self.state.bad_nodes, reason=reason)

    def _requeue(self, kind: str, **fields: Any) -> int:
        self._save_state()
        try:
            self.slurm.requeue(self.job.job_id)
        except SlurmError as e:
            self.event("requeue_failed", reason=str(e))
            return EXIT_UNRECOVERABLE
        self.event(kind, **fields)
        return 0

    def _withdraw_stale_requests(self) -> None:
        """Stop requests of an earlier hook that nobody answered must not stop this run."""
        try:
            stale = [r for r in pending_requests(self.rundir) if r.reason.startswith("slurm hook:")]
            for request in stale:
                withdraw_request(self.rundir, request)
                self.event("stale_request_withdrawn", request=request.request_id,
                           reason="a save request of an earlier hook was never answered")
        except OSError as e:
            self.event("control_unreadable", reason=str(e))

    def _save_wait(self) -> float:
        """How long to wait for the save after the signal: the grace budget (``--grace``, else
        from measured saves) less what is kept for stopping the step and requeueing."""
        return max(1.0, grace_budget(self.rundir, override=self.cfg.grace_s) - STOP_MARGIN_S)

    # -- the step ---------------------------------------------------------------------------

    def _launch(self, dp: int, nodes: list[str]) -> Any:
        self.state.launches += 1
        self._save_state()
        try:
            addresses = self.slurm.node_addresses(nodes[:1])
        except SlurmError:
            addresses = {}
        master = addresses.get(nodes[0], nodes[0])
        port = 20000 + (int(self.job.job_id) * 7 + self.state.launches) % 20000 \
            if self.job.job_id.isdigit() else 29500
        tasks = len(nodes) * self.cfg.tasks_per_node
        env = dict(self.env, MASTER_ADDR=master, MASTER_PORT=str(port), RESUME_DP=str(dp),
                   RESUME_LAUNCH=str(self.state.launches), **self.accept_env)
        cmd = ["srun", f"--nodes={len(nodes)}", f"--ntasks={tasks}",
               f"--ntasks-per-node={self.cfg.tasks_per_node}", f"--nodelist={','.join(nodes)}",
               "--kill-on-bad-exit=1", *TASK, *self.cfg.command]
        self.event("launch", launch=self.state.launches, dp=dp, nodes=nodes, tasks=tasks,
                   master=f"{master}:{port}", committed_step=self._committed_quietly(), **self.accept_env)
        proc = self.popen(cmd, env=env, stderr=subprocess.PIPE)
        self._refused.clear()
        stream = getattr(proc, "stderr", None)
        self._relay = None
        if stream is not None:  # srun's errors, passed on to the job's output as they come
            self._relay = threading.Thread(target=self._relay_stderr, args=(stream,), name="srun-stderr",
                                           daemon=True)
            self._relay.start()
        return proc

    def _relay_stderr(self, stream: Any) -> None:
        """Copy the step's stderr to the hook's, noting whether Slurm refused to create the step."""
        out = getattr(sys.stderr, "buffer", None)
        for line in iter(stream.readline, b""):
            if STEP_REFUSED in line:
                self._refused.set()
            if out is not None:
                out.write(line)
                out.flush()
            else:
                sys.stderr.write(line.decode(errors="replace"))

    def _step_refused(self) -> bool:
        """Whether srun said it could not create the step (its stderr read to the end)."""
        if self._relay is not None:
            self._relay.join(timeout=5.0)
        return self._refused.is_set()

    def _accept_env(self) -> dict[str, str]:
        """``RESUME_ACCEPT_CHANGES`` for the step: the environment's names, then --accept-change's.
        Checked here, once: a bad name would otherwise fail every rank of every launch."""
        if not self.cfg.accept_changes:
            return {}
        try:
            inherited = AcceptChanges.parse((), env=self.env).names
        except UsageError as e:
            raise UsageError(f"slurm run: {ACCEPT_ENV} in the environment: {e}") from None
        return {ACCEPT_ENV: ",".join(dict.fromkeys(inherited + self.cfg.accept_changes))}

    def _supervise(self, proc: Any) -> str:
        while proc.poll() is None:
            if self._signal is not None:
                return "signal"
            self.sleep(self.cfg.poll_s)
        return "exited"

    def _stop_step(self, proc: Any, *, wait_s: float) -> None:
        deadline = self.clock() + wait_s
        while proc.poll() is None and self.clock() < deadline:
            self.sleep(self.cfg.poll_s)
        for sig, patience in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            if proc.poll() is not None:
                break
            self.event("stop_step", signal=sig.name, reason="the step did not leave by itself")
            proc.send_signal(sig)
            deadline = self.clock() + patience
            while proc.poll() is None and self.clock() < deadline:
                self.sleep(self.cfg.poll_s)
        self.event("step_ended", exit_code=proc.poll())

    # -- run records ------------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> None:
        """One decision: a JSON line in the event log, and a line on the job's output naming its
        nodes, step and exit code (``_SHOWN``) before the reason."""
        record = {"at": utc_now("milliseconds"), "event": kind, "job": self.job.job_id,
                  "restart": self.job.restart_count, **fields}
        self._record((json.dumps(record, sort_keys=False) + "\n").encode())
        facts = " ".join(f"{key}={_fact(fields[key])}" for key in _SHOWN if fields.get(key) is not None)
        reason = fields.get("reason", "")
        print(f"resume slurm: {kind}" + (f" [{facts}]" if facts else "") + (f": {reason}" if reason else ""),
              flush=True)

    def _record(self, line: bytes) -> None:
        """One line at the end of the event log. A log that is not a regular file of ours (a
        link, a FIFO, one past ``EVENTS_CAP``) is moved aside and a new one begun; a log that
        cannot be written is said on the job's output, and the hook goes on."""
        storage = self.rundir.storage
        try:
            try:
                storage.append_bytes(EVENTS, line, limit=EVENTS_CAP)
            except OSError as e:
                if not is_damage(e):
                    raise
                aside = f"{EVENTS}.aside-{int(time.time())}-{os.urandom(3).hex()}"
                print(f"resume slurm: warning: {clip(str(e))}; moved to {aside}", flush=True)
                storage.rename(EVENTS, aside)
                storage.append_bytes(EVENTS, line, limit=EVENTS_CAP)
        except OSError as e:
            print(f"resume slurm: warning: event not recorded in {storage.url(EVENTS)}: {clip(str(e))}",
                  flush=True)

    def _load_state(self) -> HookState:
        """The state the last requeue left; a file that is not one (too big, a link, a bad
        field) is said on the job's output and the hook starts afresh."""
        try:
            body = parse_json(self.rundir.storage.read_bytes(STATE, limit=SMALL_FILE_CAP))
        except FileNotFoundError:
            return HookState()
        except (OSError, ValueError) as e:
            print(f"resume slurm: warning: {STATE} ignored: {clip(str(e))}", flush=True)
            return HookState()
        problem = _state_problem(body)
        if problem is not None:
            print(f"resume slurm: warning: {self.rundir.storage.url(STATE)}: {problem}; ignored",
                  flush=True)
            return HookState()
        same_job = body.get("job") == self.job.job_id  # requeues keep the job id
        return HookState(bad_nodes=list(body.get("bad_nodes", [])),
                         failures=list(body.get("failures", [])) if same_job else [],
                         launches=body.get("launches", 0))

    def _save_state(self) -> None:
        body = {"bad_nodes": self.state.bad_nodes, "failures": self.state.failures[-20:],
                "launches": self.state.launches, "job": self.job.job_id}
        self.rundir.storage.write_bytes_atomic(STATE, json.dumps(body, indent=1).encode())

    def _newer_committed(self, before: int | None) -> int | None:
        """The newest committed checkpoint after ``before``; only newer directories are checked."""
        try:
            manifest, _ = self.rundir.find_latest(above=before)
        except OSError:  # StorageError included: nothing seen yet, the next poll looks again
            return None
        return manifest.step if manifest is not None else None

    def _check(self, step: int) -> CheckResult:
        self._detect_layout()
        return self.rundir.check(step)

    def _detect_layout(self) -> None:
        """The run's layout as it is now (a framework's first save may have made it)."""
        if self.cfg.exit_signal is None:
            self.rundir.layout = detect_layout(self.rundir.storage)

    def _complete_step(self) -> int | None:
        """The newest committed step when its manifest marks the run complete, else None."""
        try:
            self._detect_layout()
            manifest, _ = self.rundir.find_latest()
        except (ResumeError, OSError):
            return None
        return manifest.step if manifest is not None and manifest.complete else None

    def _committed_quietly(self) -> int | None:
        """The newest committed step for an event line; None when there is none or storage refuses."""
        try:
            return self._latest_committed()
        except (ResumeError, OSError):
            return None

    def _latest_committed(self) -> int | None:
        self._detect_layout()
        manifest, _ = self.rundir.find_latest()
        return manifest.step if manifest is not None else None

    def _install_handlers(self) -> None:
        def flag(signum: int, frame: Any) -> None:
            self._signal = signum
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, flag)

