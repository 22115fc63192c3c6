"""``resume save | verify | ls | inspect``: a run's checkpoints, asked for, checked, listed, shown.

``verify`` and ``inspect`` print the verdict of ``resume.verify.verify_run``; with ``--json``
its errors are also records of their fields (what, step, where, field, expected, actual).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import click

from ..errors import EXIT_NOTHING, EXIT_OK, ResumeError
from ..lease import read_holder
from ..run import CheckResult, Run
from ..verify import Verdict, verify_run
from . import show
from .common import command, emit_json, is_terminal, json_option

__all__ = ["dcp_metadata_problems", "inspect", "ls_command", "save", "verify"]


@click.command()
@click.argument("run_url", metavar="RUN")
@click.option("--timeout", type=click.FloatRange(min=0), default=600.0, show_default=True,
              help="Seconds to wait for the commit.")
@click.option("--stop", is_flag=True, help="Ask the job to stop after the save.")
@json_option
@command
def save(run_url: str, timeout: float, stop: bool, as_json: bool) -> int:
    """Ask a running job to checkpoint at its next iteration boundary; wait for the commit.

    Exits 0 with the committed step, 1 if the save failed, 4 on timeout (the
    request is then withdrawn), 3 if RUN does not exist. An answer that is not the job's
    for this request, or names a step that is not committed, is ignored with a warning.
    """
    from ..control import post_save_request, wait_for_answer

    run = Run.open(run_url)
    request = post_save_request(run, stop=stop)
    shown = is_terminal() and not as_json

    def on_wait(remaining: float) -> None:
        if shown:
            click.echo(f"\rwaiting for the job to commit a checkpoint ({remaining:5.0f}s left)",
                       err=True, nl=False)

    try:
        # An answer counts only for a step the run holds committed (one may be forged).
        step = wait_for_answer(run, request, timeout=timeout, on_wait=on_wait,
                               check=lambda step: Run.open(run_url).check(step))
    finally:
        if shown:
            click.echo("", err=True)
    run = Run.open(run_url)  # the layout again: a framework's save directory may have been empty
    manifest = run.read_manifest(step)
    if as_json:
        emit_json({"ok": True, "step": step, "train_state": manifest.train_state.to_dict()})
    else:
        click.echo(f"committed {run.dirname(step)} (iteration {manifest.train_state.iteration})")
    return EXIT_OK


def dcp_metadata_problems(run: Run, result: CheckResult) -> list[str]:
    """Deep: DCP's pickled .metadata must parse with the restricted unpickler and hold what DCP
    puts there, and the index a restore reads instead (where the step has one) must pass its
    bounds checks, every item inside the files the manifest lists (none without torch)."""
    if result.manifest is None or ".metadata" not in result.manifest.files:
        return []
    try:
        from ..adapters.dcp.index import INDEX_FILE, CheckpointIndex
        from ..adapters.dcp.unpickle import restricted_load_metadata
    except ImportError:
        return []
    sizes = {rel: entry.size for rel, entry in result.manifest.files.items()}
    compression = result.manifest.topology.get("compression")
    problems = []
    for name in (".metadata", INDEX_FILE):
        if name not in result.manifest.files:
            continue
        path = run.step_path(result.step, name)
        try:
            data = run.storage.read_bytes(path, limit=result.manifest.files[name].size)
            if name == INDEX_FILE:
                CheckpointIndex.parse(data, source=run.storage.url(path), file_sizes=sizes,
                                      compression=compression if compression == "zstd" else None)
            else:
                restricted_load_metadata(data, source=run.storage.url(path), file_sizes=sizes,
                                         compression=compression)
        except ResumeError as e:
            problems.append(str(e))
    return problems


def verified(run: Run, step: int | None, *, deep: bool, progress: bool = False) -> Verdict:
    """``verify_run`` with the DCP check for ``deep`` and, with ``progress``, a progress bar."""

    def check(s: int) -> CheckResult:
        try:
            total = run.read_manifest(s).total_bytes
        except ResumeError:
            return run.check(s, deep=deep)
        with click.progressbar(length=total, label=f"verifying {run.dirname(s)}", file=sys.stderr) as bar:
            return run.check(s, deep=True, progress=bar.update)

    return verify_run(run, step, deep=deep, check=check if deep and progress else None,
                      deep_checks=(dcp_metadata_problems,))


def report(run: Run, verdict: Verdict) -> int:
    """The verdict's errors on stderr, one line each; its exit code."""
    for message in verdict.errors(run):
        click.echo(f"resume: error: {message}", err=True)
    return verdict.exit_code


@click.command()
@click.argument("run_url", metavar="RUN")
@click.option("--step", type=click.IntRange(min=0), default=None, help="Verify only this step.")
@click.option("--deep", is_flag=True, help="Also read every file and compare its xxh3 checksum; check "
              "DCP's .metadata and the rank state files in shape and bounds.")
@json_option
@command
def verify(run_url: str, step: int | None, deep: bool, as_json: bool) -> int:
    """Check checkpoints: complete, sizes, checksums (--deep), invariants, schedule.

    Without --step every step directory is checked; uncommitted ones (no
    manifest: a save that did not finish) are listed but are not problems; and
    LATEST, when present, must name a committed step. A file in a step
    directory that its manifest does not list is a problem. In a Megatron save
    directory, a save Megatron finished without our manifest is checked from its
    own .metadata (--deep: every record's CRC-32): unrecorded when sound, broken
    otherwise (runbooks/megatron.md).
    Exits 0 if every committed (or unrecorded) checkpoint is sound, 1 naming each
    problem, 3 if there is no run or no checkpoint at all.
    """
    run = Run.open(run_url)
    verdict = verified(run, step, deep=deep, progress=is_terminal() and not as_json)
    if as_json:
        emit_json({"ok": verdict.ok, "deep": deep, "layout": run.layout.name,
                   "pointer_problems": verdict.pointer, "pointer_notes": verdict.notes,
                   "steps": [{"step": r.step, "status": r.status, "committed": r.committed,
                              "problems": r.problems,
                              "framework": dataclasses.asdict(r.framework) if r.framework else None}
                             for r in verdict.results],
                   "exit_code": verdict.exit_code, "errors": verdict.error_records(run)})
    else:
        show.verdict(run, verdict, deep=deep)
    return report(run, verdict)


@click.command(name="ls")
@click.argument("run_url", metavar="RUN")
@json_option
@command
def ls_command(run_url: str, as_json: bool) -> int:
    """List checkpoints with their counters; uncommitted step directories say why.

    A framework's own save without our manifest (a Megatron save made before ``resume`` was
    installed) is ``unrecorded`` with the counters its own state gives (unknown ones shown as
    ``?``, with the reason) or ``broken``, naming the file.
    """
    run = Run.open(run_url)
    results = [run.check(s) for s in run.step_dirs()]
    for r in results:
        r.examine_framework(run)
    holder = read_holder(run.storage)
    abandoned = show.abandoned(run)
    if as_json:
        emit_json({"run": run.url, "layout": run.layout.name, "latest_hint": run.latest_hint(),
                   "lease": show.lease_record(holder),
                   "checkpoints": [show.listed(run, r) for r in results], "abandoned": abandoned})
        return EXIT_OK if results else EXIT_NOTHING
    if not results:
        click.echo(f"resume: error: {run.url}: expected checkpoints, actual none", err=True)
        return EXIT_NOTHING
    show.listing(run, results, holder)
    for branch in abandoned:
        click.echo(f"abandoned by rewind {branch['rewind']} (to step {branch['to']}, {branch['time']}: "
                   f"{branch['reason']}): steps {branch['steps'] or 'none'} in {branch['directory']} "
                   "(kept; never restored or deleted)")
    return EXIT_OK


@click.command()
@click.argument("run_url", metavar="RUN")
@click.option("--step", type=click.IntRange(min=0), default=None,
              help="The step to show (default: the newest committed).")
@json_option
@command
def inspect(run_url: str, step: int | None, as_json: bool) -> int:
    """Show one checkpoint's manifest: counters, expectation, files, topology, config, the
    program's own values (``user``) and the settings changed on purpose at restarts
    (``changes``: step, item, from -> to; accept_changes / RESUME_ACCEPT_CHANGES).

    Exits as `verify` (without --deep) does for the same RUN and --step: 0 sound, 1 problems
    (named on stderr; a manifest that can be read is still shown), 3 nothing there.
    """
    from ..continuity import Expectation

    run = Run.open(run_url)
    verdict = verified(run, step, deep=False)
    shown = step if step is not None else verdict.restorable
    manifest = next((r.manifest for r in verdict.results if r.step == shown), None)
    framework = next((r for r in verdict.results if r.step == shown and r.framework is not None), None)
    if manifest is None and framework is not None and framework.status != "uncommitted":
        show.framework_save(run, framework, as_json)
        return report(run, verdict)
    if manifest is None:
        if as_json:
            emit_json(unshown(run, verdict))
        return report(run, verdict)
    source = run.storage.url(run.manifest_path(manifest.step))
    expectation = Expectation.from_dict(manifest.expectation, source=source)  # validates
    if as_json:
        emit_json(json.loads(manifest.to_json()))
    else:
        show.manifest(run, manifest, expectation.to_dict())
    return report(run, verdict)


def unshown(run: Run, verdict: Verdict) -> dict:
    """``inspect --json`` with no manifest to show: the error object (``common.fail``'s shape,
    the first error's fields at the top) and every error's record."""
    records = verdict.error_records(run)
    first = {k: v for k, v in records[0].items() if k not in ("error", "step")} if records else {}
    return {"ok": False, "error": "; ".join(verdict.errors(run)), "exit_code": verdict.exit_code,
            **first, "errors": records}
