"""resume: committed, verifiable checkpoints and a continuity check after every restart."""

from .adapter import Adapter
from .comm import Comm, LocalComm
from .config import CoordinatorConfig
from .continuity import Expectation
from .coordinator import Coordinator
from .errors import (
    CheckpointNotFoundError,
    ContinuityError,
    CorruptCheckpointError,
    InvariantError,
    LeaseLostError,
    ManifestError,
    NoValidCheckpointError,
    OversizedFileError,
    ResumeError,
    RunBusyError,
    RunNotFoundError,
    SaveFailedError,
    SaveTimeoutError,
    StorageError,
    UnsafeCheckpointError,
    UnsafePathError,
    UsageError,
)
from .manifest import Manifest
from .policy import KeepPolicy
from .rng import RngRegistry
from .run import CheckResult, Run
from .state import TrainState
from .storage import open_storage
from .watchdog import HangBounds, expect, watch_from_start

__version__ = "0.1.0"

watch_from_start()  # under the Slurm hook: hang detection from the process's start (resume.watchdog)

__all__ = [
    "Adapter",
    "CheckResult",
    "CheckpointNotFoundError",
    "Comm",
    "ContinuityError",
    "Coordinator",
    "CoordinatorConfig",
    "CorruptCheckpointError",
    "Expectation",
    "HangBounds",
    "InvariantError",
    "KeepPolicy",
    "LeaseLostError",
    "LocalComm",
    "Manifest",
    "ManifestError",
    "NoValidCheckpointError",
    "OversizedFileError",
    "ResumeError",
    "RngRegistry",
    "Run",
    "RunBusyError",
    "RunNotFoundError",
    "SaveFailedError",
    "SaveTimeoutError",
    "StorageError",
    "TrainState",
    "UnsafeCheckpointError",
    "UnsafePathError",
    "UsageError",
    "__version__",
    "expect",
    "open_storage",
]
