"""Signal handlers a test process lends to code under test (the Slurm hook installs its own)."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def handlers_restored() -> Iterator[None]:
    """The hook installs USR1/TERM handlers in this process: put pytest's back afterwards."""
    previous = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, previous[0])
        signal.signal(signal.SIGTERM, previous[1])
