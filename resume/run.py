"""The run directory: checkpoints, the one commit check, discovery, retention.

Layout of a run (local path or fsspec URL)::

    run.json                 identity: config fingerprint, schedule, layout
    LATEST                   a hint only; discovery trusts manifests
    control/                 save requests from outside (resume save, the Slurm hook)
    step-000000200/
        manifest.json        the commit record, written last
        ...                  the adapter's shards and per-rank state

A framework's own save directory can be a run too, in that framework's layout
(another directory name, our manifest under another name beside its files, its
own pointer instead of our ``LATEST``). The adapter that knows the framework
defines the ``RunLayout`` and registers it (``register_layout``); the core
knows only ours, and ``detect_layout`` asks each registered layout whether a
directory is its own.

``check`` is the only definition of "committed": the manifest parses and is
valid (its counters consistent), every file it lists is present with the right
size (``deep`` adds the checksums), and the step directory holds nothing else.
Discovery, restore, ``ls``, ``verify`` and retention all use it.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from . import faults
from .checksum import checksum_file
from .errors import (
    CheckpointNotFoundError,
    InvariantError,
    ManifestError,
    NoValidCheckpointError,
    RunNotFoundError,
    StorageError,
    UnsafePathError,
)
from .manifest import MANIFEST_NAME, Manifest
from .policy import KeepPolicy
from .storage import MANIFEST_CAP, SMALL_FILE_CAP, Storage, is_damage, join, open_storage
from .text import parse_json, short

__all__ = ["RESUME_LAYOUT", "CheckResult", "FrameworkSave", "KeepPolicy", "Run", "RunLayout", "detect_layout",
           "parse_step_dirname", "register_layout", "step_dirname"]

log = logging.getLogger("resume")

STEP_RE = re.compile(r"^step-(\d{9,})$")
RUN_INFO = "run.json"
LATEST = "LATEST"
CONTROL = "control"


def step_dirname(step: int) -> str:
    return f"step-{step:09d}"


def parse_step_dirname(name: str) -> int | None:
    m = STEP_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True, slots=True)
class RunLayout:
    """How checkpoint directories and their manifests are named in a run, and what the
    framework that owns the layout adds to ``resume verify`` and ``resume ls``.

    Ours is ``RESUME_LAYOUT``. An adapter whose framework keeps its own save directory
    subclasses this, overrides the hooks and registers it (``register_layout``). The
    hooks never raise for a bad checkpoint: they list its problems.
    """

    name: str
    pattern: re.Pattern
    """Matches a checkpoint directory's name; group 1 is the step."""
    dir_format: str
    manifest_name: str
    latest: str | None
    """Our LATEST hint, written at each commit; None where the framework keeps its own pointer."""
    pointer: str
    """The file naming the newest checkpoint: our LATEST, or the framework's own pointer."""

    def dirname(self, step: int) -> str:
        return self.dir_format.format(step)

    def parse(self, name: str) -> int | None:
        m = self.pattern.match(name)
        return int(m.group(1)) if m else None

    def claims(self, storage: Storage) -> bool:
        """Whether the existing directory ``storage`` is in this layout (``detect_layout``)."""
        return False

    def extra_problems(self, run: Run, result: CheckResult) -> list[str]:
        """What the framework's own state of a committed checkpoint says against its manifest."""
        return []

    def pointer_problems(self, run: Run, results: list[CheckResult], *, whole_run: bool) -> list[str]:
        """The framework's own pointer (``whole_run``: every step directory was checked, not one
        asked for) and step directories the framework wrote in a form we cannot read."""
        return []

    def framework_save(self, run: Run, step: int, *, deep: bool = False,
                       progress: Callable[[int], None] | None = None) -> FrameworkSave | None:
        """A step directory without our manifest, as the framework's own files describe it
        (``ls``, ``verify``, ``inspect``); None where the framework keeps no state of its own."""
        return None

    def framework_counters(self, run: Run, result: CheckResult) -> dict | None:
        """The framework's own counters of a committed checkpoint (e.g. Megatron's sample
        counters), for ``ls`` and ``inspect``; None where it keeps none."""
        return None


RESUME_LAYOUT = RunLayout("resume", STEP_RE, "step-{:09d}", MANIFEST_NAME, latest=LATEST, pointer=LATEST)

_REGISTERED: dict[str, RunLayout] = {}


def register_layout(layout: RunLayout) -> RunLayout:
    """Let ``detect_layout`` recognise another layout's directories (by name: registering
    again replaces). An adapter registers its layout when its module is imported; the top
    layers (the CLI, the Slurm hook) import those modules, the core never does."""
    _REGISTERED[layout.name] = layout
    return layout


def detect_layout(storage: Storage) -> RunLayout:
    """The registered layout that claims the directory, else ours."""
    if storage.isdir(""):
        for layout in _REGISTERED.values():
            if layout.claims(storage):
                return layout
    return RESUME_LAYOUT


class _Unreadable(Exception):
    """A listing storage refused (not damage)."""


def _can_heal(e: BaseException) -> bool:
    """Storage trouble that may pass (EIO, timeouts, 5xx, access denied): restore stops and
    says "try again". Everything else read from a checkpoint is damage: restore falls back."""
    return isinstance(e, OSError) and not is_damage(e)


def _problem(source: str, expected: str, e: BaseException) -> str:
    """A problem line for an error met reading ``source``; the error's own message is capped,
    as it may quote what it read."""
    if isinstance(e, UnsafePathError):
        return str(e)
    message = "".join(c if c.isprintable() else "?" for c in str(e)[:200])
    return f"{source}: expected {expected}, actual {type(e).__name__}: {message}"


def utc_now(timespec: str = "seconds") -> str:
    """Now, in UTC, ISO 8601 (``timespec="milliseconds"`` for event logs)."""
    return _dt.datetime.now(_dt.UTC).isoformat(timespec=timespec)


@dataclass
class FrameworkSave:
    """A step directory without our manifest that the layout's framework wrote (a Megatron save
    made before ``resume`` was installed), as the framework's own files describe it."""

    status: str
    """'unrecorded' (sound as far as the framework's files tell), 'broken' (problems, each naming
    its file) or 'uncommitted' (the framework itself never finished it)."""
    problems: list[str] = field(default_factory=list)
    counters: dict | None = None
    """iteration, samples_read, updates_successful, updates_skipped (None: unknown) and
    ``unknown``, why; None when the framework's state could not be read."""
    framework_counters: dict = field(default_factory=dict)
    checked: str = ""
    """What was checked, and what such a check cannot catch."""
    reason: str = ""
    """Why it is uncommitted."""


@dataclass
class CheckResult:
    """The outcome of the commit check for one step directory."""

    step: int
    manifest: Manifest | None = None
    problems: list[str] = field(default_factory=list)
    deep: bool = False
    has_manifest: bool = True
    """False when the step directory has no manifest at all: a save that never
    finished. Not committed, but not damage either; a manifest that exists and
    is invalid, or lists files that are wrong, is damage."""
    unreadable: bool = False
    """True when storage refused a read (EIO, EACCES, a timeout, an outage): that says nothing
    about the checkpoint, so restore must not pass over it or move it aside for that. A link,
    a FIFO or device, a directory, a loop or an over-long name where a checkpoint's file or
    directory should be is damage instead (``storage.is_damage``): a problem, not this."""

    @property
    def committed(self) -> bool:
        return self.manifest is not None and not self.problems

    @property
    def reason(self) -> str:
        return "; ".join(self.problems)

    framework: FrameworkSave | None = None
    """For a step directory without our manifest: what the layout's framework says of it
    (set by the CLI through ``RunLayout.framework_save``; discovery never reads it)."""

    @property
    def status(self) -> str:
        """'committed'; 'broken' (a manifest that fails, or a framework's save with problems);
        'unrecorded' (the framework's own save, sound, no manifest of ours); 'uncommitted'."""
        if self.committed:
            return "committed"
        if self.has_manifest:
            return "broken"
        return self.framework.status if self.framework is not None else "uncommitted"

    def examine_framework(self, run: Run, *, deep: bool = False,
                          progress: Callable[[int], None] | None = None) -> None:
        """For a step directory without any manifest: ask the layout's framework about it; its
        problems (or why it is uncommitted) become this result's."""
        if self.has_manifest or self.unreadable:
            return
        self.framework = run.layout.framework_save(run, self.step, deep=deep, progress=progress)
        if self.framework is not None:
            self.problems = list(self.framework.problems) or (
                [self.framework.reason] if self.framework.status == "uncommitted" else [])


class _Sizes:
    """File sizes of a step directory from one listing per directory, not one stat per file.
    A name the listing does not show as a regular file is asked for alone: ``size`` raises
    what it is (missing, a link, a FIFO, a directory)."""

    def __init__(self, storage: Storage, step_dir: str) -> None:
        self.storage = storage
        self.step_dir = step_dir
        self._listed: dict[str, dict[str, int] | None] = {}

    def size(self, rel: str) -> int:
        parent, _, name = rel.rpartition("/")
        if parent not in self._listed:
            try:
                self._listed[parent] = self.storage.sizes(join(self.step_dir, parent) if parent else self.step_dir)
            except (OSError, ValueError, AttributeError):  # asked one by one below: the error is the file's
                self._listed[parent] = None
        known = self._listed[parent]
        if known is not None and name in known:
            return known[name]
        return self.storage.size(join(self.step_dir, rel))


class Run:
    """One training run's home."""

    def __init__(self, storage: Storage, layout: RunLayout = RESUME_LAYOUT) -> None:
        self.storage = storage
        self.layout = layout
        self._parsed: dict[int, tuple[bytes, Manifest]] = {}
        """Retention's manifests by step, with the bytes they were parsed from."""

    @property
    def url(self) -> str:
        return self.storage.root

    @classmethod
    def open(cls, url: str, *, create: bool = False, layout: RunLayout | None = None) -> Run:
        """Open a run; ``RunNotFoundError`` (exit 3) if it does not exist and ``create`` is false.

        Without ``layout`` it is detected: a registered layout that claims the directory
        (a framework's own save directory), else ours.
        """
        storage = open_storage(url)
        run = cls(storage, layout or detect_layout(storage))
        if create:
            run.ensure_exists()
        elif not run.storage.isdir(""):
            actual = "not a directory" if run.storage.exists("") else "missing"
            raise RunNotFoundError(f"{url}: run directory: expected an existing directory, actual {actual}")
        return run

    def ensure_exists(self) -> None:
        """Create the run directory (rank 0, at start); a file in its place is an error."""
        if self.storage.exists("") and not self.storage.isdir(""):
            raise RunNotFoundError(f"{self.url}: run directory: expected a directory, actual a file")
        self.storage.makedirs("")

    # -- listing ---------------------------------------------------------------

    def step_dirs(self) -> list[int]:
        """Every step directory, committed or not, ascending."""
        steps = []
        for name in self.storage.listdir(""):
            step = self.layout.parse(name)
            if step is not None:
                steps.append(step)
        return sorted(steps)

    def dirname(self, step: int) -> str:
        return self.layout.dirname(step)

    def step_path(self, step: int, *parts: str) -> str:
        return join(self.dirname(step), *parts)

    def manifest_path(self, step: int) -> str:
        return self.step_path(step, self.layout.manifest_name)

    # -- the commit check -------------------------------------------------------

    def read_manifest(self, step: int, *, reuse: bool = False) -> Manifest:
        """The step's manifest, parsed and validated. ``reuse``: a manifest parsed before from the
        very same bytes is returned, not parsed again; the caller must not change it (retention
        reads the kept manifests at every commit)."""
        path = self.manifest_path(step)
        source = self.storage.url(path)
        try:
            text = self.storage.read_bytes(path, limit=MANIFEST_CAP)
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(f"{source}: expected a manifest, actual missing "
                                          "(step not committed)") from e
        if reuse and (hit := self._parsed.get(step)) is not None and hit[0] == text:
            return hit[1]
        manifest = Manifest.from_json(text, source=source)
        if manifest.step != step:
            raise ManifestError(f"{source}: step: expected {step} (the directory's), "
                                f"actual {manifest.step}")
        if reuse:
            self._parsed[step] = (bytes(text), manifest)
        return manifest

    def check(self, step: int, *, deep: bool = False, progress: Callable[[int], None] | None = None,
              reuse: bool = False) -> CheckResult:
        """The commit check. Never raises for a bad checkpoint: problems are listed. ``reuse``:
        see ``read_manifest`` (the files are checked all the same)."""
        result = CheckResult(step=step, deep=deep)
        try:
            result.manifest = self.read_manifest(step, reuse=reuse)
        except CheckpointNotFoundError:
            result.has_manifest = False
            result.problems.append(f"{self.storage.url(self.manifest_path(step))}: "
                                   "missing (uncommitted)")
            return result
        except ManifestError as e:
            result.problems.append(str(e))
            return result
        except (OSError, ValueError) as e:  # a link, a special file, not a directory, storage down
            _note_unreadable_manifest(self, result, e)
            return result
        result.problems.extend(_counter_problems(self, result.manifest))
        _check_files(self, result.manifest, result, progress)
        try:
            result.problems.extend(_unlisted_entries(self, result.manifest))
        except _Unreadable as e:
            result.unreadable = True
            result.problems.append(str(e))
        return result

    def verify_checksums(self, manifest: Manifest, paths: Iterable[str],
                         progress: Callable[[int], None] | None = None, *,
                         raise_unreadable: bool = False) -> list[str]:
        """Problems found reading ``paths`` (of ``manifest``) and comparing their checksums.

        The deep half of the commit check, split out so that every rank can
        verify its share of a large checkpoint. With ``raise_unreadable`` an I/O
        error propagates: storage that cannot be read says nothing about the
        checkpoint, and restore must not pass over a good one because of it.
        """
        problems = []
        for rel in paths:
            entry = manifest.files[rel]
            path = self.step_path(manifest.step, rel)
            try:
                _, checksum = checksum_file(self.storage, path, progress)
            except FileNotFoundError:
                problems.append(f"{self.storage.url(path)}: expected a file of {entry.size} bytes, "
                                "actual missing")
                continue
            except (OSError, ValueError) as e:
                if raise_unreadable and _can_heal(e):
                    raise
                problems.append(_problem(self.storage.url(path), "a readable regular file", e))
                continue
            if checksum != entry.checksum:
                problems.append(f"{self.storage.url(path)}: checksum: expected {entry.checksum}, "
                                f"actual {checksum}")
        return problems

    def is_committed(self, step: int) -> bool:
        return self.check(step).committed

    def committed_steps(self) -> list[int]:
        return [s for s in self.step_dirs() if self.is_committed(s)]

    # -- discovery ---------------------------------------------------------------

    def discover(self, *, deep: bool = False, below: int | None = None, above: int | None = None,
                 only: int | None = None) -> Iterator[CheckResult]:
        """The commit check on each step directory, newest first, one at a time: a caller stops
        at the first committed one it takes, so older checkpoints are never read.

        ``below``/``above`` bound the steps (exclusive), ``only`` picks one. A directory that
        storage refused to read raises StorageError: an outage says nothing about a
        checkpoint, and nothing may be passed over or moved aside for it.
        """
        for step in reversed(self.step_dirs()):
            if (below is not None and step >= below) or (only is not None and step != only):
                continue
            if above is not None and step <= above:
                return
            result = self.check(step, deep=deep)
            if result.unreadable:
                raise StorageError(f"{self.storage.url(self.dirname(step))}: expected readable storage, "
                                   f"actual {result.reason} (nothing passed over or moved; try again)")
            yield result

    def find_latest(self, *, deep: bool = False, below: int | None = None, above: int | None = None,
                    only: int | None = None) -> tuple[Manifest | None, list[CheckResult]]:
        """The newest committed checkpoint (within the bounds of ``discover``), falling back past
        torn or corrupt ones: (manifest or None, the newer steps passed over, with their reasons).

        The one definition of discovery; rank 0 calls it, the other ranks are told.
        """
        rejected: list[CheckResult] = []
        for result in self.discover(deep=deep, below=below, above=above, only=only):
            if result.committed:
                return result.manifest, rejected
            rejected.append(result)
        return None, rejected

    def latest_or_raise(self, *, deep: bool = False) -> Manifest:
        manifest, rejected = self.find_latest(deep=deep)
        if manifest is not None:
            return manifest
        if rejected:
            reasons = "; ".join(f"{self.dirname(r.step)}: {r.reason}" for r in rejected[:3])
            raise NoValidCheckpointError(f"{self.url}: expected a committed checkpoint among "
                                         f"{len(rejected)} step directories, actual none valid ({reasons})")
        raise CheckpointNotFoundError(f"{self.url}: expected a committed checkpoint, actual none")

    def manifest_for(self, step: int | None, *, deep: bool = False) -> Manifest:
        """The manifest of ``step`` (must be committed) or of the newest committed one."""
        if step is None:
            return self.latest_or_raise(deep=deep)
        if step not in self.step_dirs():
            raise CheckpointNotFoundError(f"{self.storage.url(self.dirname(step))}: expected a step "
                                          f"directory, actual missing (steps: {self.step_dirs()})")
        return self.read_manifest(step)

    # -- writing -----------------------------------------------------------------

    def write_manifest(self, manifest: Manifest) -> None:
        """The commit point. Written atomically, after every listed file."""
        if not manifest.created_at:
            manifest.created_at = utc_now()
        self.storage.write_bytes_atomic(self.manifest_path(manifest.step), manifest.to_json().encode())
        faults.point("save.after_manifest")
        if self.layout.latest:
            self.point_latest(manifest.step)
            faults.point("save.after_latest")

    def point_latest(self, step: int) -> None:
        """Set our LATEST hint (no-op in a layout without one)."""
        if self.layout.latest:
            self.storage.write_bytes_atomic(self.layout.latest, f"{step}\n".encode())

    def latest_hint(self) -> int | None:
        """The step the layout's pointer names: our LATEST, or the framework's own (a hint
        either way)."""
        try:
            return int(self.storage.read_bytes(self.layout.pointer, limit=SMALL_FILE_CAP).decode().strip())
        except (FileNotFoundError, ValueError, UnsafePathError):  # a link or FIFO names nothing
            return None

    def delete_step(self, step: int) -> None:
        self.storage.delete(self.dirname(step))

    def quarantine_step(self, step: int, reason: str) -> str:
        """Move a broken checkpoint out of discovery's and retention's way; never delete it.

        A name that is not ``step-…`` is ignored by discovery and retention.
        """
        name = f"quarantine-{self.dirname(step)}-{_dt.datetime.now(_dt.UTC):%Y%m%dT%H%M%S}"
        if self.storage.exists(name):  # moved aside twice within a second: never merged
            name += f"-{_dt.datetime.now(_dt.UTC):%f}"
        self.storage.rename(self.dirname(step), name)  # a link is renamed itself, never its target
        log.warning("resume: moved broken %s to %s: %s", self.dirname(step), name, reason)
        if not self.storage.isdir(name):
            return name  # a link or a file in a step's place: nothing is written through it
        try:
            self.storage.write_bytes_atomic(join(name, "QUARANTINED.txt"), (reason + "\n").encode())
        except OSError as e:
            log.warning("resume: cannot write the reason into %s: %s", name, e)
        return name

    def apply_retention(self, policy: KeepPolicy, *, just_committed: int | None = None) -> list[int]:
        """Delete old committed checkpoints per policy, only behind a newer committed one; the
        steps deleted, ascending.

        From one listing, newest first: the commit check runs until ``keep_last`` committed
        steps are found, then only on steps that may go (never on one kept forever, nor on
        ``just_committed``, the step whose commit called this). A deleted checkpoint loses its
        manifest first; leftovers without a manifest behind the newest commit are removed; a
        damaged checkpoint is left for the operator.
        """
        kept, newest, doomed, leftovers = 0, None, [], []
        listed = self.step_dirs()
        for step in reversed(listed):
            if step == just_committed:
                committed, has_manifest = True, True
            elif kept >= policy.keep_last and policy.kept_forever(step):
                committed, has_manifest = False, self.storage.exists(self.manifest_path(step))
            else:
                result = self.check(step, reuse=True)
                committed, has_manifest = result.committed, result.has_manifest
            if committed:
                if not policy.keeps(step, kept):
                    doomed.append(step)
                kept += 1
                newest = step if newest is None else newest
            elif not has_manifest and newest is not None:
                leftovers.append(step)
        for step in doomed:
            # The manifest goes first: a half-deleted checkpoint is then
            # plainly uncommitted, never a torn "committed" one.
            self.storage.delete(self.manifest_path(step))
            faults.point("retention.mid_delete")
            self.delete_step(step)
        for step in leftovers:
            if self.storage.isdir(self.dirname(step)):
                log.warning("resume: removing %s, left without a manifest", self.dirname(step))
                self.delete_step(step)
        for step in [s for s in self._parsed if s in doomed or s not in listed]:
            del self._parsed[step]
        return sorted(doomed)

    # -- run identity ---------------------------------------------------------------

    def read_info(self) -> dict | None:
        try:
            text = self.storage.read_bytes(RUN_INFO, limit=SMALL_FILE_CAP)
        except FileNotFoundError:
            return None
        source = self.storage.url(RUN_INFO)
        try:
            info = parse_json(text)
        except ValueError as e:
            raise ManifestError(f"{source}: {e}") from e
        if not isinstance(info, dict) or info.get("schema") != "resume.run":
            raise ManifestError(f"{source}: schema: expected 'resume.run', actual "
                                f"{short(info.get('schema') if isinstance(info, dict) else info)}")
        return info

    def write_info(self, info: dict) -> None:
        body = {"schema": "resume.run", "schema_version": 1, "created_at": utc_now(), **info}
        self.storage.write_bytes_atomic(RUN_INFO, (json.dumps(body, indent=1) + "\n").encode())


# -- the commit check's parts (``Run.check``) ---------------------------------------------


def _check_files(run: Run, manifest: Manifest, result: CheckResult,
                 progress: Callable[[int], None] | None) -> None:
    """Each file ``manifest`` lists: present, a regular file, the right size (and checksum when
    ``result.deep``); an error storage may heal from marks ``result`` unreadable."""
    listed = _Sizes(run.storage, run.dirname(manifest.step))

    def source(rel: str) -> str:
        return run.storage.url(run.step_path(manifest.step, rel))

    for rel, entry in sorted(manifest.files.items()):
        try:
            size = listed.size(rel)
        except FileNotFoundError:
            result.problems.append(f"{source(rel)}: expected a file of {entry.size} bytes, actual missing")
            continue
        except (OSError, ValueError) as e:
            result.unreadable = result.unreadable or _can_heal(e)
            result.problems.append(_problem(source(rel), "a readable regular file", e))
            continue
        if size != entry.size:
            result.problems.append(f"{source(rel)}: size: expected {entry.size}, actual {size}")
            continue
        if result.deep:
            result.problems.extend(run.verify_checksums(manifest, [rel], progress))


def _note_unreadable_manifest(run: Run, result: CheckResult, e: Exception) -> None:
    """Why the manifest could not be read, sorted: damage (a link, a FIFO, a directory or a
    loop where the manifest or step directory should be) is a broken checkpoint; a plain file
    with a step's name is no checkpoint at all; only storage trouble is ``unreadable``."""
    d = run.dirname(result.step)
    if isinstance(e, UnsafePathError):
        result.problems.append(str(e))
        return
    if not run.storage.isdir(d):
        result.has_manifest = False  # a stray file with a step's name: not a checkpoint
    else:
        result.unreadable = _can_heal(e)
    result.problems.append(_problem(run.storage.url(d), "a readable step directory", e))


def _counter_problems(run: Run, manifest: Manifest) -> list[str]:
    """Counters that contradict each other make the manifest invalid, so restore passes over it."""
    global_batch = manifest.config.get("global_batch")
    try:
        manifest.train_state.check_invariants(
            global_batch=global_batch if isinstance(global_batch, int) else None,
            where=run.storage.url(run.manifest_path(manifest.step)))
    except InvariantError as e:
        return [str(e)]
    return []


def _unlisted_entries(run: Run, manifest: Manifest) -> list[str]:
    """Entries of the step directory that the manifest does not list: planted or stray.

    One listing, top level only: ``a`` counts as listed when a manifest path
    is ``a`` or starts with ``a/``.
    """
    d = run.dirname(manifest.step)
    try:
        names = run.storage.listdir(d)
    except (OSError, ValueError) as e:
        if not _can_heal(e):
            return [_problem(run.storage.url(d), "a listable step directory", e)]
        raise _Unreadable(_problem(run.storage.url(d), "a listable step directory", e)) from e
    # d itself: an object store's "directory marker" object lists as an entry of its own.
    listed = {rel.split("/", 1)[0] for rel in manifest.files} | {run.layout.manifest_name, d}
    problems = []
    for name in names:
        if name not in listed:
            path = run.step_path(manifest.step, name)
            kind = "directory" if run.storage.isdir(path) else "file"
            problems.append(f"{run.storage.url(path)}: expected only the files the manifest "
                            f"lists, actual an unlisted {kind}")
    return problems
