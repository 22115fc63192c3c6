"""Results that tests compute once per session and compare against (an uninterrupted run's state).

``once`` runs the computation in a fresh directory the first time any test of the session asks
for the name, under a file lock, and stores the result; later calls read it. Under pytest-xdist
the directory is the one all workers share: the first worker to ask computes, the others wait. The result is a
value (pickled): a test may read what ``compute`` wrote in the directory but never writes there,
and a directory that a test would restore from or change stays per worker (a module fixture).
"""

from __future__ import annotations

import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from filelock import FileLock

T = TypeVar("T")


def once(tmp_path_factory, name: str, compute: Callable[[Path], T]) -> T:
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER") is not None:
        root = root.parent  # the session's, above each worker's own
    where, stored = root / f"once-{name}", root / f"once-{name}.pickle"
    with FileLock(str(root / f"once-{name}.lock")):
        if stored.exists():
            return pickle.loads(stored.read_bytes())
        shutil.rmtree(where, ignore_errors=True)  # left by a worker whose computation failed
        where.mkdir()
        result = compute(where)
        partial = stored.with_suffix(".partial")
        partial.write_bytes(pickle.dumps(result))
        os.replace(partial, stored)
        return result
