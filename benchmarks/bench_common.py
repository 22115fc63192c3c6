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

__all__ = ["drop_pages", "in_fresh_process", "profile_text", "quiet", "settle", "timed", "write_proc"]


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


def profile_text(prof: object, top: int, sort: str, roots: list[str]) -> str:
    """A cProfile's top ``top`` rows by ``sort``, from the column header on, with the ``roots``
    (site-packages, the repository) taken off the file names."""
    import pstats

    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats(sort).print_stats(top)  # type: ignore[arg-type]
    body = buf.getvalue()
    body = body[body.find("   ncalls"):] if "   ncalls" in body else body
    for prefix in sorted({r.rstrip(os.sep) + os.sep for r in roots}, key=len, reverse=True):
        body = body.replace(prefix, "")
    return body.rstrip()


def write_proc(path: str, text: str) -> bool:
    """Write a /proc control file (drop the page cache, reset a peak); False where not permitted."""
    try:
        with open(path, "w") as f:
            f.write(text)
        return True
    except OSError:
        return False


def in_fresh_process(module: str, call: str, what: str) -> str:
    """``module.call`` run by a fresh Python process (``python -c``: nothing imported, allocated or
    planned before), this folder on its path; the last line it printed."""
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import {module}; {call}"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} in a fresh process failed:\n{proc.stderr[-4000:]}")
    return proc.stdout.strip().splitlines()[-1]
