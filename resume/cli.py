"""The command line: ``resume save | verify | ls | inspect | drill``.

Exit codes (every command): 0 ok, 1 problems found or failed, 2 usage error,
3 nothing there (no run, no committed checkpoint), 4 timed out.
Errors are one line on stderr naming the file, the field, the expected and
the actual value; with ``--json`` the same error is also printed as a JSON
object on stdout.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shlex
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import click

# The adapters' run layouts register themselves at import (cheap: no framework is imported),
# so that every command here detects a framework's own save directory (Megatron-LM's --save).
from .adapters import megatron_ckpt  # noqa: F401
from .cluster.reference import DEFAULT_INPUTS
from .errors import (
    EXIT_NOTHING,
    EXIT_OK,
    EXIT_PROBLEM,
    CheckpointNotFoundError,
    ResumeError,
    UnsafePathError,
    UsageError,
)
from .lease import Holder, read_holder
from .manifest import Manifest
from .run import CheckResult, Run
from .storage import SMALL_FILE_CAP
from .text import short

__all__ = ["cli", "main"]


def _emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=1, sort_keys=False))


def _is_terminal() -> bool:
    return sys.stderr.isatty()


def command(fn: Callable[..., int]) -> Callable[..., None]:
    """Map ResumeError (and stray OSError) to a one-line message and its exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        as_json = kwargs.get("as_json", False)
        try:
            code = fn(*args, **kwargs)
        except ResumeError as e:
            _fail(str(e), e.exit_code, as_json)
        except BrokenPipeError:
            # `resume ... | head`: the reader left; say nothing more.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(EXIT_OK)
        except OSError as e:
            _fail(f"{getattr(e, 'filename', '') or ''}: {type(e).__name__}: {e}".lstrip(": "),
                  EXIT_PROBLEM, as_json)
        else:
            sys.exit(code or EXIT_OK)

    return wrapper


def _fail(message: str, code: int, as_json: bool) -> None:
    if as_json:
        _emit_json({"ok": False, "error": message, "exit_code": code})
    click.echo(f"resume: error: {message}", err=True)
    sys.exit(code)


json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object; no progress.")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="resume")
def cli() -> None:
    """Committed, verifiable checkpoints, and a continuity check after every restart.

    Exit codes: 0 ok, 1 problems found / failed, 2 usage error, 3 nothing there
    (no run, no committed checkpoint), 4 timed out.
    """


# -- save ------------------------------------------------------------------------------------


@cli.command()
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
    from .control import post_save_request, wait_for_answer

    run = Run.open(run_url)
    request = post_save_request(run, stop=stop)
    show = _is_terminal() and not as_json

    def on_wait(remaining: float) -> None:
        if show:
            click.echo(f"\rwaiting for the job to commit a checkpoint ({remaining:5.0f}s left)",
                       err=True, nl=False)

    try:
        # An answer counts only for a step the run holds committed (one may be forged).
        step = wait_for_answer(run, request, timeout=timeout, on_wait=on_wait,
                               check=lambda step: Run.open(run_url).check(step))
    finally:
        if show:
            click.echo("", err=True)
    run = Run.open(run_url)  # the layout again: a framework's save directory may have been empty
    manifest = run.read_manifest(step)
    if as_json:
        _emit_json({"ok": True, "step": step, "train_state": manifest.train_state.to_dict()})
    else:
        click.echo(f"committed {run.dirname(step)} (iteration {manifest.train_state.iteration})")
    return EXIT_OK


# -- verify ----------------------------------------------------------------------------------


def _semantic_problems(run: Run, result: CheckResult) -> list[str]:
    """Schedule sanity of a committed checkpoint's manifest (the counters' invariants are
    part of the commit check)."""
    from .continuity import Expectation
    from .errors import ManifestError

    manifest = result.manifest
    assert manifest is not None
    source = run.storage.url(run.manifest_path(result.step))
    problems: list[str] = []
    try:
        expectation = Expectation.from_dict(manifest.expectation, source=source)
    except ManifestError as e:
        return problems + [str(e)]
    successful = manifest.train_state.updates_successful
    for i, steps in enumerate(expectation.optimizer_steps):
        if steps != successful:
            problems.append(f"{source}: expectation.optimizer_steps[{i}]: expected {successful} "
                            f"(updates_successful), actual {steps}")
    if len(expectation.lr_ahead) < 2:
        problems.append(f"{source}: expectation.lr_ahead: expected >= 2 updates, "
                        f"actual {len(expectation.lr_ahead)}")
    if any(math.isnan(lr) or lr < 0 for lrs in expectation.lr_ahead for lr in lrs):
        problems.append(f"{source}: expectation.lr_ahead: expected non-negative LRs, "
                        f"actual {expectation.lr_ahead}")
    return problems


def _check_dcp_metadata(run: Run, result: CheckResult) -> list[str]:
    """Deep: DCP's pickled .metadata must parse with the restricted unpickler and hold what DCP
    puts there, every item inside the files the manifest lists."""
    if result.manifest is None or ".metadata" not in result.manifest.files:
        return []
    try:
        from .adapters.dcp_safe import restricted_load_metadata
    except ImportError:
        return []
    path = run.step_path(result.step, ".metadata")
    try:
        data = run.storage.read_bytes(path, limit=result.manifest.files[".metadata"].size)
        sizes = {rel: entry.size for rel, entry in result.manifest.files.items()}
        restricted_load_metadata(data, source=run.storage.url(path), file_sizes=sizes,
                                 compression=result.manifest.topology.get("compression"))
    except ResumeError as e:
        return [str(e)]
    return []


@dataclasses.dataclass
class _Verdict:
    """What ``verify`` finds in a run, or in the one step asked for. ``inspect`` takes the
    same verdict, so both exit with the same code for the same state."""

    results: list[CheckResult]
    """Every step directory checked, ascending, with verify's own problems added."""
    restorable: int | None
    """The newest step that passes the commit check: the one restore would load."""
    pointer: list[str]
    """Problems of the layout's pointer (our LATEST, a framework's own) and of the run as a whole."""
    notes: list[str]
    problems: list[str]
    """Everything that makes the exit code 1, in the order it is reported."""

    @property
    def ok(self) -> bool:
        """No problem, and something a restart loads: a committed checkpoint, or a framework's
        own save that is sound (``unrecorded``; loaded without the continuity check)."""
        return not self.problems and any(r.status in ("committed", "unrecorded") for r in self.results)

    @property
    def exit_code(self) -> int:
        """0 sound, 1 problems, 3 no committed checkpoint (DESIGN: exit codes)."""
        if self.problems:
            return EXIT_PROBLEM
        return EXIT_OK if self.ok else EXIT_NOTHING

    def errors(self, run: Run) -> list[str]:
        """What stderr says: each problem, or that there is no committed checkpoint."""
        if self.problems or self.ok:
            return self.problems
        return [f"{run.url}: expected a committed checkpoint, actual none"]


def _verify_run(run: Run, step: int | None, *, deep: bool, show: bool = False) -> _Verdict:
    """The commit check on every step directory (or on ``step``), verify's own checks on each
    committed one, then the layout's pointer and, for the whole run, our LATEST."""
    results, restorable, unrecorded = [], None, None
    for s in _steps_to_check(run, step):
        result = _check_with_progress(run, s, deep=deep, show=show)
        if result.committed:
            restorable = s
            result.problems.extend(_checkpoint_problems(run, result, deep=deep))
        else:
            result.examine_framework(run, deep=deep)
            unrecorded = s if result.status == "unrecorded" else unrecorded
        results.append(result)
    if restorable is None:
        restorable = unrecorded  # nothing of ours: the framework loads its own save
    whole_run = step is None
    pointer = run.layout.pointer_problems(run, results, whole_run=whole_run)
    notes: list[str] = []
    if whole_run and run.layout.latest:
        latest, notes = _latest_problems(run, results)
        pointer += latest
    # A step directory without any manifest is a save that never finished (uncommitted):
    # listed, not a problem, unless it was asked for by --step. A framework's own save
    # with problems is broken, as a checkpoint of ours with problems is.
    problems = [p for r in results if r.status == "broken" or not whole_run for p in r.problems]
    return _Verdict(results, restorable, pointer, notes, problems + pointer)


def _steps_to_check(run: Run, step: int | None) -> list[int]:
    """Every step directory, or the one asked for; CheckpointNotFoundError (exit 3) if none."""
    steps = run.step_dirs()
    if step is not None:
        if step not in steps:
            raise CheckpointNotFoundError(f"{run.storage.url(run.dirname(step))}: expected a step "
                                          f"directory, actual missing (steps: {steps})")
        return [step]
    if not steps:
        raise CheckpointNotFoundError(f"{run.url}: expected checkpoints, actual none")
    return steps


def _checkpoint_problems(run: Run, result: CheckResult, *, deep: bool) -> list[str]:
    """What verify adds to the commit check of a committed checkpoint: the schedule's sanity,
    DCP's metadata and every rank state file in shape and bounds (``deep``), and what the
    layout's framework says against the manifest."""
    problems = _semantic_problems(run, result)
    if deep:
        from .restore import rank_state_problems

        assert result.manifest is not None
        problems += _check_dcp_metadata(run, result) + rank_state_problems(run, result.manifest)
    return problems + run.layout.extra_problems(run, result)


def _report(run: Run, verdict: _Verdict) -> int:
    """The verdict's errors on stderr, one line each; its exit code."""
    for message in verdict.errors(run):
        click.echo(f"resume: error: {message}", err=True)
    return verdict.exit_code


@cli.command()
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
    verdict = _verify_run(run, step, deep=deep, show=_is_terminal() and not as_json)
    if as_json:
        _emit_json({"ok": verdict.ok, "deep": deep, "layout": run.layout.name,
                    "pointer_problems": verdict.pointer, "pointer_notes": verdict.notes,
                    "steps": [{"step": r.step, "status": r.status, "committed": r.committed,
                               "problems": r.problems,
                               "framework": dataclasses.asdict(r.framework) if r.framework else None}
                              for r in verdict.results]})
    else:
        _print_verdict(run, verdict, deep=deep, whole_run=step is None)
    return _report(run, verdict)


def _print_verdict(run: Run, verdict: _Verdict, *, deep: bool, whole_run: bool) -> None:
    for p in verdict.pointer:
        click.echo(f"{run.layout.pointer}  PROBLEM: {p}")
    for note in verdict.notes:
        click.echo(f"{run.layout.pointer}  note: {note}")
    for r in verdict.results:
        if r.committed:
            state = r.manifest.train_state  # type: ignore[union-attr]
            click.echo(f"{run.dirname(r.step)}  ok{' (checksums)' if deep else ''}  "
                       f"iteration {state.iteration}, {len(r.manifest.files)} files"  # type: ignore[union-attr]
                       + _framework_counters(run, run.layout.framework_counters(run, r)))
        elif r.status == "unrecorded":
            click.echo(f"{run.dirname(r.step)}  unrecorded (no resume manifest): {r.framework.checked}"  # type: ignore[union-attr]
                       + _framework_counters(run, r.framework.framework_counters))  # type: ignore[union-attr]
        elif r.status == "uncommitted" and whole_run:
            click.echo(f"{run.dirname(r.step)}  uncommitted (ignored): {r.reason}")
        else:
            for p in r.problems:
                click.echo(f"{run.dirname(r.step)}  PROBLEM: {p}")


def _framework_counters(run: Run, counters: dict | None) -> str:
    """``; megatron: consumed_train_samples 24, skipped_train_samples 4`` (empty without)."""
    if not counters:
        return ""
    return f"; {run.layout.name}: " + _counter_list(counters)


def _counter_list(counters: dict) -> str:
    """``consumed_train_samples 24, skipped_train_samples ?``."""
    return ", ".join(f"{k} {_shown(v)}" for k, v in counters.items())


def _latest_problems(run: Run, results: list[CheckResult]) -> tuple[list[str], list[str]]:
    """Our LATEST hint: (problems, notes). Missing is fine; it must name a committed step.

    Naming a broken step is only a note: that step's own problems are reported.
    Older than the newest committed step is only a note too: a crash between
    the manifest write and the LATEST update leaves it so, and discovery trusts
    manifests, not LATEST.
    """
    name = run.layout.latest
    assert name is not None
    source = run.storage.url(name)
    try:
        # Capped and never through a link: a LATEST linked to a secret is refused, not quoted.
        text = run.storage.read_bytes(name, limit=SMALL_FILE_CAP).decode(errors="replace").strip()
    except FileNotFoundError:
        return [], []
    except UnsafePathError as e:
        return [str(e)], []
    except OSError as e:
        return [f"{source}: expected a readable file, actual {type(e).__name__}: {short(str(e))}"], []
    if not (text.isascii() and text.isdigit()):
        return [f"{source}: expected a step number, actual {short(text, 60)}"], []
    latest = int(text)
    named = run.dirname(latest)
    expected = f"{source}: names {named}: expected a committed checkpoint, actual"
    by_step = {r.step: r for r in results}
    if latest not in by_step:
        aside = [n for n in run.storage.listdir("") if n.startswith(f"quarantine-{named}-")]
        why = (f" (moved aside as {aside[-1]} by a restore that passed over it; the next commit "
               "rewrites LATEST)") if aside else ""
        return [f"{expected} no such directory{why}"], []
    if by_step[latest].status == "broken":
        return [], [f"{source}: names {named}, which is broken (its problems are listed)"]
    if not by_step[latest].committed:
        return [f"{expected} {by_step[latest].status} ({by_step[latest].reason})"], []
    newest = max(r.step for r in results if r.committed)
    if latest < newest:
        note = (f"{source}: names {named}, older than the newest committed {run.dirname(newest)} "
                "(a hint only; discovery trusts manifests)")
        return [], [note]
    return [], []


def _check_with_progress(run: Run, step: int, *, deep: bool, show: bool) -> CheckResult:
    if not (deep and show):
        return run.check(step, deep=deep)
    try:
        total = run.read_manifest(step).total_bytes
    except ResumeError:
        return run.check(step, deep=deep)
    with click.progressbar(length=total, label=f"verifying {run.dirname(step)}",
                           file=sys.stderr) as bar:
        return run.check(step, deep=True, progress=bar.update)


# -- ls / inspect ------------------------------------------------------------------------------


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


@cli.command(name="ls")
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
    if as_json:
        _emit_json({"run": run.url, "layout": run.layout.name, "latest_hint": run.latest_hint(),
                    "lease": None if holder is None else {**dataclasses.asdict(holder), "age_s": round(
                        time.time() - holder.heartbeat_at, 1), "stale_because": holder.stale_because(
                            time.time(), host=socket.gethostname())},
                    "checkpoints": [_listed(run, r) for r in results]})
        return EXIT_OK if results else EXIT_NOTHING
    if not results:
        click.echo(f"resume: error: {run.url}: expected checkpoints, actual none", err=True)
        return EXIT_NOTHING
    click.echo(f"{'step':>10}  {'status':<11}  {'iteration':>9}  {'samples':>10}  {'ok':>8}  "
               f"{'skipped':>7}  {'size':>10}  created")
    for r in results:
        entry = _listed(run, r)
        s = entry["train_state"]
        if s is None:
            click.echo(f"{r.step:>10}  {r.status:<11}  {r.reason}")
            continue
        shown = {k: "?" if s.get(k) is None else str(s[k])
                 for k in ("iteration", "samples_read", "updates_successful", "updates_skipped")}
        size = _human_bytes(r.manifest.total_bytes) if r.manifest else ""
        created = r.manifest.created_at if r.manifest else "(no resume manifest; counters from the framework's state)"
        click.echo(f"{r.step:>10}  {r.status:<11}  {shown['iteration']:>9}  {shown['samples_read']:>10}  "
                   f"{shown['updates_successful']:>8}  {shown['updates_skipped']:>7}  {size:>10}  {created}")
        if s.get("unknown"):
            click.echo(f"{'':>10}  updates unknown: {s['unknown']}")
        if entry["framework_counters"]:
            counters = _counter_list(entry["framework_counters"])
            click.echo(f"{'':>10}  {run.layout.name}: {counters}")
        if r.status in ("broken", "uncommitted"):
            click.echo(f"{'':>10}  {r.reason}")
    complete = [r.step for r in results if r.committed and r.manifest is not None and r.manifest.complete]
    if complete:
        click.echo(f"run complete at step {complete[-1]} (total_iterations reached: a restart trains no further)")
    # The writer (runbooks/two-jobs.md): the job holding the run's lease, if any.
    click.echo(f"lease: {_describe_lease(holder)}")
    return EXIT_OK


def _listed(run: Run, r: CheckResult) -> dict[str, Any]:
    """One checkpoint as ``ls`` shows it: its counters from our manifest, else from the
    framework's own state (``counters_derived``: not verified; None for a counter it cannot give)."""
    framework = r.framework
    derived = r.manifest is None and framework is not None and framework.counters is not None
    return {"step": r.step, "status": r.status, "committed": r.committed, "reason": r.reason or None,
            "train_state": (r.manifest.train_state.to_dict() if r.manifest else
                            framework.counters if derived else None),  # type: ignore[union-attr]
            "counters_derived": derived,
            "framework_counters": (run.layout.framework_counters(run, r) if r.committed else
                                   framework.framework_counters if framework is not None else None) or None,
            "complete": bool(r.manifest and r.manifest.complete),
            "bytes": r.manifest.total_bytes if r.manifest else None,
            "created_at": r.manifest.created_at if r.manifest else None}


def _describe_lease(holder: Holder | None) -> str:
    """The lease for a listing: its holder, and whether it is gone (a dead pid on this host, a
    stale or impossible heartbeat); the next job takes such a lease over."""
    if holder is None:
        return "none (no job is writing this run)"
    now = time.time()
    gone = holder.stale_because(now, host=socket.gethostname())
    return holder.describe(now) + (f"; holder gone: {gone} (the next job takes the lease over)" if gone else "")


@cli.command()
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
    from .continuity import Expectation

    run = Run.open(run_url)
    verdict = _verify_run(run, step, deep=False)
    shown = step if step is not None else verdict.restorable
    manifest = next((r.manifest for r in verdict.results if r.step == shown), None)
    framework = next((r for r in verdict.results if r.step == shown and r.framework is not None), None)
    if manifest is None and framework is not None and framework.status != "uncommitted":
        _print_framework_save(run, framework, as_json)
        return _report(run, verdict)
    if manifest is None:
        if as_json:
            _emit_json({"ok": False, "error": "; ".join(verdict.errors(run)), "exit_code": verdict.exit_code})
        return _report(run, verdict)
    source = run.storage.url(run.manifest_path(manifest.step))
    expectation = Expectation.from_dict(manifest.expectation, source=source)  # validates
    if as_json:
        _emit_json(json.loads(manifest.to_json()))
    else:
        _print_manifest(run, manifest, expectation.to_dict())
    return _report(run, verdict)


def _print_manifest(run: Run, manifest: Manifest, e: dict[str, Any]) -> None:
    s = manifest.train_state
    click.echo(f"{run.dirname(manifest.step)}  ({run.storage.url(run.dirname(manifest.step))})")
    adopted = (manifest.expectation.get("megatron") or {}).get("adopted")
    if isinstance(adopted, dict):  # a framework's own save recorded afterwards (resume megatron adopt)
        click.echo(f"  written by    {manifest.adapter}, adopted at {_shown(adopted.get('at'))} by "
                   f"{_shown(adopted.get('by'))} (not recorded: {_shown(adopted.get('not_recorded'))})")
    else:
        click.echo(f"  written by    {manifest.adapter} at {manifest.created_at}")
    click.echo(f"  counters      iteration {s.iteration}, samples read {s.samples_read}, "
               f"updates {s.updates_successful} successful / {s.updates_skipped} skipped")
    framework = run.layout.framework_counters(run, CheckResult(step=manifest.step, manifest=manifest))
    if framework:
        click.echo(f"  {run.layout.name:<13} " + _counter_list(framework))
    click.echo(f"  config        {json.dumps(manifest.config, sort_keys=True)}")
    click.echo(f"  topology      {json.dumps(manifest.topology, sort_keys=True)}")
    click.echo(f"  user          {json.dumps(manifest.user, sort_keys=True) if manifest.user else 'none'}")
    click.echo("  complete      " + ("yes (the run's last checkpoint)" if manifest.complete else "no"))
    click.echo(f"  changes       {len(manifest.changes) or 'none'}")
    for change in manifest.changes:
        item = change["item"] if change["item"].isprintable() else _shown(change["item"])
        click.echo(f"    step {change['step']:<8} {item}: {_shown(change['from'])} -> {_shown(change['to'])}")
    nb = e.get("next_batch")
    if nb:
        ids = nb["ids"]
        shown = ", ".join(map(str, ids[:8])) + (", ..." if len(ids) > 8 else "")
        click.echo(f"  next batch    {nb['samples']} samples [{shown}] digest {nb['digest']}")
    else:
        click.echo("  next batch    none (end of data)")
    for i, lrs in enumerate(e.get("lr_ahead", [])):
        click.echo(f"  lr +{i:<9d}{lrs}")
    click.echo(f"  optimizers    steps {e.get('optimizer_steps')}")
    click.echo(f"  files         {len(manifest.files)}, {_human_bytes(manifest.total_bytes)}")
    for rel, entry in sorted(manifest.files.items()):
        click.echo(f"    {rel:<28} {entry.size:>12}  {entry.checksum}")


def _print_framework_save(run: Run, r: CheckResult, as_json: bool) -> None:
    """``inspect`` of a framework's own save without our manifest: what its files give."""
    f = r.framework
    assert f is not None
    if as_json:
        _emit_json({"step": r.step, "status": r.status, "train_state": f.counters,
                    "framework_counters": f.framework_counters, "checked": f.checked, "problems": r.problems})
        return
    click.echo(f"{run.dirname(r.step)}  ({run.storage.url(run.dirname(r.step))})")
    click.echo(f"  status        {r.status}: no resume manifest (saved by {run.layout.name} alone); the next "
               "restart loads it without the continuity check")
    c = f.counters or {}
    if c:
        updates = (f"updates {c['updates_successful']} successful / {c['updates_skipped']} skipped"
                   if c.get("unknown") is None else f"updates unknown ({c['unknown']})")
        click.echo(f"  counters      iteration {c.get('iteration')}, samples read {c.get('samples_read')}, {updates}")
    else:
        click.echo("  counters      unknown (the framework's state cannot be read)")
    if f.framework_counters:
        click.echo(f"  {run.layout.name:<13} " + _counter_list(f.framework_counters))
    if f.checked:
        click.echo(f"  checked       {f.checked}")


def _shown(value: Any, limit: int = 100) -> str:
    """A JSON value on one line, cut at ``limit`` characters (``--json`` shows it whole)."""
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- plan / simulate ---------------------------------------------------------------------------


def layout_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed([
        click.option("--nodes", type=int, default=640, show_default=True),
        click.option("--gpus-per-node", type=int, default=8, show_default=True),
        click.option("--tp", type=int, default=8, show_default=True, help="Tensor-parallel size."),
        click.option("--pp", type=int, default=8, show_default=True, help="Pipeline-parallel size."),
        click.option("--cp", type=int, default=1, show_default=True, help="Context-parallel size."),
        click.option("--spares", type=int, default=0, show_default=True,
                     help="Hot-spare nodes inside the allocation."),
        click.option("--global-batch", type=int, default=1920, show_default=True),
        click.option("--micro-batch", type=int, default=1, show_default=True),
    ]):
        fn = option(fn)
    return fn


@cli.command()
@layout_options
@json_option
@command
def plan(nodes: int, gpus_per_node: int, tp: int, pp: int, cp: int, spares: int, global_batch: int,
         micro_batch: int, as_json: bool) -> int:
    """The parallel layout: replicas, spares, valid data-parallel sizes, checkpoint interval.

    Defaults are the reference run: 640 nodes x 8 GPUs, TP8 x PP8 x DP80,
    global batch 1,920. Exits 2 for a layout that does not fit.
    """
    from .cluster.layout import Layout
    from .cluster.simulate import Assumptions, best_interval, plan_spares

    layout = Layout(nodes=nodes, gpus_per_node=gpus_per_node, tp=tp, pp=pp, cp=cp, spares=spares,
                    global_batch=global_batch, micro_batch=micro_batch)
    shrunk = layout.shrink_after(spares + 1)
    sim = Assumptions(nodes=layout.dp * layout.nodes_per_replica, gpus_per_node=gpus_per_node,
                      spares=spares, shrink_factor=max(shrunk, 1) / layout.dp)
    best, yd = best_interval(sim)
    recommended, _ = plan_spares(sim, best.interval_s)
    body = {**layout.to_dict(), "checkpoint_interval_s": round(best.interval_s),
            "young_daly_interval_s": round(yd), "recommended_spares": recommended,
            "simulation": "resume simulate (default assumptions)"}
    if as_json:
        _emit_json(body)
        return EXIT_OK
    d, npr = layout.dp, layout.nodes_per_replica
    click.echo(f"layout     {nodes} nodes x {gpus_per_node} GPUs; TP{tp} x PP{pp} x CP{cp} x DP{d} "
               f"= {layout.world_size} ranks (Megatron order tp-cp-dp-pp)")
    example = layout.replica_nodes(0)
    shown = ", ".join(map(str, example[:4])) + (", ..." if len(example) > 4 else "")
    click.echo(f"replicas   {d} of {npr} nodes each (replica 0: nodes {shown}); one failed node "
               f"takes its replica out")
    click.echo(f"spares     {spares} (nodes {layout.spare_nodes[:1] + layout.spare_nodes[-1:]})"
               if spares else "spares     0")
    if layout.idle_nodes:
        click.echo(f"idle       {layout.idle_nodes} nodes fit no whole valid replica count")
    click.echo(f"one node lost without a free spare: DP {d} -> {layout.shrink_after(spares + 1)} "
               "(global batch kept)")
    click.echo(f"global batch {global_batch} = micro-batch {micro_batch} x "
               f"{layout.micro_batches_per_rank(d)} micro-batches x DP{d}")
    click.echo(f"{'dp':>5}  {'nodes':>6}  {'micro-batches/rank':>18}  {'global batch if micro-batches/rank kept':>40}")
    for v in layout.valid_dp:
        click.echo(f"{v:>5}  {v * npr:>6}  {layout.micro_batches_per_rank(v):>18}  "
                   f"{layout.global_batch_at_constant_micro_batches(v):>40}")
    click.echo(f"checkpoint every ~{best.interval_s / 60:.0f} min (Young/Daly {yd / 60:.0f} min); "
               f"recommended spares {recommended} (resume simulate for the assumptions)")
    return EXIT_OK


@cli.command()
@click.option("--nodes", type=int, default=640, show_default=True, help="Nodes that train.")
@click.option("--spares", type=int, default=0, show_default=True)
@click.option("--node-mtbf-hours", type=float, default=None,
              help="Mean time between failures of one node [default: Llama 3's 419 interruptions "
                   "in 54 days on 16,384 GPUs, 8 GPUs per node].")
@click.option("--distribution", type=click.Choice(["exponential", "weibull"]), default="exponential",
              show_default=True)
@click.option("--weibull-shape", type=float, default=0.7, show_default=True)
@click.option("--stall-s", type=float, default=None,
              help="Training time lost to each checkpoint [default: the reference run's save stall, "
                   "computed (--reference)].")
@click.option("--restart-spare-s", type=float, default=None,
              help="Detect, relaunch on a spare, restore [default: the reference run's, computed].")
@click.option("--restart-requeue-s", type=float, default=None,
              help="Requeue, wait in the queue, start, restore [default: the reference run's, computed].")
@click.option("--fs-bandwidth-gbs", type=float, default=DEFAULT_INPUTS.fs_bandwidth_gbs, show_default=True,
              help="Shared file system bandwidth, aggregate, GB/s (assumed): the reference run's bulk "
                   "write and read times.")
@click.option("--d2h-gbs", type=float, default=DEFAULT_INPUTS.d2h_gbs, show_default=True,
              help="Device-to-host copy bandwidth per GPU, GB/s (assumed): the asynchronous save's "
                   "staging copy.")
@click.option("--queue-wait-s", type=float, default=DEFAULT_INPUTS.queue_wait_s, show_default=True,
              help="Wait in the queue after a requeue (assumed): the restart after a requeue.")
@click.option("--save", "save_mode", type=click.Choice(["async", "sync"]), default=DEFAULT_INPUTS.save,
              show_default=True, help="Whose stall is the default --stall-s: an asynchronous or a "
                                      "synchronous save's.")
@click.option("--reference", is_flag=True,
              help="Print the reference run's figures (measured, assumed, computed, each with its "
                   "source) at these inputs, and simulate nothing.")
@click.option("--repair-hours", type=float, default=72.0, show_default=True)
@click.option("--no-spare", type=click.Choice(["shrink", "requeue"]), default="shrink",
              show_default=True, help="With no spare free: run on fewer replicas until the next "
                                      "requeue (the hook's policy), or requeue at once.")
@click.option("--shrink-factor", type=float, default=0.8, show_default=True,
              help="Speed on fewer replicas (DP 64 / 80 for the reference).")
@click.option("--time-limit-hours", type=float, default=24.0, show_default=True,
              help="The job's time limit: each requeue starts at full size again.")
@click.option("--days", type=float, default=90.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@json_option
@command
def simulate(nodes: int, spares: int, node_mtbf_hours: float | None, distribution: str,
             weibull_shape: float, stall_s: float | None, restart_spare_s: float | None,
             restart_requeue_s: float | None, fs_bandwidth_gbs: float, d2h_gbs: float,
             queue_wait_s: float, save_mode: str, reference: bool, repair_hours: float, no_spare: str,
             shrink_factor: float, time_limit_hours: float, days: float, seed: int, as_json: bool) -> int:
    """Simulate failures of a long run: goodput, work lost, best checkpoint interval, spares.

    The stall and restart times default to the reference run's (640 nodes, 500B parameters):
    its measured control plane, the assumed inputs below, and their sums; the output says
    where each came from. --reference prints every figure with its source.
    """
    from .cluster.reference import Inputs, figures, markdown_table, simulate_defaults
    from .cluster.simulate import Assumptions, report

    inputs = Inputs(fs_bandwidth_gbs=fs_bandwidth_gbs, d2h_gbs=d2h_gbs, queue_wait_s=queue_wait_s,
                    save=save_mode)
    if reference:
        figs = figures(inputs)
        if as_json:
            _emit_json({key: fig.to_dict() for key, fig in figs.items()})
        else:
            click.echo(markdown_table(figs))
        return EXIT_OK
    given = {"stall_s": stall_s, "restart_spare_s": restart_spare_s, "restart_requeue_s": restart_requeue_s}
    computed = simulate_defaults(inputs)
    times = {name: computed[name].value if value is None else value for name, value in given.items()}
    sources = {name: computed[name].source if value is None else "given" for name, value in given.items()}
    kwargs = {} if node_mtbf_hours is None else {"node_mtbf_s": node_mtbf_hours * 3600}
    a = Assumptions(nodes=nodes, spares=spares, distribution=distribution, weibull_shape=weibull_shape,
                    repair_s=repair_hours * 3600, no_spare=no_spare, shrink_factor=shrink_factor,
                    requeue_every_s=time_limit_hours * 3600, days=days, seed=seed, **times, **kwargs)
    r = {**report(a), "sources": sources}
    if as_json:
        _emit_json(r)
        return EXIT_OK
    click.echo("assumptions:")
    for key, value in r["assumptions"].items():
        click.echo(f"  {key:<18} {value:.6g}" if isinstance(value, float) else f"  {key:<18} {value}")
    click.echo("where the stall and restart times came from (resume simulate --reference):")
    for key, source in sources.items():
        click.echo(f"  {key:<18} {source}")
    click.echo(f"  {'job MTBF':<18} {r['system_mtbf_s'] / 3600:.2f} h ({nodes} nodes)")
    click.echo(f"result over {days:g} days ({r['failures']} failures on average):")
    click.echo(f"  goodput            {r['goodput']:.4f}")
    click.echo(f"  best interval      {r['best_interval_s']:.0f} s  (Young/Daly sqrt(2*C*MTBF) = "
               f"{r['young_daly_interval_s']:.0f} s, ratio {r['interval_ratio']:.2f})")
    click.echo(f"  work lost          {r['work_lost_hours']:.1f} h; restarts {r['restart_hours']:.1f} h; "
               f"checkpoint stalls {r['stall_hours']:.1f} h")
    click.echo(f"  recommended spares {r['recommended_spares']} (best goodput per allocated node)")
    return EXIT_OK


# -- slurm -------------------------------------------------------------------------------------


@cli.group()
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


@slurm.command(name="run", context_settings={"ignore_unknown_options": True})
@hook_options
@click.option("--crash-loop", type=int, default=3, show_default=True,
              help="Failures in a row without a new checkpoint that stop the requeueing.")
@click.option("--grace", type=click.FloatRange(min=1), default=None,
              help="Seconds between USR1/TERM and Slurm's kill: save, stop and requeue fit in it "
                   "[default: wait for the save as long as measured saves need].")
@exit_signal_option
@accept_change_option
@click.argument("command_args", nargs=-1, type=click.UNPROCESSED, required=True,
                metavar="-- COMMAND...")
@command
def slurm_run(run_url: str, global_batch: int, micro_batch: int, nodes_per_replica: int,
              tasks_per_node: int, spares: int, crash_loop: int, grace: float | None,
              exit_signal: str | None, accept_changes: tuple[str, ...], command_args: tuple[str, ...]) -> int:
    """Start the training step with srun and supervise it (the batch script's main process)."""
    from .cluster.hook import HookConfig, Supervisor
    from .cluster.slurm import Slurm, SlurmJob

    # Usage first (exit 2), then the allocation (7) and the Slurm commands (6).
    cfg = HookConfig(run_url=run_url, command=list(command_args), global_batch=global_batch,
                     micro_batch=micro_batch, nodes_per_replica=nodes_per_replica,
                     tasks_per_node=tasks_per_node, spares=spares, crash_loop=crash_loop, grace_s=grace,
                     exit_signal=exit_signal, accept_changes=accept_changes)
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
@click.argument("command_args", nargs=-1, type=click.UNPROCESSED, required=True,
                metavar="-- COMMAND...")
@command
def template(run_url: str, global_batch: int, micro_batch: int, nodes_per_replica: int,
             tasks_per_node: int, spares: int, nodes: int, grace: int | None, time_limit: str | None,
             partition: str | None, job_name: str, output: str, out_file: str | None,
             exit_signal: str | None, accept_changes: tuple[str, ...], command_args: tuple[str, ...]) -> int:
    """Write a ready sbatch script: --requeue, --no-kill, --signal=B:USR1@GRACE, the hook
    (with its --exit-signal and --accept-change options)."""
    from .cluster.hook import HookConfig
    from .cluster.template import SbatchTemplate

    # The hook's own checks, now rather than inside the allocation.
    cfg = HookConfig(run_url=run_url, command=list(command_args), global_batch=global_batch,
                     micro_batch=micro_batch, nodes_per_replica=nodes_per_replica,
                     tasks_per_node=tasks_per_node, spares=spares, exit_signal=exit_signal,
                     accept_changes=accept_changes)
    if nodes < nodes_per_replica + spares:
        raise UsageError(f"--nodes: expected at least {nodes_per_replica + spares} "
                         f"({nodes_per_replica} per replica + {spares} spares), actual {nodes}")
    from .cluster.grace import fit_to_time_limit

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
                            accept_changes=cfg.accept_changes).render()
    if out_file:
        with open(out_file, "w") as f:
            f.write(script)
        os.chmod(out_file, 0o755)
    else:
        click.echo(script, nl=False)
    return EXIT_OK


def _measured_grace(run_url: str) -> int:
    """The USR1 lead time: resume.cluster.grace's one formula over the run's recent saves
    (2 x slowest of the newest 5 committed saves + 60 s; 300 s before any was measured)."""
    from .cluster.grace import UNMEASURED_S, grace_budget

    try:
        run = Run.open(run_url)
    except (ResumeError, OSError):
        return int(UNMEASURED_S)  # no run yet: nothing measured
    return math.ceil(grace_budget(run))


# -- drill -------------------------------------------------------------------------------------


@cli.command()
@click.option("--run", "run_url", default=None,
              help="Run directory (local path or fsspec URL) of the drilled run; default a new "
                   "temporary directory. Its checkpoints stay there for verify/ls/inspect.")
@click.option("--ranks", type=int, default=2, show_default=True, help="Processes (gloo, CPU).")
@click.option("--iterations", type=click.IntRange(min=2), default=40, show_default=True)
@click.option("--every", type=click.IntRange(min=1), default=5, show_default=True,
              help="Checkpoint interval in iterations.")
@click.option("--kills", type=click.IntRange(min=0), default=2, show_default=True,
              help="SIGKILLs at random iterations after a checkpoint.")
@click.option("--seed", type=int, default=0, show_default=True)
@json_option
@command
def drill(run_url: str | None, ranks: int, iterations: int, every: int, kills: int, seed: int,
          as_json: bool) -> int:
    """The resume drill: train a tiny GPT straight through, then again with SIGKILLs and
    resumes, and compare parameters, moments, LR and loss traces and counters bitwise.

    Exits 0 only if everything is identical.
    """
    try:
        from .drill.runner import DrillConfig, format_table, run_drill
    except ImportError as e:
        raise UsageError(f"resume drill needs torch: expected it installed, actual {e} "
                         "(pip install torch==2.13.0)") from e
    cfg = DrillConfig(run=run_url, ranks=ranks, iterations=iterations, every=every, kills=kills,
                      seed=seed)
    say = (lambda s: None) if as_json else (lambda s: click.echo(s, err=True))
    try:
        result = run_drill(cfg, say=say)
    except RuntimeError as e:
        raise DrillFailed(str(e)) from e
    if as_json:
        _emit_json(result.to_dict())
    else:
        click.echo(format_table(result))
    return EXIT_OK if result.identical else EXIT_PROBLEM


class DrillFailed(ResumeError):
    exit_code = EXIT_PROBLEM


# -- megatron ----------------------------------------------------------------------------------


@cli.group()
def megatron() -> None:
    """Megatron-LM: the arguments the orchestrator needs. `verify`, `ls` and `inspect` take a
    Megatron save directory (--save) as RUN."""


@megatron.command(name="args")
@click.option("--save", "save_dir", default=None, help="Megatron's --save/--load directory.")
@click.option("--world-size", type=click.IntRange(min=1), default=None, help="GPUs (default 5120).")
@click.option("--tp", type=click.IntRange(min=1), default=None, help="Tensor-parallel size (default 8).")
@click.option("--pp", type=click.IntRange(min=1), default=None, help="Pipeline-parallel size (default 8).")
@click.option("--save-interval", type=click.IntRange(min=1), default=None,
              help="Iterations between scheduled saves (default 500).")
@click.option("--exit-signal", default=None, help="Signal for --exit-signal-handler (default SIGTERM).")
@click.option("--check", is_flag=True,
              help="Parse and validate them with Megatron's own parser (needs megatron-core).")
@json_option
@command
def megatron_args(save_dir: str | None, world_size: int | None, tp: int | None, pp: int | None,
                  save_interval: int | None, exit_signal: str | None, check: bool, as_json: bool) -> int:
    """Print Megatron-LM's arguments for the reference run (TP8 x PP8 x DP80, 1,920 x 8,192,
    AdamW, sample-based warm-up + cosine, bf16, distributed optimizer) with the checkpoint
    and exit flags `resume` relies on. Exits 0; 1 if --check finds a problem."""
    import dataclasses

    from .adapters.megatron_args import REFERENCE, check_with_megatron_parser

    given = {"save_dir": save_dir, "world_size": world_size, "tensor_parallel": tp,
             "pipeline_parallel": pp, "save_interval": save_interval, "exit_signal": exit_signal}
    run_args = dataclasses.replace(REFERENCE, **{k: v for k, v in given.items() if v is not None})
    checked = None
    if check:
        try:
            parsed = check_with_megatron_parser(run_args)
        except UsageError as e:
            raise CheckFailed(str(e)) from e
        checked = {"data_parallel_size": parsed.data_parallel_size,
                   "num_micro_batches_per_rank": parsed.global_batch_size
                   // (parsed.micro_batch_size * parsed.data_parallel_size)}
    if as_json:
        _emit_json({"argv": run_args.argv(), "environment": run_args.environment(), "checked": checked,
                    "groups": {what: flags for what, flags in run_args.groups()}})
        return EXIT_OK
    for name, value in run_args.environment().items():
        click.echo(f"export {name}={value}")
    # A bash array: comments are allowed inside it, and the launch line stays
    # `torchrun ... pretrain_gpt.py "${MEGATRON_ARGS[@]}"`.
    click.echo("MEGATRON_ARGS=(")
    for what, flags in run_args.groups():
        click.echo(f"  # {what}\n  {' '.join(shlex.quote(f) for f in flags)}")
    click.echo(")")
    if checked is not None:
        click.echo(f"# checked with Megatron's parser and validate_args: data-parallel size "
                   f"{checked['data_parallel_size']}, {checked['num_micro_batches_per_rank']} "
                   "micro-batches per rank", err=True)
    return EXIT_OK


@megatron.command(name="adopt")
@click.argument("save_dir", metavar="SAVE_DIR")
@click.option("--iteration", type=click.IntRange(min=0), default=None,
              help="The save to adopt (default: the newest up to Megatron's tracker that passes).")
@click.option("--lr-lookahead", type=click.IntRange(min=2), default=3, show_default=True,
              help="Updates whose LR the manifest records.")
@json_option
@command
def megatron_adopt(save_dir: str, iteration: int | None, lr_lookahead: int, as_json: bool) -> int:
    """Record a Megatron save that resume never recorded: after the deep check (every record
    read, CRC-32s compared), write its manifest (checksums taken now, the counters and the
    expectation from Megatron's own state), marked adopted. From the next restart with
    resume installed on, the continuity check covers the run.

    Exits 0 adopted (or already recorded), 1 refused (the reason names the file), 2 usage,
    3 nothing there.
    """
    from .adapters.megatron_adopt import adopt, describe

    result = adopt(save_dir, iteration=iteration, lr_lookahead=lr_lookahead)
    if as_json:
        _emit_json({"ok": True, "iteration": result.iteration, "already": result.already,
                    "passed_over": [{"iteration": s, "why": w} for s, w in result.passed_over],
                    "manifest": json.loads(result.manifest.to_json()) if result.manifest else None})
        return EXIT_OK
    for step, why in result.passed_over:
        click.echo(f"{step:>10}  passed over: {why}")
    click.echo(describe(result, save_dir))
    return EXIT_OK


class CheckFailed(ResumeError):
    exit_code = EXIT_PROBLEM


def main() -> None:
    cli(prog_name="resume")


if __name__ == "__main__":
    main()
