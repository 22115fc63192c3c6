"""The error hierarchy, the exit codes and the structured fields every error gives.

Every exit code a command or the Slurm hook returns is defined here, once. Every error
carries its exit code and, beside its message, the fields ``details()`` returns: what
(the class), where (the file or URL), field, expected, actual, exit_code. A field given at
the raise (``where=``, ``field=``, ``expected=``, ``actual=``) wins; the rest are read off
the message, whose shape is ``WHERE: FIELD: expected EXPECTED, actual ACTUAL`` everywhere
(``message_fields``). Errors cross ranks as records (``fields()``, ``from_fields``) that
keep the given fields. Each class subclasses the built-in that fits.
"""

from __future__ import annotations

import re
from typing import Any

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2
EXIT_NOTHING = 3
EXIT_TIMEOUT = 4
EXIT_CRASH_LOOP = 5
"""The Slurm hook stopped requeueing: failures in a row without a new checkpoint."""
EXIT_NO_SLURM = 6
EXIT_NOT_IN_ALLOCATION = 7
EXIT_UNRECOVERABLE = EXIT_PROBLEM
"""The Slurm hook could not recover the step (no valid layout, no checkpoint to go on from)."""

LOCATION = ("where", "field", "expected", "actual")
"""The fields an error may be given at its raise, beside its message."""
DETAILS = ("what", *LOCATION, "exit_code")
"""The keys of ``details()``, in the order ``--json`` prints them."""

_SHAPE = re.compile(r"(?:(?P<head>.+?): )?expected (?P<expected>.+?), actual (?P<actual>.+)", re.DOTALL)
_LOCATION = re.compile(r"[^\s]*(/|://)[^\s]*|[\w.-]+\.\w+")
"""A path or URL (holds a slash), or a file name with a suffix (``run.json``)."""


def message_fields(message: str) -> dict[str, str | None]:
    """``where``, ``field``, ``expected``, ``actual`` of a message shaped ``WHERE: FIELD:
    expected EXPECTED, actual ACTUAL`` (each part optional; WHERE only when it is a path, a
    URL or a file name); None for a part the message does not have."""
    found: dict[str, str | None] = dict.fromkeys(LOCATION)
    shaped = _SHAPE.fullmatch(message)
    if shaped:
        found["expected"], found["actual"] = shaped["expected"], shaped["actual"]
        head = shaped["head"] or ""
    else:
        head = message.split(": ")[0] if ": " in message else ""
    parts = head.split(": ") if head else []
    if parts and _LOCATION.fullmatch(parts[0]):
        found["where"] = parts.pop(0)
    if shaped and parts:
        found["field"] = ": ".join(parts)
    return found


def error_details(error: BaseException) -> dict[str, Any]:
    """``details()`` of any error: ours give theirs; another one (an ``OSError`` the standard
    library raised) its class, its file name or what its message names, and exit code 1."""
    if isinstance(error, ResumeError):
        return error.details()
    found = message_fields(str(error))
    if isinstance(error, OSError) and error.filename:
        found["where"] = str(error.filename)
    return {"what": type(error).__name__, **found, "exit_code": EXIT_PROBLEM}


class ResumeError(Exception):
    """Base of every error this package raises on purpose."""

    exit_code: int = EXIT_PROBLEM

    def __init__(self, *args: object, where: str | None = None, field: str | None = None,
                 expected: object = None, actual: object = None) -> None:
        super().__init__(*args)
        given = {"where": where, "field": field, "expected": expected, "actual": actual}
        self.given_fields: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
        """The fields given at the raise; they win over what the message names."""

    def details(self) -> dict[str, Any]:
        """what, where, field, expected, actual, exit_code (``DETAILS``): given, else read off
        the message (``message_fields``); None for what neither names."""
        given = getattr(self, "given_fields", {})
        return {"what": type(self).__name__, **message_fields(str(self)), **given,
                "exit_code": self.exit_code}

    def fields(self) -> dict:
        """What ``from_fields`` needs to build this error again (on another rank)."""
        return {"message": str(self), **getattr(self, "given_fields", {})}

    @classmethod
    def from_fields(cls, fields: dict) -> ResumeError:
        return cls(fields["message"], **{k: fields[k] for k in LOCATION if k in fields})


class UsageError(ResumeError, ValueError):
    """Bad arguments or configuration given by the user."""

    exit_code = EXIT_USAGE


class RunNotFoundError(ResumeError, FileNotFoundError):
    """The run URL does not exist or holds no run."""

    exit_code = EXIT_NOTHING


class CheckpointNotFoundError(ResumeError, FileNotFoundError):
    """No committed checkpoint (or not the step asked for)."""

    exit_code = EXIT_NOTHING


class NoValidCheckpointError(ResumeError, RuntimeError):
    """Step directories exist, but none of them is a valid committed checkpoint.

    Training must not silently start from scratch in that case: the user has
    to say so explicitly (``allow_fresh_start``).
    """

    exit_code = EXIT_PROBLEM


class ManifestError(ResumeError, ValueError):
    """A manifest (or run.json) that is not JSON, has an unknown schema or a bad field."""

    exit_code = EXIT_PROBLEM


class CorruptCheckpointError(ResumeError, RuntimeError):
    """A file listed in a manifest is missing, or has the wrong size or checksum."""

    exit_code = EXIT_PROBLEM


class DamagedShardsError(CorruptCheckpointError):
    """A checkpoint's shards found damaged while a load read them (their checksums, taken from
    the bytes the load read): nothing reached the live objects, and the restore passes over the
    checkpoint for the previous one, as when the checksums are compared before the load."""

    exit_code = EXIT_PROBLEM


class UnsafePathError(CorruptCheckpointError, OSError):
    """A path in a run that must not be read, written or deleted through: a symbolic link (at
    any component below the run's root), a FIFO, a device or socket, a path leading outside the
    run, or a file larger than the cap its reader set.

    Damage, not an outage: it subclasses ``CorruptCheckpointError`` (exit 1; restore passes over
    the checkpoint holding it), and ``OSError`` so that code handling a file it cannot read
    handles this one too. Storage never retries it (``storage.is_transient``) and the commit
    check never reports it as ``unreadable`` (``storage.is_damage``).
    """

    exit_code = EXIT_PROBLEM


class OversizedFileError(UnsafePathError):
    """A file larger than the cap its reader set (``Storage.read_bytes(limit=...)``)."""


class InvariantError(ResumeError, RuntimeError):
    """The counters contradict each other or the optimizer/scheduler."""

    exit_code = EXIT_PROBLEM


class ContinuityError(ResumeError, RuntimeError):
    """After a restart, training would not continue exactly where it stopped.

    ``item`` names what differs (``next_batch.ids``, ``lr_ahead``,
    ``optimizer[0].moments``, ``rng``, ``config.seed``, ...).
    """

    exit_code = EXIT_PROBLEM

    def __init__(self, item: str, expected: object, actual: object, hint: str = "") -> None:
        self.item = item
        self.expected = expected
        self.actual = actual
        self.hint = hint
        message = f"continuity check failed: {item}: expected {expected}, actual {actual}"
        if hint:
            message += f" ({hint})"
        super().__init__(message)
        self.given_fields = {"field": item, "expected": expected, "actual": actual}

    def fields(self) -> dict:
        return {"item": self.item, "expected": self.expected, "actual": self.actual, "hint": self.hint}

    @classmethod
    def from_fields(cls, fields: dict) -> ContinuityError:
        return cls(fields["item"], fields["expected"], fields["actual"], fields.get("hint", ""))


class SaveFailedError(ResumeError, RuntimeError):
    """A save (possibly on another rank) failed; nothing was committed."""

    exit_code = EXIT_PROBLEM


class SaveTimeoutError(ResumeError, TimeoutError):
    """A requested save did not commit before the deadline."""

    exit_code = EXIT_TIMEOUT


class StorageError(ResumeError, OSError):
    """A storage operation failed after its retries."""

    exit_code = EXIT_PROBLEM


class StorageAccessError(ResumeError, PermissionError):
    """Storage refuses us: no credentials, wrong credentials, access denied (not transient)."""

    exit_code = EXIT_NOTHING


class UnsafeCheckpointError(ResumeError, RuntimeError):
    """A checkpoint file tried to make the loader run code (a forbidden pickle global)."""

    exit_code = EXIT_PROBLEM


class RunBusyError(ResumeError, RuntimeError):
    """Another live job holds the run's lease (two writers on one run)."""

    exit_code = EXIT_PROBLEM


class LeaseLostError(SaveFailedError):
    """This job's lease on the run was taken over; it must not commit any more."""


class DrillFailed(ResumeError):
    """``resume drill`` could not run its trainings to the end (not: they differ)."""

    exit_code = EXIT_PROBLEM


class CheckFailed(ResumeError):
    """``resume megatron args --check``: Megatron's own parser refuses the arguments."""

    exit_code = EXIT_PROBLEM


class InjectedFault(RuntimeError):
    """Raised at an armed point with the ``raise`` action (``resume.faults``)."""


class BadControlFile(ValueError):
    """A control file that is not what its name says (ignored with a warning; ``resume.control``)."""


class SlurmError(ResumeError, RuntimeError):
    """A Slurm command failed after its retries."""


class SlurmMissingError(ResumeError, FileNotFoundError):
    """The Slurm commands (``scontrol``, ``srun``) are not installed here."""

    exit_code = EXIT_NO_SLURM


class NotInAllocationError(ResumeError, RuntimeError):
    """``resume slurm run`` outside a Slurm allocation."""

    exit_code = EXIT_NOT_IN_ALLOCATION


class AdoptRefusedError(ResumeError, RuntimeError):
    """The save asked for (or every candidate) cannot be adopted; the message says why."""

    exit_code = EXIT_PROBLEM


class WarmStartError(ResumeError, RuntimeError):
    """A warm start's source is missing, damaged, or does not fit the model (names and shapes
    named one per line); nothing was loaded."""

    exit_code = EXIT_PROBLEM


class PlanCacheMismatchError(RuntimeError):
    """Rank 0 has no cached plans while a rank sent an empty one (it believes rank 0 does)."""
