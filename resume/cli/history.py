"""``resume journal`` (the update records, their branches, the spikes) and ``resume rewind``."""

from __future__ import annotations

import re

import click

from ..errors import EXIT_NOTHING, EXIT_OK, UsageError
from ..journal import JournalView, read_journal
from ..rewind import abandoned_branches, apply_rewind, plan_rewind
from ..run import Run
from ..spikes import SpikeRule, find_spikes
from .common import command, emit_json, json_option

__all__ = ["journal", "rewind", "run_journal"]


def run_journal(run: Run) -> tuple[JournalView, list[int]]:
    """Every branch of the run's journal, and the main line's committed steps (ascending)."""
    committed = run.committed_steps()
    newest = run.read_manifest(committed[-1]) if committed else None
    branches = [(name, directory, entry, to) for name, directory, entry, to, _ in abandoned_branches(run)]
    view = read_journal(run.storage, newest.journal if newest is not None else None,
                        source=run.storage.url(run.manifest_path(newest.step)) if newest else run.url,
                        abandoned_branches=branches)
    return view, committed


def _row(branch: str, r: dict) -> str:
    lr = r.get("lr")
    lr_text = "-" if lr is None else ",".join(f"{x:.3g}" if isinstance(x, float) else str(x) for x in lr)
    ids = r.get("ids")
    batch = (f"ids {','.join(map(str, ids[:4]))}{',...' if r.get('ids_n', len(ids)) > 4 else ''}" if ids
             else f"digest {r['digest']}" if "digest" in r else "")

    def num(key: str) -> str:
        v = r.get(key)
        return "-" if v is None else (f"{v:.5g}" if isinstance(v, float) else str(v))
    skipped = f" (+{r['skipped']} skipped)" if r.get("skipped") else ""
    return (f"{r['it']:>8}  {'ok' if r['ok'] else 'SKIPPED':<7}  {r.get('at', '?')}+{r.get('n', '?')}{skipped:<4}  "
            f"loss {num('loss'):<10} grad {num('grad_norm'):<10} clip {num('clipped'):<5} lr {lr_text:<12} "
            f"{batch}  [{branch}]")


@click.command()
@click.argument("run_url", metavar="RUN")
@click.option("--from", "first", type=click.IntRange(min=0), default=None, help="First iteration shown.")
@click.option("--to", "last", type=click.IntRange(min=0), default=None, help="Last iteration shown.")
@click.option("--spikes", is_flag=True, help="Only the updates whose loss or gradient norm stand out "
              "(resume.spikes: > 1.5x the loss median, > 4x the norm median of the last 20, or not finite).")
@click.option("--window", type=click.IntRange(min=2), default=20, show_default=True, help="--spikes: updates compared.")
@json_option
@command
def journal(run_url: str, first: int | None, last: int | None, spikes: bool, window: int, as_json: bool) -> int:
    """The update journal: one record per update (succeeded or skipped, samples, LR applied, loss,
    gradient norm, clipped, batch ids), with its branches: the main line sealed by the committed
    checkpoints, records not sealed yet, updates a crash lost, and each rewind's abandoned line.

    Exit codes: 0 shown, 3 no records (or no run).
    """
    run = Run.open(run_url)
    view, committed = run_journal(run)

    def shown(r: dict) -> bool:
        return (first is None or r["it"] >= first) and (last is None or r["it"] <= last)
    if spikes:
        found = []
        for b in view.branches:
            # A branch other than the main line goes on from the main line's records before it.
            start = b.records[0]["it"] if b.records else 0
            context = [r for r in view.main.records if r["it"] < start] if b is not view.main else []
            found += [(b, s) for s in find_spikes(context + b.records, SpikeRule(window=window))
                      if shown(s["record"]) and s["record"]["it"] >= start]
        return _spikes(run, found, committed, as_json)
    rows = [(b, r) for b, r in view.all_records() if shown(r)]
    if as_json:
        emit_json({"run": run.url, "branches": [
            {"name": b.name, "abandoned": b.abandoned, "note": b.note, "problems": b.problems,
             "records": [r for r in b.records if shown(r)]} for b in view.branches]})
        return EXIT_OK if rows else EXIT_NOTHING
    for b in view.branches:
        if b.records or b.problems:
            span = f"updates {b.records[0]['it']}..{b.records[-1]['it']}" if b.records else "no records"
            click.echo(f"branch {b.name}{' (ABANDONED)' if b.abandoned else ''}: {span}"
                       f"{'; ' + b.note if b.note else ''}")
        for p in b.problems:
            click.echo(f"  PROBLEM: {p}")
    for b, r in rows:
        click.echo(_row(b.name, r))
    if not rows:
        click.echo(f"resume: error: {run.url}: expected update records, actual none", err=True)
        return EXIT_NOTHING
    return EXIT_OK


def _spikes(run: Run, found: list, committed: list[int], as_json: bool) -> int:
    out = []
    for branch, spike in found:
        r = spike["record"]
        before = [s for s in committed if s < r["it"]]
        out.append({"branch": branch.name, "abandoned": branch.abandoned, "iteration": r["it"], "why": spike["why"],
                    "samples": [r.get("at"), r.get("at", 0) + r.get("n", 0)], "ids": r.get("ids"),
                    "digest": r.get("digest"), "checkpoint_before": before[-1] if before else None,
                    "record": r})
    if as_json:
        emit_json({"run": run.url, "spikes": out})
        return EXIT_OK
    if not out:
        click.echo("no spikes (rule: resume.spikes)")
        return EXIT_OK
    for s in out:
        ids = s["ids"]
        batch = f"ids {ids}" if ids else f"digest {s['digest']}"
        click.echo(f"iteration {s['iteration']} [{s['branch']}]: {s['why']}; samples [{s['samples'][0]}, "
                   f"{s['samples'][1]}) {batch}; newest checkpoint before: "
                   f"{run.dirname(s['checkpoint_before']) if s['checkpoint_before'] is not None else 'none'}")
    return EXIT_OK


_RANGE = re.compile(r"^(\d+):(\d+)$")


def _ranges(values: tuple[str, ...], option: str) -> list[tuple[int, int]]:
    out = []
    for v in values:
        m = _RANGE.match(v.strip())
        if not m or int(m.group(1)) >= int(m.group(2)):
            raise UsageError(f"{option}: expected START:END with START < END (half-open, like Python's "
                             f"range), actual {v!r}")
        out.append((int(m.group(1)), int(m.group(2))))
    return out


def _batches_as_samples(batches: list[tuple[int, int]], view: JournalView) -> list[tuple[int, int]]:
    """``--skip-batches I:J``: the samples the updates I..J-1 read, from the journal's records: the
    main line's (sealed, unsealed, lost in a crash) before an abandoned branch's."""
    by_iteration: dict[int, dict] = {}
    for branch in reversed(view.branches):  # main first in the view: its record wins
        for r in branch.records:
            by_iteration[r["it"]] = r
    out = []
    for i, j in batches:
        missing = [k for k in range(i, j) if k not in by_iteration][:5]
        if missing:
            raise UsageError(f"--skip-batches {i}:{j}: expected journal records of updates {i}..{j - 1}, actual "
                             f"none for {missing}: give the samples with --skip-samples")
        out += [(by_iteration[k]["at"], by_iteration[k]["at"] + by_iteration[k]["n"]) for k in range(i, j)]
    return out


@click.command()
@click.argument("run_url", metavar="RUN")
@click.option("--to", "to", type=click.IntRange(min=0), required=True, help="The committed step to go back to.")
@click.option("--reason", required=True, help="Why (recorded in every later manifest).")
@click.option("--skip-samples", multiple=True, metavar="START:END",
              help="Pass over samples [START, END) of the run's sample numbering (journal `at`); repeatable.")
@click.option("--skip-batches", multiple=True, metavar="I:J",
              help="Pass over the batches updates I..J-1 read (from the journal); repeatable.")
@click.option("--branch", type=click.IntRange(min=1), default=None, metavar="N",
              help="--to is a checkpoint of rewind N's abandoned branch (`resume ls` lists them): it becomes the "
                   "main line again, and the main line after that branch's fork is abandoned in turn.")
@click.option("--accept", multiple=True, metavar="NAME",
              help="A setting change the restart may make (accept_changes names: lr, warmup's schedule[0], ...).")
@json_option
@command
def rewind(run_url: str, to: int, reason: str, skip_samples: tuple[str, ...], skip_batches: tuple[str, ...],
           branch: int | None, accept: tuple[str, ...], as_json: bool) -> int:
    """Go back to the committed checkpoint --to, past a loss spike: the checkpoints and journal after
    it move to abandoned/rewind-N/ (kept, listed by `ls`, never restored or deleted by retention);
    the next restore takes --to, passes over the skipped samples (counted as read, not trained on),
    accepts the named changes, and its continuity check expects exactly that break.

    Refused while a job holds the run's lease. Exit codes: 0 done, 1 refused (nothing changed),
    2 usage error, 3 no such run or step.
    """
    run = Run.open(run_url)
    view, _ = run_journal(run)
    records = [r for _, r in view.all_records()]
    skips = _ranges(skip_samples, "--skip-samples") + _batches_as_samples(_ranges(skip_batches, "--skip-batches"), view)
    plan = plan_rewind(run, to=to, skips=skips, accept=list(accept), reason=reason, journal_records=records,
                       branch=branch)
    record = apply_rewind(run, plan)
    if as_json:
        emit_json({"ok": True, "rewind": record})
        return EXIT_OK
    click.echo(f"rewound {run.url} to {run.dirname(to)} (rewind {record['n']}): {record['reason']}")
    click.echo(f"  abandoned     {len(record['moved'])} entries moved to {run.storage.url(record['branch'])}")
    if record.get("from_branch") is not None:
        click.echo(f"  returned      {len(record['returned'])} entries of rewind {record['from_branch']}'s branch")
    click.echo(f"  skipped       {record['skips'] or 'nothing'}")
    click.echo(f"  accepted      {record['accept'] or 'nothing'}")
    nxt = record.get("expect_next")
    if nxt:
        click.echo(f"  next batch    starts at sample {nxt['at']}" + (f", ids {nxt['ids'][:8]}" if nxt["ids"] else ""))
    click.echo("  the next launch restores it (check its log: 'continuity ok')")
    return EXIT_OK
