"""The rewind: back to a committed checkpoint past a loss spike, with declared changes, nothing lost.

    plan = plan_rewind(run, to=1000, skips=[(2_304_000, 2_311_680)], accept=["lr"], reason="spike at 1203")
    record = apply_rewind(run, plan)

``plan_rewind`` checks everything first and changes nothing: ``to`` is a committed checkpoint,
each skip lies in data the run has read beyond it (from its sample position to the furthest
position any checkpoint or journal record reached), the accepted names parse, Megatron's data
cannot skip. ``apply_rewind`` (under the run's lease: a job holding it refuses the rewind) writes
``rewinds/rewind-<n>.json`` with ``done: false``, moves every checkpoint after ``to`` and the
journal segments sealed after it to ``abandoned/rewind-<n>/`` (nothing is deleted; ``ls`` lists
them; no restore or retention sees them there), points the run's pointer at ``to`` and sets
``done: true``. An interrupted rewind is refused by the restore until ``resume rewind`` is run
again with the same ``--to`` (it finishes the moves).

The next restore takes ``to`` and applies the newest rewind whose ``to`` it is and that its
manifest does not carry yet: the accepted names join the run's ``accept_changes``, the skips
reach the loader (``Adapter.skip_samples``) and the counters (``TrainState.samples_skipped``),
and the continuity check expects exactly that break (``expect_next``: the ids the abandoned
branch's journal recorded for the batch after the skip). Every later manifest carries the rewind
(``rewinds``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
from dataclasses import dataclass, field
from typing import Any

from .changes import AcceptChanges
from .errors import CheckpointNotFoundError, ContinuityError, ManifestError, ResumeError, UsageError
from .journal import JOURNAL_DIR
from .lease import Lease
from .manifest import Manifest
from .run import Run, utc_now
from .skips import Skips
from .storage import SMALL_FILE_CAP, join
from .text import clip, parse_json, short

__all__ = ["ABANDONED_DIR", "REWINDS_DIR", "RewindPlan", "RewindRefused", "abandoned_branches", "apply_rewind",
           "carried", "check_rewind", "expect_declared_break", "pending_rewind", "plan_rewind", "read_rewinds"]

log = logging.getLogger("resume")

REWINDS_DIR = "rewinds"
ABANDONED_DIR = "abandoned"
SCHEMA = "resume.rewind"
_NAME = re.compile(r"^rewind-(\d{4,})\.json$")
_REASON_CAP = 1000
_MOVABLE = re.compile(r"^([A-Za-z0-9_.-]+|journal/[A-Za-z0-9_.-]+)$")
"""What a rewind moves: a step directory (any layout's) or a journal file; never a path out."""


class RewindRefused(ResumeError, RuntimeError):
    """A rewind that cannot be done as asked (exit 1); nothing was changed."""


def _record_name(n: int) -> str:
    return join(REWINDS_DIR, f"rewind-{n:04d}.json")


def branch_dir(n: int) -> str:
    return join(ABANDONED_DIR, f"rewind-{n:04d}")


def check_rewind(record: Any, *, source: str) -> dict:
    """A rewind record's shape (ManifestError naming the field): every later manifest carries it."""
    def bad(name: str, expected: str) -> ManifestError:
        value = record.get(name) if isinstance(record, dict) else record
        return ManifestError(f"{source}: {name}: expected {expected}, actual {short(value)}")
    if not isinstance(record, dict):
        raise bad("rewind", "an object")
    for name in ("n", "to"):
        if type(record.get(name)) is not int or record[name] < 0:
            raise bad(name, "a non-negative integer")
    try:
        Skips(record.get("skips", []))
    except (ValueError, TypeError) as e:
        raise bad("skips", f"a list of [start, end) sample ranges ({e})") from e
    if not isinstance(record.get("accept", []), list) or not all(isinstance(a, str) for a in record.get("accept", [])):
        raise bad("accept", "a list of names")
    if not isinstance(record.get("reason", ""), str):
        raise bad("reason", "text")
    expect = record.get("expect_next")
    if expect is not None and not (isinstance(expect, dict) and type(expect.get("at")) is int
                                   and isinstance(expect.get("ids"), list)
                                   and all(type(i) is int for i in expect["ids"])):
        raise bad("expect_next", "null or {at, ids}")
    if not isinstance(record.get("done", True), bool):
        raise bad("done", "true or false")
    for name in ("moved", "returned"):
        names = record.get(name, [])
        if not isinstance(names, list) or not all(isinstance(x, str) and _MOVABLE.match(x)
                                                  and not {".", ".."} & set(x.split("/")) for x in names):
            raise bad(name, "a list of step directories and journal files")
    if record.get("from_branch") is not None and type(record["from_branch"]) is not int:
        raise bad("from_branch", "null or a rewind's number")
    if record.get("branch", branch_dir(record["n"])) != branch_dir(record["n"]):
        raise bad("branch", repr(branch_dir(record["n"])))
    return record


def read_rewinds(run: Run) -> list[dict]:
    """Every rewind record of the run, oldest first, checked (ManifestError naming the file)."""
    try:
        names = run.storage.listdir(REWINDS_DIR)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in names:
        m = _NAME.match(name)
        if not m:
            continue
        path = join(REWINDS_DIR, name)
        source = run.storage.url(path)
        try:
            record = parse_json(run.storage.read_bytes(path, limit=SMALL_FILE_CAP))
        except ValueError as e:
            raise ManifestError(f"{source}: expected a rewind record, actual {clip(str(e), 120)}") from e
        record = check_rewind(record, source=source)
        if record["n"] != int(m.group(1)):
            raise ManifestError(f"{source}: n: expected {int(m.group(1))} (the file's), actual {record['n']}")
        out.append(record)
    return sorted(out, key=lambda r: r["n"])


def pending_rewind(run: Run, manifest: Manifest) -> dict | None:
    """The rewind the restore of ``manifest`` applies: the newest one, when its ``to`` is this
    checkpoint and the manifest does not carry it yet. An interrupted rewind is refused."""
    records = read_rewinds(run)
    if not records:
        return None
    newest = records[-1]
    if not newest.get("done", True):
        raise RewindRefused(f"{run.storage.url(_record_name(newest['n']))}: done: expected true, actual false "
                            f"(a rewind to step {newest['to']} was interrupted: run `resume rewind {run.url} "
                            f"--to {newest['to']} ...` again to finish it)")
    carried = {r.get("n") for r in manifest.rewinds}
    if newest["to"] != manifest.step or newest["n"] in carried:
        return None
    return newest


@dataclass
class RewindPlan:
    to: Manifest
    n: int
    skips: Skips
    accept: list[str]
    reason: str
    moves: list[str] = field(default_factory=list)
    """Names (step directories, journal segments) that go to the abandoned branch."""
    newest: int | None = None
    journal: dict | None = None
    """The abandoned line's newest journal entry (to read its records later)."""
    expect_next: dict | None = None
    resumed: dict | None = None
    """An interrupted record with the same ``to``, finished instead of a new one."""
    source: dict | None = None
    """With ``--branch``: the rewind whose abandoned branch holds ``to``."""
    returns: list[str] = field(default_factory=list)
    """With ``--branch``: names in that branch that come back to the main line."""

    def record(self) -> dict:
        return {"schema": SCHEMA, "n": self.n, "to": self.to.step, "from": self.newest,
                "from_branch": self.source["n"] if self.source is not None else None,
                "skips": self.skips.to_list(), "accept": self.accept, "reason": self.reason,
                "time": utc_now(), "branch": branch_dir(self.n), "moved": list(self.moves),
                "returned": list(self.returns), "journal": self.journal, "expect_next": self.expect_next,
                "done": False}


def plan_rewind(run: Run, *, to: int, skips: list[tuple[int, int]] = (), accept: list[str] = (),
                reason: str, journal_records: list[dict] | None = None, branch: int | None = None) -> RewindPlan:
    """Everything checked, nothing changed (see the module). ``journal_records``: the run's
    update records (``resume journal``'s), to find the ids of the batch after a skip. ``branch``:
    ``to`` is a checkpoint of that rewind's abandoned branch, which becomes the main line again
    up to ``to`` (the main line after the branch's fork point becomes a new abandoned branch)."""
    if not reason or not reason.strip():
        raise UsageError("--reason: expected why the run is rewound (it is recorded), actual nothing")
    AcceptChanges.parse(list(accept), env={})
    records = read_rewinds(run)
    n = records[-1]["n"] + 1 if records else 1
    resumed = records[-1] if records and not records[-1].get("done", True) else None
    if resumed is not None:
        if resumed["to"] != to or resumed.get("from_branch") != branch:
            raise RewindRefused(f"{run.storage.url(_record_name(resumed['n']))}: to: an interrupted rewind to "
                                f"{resumed['to']} must be finished first (run it again), actual --to {to}")
        n = resumed["n"]
    source = _source_branch(run, records, branch)
    home = run if source is None else Run.open(run.storage.url(source["branch"]), layout=run.layout)
    manifest = _committed(home, to)
    fork = to if source is None else source["to"]
    later = [s for s in run.step_dirs() if s > fork]
    plan = RewindPlan(to=manifest, n=n, skips=Skips(skips), accept=list(accept), reason=reason.strip()[:_REASON_CAP],
                      resumed=resumed, newest=later[-1] if later else to, source=source)
    _check_skips(home, plan, [s for s in home.step_dirs() if s > to], journal_records or [])
    plan.moves = [run.dirname(s) for s in later] + _segments_after(run, fork)
    if source is not None:
        plan.returns = [home.dirname(s) for s in home.step_dirs() if s <= to] + [
            rel for rel in _segments_after(home, fork) if _sealed_step(rel) is not None and _sealed_step(rel) <= to]
    plan.journal = _newest_entry(run, later)
    return plan


def _source_branch(run: Run, records: list[dict], branch: int | None) -> dict | None:
    if branch is None:
        return None
    source = next((r for r in records if r["n"] == branch), None)
    if source is None:
        raise CheckpointNotFoundError(f"{run.storage.url(REWINDS_DIR)}: --branch: expected one of the rewinds "
                                      f"{[r['n'] for r in records]}, actual {branch}")
    return source


def _committed(home: Run, to: int) -> Manifest:
    result = home.check(to)
    if result.manifest is None and not result.has_manifest and to not in home.step_dirs():
        raise CheckpointNotFoundError(f"{home.storage.url(home.dirname(to))}: --to: expected a committed checkpoint, "
                                      f"actual no such step (committed: {home.committed_steps()[-8:]})")
    if not result.committed:
        raise RewindRefused(f"{home.storage.url(home.dirname(to))}: --to: expected a committed checkpoint, "
                            f"actual {result.status}: {clip(result.reason, 300)}")
    assert result.manifest is not None
    return result.manifest


def _sealed_step(rel: str) -> int | None:
    m = re.match(r"^journal/sealed-(\d{9,})\.jsonl$", rel)
    return int(m.group(1)) if m else None


def _check_skips(run: Run, plan: RewindPlan, later: list[int], records: list[dict]) -> None:
    """Each skip lies in data the run read after ``to``; Megatron's data position cannot skip."""
    if not plan.skips:
        return
    manifest = plan.to
    if manifest.adapter.startswith("megatron"):
        raise RewindRefused(
            f"{run.storage.url(run.manifest_path(manifest.step))}: --skip-samples: expected an adapter whose "
            f"data can skip exactly, actual {manifest.adapter}: Megatron's data position is consumed_train_samples, "
            "which its schedules and its own checks also take as iteration x global batch, so it cannot pass "
            "over samples without breaking them; rewind without a skip (e.g. --accept lr), or remove the "
            "samples from the dataset's index and restart with the change accepted")
    position = manifest.train_state.samples_read
    furthest = position
    for step in later:
        try:
            furthest = max(furthest, run.read_manifest(step).train_state.samples_read)
        except (OSError, ResumeError):
            continue
    for r in records:
        if r.get("it", 0) > manifest.step and type(r.get("at")) is int and type(r.get("n")) is int:
            furthest = max(furthest, r["at"] + r["n"])
    carried = Skips([tuple(s) for rw in manifest.rewinds for s in rw.get("skips", [])])
    for start, end in plan.skips.ranges:
        if start < position or end > furthest:
            raise RewindRefused(
                f"{run.storage.url(run.manifest_path(manifest.step))}: --skip-samples {start}:{end}: expected a "
                f"range of samples the run read after step {manifest.step}, i.e. within [{position}, {furthest}) "
                f"(samples_read at the checkpoint, the furthest any checkpoint or journal record reached), "
                f"actual outside it")
        if carried.overlaps(start, end):
            raise RewindRefused(f"--skip-samples {start}:{end}: expected samples not skipped already, "
                                f"actual overlapping {carried.to_list()}")
    plan.expect_next = _expect_next(plan, records)


def _expect_next(plan: RewindPlan, records: list[dict]) -> dict | None:
    """Where the first batch after the rewind starts and, when a record of the abandoned line
    read a batch there, its ids: the continuity check compares them."""
    manifest = plan.to
    gbs = manifest.config.get("global_batch")
    if not isinstance(gbs, int) or gbs < 1:
        return None
    carried = Skips([tuple(s) for rw in manifest.rewinds for s in rw.get("skips", [])] +
                    list(plan.skips.ranges))
    first, _, passed = carried.take(manifest.train_state.samples_read, gbs)
    if not passed:
        return None  # the next batch is the recorded one: compared as always
    ids = next((r.get("ids") for r in records if r.get("at") == first and isinstance(r.get("ids"), list)), None)
    return {"at": first, "ids": [i for i in (ids or []) if type(i) is int]}


def carried(rewind: dict) -> dict:
    """What every later manifest keeps of a rewind (its record less the bookkeeping)."""
    return {k: rewind[k] for k in ("n", "to", "from", "skips", "accept", "reason", "time") if k in rewind}


def expect_declared_break(expected: Any, actual: Any, rewind: dict) -> None:
    """Rank 0, at the restore that applies ``rewind``: when its skip moves the next batch, the live
    next batch must not be the recorded one and, where the abandoned branch's journal recorded the
    batch at the new position, must hold its ids; it then stands for the recorded one. A skip
    that starts later leaves the next batch as recorded (``compare`` checks it)."""
    nxt = rewind.get("expect_next")
    if not nxt:
        return
    recorded, live = expected.next_batch, actual.next_batch
    label = f"rewind {rewind['n']} skipping samples {rewind.get('skips')}"
    if live is not None and recorded is not None and live.get("ids") == recorded.get("ids") \
            and live.get("digest") == recorded.get("digest"):
        raise ContinuityError("next_batch", f"the batch at sample {nxt['at']} ({label})",
                              "the batch recorded at the checkpoint", "the loader did not pass over the skipped samples")
    if nxt.get("ids"):
        have = set(live.get("ids", [])) if live is not None else set()
        missing = [i for i in nxt["ids"] if i not in have]
        if missing:
            raise ContinuityError("next_batch.ids", f"ids {short(nxt['ids'], 80)} (the batch the run read at sample "
                                  f"{nxt['at']}, {label})", short(sorted(have), 80),
                                  "the first batch after the skip is not the one the run read there")
    expected.next_batch = live


def _segments_after(run: Run, to: int) -> list[str]:
    try:
        names = run.storage.listdir(JOURNAL_DIR)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in sorted(names):
        m = re.match(r"^sealed-(\d{9,})\.jsonl$", name)
        if (m and int(m.group(1)) > to) or name.startswith(("open-", "lost-after-")):
            out.append(join(JOURNAL_DIR, name))
    return out


def _newest_entry(run: Run, later: list[int]) -> dict | None:
    for step in reversed(later):
        try:
            return run.read_manifest(step).journal
        except (OSError, ResumeError):
            continue
    return None


def apply_rewind(run: Run, plan: RewindPlan, *, lease_ttl_s: float = 600.0) -> dict:
    """Under the run's lease: record, move, point, done. Returns the record."""
    lease = Lease(run.storage, ttl_s=lease_ttl_s, job_id=f"resume-rewind:{socket.gethostname()}:{os.getpid()}")
    lease.acquire()  # RunBusyError (exit 1) while a job holds the run
    try:
        # An interrupted rewind finishes the moves it recorded (some are done: they are passed).
        record = dict(plan.resumed) if plan.resumed is not None else plan.record()
        name = _record_name(plan.n)
        run.storage.makedirs(REWINDS_DIR)
        run.storage.write_bytes_atomic(name, _dump(record))
        for rel in record["moved"]:  # the main line after the fork: out first
            _move(run, rel, join(record["branch"], rel))
        if record.get("from_branch") is not None:
            source = branch_dir(record["from_branch"])
            for rel in record.get("returned", []):  # then the branch's checkpoints up to --to: back in
                _move(run, join(source, rel), rel)
        if run.layout.latest:
            run.point_latest(plan.to.step)
        else:  # the framework's own pointer (Megatron's tracker file) names the checkpoint restored
            run.storage.write_bytes_atomic(run.layout.pointer, str(plan.to.step).encode())
        record["done"] = True
        run.storage.write_bytes_atomic(name, _dump(record))
        log.warning("resume: %s: rewound to %s (%s); %d entries moved to %s", run.url, run.dirname(plan.to.step),
                    record["reason"], len(record["moved"]), run.storage.url(record["branch"]))
        return record
    finally:
        lease.release()


def _move(run: Run, source: str, target: str) -> None:
    """``source`` to ``target`` unless done already; never over something there."""
    if run.storage.exists(source) and not run.storage.exists(target):
        if "/" in target:
            run.storage.makedirs(target.rsplit("/", 1)[0])
        run.storage.rename(source, target)


def _dump(record: dict) -> bytes:
    return (json.dumps(record, indent=1, allow_nan=False) + "\n").encode()


def abandoned_branches(run: Run) -> list[tuple[str, str, dict | None, int, list[int]]]:
    """(name, directory, its newest journal entry, the step it left the main line at, the steps in
    it) of each rewind's branch."""
    out = []
    for record in read_rewinds(run):
        directory = record.get("branch") or branch_dir(record["n"])
        steps = []
        try:
            names = run.storage.listdir(directory)
        except (FileNotFoundError, NotADirectoryError):
            names = []
        for name in names:
            step = run.layout.parse(name)
            if step is not None:
                steps.append(step)
        out.append((f"rewind {record['n']}", directory, record.get("journal"), record["to"], sorted(steps)))
    return out


