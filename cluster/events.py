"""The hook's event log: every decision of ``resume slurm run`` as one JSON line in
``RUN/cluster/events.jsonl``, and one line on the job's output.

Invariants: nothing is written through a log that is not a regular file of ours (a
link, a FIFO, one past ``EVENTS_CAP``): it is moved aside and a new one begun; a log
that cannot be written never stops the hook (it says so on the job's output).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from resume.run import utc_now
from resume.storage import Storage, is_damage
from resume.text import clip

from .slurm import SlurmJob

__all__ = ["EVENTS", "EVENTS_CAP", "EventLog"]

EVENTS = "cluster/events.jsonl"
EVENTS_CAP = 64 << 20
"""Bytes: a longer event log is moved aside and a new one begun."""
SHOWN = ("launch", "dp", "from_dp", "to_dp", "nodes", "tasks", "signal", "step", "committed_step",
         "exit_code")
"""The fields an event's line on the job output shows, in this order."""


class EventLog:
    """The event log of one hook: each record names the job and its restart count."""

    def __init__(self, storage: Storage, job: SlurmJob) -> None:
        self.storage = storage
        self.job = job

    def event(self, kind: str, **fields: Any) -> None:
        """One decision: a JSON line in the log, and a line on the job's output naming its
        nodes, step and exit code (``SHOWN``) before the reason."""
        record = {"at": utc_now("milliseconds"), "event": kind, "job": self.job.job_id,
                  "restart": self.job.restart_count, **fields}
        self._append((json.dumps(record, sort_keys=False) + "\n").encode())
        facts = " ".join(f"{key}={_fact(fields[key])}" for key in SHOWN if fields.get(key) is not None)
        reason = fields.get("reason", "")
        print(f"resume slurm: {kind}" + (f" [{facts}]" if facts else "") + (f": {reason}" if reason else ""),
              flush=True)

    def _append(self, line: bytes) -> None:
        try:
            try:
                self.storage.append_bytes(EVENTS, line, limit=EVENTS_CAP)
            except OSError as e:
                if not is_damage(e):
                    raise
                aside = f"{EVENTS}.aside-{int(time.time())}-{os.urandom(3).hex()}"
                print(f"resume slurm: warning: {clip(str(e))}; moved to {aside}", flush=True)
                self.storage.rename(EVENTS, aside)
                self.storage.append_bytes(EVENTS, line, limit=EVENTS_CAP)
        except OSError as e:
            print(f"resume slurm: warning: event not recorded in {self.storage.url(EVENTS)}: {clip(str(e))}",
                  flush=True)


def _fact(value: Any) -> str:
    if isinstance(value, list):
        shown = ",".join(map(str, value[:16]))
        return shown + (f",…(+{len(value) - 16})" if len(value) > 16 else "")
    return str(value)
