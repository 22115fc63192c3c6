"""The hook's state file, ``RUN/cluster/hook.json``: what must survive a requeue.

Invariants: bad nodes and the launch count carry over to every later job; the recent
failures (the crash loop's history) only within the same job id (requeues keep it). A
file that is not one the hook wrote (too big, a link, a bad field) is said on the job's
output and ignored: the hook starts afresh rather than fail.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from resume.storage import SMALL_FILE_CAP, Storage
from resume.text import clip, parse_json, short
from resume.watchdog import seconds_or_none

__all__ = ["STATE", "HookState", "StateFile"]

STATE = "cluster/hook.json"
MAX_NODES = 100_000
KEPT_FAILURES = 20
"""The most recent failures written: more than any crash-loop limit needs."""


@dataclass
class HookState:
    bad_nodes: list[str] = field(default_factory=list)
    """Nodes Slurm reported bad after a failed step; used again once Slurm reports them healthy."""
    failures: list[dict] = field(default_factory=list)
    """Step failures on healthy nodes, oldest first: ``{at, exit_code, committed_step}``."""
    launches: int = 0
    startup_s: float | None = None
    """The last launch's start-up, launch to first iteration (the hook's clock): the start-up
    bound of the next (``HangBounds.bound``)."""
    watched: bool = False
    """A launch of this run wrote rank 0's progress (the program runs ``resume``'s watchdog): from
    then on a launch with no progress within the start-up bound is a hang."""


class StateFile:
    """``HookState`` read from and written to the run (atomically) for one job."""

    def __init__(self, storage: Storage, job_id: str) -> None:
        self.storage = storage
        self.job_id = job_id

    def load(self) -> HookState:
        """The state the last requeue left, or a fresh one."""
        try:
            body = parse_json(self.storage.read_bytes(STATE, limit=SMALL_FILE_CAP))
        except FileNotFoundError:
            return HookState()
        except (OSError, ValueError) as e:
            print(f"resume slurm: warning: {STATE} ignored: {clip(str(e))}", flush=True)
            return HookState()
        problem = state_problem(body)
        if problem is not None:
            print(f"resume slurm: warning: {self.storage.url(STATE)}: {problem}; ignored", flush=True)
            return HookState()
        same_job = body.get("job") == self.job_id
        return HookState(bad_nodes=list(body.get("bad_nodes", [])),
                         failures=list(body.get("failures", [])) if same_job else [],
                         launches=body.get("launches", 0), startup_s=seconds_or_none(body.get("startup_s")),
                         watched=body.get("watched") is True)

    def save(self, state: HookState) -> None:
        body = {"bad_nodes": state.bad_nodes, "failures": state.failures[-KEPT_FAILURES:],
                "launches": state.launches, "job": self.job_id, "startup_s": state.startup_s,
                "watched": state.watched}
        self.storage.write_bytes_atomic(STATE, json.dumps(body, indent=1).encode())


def state_problem(body: Any) -> str | None:
    """What is wrong with the state file's ``body`` (parsed JSON), or None."""
    if not isinstance(body, dict):
        return f"expected an object, actual {short(body)}"
    nodes, failures, launches = body.get("bad_nodes", []), body.get("failures", []), body.get("launches", 0)
    if not (isinstance(nodes, list) and len(nodes) <= MAX_NODES
            and all(isinstance(n, str) and 0 < len(n) <= 255 for n in nodes)):
        return f"bad_nodes: expected a list of node names, actual {short(nodes)}"
    if not (isinstance(failures, list) and all(_is_failure(f) for f in failures)):
        return ("failures: expected a list of {at, exit_code, committed_step} records, actual "
                f"{short(failures)}")
    if type(launches) is not int or not 0 <= launches < 1 << 31:
        return f"launches: expected a count >= 0, actual {short(launches)}"
    return None


def _is_failure(record: Any) -> bool:
    def small_int(v: Any) -> bool:
        return type(v) is int and -(1 << 63) <= v < 1 << 63
    return (isinstance(record, dict) and isinstance(record.get("at", ""), str)
            and (record.get("exit_code") is None or small_int(record.get("exit_code")))
            and (record.get("committed_step") is None or small_int(record.get("committed_step"))))
