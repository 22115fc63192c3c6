"""The requeue hook, ``resume slurm run [options] -- <launch command>``: the batch script's
main process (``exec``-ed by the script ``resume slurm template`` writes). It starts the
training step with ``srun`` and decides what follows each of its ends:

- USR1 (time limit ahead) or TERM (preemption): save through the run's control area (or
  ``--exit-signal`` to the step) within the grace budget, stop the step, requeue;
- a failed step: nodes Slurm reports bad are recorded; relaunch on spares inside the
  allocation, else on the next valid data-parallel size (global batch kept), else requeue;
- a hang (``cluster/hangs.py``: rank 0's progress past a phase's bound, or no progress within
  the start-up bound): every rank's stacks kept, the suspect named, the step ended for sure
  (TERM, KILL to the Slurm step, KILL), relaunched without the suspect's node when a spare is
  free, else on the same nodes; a failure for the crash loop;
- ``--replace-stragglers``: a node the slowest by more than the factor at K checkpoints in a
  row is replaced by a free spare after a save (``cluster/straggler_watch.py``);
- ``CrashLoopPolicy``'s failures (hangs included) in a row with no new committed checkpoint:
  exit ``EXIT_CRASH_LOOP``, no requeue;
- exit 0: training finished (or was asked to stop), exit 0.

Its parts: the event log (``cluster/events.py``), the state file (``cluster/hook_state.py``),
the run watcher (``cluster/watch.py``), the step launcher (``cluster/step.py``), hang detection's
side (``cluster/hangs.py``), the stragglers' (``cluster/straggler_watch.py``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from resume.adapters.megatron import MEGATRON_LAYOUT  # and registers it: detect_layout knows it

from resume.changes import ACCEPT_ENV, AcceptChanges
from resume.control import pending_requests, post_save_request, wait_for_answer, withdraw_request
from resume.errors import EXIT_CRASH_LOOP, EXIT_UNRECOVERABLE, ResumeError, UsageError
from resume.run import Run, utc_now
from resume.watchdog import HANG_ENV, HANGS, RUN_ENV, HangBounds

from .crash_loop import CrashLoopPolicy
from .events import EventLog
from .grace import STOP_MARGIN_S, grace_budget
from .hangs import COLLECT_S, STOP_STAGES, Hang, HangWatch, collect, find_suspects, hang_summary
from .hook_state import StateFile
from .layout import valid_dp_sizes
from .slurm import Slurm, SlurmError, SlurmJob, is_bad_state
from .step import StepLauncher, master_port, srun_command
from .straggler_watch import StragglerWatch
from .watch import RunWatcher

__all__ = ["EXIT_CRASH_LOOP", "EXIT_UNRECOVERABLE", "HookConfig", "Supervisor"]

REQUEUE_S = 2.0
"""Kept for ``scontrol requeue`` after the step is stopped (within ``STOP_MARGIN_S``)."""
MAX_REFUSALS = 3
"""Refused launches in a row that end this allocation (the job is requeued elsewhere)."""


@dataclass(frozen=True, kw_only=True)
class HookConfig:
    """``resume slurm run``'s options, validated once: a bad one is a ``UsageError`` naming it."""

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
    hang: HangBounds = field(default_factory=HangBounds)
    """Hang detection's bounds (``resume.watchdog``), passed to every rank (``RESUME_HANG``);
    the start-up bound comes from the launches measured so far."""
    hang_collect_s: float = COLLECT_S
    """After a hang is declared, how long to wait for every rank's report."""
    straggler_factor: float | None = None
    """Replace a node that is the slowest by more than this factor (its slowest rank's median
    iteration time over the median) at ``straggler_saves`` checkpoints in a row, when a spare is
    free. None: off."""
    straggler_saves: int = 3

    def __post_init__(self) -> None:
        if not self.command:
            raise UsageError("slurm run: expected a launch command after --, actual none")
        try:
            object.__setattr__(self, "accept_changes", AcceptChanges.parse(self.accept_changes, env={}).names)
        except UsageError as e:
            raise UsageError(f"slurm run: --accept-change: {e}") from None
        if self.straggler_factor is not None and not self.straggler_factor > 1:
            raise UsageError(f"slurm run: --replace-stragglers: expected a factor > 1, actual {self.straggler_factor}")
        if not self.hang_collect_s >= 0:
            raise UsageError(f"slurm run: --hang-collect: expected seconds >= 0, actual {self.hang_collect_s}")
        for name in ("global_batch", "micro_batch", "nodes_per_replica", "tasks_per_node", "crash_loop",
                     "straggler_saves"):
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

    def accept_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """``RESUME_ACCEPT_CHANGES`` for the step: ``env``'s names, then --accept-change's.
        Checked here, once: a bad name would otherwise fail every rank of every launch."""
        if not self.accept_changes:
            return {}
        try:
            inherited = AcceptChanges.parse((), env=env).names
        except UsageError as e:
            raise UsageError(f"slurm run: {ACCEPT_ENV} in the environment: {e}") from None
        return {ACCEPT_ENV: ",".join(dict.fromkeys(inherited + self.accept_changes))}


class _StepEnded(Exception):
    pass


class Supervisor:
    """The decision loop of one batch job: launch the step, wait for it or for a signal,
    decide what follows (relaunch, shrink, save-stop-requeue, requeue, stop), again.

    Invariants: every decision is an event (``EventLog``) with its reason; the state file
    is written before each launch and requeue; the step never outlives the hook; a save
    counts only once ``Run.check`` holds its step committed; a save request the hook posted
    and nobody answered is withdrawn (it would stop the requeued run). ``clock``, ``sleep``
    and ``popen`` are injectable: tests replace Slurm, srun and time.
    """

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
        self.launcher = StepLauncher(popen)
        self._refusals = 0  # launches Slurm refused in a row
        self.clock = clock
        self.sleep = sleep
        self.env = dict(os.environ if env is None else env)
        self.accept_env = cfg.accept_env(self.env)
        # With --exit-signal the run is a Megatron save directory, which may
        # still be empty at the first start; otherwise detected (again) as it fills.
        self.rundir = Run.open(cfg.run_url, create=True,
                               layout=MEGATRON_LAYOUT if cfg.exit_signal else None)
        self.watch = RunWatcher(self.rundir, fixed_layout=cfg.exit_signal is not None)
        self.log = EventLog(self.rundir.storage, job)
        self.state_file = StateFile(self.rundir.storage, job.job_id)
        self.state = self.state_file.load()
        self.crash_loop = CrashLoopPolicy(cfg.crash_loop)
        self._signal: int | None = None
        self.hangs: HangWatch | None = None
        self._hang: Hang | None = None
        self.excluded: list[str] = []
        """Nodes of a hang's suspects, left out for the rest of this allocation (a spare took over)."""
        self.stragglers = StragglerWatch(self.watch, cfg.straggler_factor, cfg.straggler_saves, self.log)
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
        self.log.event("start", restart_count=self.job.restart_count, nodes=self.job.nodes,
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
            if outcome == "hang":
                verdict = self._after_hang(proc, nodes)
                if verdict is not None:
                    return verdict
                continue
            if outcome == "straggler":
                self._replace_straggler(proc, nodes)
                continue
            rc = proc.returncode
            if rc == 0:
                self.log.event("finished", exit_code=0, nodes=nodes,
                               committed_step=self.watch.committed_quietly(),
                               reason="the training step exited 0: no requeue")
                self.state.failures.clear()
                self._save_state()
                return 0
            verdict = self._after_failure(rc, nodes)
            if verdict is not None:
                return verdict

    # -- decisions --------------------------------------------------------------------------

    def _choose_nodes(self) -> tuple[int, list[str]] | None:
        healthy = [n for n in self.allocation if n not in self.state.bad_nodes and n not in self.excluded]
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
                self.log.event("relaunch_on_spares", dp=dp, nodes=nodes, reason=reason)
            else:
                reason = (f"{len(healthy)} healthy nodes hold no {self.planned_dp} replicas: the next "
                          f"valid data-parallel size keeping global batch {self.cfg.global_batch}")
                self.log.event("shrink", from_dp=self.planned_dp, to_dp=dp, nodes=nodes, reason=reason)
        return dp, nodes

    def _follow_allocation(self) -> list[str]:
        """The job's nodes as Slurm has them now (``scontrol show job``); the nodes it removed,
        which count as failed for the rest of this allocation, even back in service."""
        try:
            current = set(self.slurm.job_nodes(self.job.job_id))
        except SlurmError as e:
            self.log.event("allocation_unknown", reason=f"{e}: the last known nodes are used")
            return []
        if not current:  # a running job holds nodes: a listing without any says nothing
            self.log.event("allocation_unknown",
                           reason="scontrol lists no node for the job: the last known nodes are used")
            return []
        removed = [n for n in self.allocation if n not in current]
        if removed:
            self.allocation = [n for n in self.allocation if n in current]
            self.log.event("nodes_removed", nodes=removed, reason="Slurm removed them from the job (a node "
                           "failure): not used again in this allocation, even if back in service")
        return removed

    def _forget_recovered_nodes(self) -> None:
        """Nodes recorded bad that Slurm now reports healthy are used again (growing back)."""
        if not self.state.bad_nodes:
            return
        try:
            states = self.slurm.node_states(self.state.bad_nodes)
        except SlurmError as e:
            self.log.event("node_states_unknown", reason=str(e))
            return
        back = [n for n in self.state.bad_nodes if n in states and not is_bad_state(states[n])]
        if back:
            self.state.bad_nodes = [n for n in self.state.bad_nodes if n not in back]
            self._save_state()
            self.log.event("nodes_back", nodes=back, reason="Slurm reports them healthy again")

    def _after_failure(self, rc: int, nodes: list[str]) -> int | None:
        if set(self._follow_allocation()) & set(nodes):
            return None  # a node of the step left the job: re-planned, not a crash of the training
        if self.launcher.refused():
            self._refusals += 1
            self.log.event("launch_refused", exit_code=rc, nodes=nodes, refusals=self._refusals,
                           reason="Slurm refused to create the step (srun: Unable to create step): "
                                  "re-planned on the job's current nodes, not counted as a crash")
            if self._refusals >= MAX_REFUSALS:
                return self._requeue_elsewhere(f"Slurm refused {self._refusals} launches in a row")
            return None
        self._refusals = 0
        committed = self.watch.latest_committed()
        try:
            states = self.slurm.node_states(self.job.nodes)
        except SlurmError as e:
            states = {}
            self.log.event("node_states_unknown", reason=str(e))
        bad = sorted(n for n in nodes if is_bad_state(states.get(n, "")))
        if bad:
            # Hardware: not the job's fault, so not part of a crash loop.
            self.state.bad_nodes = sorted(set(self.state.bad_nodes) | set(bad))
            self._save_state()
            self.log.event("nodes_failed", exit_code=rc, nodes=bad, states={n: states[n] for n in bad},
                           committed_step=committed,
                           reason="the step failed and Slurm reports these nodes bad")
            return None
        self.state.failures.append({"at": utc_now(), "exit_code": rc, "committed_step": committed})
        self._save_state()
        if self.crash_loop.should_stop(self.state.failures):
            limit = self.crash_loop.limit
            self.log.event("crash_loop", failures=limit, committed_step=committed,
                           reason=f"{limit} failures in a row on healthy nodes without a new "
                                  f"checkpoint (last committed step {committed}); not requeueing")
            return EXIT_CRASH_LOOP
        self.log.event("step_failed", exit_code=rc, nodes=nodes, committed_step=committed,
                       reason="the step failed on healthy nodes: relaunch in place")
        return None

    def _save_stop_requeue(self, proc: Any) -> int:
        name = signal.Signals(self._signal).name if self._signal else "signal"
        # Everything (save, stop, requeue) must fit before Slurm's kill: the
        # lead time is the template's --grace; STOP_MARGIN_S of it is for stopping.
        started = self.clock()
        lead = self.cfg.grace_s
        save_wait = self._save_wait()
        self.log.event("signal", signal=name, save_wait_s=save_wait, lead_s=lead,
                       reason="time limit ahead or preemption: save, stop, requeue")
        saved = False
        if proc.poll() is not None:
            self.log.event("save_skipped", exit_code=proc.returncode,
                           reason="the step had already ended: requeue from the last checkpoint")
        elif self.cfg.exit_signal is not None:
            saved = self._save_by_exit_signal(proc, save_wait)
        else:
            saved = self._save_by_request(proc, name, save_wait)
        spent = self.clock() - started
        # The step's own exit, then every stage of stopping it, then the requeue, before Slurm's kill.
        stopping = sum(patience for _, patience in STOP_STAGES) + REQUEUE_S
        exit_wait = self.cfg.step_exit_s if lead is None else \
            max(0.0, min(self.cfg.step_exit_s, lead - spent - stopping))
        self._stop_step(proc, wait_s=exit_wait if saved else 0.0)
        self.state.failures.clear()
        complete = self.watch.complete_step() if proc.poll() == 0 else None
        if complete is not None:  # the run ended as the signal came: nothing left to train
            self._save_state()
            self.log.event("finished", exit_code=0, committed_step=complete,
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
                                   check=self.watch.check)
            saved = True
            self.log.event("saved", step=step, reason=f"checkpoint committed after the save request ({name})")
        except _StepEnded:
            self.log.event("save_skipped", exit_code=proc.returncode,
                           reason="the step ended before it answered the save request")
        except ResumeError as e:
            self.log.event("save_failed", reason=str(e))
        finally:
            if not saved:  # a stale stop request would end the requeued run early
                withdraw_request(self.rundir, request)
        return saved

    def _save_by_exit_signal(self, proc: Any, save_wait: float) -> bool:
        """Megatron's --exit-signal-handler: signal the step (srun forwards it to every task),
        wait for a newer committed manifest: the commit, not Megatron's tracker file."""
        sig = self.cfg.exit_signal or "SIGTERM"
        before = self.watch.latest_committed()
        proc.send_signal(signal.Signals[sig if sig.startswith("SIG") else "SIG" + sig])
        deadline = self.clock() + save_wait
        while True:
            latest = self.watch.newer_committed(before)
            if latest is not None:
                self.log.event("saved", step=latest, reason=f"checkpoint committed after {sig} to the step")
                return True
            if proc.poll() is not None:
                self.log.event("save_skipped", exit_code=proc.returncode,
                               reason=f"the step ended after {sig} without a new committed checkpoint")
                return False
            if self.clock() >= deadline:
                self.log.event("save_failed", reason=f"no checkpoint newer than {before} committed "
                                                     f"within {save_wait:.0f}s of {sig}")
                return False
            self.sleep(self.cfg.poll_s)

    def _requeue_elsewhere(self, reason: str) -> int:
        """A plain requeue: Slurm allocates none of the nodes recorded bad (down, drained,
        failing), so the job starts on others. No ExcNodeList: Slurm refuses it for a running
        job, and it would keep a repaired node out of every later start. The event keeps its
        name, ``requeue_excluding``, for the runbooks' greps."""
        return self._requeue("requeue_excluding", nodes=self.state.bad_nodes, reason=reason)

    def _requeue(self, kind: str, **fields: Any) -> int:
        self._save_state()
        try:
            self.slurm.requeue(self.job.job_id)
        except SlurmError as e:
            self.log.event("requeue_failed", reason=str(e))
            return EXIT_UNRECOVERABLE
        self.log.event(kind, **fields)
        return 0

    def _withdraw_stale_requests(self) -> None:
        """Stop requests of an earlier hook that nobody answered must not stop this run."""
        try:
            stale = [r for r in pending_requests(self.rundir) if r.reason.startswith("slurm hook:")]
            for request in stale:
                withdraw_request(self.rundir, request)
                self.log.event("stale_request_withdrawn", request=request.request_id,
                               reason="a save request of an earlier hook was never answered")
        except OSError as e:
            self.log.event("control_unreadable", reason=str(e))

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
        port = master_port(self.job.job_id, self.state.launches)
        tasks = len(nodes) * self.cfg.tasks_per_node
        bounds = self.cfg.hang.merged(startup_s=self.cfg.hang.bound(self.state.startup_s)
                                      if self.state.startup_s is not None else None)
        self.hangs = HangWatch(self.rundir.storage, launch=self.state.launches, bounds=bounds, clock=self.clock,
                               expect_progress=self.state.watched)
        env = dict(self.env, MASTER_ADDR=master, MASTER_PORT=str(port), RESUME_DP=str(dp),
                   RESUME_LAUNCH=str(self.state.launches), **self.accept_env,
                   **{HANG_ENV: bounds.to_env(), RUN_ENV: self.cfg.run_url})
        self.log.event("launch", launch=self.state.launches, dp=dp, nodes=nodes, tasks=tasks,
                       master=f"{master}:{port}", committed_step=self.watch.committed_quietly(),
                       **self.accept_env)
        return self.launcher.start(srun_command(nodes, self.cfg.tasks_per_node, self.cfg.command), env)

    def _supervise(self, proc: Any) -> str:
        while proc.poll() is None:
            if self._signal is not None:
                return "signal"
            hang = self.hangs.poll() if self.hangs is not None else None
            if hang is not None:
                self._hang = hang
                return "hang"
            if self.stragglers.poll(self.clock(), spare_free=self._spare_free):
                return "straggler"
            self.sleep(self.cfg.poll_s)
        self._note_startup()
        return "exited"

    def _note_startup(self) -> None:
        """The launch's measured start-up (to its first iteration): the next launch's bound."""
        if self.hangs is not None and self.hangs.startup_s is not None:
            self.state.startup_s = self.hangs.startup_s
        if self.hangs is not None and self.hangs.record is not None:
            self.state.watched = True

    def _after_hang(self, proc: Any, nodes: list[str]) -> int | None:
        """A phase went on past its bound: keep every rank's report, name the suspect, end the
        step for sure, leave the suspect's node out when a spare is free, count a failure."""
        hang, launch = self._hang, self.state.launches
        if hang is None:
            return None
        self._note_startup()
        tasks = len(nodes) * self.cfg.tasks_per_node
        reports = collect(self.rundir.storage, launch=launch, world_size=tasks, clock=self.clock,
                          sleep=self.sleep, window_s=self.cfg.hang_collect_s, poll_s=self.cfg.poll_s)
        suspects, why = find_suspects(reports, tasks, hang.phase)
        summary = hang_summary(hang, reports, suspects, why, nodes, self.cfg.tasks_per_node,
                               self.rundir.storage.url(f"{HANGS}/launch-{launch}"))
        committed = self.watch.committed_quietly()
        self.log.event("hang", nodes=nodes, committed_step=committed, **summary)
        self._stop_step(proc, wait_s=0.0)
        self.state.failures.append({"at": utc_now(), "exit_code": proc.poll(), "committed_step": committed,
                                    "hang": hang.phase})
        leave_out = [n for n in summary["suspect_nodes"] if n in self.allocation]
        if leave_out and self._spare_free(len(leave_out)):
            self.excluded.extend(n for n in leave_out if n not in self.excluded)
            self.log.event("hung_node_excluded", nodes=leave_out, reason="a spare is free: relaunched "
                           "without the suspect's node for the rest of this allocation")
        else:
            self.log.event("hang_relaunch_in_place", nodes=nodes, reason="no suspect node, or no spare "
                           "free: the same nodes are relaunched")
        self._save_state()
        if self.crash_loop.should_stop(self.state.failures):
            self.log.event("crash_loop", failures=self.crash_loop.limit, committed_step=committed,
                           reason=f"{self.crash_loop.limit} failures (hangs included) in a row without a "
                                  f"new checkpoint (last committed step {committed}); not requeueing")
            return EXIT_CRASH_LOOP
        return None

    def _spare_free(self, count: int = 1) -> bool:
        """Whether ``count`` more nodes can be left out and the planned replicas still fit."""
        healthy = [n for n in self.allocation if n not in self.state.bad_nodes and n not in self.excluded]
        return (len(healthy) - count) // self.cfg.nodes_per_replica >= self.planned_dp

    def _replace_straggler(self, proc: Any, nodes: list[str]) -> None:
        """The straggler policy chose a node: save now (a checkpoint, nothing lost), stop, relaunch
        without it on a spare."""
        node = self.stragglers.chosen
        saved = self._save_by_request(proc, "straggler", self._save_wait())
        self._stop_step(proc, wait_s=self.cfg.step_exit_s if saved else 0.0)
        why = (f"node {node} was the slowest by more than x{self.cfg.straggler_factor} at "
               f"{self.cfg.straggler_saves} checkpoints in a row")
        if node is not None and node in nodes and self._spare_free():
            self.excluded.append(node)
            self.log.event("straggler_replaced", nodes=[node], committed_step=self.watch.committed_quietly(),
                           reason=f"{why}: relaunched without it")
        else:
            self.log.event("straggler_kept", nodes=[node], reason=f"{why}, but it is not in the step or no spare "
                           "is free any more: relaunched on the same nodes")
        self.stragglers.reset()
        self._save_state()

    def _stop_step(self, proc: Any, *, wait_s: float) -> None:
        """Until the step has ended: its own exit within ``wait_s``, then TERM to srun (passed on
        to every task), then KILL to the Slurm step (a stopped task too), then KILL to srun; a
        step that outlives all of it (a task in uninterruptible sleep) is said and left behind."""
        deadline = self.clock() + wait_s
        while proc.poll() is None and self.clock() < deadline:
            self.sleep(self.cfg.poll_s)
        for how, patience in STOP_STAGES:
            if proc.poll() is not None:
                break
            self.log.event("stop_step", signal=how, reason="the step did not leave by itself")
            if how in signal.Signals.__members__:
                proc.send_signal(signal.Signals[how])
            else:
                self._kill_slurm_steps()
            deadline = self.clock() + patience
            while proc.poll() is None and self.clock() < deadline:
                self.sleep(self.cfg.poll_s)
        if proc.poll() is None:
            self.log.event("step_unkillable", reason="srun outlived TERM, the step's KILL and its own KILL "
                           "(a task in uninterruptible sleep?): left behind, Slurm drains its node")
        self.log.event("step_ended", exit_code=proc.poll())

    def _kill_slurm_steps(self) -> None:
        try:
            for step in self.slurm.job_steps(self.job.job_id):
                self.slurm.signal_step(step, "KILL")
        except SlurmError as e:
            self.log.event("step_kill_failed", reason=str(e))

    def _save_state(self) -> None:
        self.state_file.save(self.state)

    def _install_handlers(self) -> None:
        def flag(signum: int, frame: Any) -> None:
            self._signal = signum
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, flag)

