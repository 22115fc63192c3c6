"""What the benchmark scripts share: timing, quiet sections, letting the disk drain, dropping pages.

Imported by the scripts as a sibling module (``python benchmarks/<script>.py`` puts this
folder first on the path).
"""

from __future__ import annotations

import contextlib
import io
import os
import time
import warnings
from collections.abc import Callable, Iterator

__all__ = ["drop_pages", "quiet", "settle", "timed"]


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def settle(seconds: float) -> None:
    """Let the disk (and a host's write cache under a virtual disk) drain before the next
    measurement, so that no write pays for the one before it."""
    os.sync()
    time.sleep(seconds)


def drop_pages(path: str) -> None:
    """Evict a file's or a directory's (clean) pages from the page cache: the next read is cold."""
    paths = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs] if os.path.isdir(path) else [path]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
