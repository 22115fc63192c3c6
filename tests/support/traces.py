"""What jobs write one JSON record a line: traces of iterations, the hook's event log."""

from __future__ import annotations

import json
import logging
import os


def read_jsonl(path: str | os.PathLike, *, missing_ok: bool = False) -> list[dict]:
    """Every record of the file, in order; ``missing_ok``: no file reads as no records."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f]
    except FileNotFoundError:
        if missing_ok:
            return []
        raise


def hook_events(run: str | os.PathLike) -> list[dict]:
    """The Slurm hook's event log of the run (``cluster/events.jsonl``)."""
    return read_jsonl(os.path.join(run, "cluster", "events.jsonl"))


class LogToFile(logging.Handler):
    """Every record at INFO and above appended to ``path`` (``with_level``: "LEVEL message" lines)."""

    def __init__(self, path: str, *, with_level: bool = False) -> None:
        super().__init__(logging.INFO)
        self.path = path
        self.with_level = with_level

    def emit(self, record: logging.LogRecord) -> None:
        with open(self.path, "a") as f:
            f.write((f"{record.levelname} " if self.with_level else "") + record.getMessage() + "\n")
