"""How ``verify``, ``ls`` and ``inspect`` print a run: text for a person, records for ``--json``."""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from typing import Any

import click

from ..layout import ParallelLayout
from ..lease import Holder
from ..manifest import Manifest
from ..run import CheckResult, Run
from ..stragglers import describe
from ..verify import Verdict
from .common import emit_json

__all__ = ["abandoned", "counter_list", "framework_save", "human_bytes", "layout_lines", "layout_text",
           "lease_record", "listed", "listing", "manifest", "shown", "verdict"]


def verdict(run: Run, found: Verdict, *, deep: bool) -> None:
    """``verify``'s lines: the pointer's problems and notes, then each step directory."""
    for p in found.pointer:
        click.echo(f"{run.layout.pointer}  PROBLEM: {p}")
    for note in found.notes:
        click.echo(f"{run.layout.pointer}  note: {note}")
    for r in found.results:
        if r.committed:
            state = r.manifest.train_state  # type: ignore[union-attr]
            click.echo(f"{run.dirname(r.step)}  ok{' (checksums)' if deep else ''}  "
                       f"iteration {state.iteration}, {len(r.manifest.files)} files"  # type: ignore[union-attr]
                       + framework_counters(run, run.layout.framework_counters(run, r)))
        elif r.status == "unrecorded":
            click.echo(f"{run.dirname(r.step)}  unrecorded (no resume manifest): {r.framework.checked}"  # type: ignore[union-attr]
                       + framework_counters(run, r.framework.framework_counters))  # type: ignore[union-attr]
        elif r.status == "uncommitted" and found.whole_run:
            click.echo(f"{run.dirname(r.step)}  uncommitted (ignored): {r.reason}")
        else:
            for p in r.problems:
                click.echo(f"{run.dirname(r.step)}  PROBLEM: {p}")


def framework_counters(run: Run, counters: dict | None) -> str:
    """``; megatron: consumed_train_samples 24, skipped_train_samples 4`` (empty without)."""
    if not counters:
        return ""
    return f"; {run.layout.name}: " + counter_list(counters)


def counter_list(counters: dict) -> str:
    """``consumed_train_samples 24, skipped_train_samples ?``."""
    return ", ".join(f"{k} {shown(v)}" for k, v in counters.items())


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def shown(value: Any, limit: int = 100) -> str:
    """A JSON value on one line, cut at ``limit`` characters (``--json`` shows it whole)."""
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def listing(run: Run, results: list[CheckResult], holder: Holder | None) -> None:
    """``ls``'s table: one row per step directory, then the run's completion and lease."""
    click.echo(f"{'step':>10}  {'status':<11}  {'iteration':>9}  {'samples':>10}  {'ok':>8}  "
               f"{'skipped':>7}  {'size':>10}  created")
    for r in results:
        _listing_row(run, r)
    complete = [r.step for r in results if r.committed and r.manifest is not None and r.manifest.complete]
    if complete:
        click.echo(f"run complete at step {complete[-1]} (total_iterations reached: a restart trains no further)")
    # The writer (runbooks/two-jobs.md): the job holding the run's lease, if any.
    click.echo(f"lease: {describe_lease(holder)}")


def _listing_row(run: Run, r: CheckResult) -> None:
    entry = listed(run, r)
    s = entry["train_state"]
    if s is None:
        click.echo(f"{r.step:>10}  {r.status:<11}  {r.reason}")
        return
    counts = {k: "?" if s.get(k) is None else str(s[k])
              for k in ("iteration", "samples_read", "updates_successful", "updates_skipped")}
    size = human_bytes(r.manifest.total_bytes) if r.manifest else ""
    created = r.manifest.created_at if r.manifest else "(no resume manifest; counters from the framework's state)"
    click.echo(f"{r.step:>10}  {r.status:<11}  {counts['iteration']:>9}  {counts['samples_read']:>10}  "
               f"{counts['updates_successful']:>8}  {counts['updates_skipped']:>7}  {size:>10}  {created}")
    if s.get("unknown"):
        click.echo(f"{'':>10}  updates unknown: {s['unknown']}")
    if entry["framework_counters"]:
        click.echo(f"{'':>10}  {run.layout.name}: {counter_list(entry['framework_counters'])}")
    if r.status in ("broken", "uncommitted"):
        click.echo(f"{'':>10}  {r.reason}")


def listed(run: Run, r: CheckResult) -> dict[str, Any]:
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


def abandoned(run: Run) -> list[dict[str, Any]]:
    """Each rewind's abandoned branch: its checkpoints (moved, kept), for ``ls``."""
    from ..rewind import read_rewinds

    out = []
    for record in read_rewinds(run):
        directory = record.get("branch") or f"abandoned/rewind-{record['n']:04d}"
        try:
            names = run.storage.listdir(directory)
        except (FileNotFoundError, NotADirectoryError):
            names = []
        steps = sorted(s for s in (run.layout.parse(n) for n in names) if s is not None)
        out.append({"rewind": record["n"], "to": record["to"], "reason": record.get("reason", ""),
                    "time": record.get("time", ""), "skips": record.get("skips", []),
                    "directory": run.storage.url(directory), "steps": steps, "done": record.get("done", True)})
    return out


def lease_record(holder: Holder | None) -> dict[str, Any] | None:
    """The lease for ``ls --json``: its holder, its heartbeat's age, why it is gone (None: live)."""
    if holder is None:
        return None
    now = time.time()
    return {**dataclasses.asdict(holder), "age_s": round(now - holder.heartbeat_at, 1),
            "stale_because": holder.stale_because(now, host=socket.gethostname())}


def describe_lease(holder: Holder | None) -> str:
    """The lease for a listing: its holder, and whether it is gone (a dead pid on this host, a
    stale or impossible heartbeat); the next job takes such a lease over."""
    if holder is None:
        return "none (no job is writing this run)"
    now = time.time()
    gone = holder.stale_because(now, host=socket.gethostname())
    return holder.describe(now) + (f"; holder gone: {gone} (the next job takes the lease over)" if gone else "")


def manifest(run: Run, m: Manifest, e: dict[str, Any]) -> None:
    """``inspect``'s lines for a checkpoint of ours: ``m`` and its validated expectation ``e``."""
    _manifest_header(run, m)
    nb = e.get("next_batch")
    if nb:
        ids = nb["ids"]
        first = ", ".join(map(str, ids[:8])) + (", ..." if len(ids) > 8 else "")
        click.echo(f"  next batch    {nb['samples']} samples [{first}] digest {nb['digest']}")
    else:
        click.echo("  next batch    none (end of data)")
    for i, lrs in enumerate(e.get("lr_ahead", [])):
        click.echo(f"  lr +{i:<9d}{lrs}")
    click.echo(f"  optimizers    steps {e.get('optimizer_steps')}")
    for name, entry in sorted((e.get("state_shown") or {}).items()):
        values = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"
                           for k, v in (entry.get("values") or {}).items())
        click.echo(f"  state         {name}: {entry.get('kind')}" + (f", {values}" if values else ""))
    if m.origin is not None:
        o = m.origin
        click.echo(f"  origin        warm start from {o.get('source')} step {o.get('step')} ({o.get('kind')}, manifest "
                   f"{o.get('manifest_checksum')}, loaded {', '.join(map(str, o.get('loaded') or []))}) at {o.get('at')}")
    scales = (m.expectation.get("megatron") or {}).get("loss_scale")
    for i, row in enumerate(scales if isinstance(scales, list) else []):
        if isinstance(row, dict) and row:  # Megatron's fp16 loss scaler, per (chained) optimizer
            click.echo(f"  loss scale    optimizer {i}: " + ", ".join(f"{k} {v:g}" if isinstance(v, float)
                                                                    else f"{k} {v}" for k, v in row.items()))
    click.echo(f"  files         {len(m.files)}, {human_bytes(m.total_bytes)}")
    for rel, entry in sorted(m.files.items()):
        click.echo(f"    {rel:<28} {entry.size:>12}  {entry.checksum}")


def _manifest_header(run: Run, m: Manifest) -> None:
    s = m.train_state
    click.echo(f"{run.dirname(m.step)}  ({run.storage.url(run.dirname(m.step))})")
    adopted = (m.expectation.get("megatron") or {}).get("adopted")
    if isinstance(adopted, dict):  # a framework's own save recorded afterwards (resume megatron adopt)
        click.echo(f"  written by    {m.adapter}, adopted at {shown(adopted.get('at'))} by "
                   f"{shown(adopted.get('by'))} (not recorded: {shown(adopted.get('not_recorded'))})")
    else:
        click.echo(f"  written by    {m.adapter} at {m.created_at}")
    click.echo(f"  counters      iteration {s.iteration}, samples read {s.samples_read}"
               + (f" ({s.samples_skipped} of them skipped by a rewind)" if s.samples_skipped else "")
               + f", updates {s.updates_successful} successful / {s.updates_skipped} skipped")
    framework = run.layout.framework_counters(run, CheckResult(step=m.step, manifest=m))
    if framework:
        click.echo(f"  {run.layout.name:<13} " + counter_list(framework))
    click.echo(f"  config        {json.dumps(m.config, sort_keys=True)}")
    topology = {k: v for k, v in m.topology.items() if k != "layout"}  # the layout has lines of its own
    click.echo(f"  topology      {json.dumps(topology, sort_keys=True)}")
    for line in layout_lines(m.topology, source=run.storage.url(run.manifest_path(m.step))):
        click.echo(line)
    click.echo(f"  user          {json.dumps(m.user, sort_keys=True) if m.user else 'none'}")
    click.echo("  complete      " + ("yes (the run's last checkpoint)" if m.complete else "no"))
    if m.stragglers is not None:  # measured since the previous save (resume.stragglers)
        click.echo(f"  stragglers    {describe(m.stragglers)}")
    j = m.journal
    click.echo("  journal       " + (f"{j.get('records')} records up to iteration {j['step']} sealed in {j['segment']} "
                                     f"({j['checksum']})" if j else "none"))
    for rw in m.rewinds:
        click.echo(f"  rewind {rw['n']:<6} to step {rw['to']} from {shown(rw.get('from'))} at {shown(rw.get('time'))}: "
                   f"{shown(rw.get('reason'))}; skipped {rw.get('skips') or 'nothing'}; accepted "
                   f"{rw.get('accept') or 'nothing'}")
    click.echo(f"  changes       {len(m.changes) or 'none'}")
    for change in m.changes:
        item = change["item"] if change["item"].isprintable() else shown(change["item"])
        click.echo(f"    step {change['step']:<8} {item}: {shown(change['from'])} -> {shown(change['to'])}")


def framework_save(run: Run, r: CheckResult, as_json: bool) -> None:
    """``inspect`` of a framework's own save without our manifest: what its files give."""
    f = r.framework
    assert f is not None
    if as_json:
        emit_json({"step": r.step, "status": r.status, "train_state": f.counters,
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
        click.echo(f"  {run.layout.name:<13} " + counter_list(f.framework_counters))
    if f.checked:
        click.echo(f"  checked       {f.checked}")


_PLACEMENT_KINDS = 4
"""Placement kinds named on ``inspect``'s layout line (the most common; ``--json`` has them all)."""


def printable(text: str) -> str:
    """``text`` as is when printable, else quoted as JSON: names come from an untrusted manifest."""
    return text if text.isprintable() else json.dumps(text)


def layout_text(layout: ParallelLayout) -> str:
    """``DP2 (shard 2) on 2 ranks (read); placements: Shard(0) over dp=2 x 12; pipeline: 1 stage``."""
    kinds = sorted(layout.placements.items(), key=lambda kv: (-kv[1], kv[0]))
    placed = ", ".join(f"{printable(kind)} x {n}" for kind, n in kinds[:_PLACEMENT_KINDS])
    if len(kinds) > _PLACEMENT_KINDS:
        placed += f", {len(kinds) - _PLACEMENT_KINDS} more kinds"
    stages = len(layout.stages)
    return (f"{printable(layout.describe())} ({printable(layout.how)}); placements: {placed or 'none'}; "
            f"pipeline: {stages} stage{'s' if stages != 1 else ''}")


def layout_lines(topology: dict, *, source: str, indent: str = "  ", label: str = "layout") -> list[str]:
    """``inspect``'s lines for a manifest's layout: the layout, each pipeline stage's first and
    last state names (when there are several), and what the checkpoint cannot be restored at
    another value of (``fixed``)."""
    if "layout" not in topology:
        return [f"{indent}{label:<14}not recorded (written before layouts were recorded)"]
    layout = ParallelLayout.from_dict(topology["layout"], source=source)
    lines = [f"{indent}{label:<14}{layout_text(layout)}"]
    if len(layout.stages) > 1:
        ranks = [0] * len(layout.stages)
        for stage, count in layout.rank_stage:
            ranks[stage] += count
        for i, (stage, n) in enumerate(zip(layout.stages, ranks)):
            lines.append(f"{indent}  {f'stage {i}':<12}{printable(stage.describe())} on {n} "
                         f"rank{'s' if n != 1 else ''}")
    for degree, why in sorted(layout.fixed.items()):
        what = "any change" if degree == "*" else printable(degree)
        lines.append(f"{indent}  {'fixed':<12}{what}: {printable(why)}")
    return lines
