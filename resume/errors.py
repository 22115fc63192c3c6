"""The error hierarchy. Every error carries the CLI exit code it maps to.

Exit codes (DESIGN.md, CLI): 0 ok, 1 problems found / failed, 2 usage error,
3 nothing there (no run, no committed checkpoint), 4 timed out.
Messages name the file, the field, the expected and the actual value.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2
EXIT_NOTHING = 3
EXIT_TIMEOUT = 4


class ResumeError(Exception):
    """Base of every error this package raises on purpose."""

    exit_code: int = EXIT_PROBLEM

    def fields(self) -> dict:
        """What ``from_fields`` needs to build this error again (on another rank)."""
        return {"message": str(self)}

    @classmethod
    def from_fields(cls, fields: dict) -> ResumeError:
        return cls(fields["message"])


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
