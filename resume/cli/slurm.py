"""``resume slurm run | template``: the requeue hook, and the sbatch script that runs it."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import click

from ..errors import EXIT_OK, ResumeError, UsageError
from ..run import Run
from ..watchdog import FIRST_BOUND_S, HANG_FACTOR, HANG_FLOOR_S, HangBounds
from .common import command, emit_json, json_option

__all__ = ["slurm"]


@click.group()
def slurm() -> None:
    """Slurm integration: the requeue hook and the sbatch script that runs it.

    Exit codes of `slurm run`: 0 finished or requeued, 1 could not recover,
    2 usage, 5 crash loop (requeueing stopped), 6 no Slurm commands,
    7 not inside a Slurm allocation.
    """


def hook_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed([
        click.option("--run", "run_url", required=True, help="The run directory (local path or URL)."),
        click.option("--global-batch", type=int, required=True,
                     help="Kept across a shrink: only data-parallel sizes dividing it are used."),
        click.option("--micro-batch", type=int, default=1, show_default=True),
        click.option("--nodes-per-replica", type=int, default=1, show_default=True,
                     help="TP x CP x PP / GPUs per node (8 for the reference run)."),
        click.option("--tasks-per-node", type=int, default=1, show_default=True),
        click.option("--spares", type=int, default=0, show_default=True,
                     help="Nodes of the allocation held back as hot spares."),
    ]):
        fn = option(fn)
    return fn


accept_change_option = click.option(
    "--accept-change", "accept_changes", multiple=True, metavar="NAME",
    help="A setting the training may change against the checkpoint at its restarts (repeatable; "
         "names as in accept_changes: weight_decay, lr, optimizer[1], schedule[0].T_max). Added to "
         "RESUME_ACCEPT_CHANGES in the training step's environment at every launch and requeue; the "
         "change is recorded in the next manifest (resume inspect RUN); drop the option once it "
         "is, or a later change of the same setting is accepted too. Exit 2 for a bad name.")

exit_signal_option = click.option(
    "--exit-signal", default=None, metavar="SIGNAL",
    help="Ask for the save by sending SIGNAL to the step (Megatron-LM's --exit-signal-handler, "
         "e.g. SIGTERM) instead of a save request; the hook waits for the committed manifest.")


def hang_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Hang detection's and the straggler policy's options (``resume.watchdog``, docs/slurm.md)."""
    for option in reversed([
        click.option("--hang-floor", type=click.FloatRange(min=0, min_open=True), default=None, metavar="S",
                     help=f"No phase's hang bound is below S seconds [default: {HANG_FLOOR_S:g}]."),
        click.option("--hang-factor", type=click.FloatRange(min=1), default=None, metavar="F",
                     help=f"A phase's bound is F x the slowest of its kind measured [default: {HANG_FACTOR:g}]."),
        click.option("--hang-first", type=click.FloatRange(min=0, min_open=True), default=None, metavar="S",
                     help=f"The bound of a phase nothing measured yet: start-up, first restore, save, "
                          f"iteration [default: {FIRST_BOUND_S:g}]."),
        click.option("--hang-collect", type=click.FloatRange(min=0), default=None, metavar="S",
                     help="After a hang, how long to wait for every rank's stacks [default: 30]."),
        click.option("--no-hang-detection", is_flag=True, default=False,
                     help="Do not watch for hangs (a hung step then runs until the time limit)."),
        click.option("--replace-stragglers", type=float, default=None, metavar="FACTOR",
                     help="Replace a node that is the slowest by more than FACTOR x the median "
                          "iteration time at --straggler-saves checkpoints in a row, when a spare is free "
                          "[default: off]."),
        click.option("--straggler-saves", type=int, default=3, show_default=True, metavar="K"),
    ]):
        fn = option(fn)
    return fn


def hang_config(hang: dict[str, Any]) -> dict[str, Any]:
    """HookConfig's fields from ``hang_options``' values."""
    bounds = HangBounds().merged(floor_s=hang["hang_floor"], factor=hang["hang_factor"],
                                 first_s=hang["hang_first"],
                                 enabled=False if hang["no_hang_detection"] else None)
    from ..cluster.hangs import COLLECT_S

    return {"hang": bounds, "hang_collect_s": COLLECT_S if hang["hang_collect"] is None else hang["hang_collect"],
            "straggler_factor": hang["replace_stragglers"], "straggler_saves": hang["straggler_saves"]}


def hang_args(hang: dict[str, Any]) -> tuple[str, ...]:
    """``hang_options``' values given, as the script's ``resume slurm run`` options."""
    args: list[str] = []
    for name, value in hang.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value not in (None, False) and not (name == "straggler_saves" and value == 3):
            args += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return tuple(args)


launch_command = click.argument("command_args", nargs=-1, type=click.UNPROCESSED, required=True,
                                metavar="-- COMMAND...")
"""The training step's launch command, after ``--``."""


@slurm.command(name="run", context_settings={"ignore_unknown_options": True})
@hook_options
@click.option("--crash-loop", type=int, default=3, show_default=True,
              help="Failures in a row without a new checkpoint that stop the requeueing.")
@click.option("--grace", type=click.FloatRange(min=1), default=None,
              help="Seconds between USR1/TERM and Slurm's kill: save, stop and requeue fit in it "
                   "[default: wait for the save as long as measured saves need].")
@exit_signal_option
@accept_change_option
@hang_options
@launch_command
@command
def slurm_run(run_url: str, global_batch: int, micro_batch: int, nodes_per_replica: int,
              tasks_per_node: int, spares: int, crash_loop: int, grace: float | None,
              exit_signal: str | None, accept_changes: tuple[str, ...], command_args: tuple[str, ...],
              **hang: Any) -> int:
    """Start the training step with srun and supervise it (the batch script's main process)."""
    from ..cluster.hook import HookConfig, Supervisor
    from ..cluster.slurm import Slurm, SlurmJob

    # Usage first (exit 2), then the allocation (7) and the Slurm commands (6).
    cfg = HookConfig(run_url=run_url, command=list(command_args), global_batch=global_batch,
                     micro_batch=micro_batch, nodes_per_replica=nodes_per_replica,
                     tasks_per_node=tasks_per_node, spares=spares, crash_loop=crash_loop, grace_s=grace,
                     exit_signal=exit_signal, accept_changes=accept_changes, **hang_config(hang))
    job = SlurmJob.from_env(os.environ)
    cluster = Slurm()
    cluster.check_installed()
    return Supervisor(cfg, job, cluster).run()


@slurm.command(context_settings={"ignore_unknown_options": True})
@hook_options
@click.option("--nodes", type=int, required=True, help="Nodes of the allocation, spares included.")
@click.option("--grace", type=click.IntRange(min=60), default=None,
              help="Seconds before the time limit for USR1 [default: from measured saves, else 300].")
@click.option("--time", "time_limit", default=None, help="Slurm --time.")
@click.option("--partition", default=None)
@click.option("--job-name", default="resume", show_default=True)
@click.option("--output", default="resume-%j.out", show_default=True)
@click.option("--out", "out_file", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write the script here instead of printing it.")
@exit_signal_option
@accept_change_option
@hang_options
@launch_command
@command
def template(run_url: str, global_batch: int, micro_batch: int, nodes_per_replica: int,
             tasks_per_node: int, spares: int, nodes: int, grace: int | None, time_limit: str | None,
             partition: str | None, job_name: str, output: str, out_file: str | None,
             exit_signal: str | None, accept_changes: tuple[str, ...], command_args: tuple[str, ...],
             **hang: Any) -> int:
    """Write a ready sbatch script: --requeue, --no-kill, --signal=B:USR1@GRACE, the hook
    (with its --exit-signal and --accept-change options)."""
    from ..cluster.hook import HookConfig
    from ..cluster.template import SbatchTemplate

    # The hook's own checks, now rather than inside the allocation.
    cfg = HookConfig(run_url=run_url, command=list(command_args), global_batch=global_batch,
                     micro_batch=micro_batch, nodes_per_replica=nodes_per_replica,
                     tasks_per_node=tasks_per_node, spares=spares, exit_signal=exit_signal,
                     accept_changes=accept_changes, **hang_config(hang))
    if nodes < nodes_per_replica + spares:
        raise UsageError(f"--nodes: expected at least {nodes_per_replica + spares} "
                         f"({nodes_per_replica} per replica + {spares} spares), actual {nodes}")
    from ..cluster.grace import fit_to_time_limit

    grace_s = grace if grace is not None else _measured_grace(run_url)
    warning = fit_to_time_limit(grace_s, time_limit, given=grace is not None)
    if warning:
        click.echo(f"resume: warning: {warning}", err=True)
    script = SbatchTemplate(run_url=run_url, command=list(command_args), nodes=nodes,
                            global_batch=global_batch, micro_batch=micro_batch,
                            nodes_per_replica=nodes_per_replica, tasks_per_node=tasks_per_node,
                            spares=spares, grace_s=grace_s,
                            job_name=job_name, time=time_limit, partition=partition,
                            output=output, exit_signal=exit_signal,
                            accept_changes=cfg.accept_changes, hook_args=hang_args(hang)).render()
    if out_file:
        with open(out_file, "w") as f:
            f.write(script)
        os.chmod(out_file, 0o755)
    else:
        click.echo(script, nl=False)
    return EXIT_OK


@slurm.command()
@click.argument("run_url", metavar="RUN")
@json_option
@command
def status(run_url: str, as_json: bool) -> int:
    """Where the supervised run stands, from the hook's events: the last launch, the last hang
    (one line: phase, suspects, their nodes, where the stacks are), the last stragglers, the
    nodes left out. Exit 0, or 3 when the hook never ran on RUN."""
    from ..cluster.status import read_events, status_of
    from ..errors import RunNotFoundError

    run = Run.open(run_url)
    try:
        events = read_events(run.storage)
    except FileNotFoundError:
        raise RunNotFoundError(f"{run.storage.url('cluster/events.jsonl')}: expected the Slurm hook's "
                               f"event log, actual none (the hook never ran on this run)") from None
    found = status_of(events)
    if as_json:
        emit_json(found)
        return EXIT_OK
    launch, strag, ev = found["last_launch"], found["last_stragglers"], found["last_event"]
    click.echo(f"run          {run.storage.url('')}")
    if launch:
        click.echo(f"last launch  #{launch.get('launch')} at {launch.get('at')} on "
                   f"{','.join(map(str, launch.get('nodes') or []))} (committed step {launch.get('committed_step')})")
    click.echo(f"last hang    {found['last_hang_line'] or 'none'}"
               + (f" ({found['hangs']} in all)" if found["hangs"] > 1 else ""))
    if strag:
        click.echo(f"stragglers   step {strag.get('step')}: {strag.get('reason', '')}")
    click.echo(f"left out     {', '.join(found['left_out']) or 'none'}")
    if ev:
        click.echo(f"last event   {ev.get('at')} {ev['event']}: {ev.get('reason', '')}")
    return EXIT_OK


def _measured_grace(run_url: str) -> int:
    """The USR1 lead time: resume.cluster.grace's one formula over the run's recent saves
    (2 x slowest of the newest 5 committed saves + 60 s; 300 s before any was measured)."""
    from ..cluster.grace import UNMEASURED_S, grace_budget

    try:
        run = Run.open(run_url)
    except (ResumeError, OSError):
        return int(UNMEASURED_S)  # no run yet: nothing measured
    return math.ceil(grace_budget(run))
