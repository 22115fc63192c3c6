"""The Slurm boundary: environment variables in, a few commands out, with timeouts.

Nothing in ``resume/`` reads ``SLURM_*``; this module turns the environment
into facts (``SlurmJob``) and wraps the handful of commands the requeue hook
needs (``scontrol``, ``sinfo``) with timeouts and bounded retries. ``run`` and
``sleep`` are injectable so unit tests need no Slurm.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from resume.errors import (
    EXIT_NO_SLURM,
    EXIT_NOT_IN_ALLOCATION,
    NotInAllocationError,
    SlurmError,
    SlurmMissingError,
    UsageError,
)

__all__ = [
    "EXIT_NOT_IN_ALLOCATION",
    "EXIT_NO_SLURM",
    "NotInAllocationError",
    "Slurm",
    "SlurmError",
    "SlurmJob",
    "SlurmMissingError",
    "parse_nodelist",
]

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_nodelist(text: str) -> list[str]:
    """Expand a Slurm node list: ``n[1-3,7],gpu[01-02],login`` -> n1 n2 n3 n7 gpu01 gpu02 login."""
    nodes: list[str] = []
    for part in _split_top_level(text.strip()):
        if not part:
            continue
        m = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\]([^\[\]]*)", part)
        if not m:
            if "[" in part or "]" in part:
                raise UsageError(f"node list: expected name or name[1-3,5], actual {part!r}")
            nodes.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            rm = _RANGE.match(r)
            if not rm:
                raise UsageError(f"node list: expected a number or a range like 1-3, actual {r!r} in {part!r}")
            lo, hi = rm.group(1), rm.group(2) or rm.group(1)
            width = len(lo) if lo.startswith("0") else 0
            if int(hi) < int(lo):
                raise UsageError(f"node list: expected an ascending range, actual {r!r}")
            for i in range(int(lo), int(hi) + 1):
                nodes.append(f"{prefix}{i:0{width}d}{suffix}")
    return nodes


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return parts


@dataclass(frozen=True)
class SlurmJob:
    """What the hook knows about its job, from the batch script's environment."""

    job_id: str
    nodes: list[str]
    restart_count: int
    tasks_per_node: int = 1

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SlurmJob:
        job_id = env.get("SLURM_JOB_ID")
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not job_id or not nodelist:
            raise NotInAllocationError("SLURM_JOB_ID / SLURM_JOB_NODELIST: expected the environment "
                                       "of a Slurm batch job, actual not set (run this inside "
                                       "sbatch; `resume slurm template` writes the script)")
        per_node = env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0] or "1"
        return cls(job_id=job_id, nodes=parse_nodelist(nodelist),
                   restart_count=int(env.get("SLURM_RESTART_COUNT", "0") or 0),
                   tasks_per_node=int(per_node) if per_node.isdigit() else 1)


Runner = Callable[..., subprocess.CompletedProcess]


class Slurm:
    """The few Slurm commands the hook needs; bounded retries, each with a timeout."""

    def __init__(self, *, run: Runner = subprocess.run, sleep: Callable[[float], None] = time.sleep,
                 attempts: int = 3, timeout_s: float = 30.0, backoff_s: float = 2.0,
                 which: Callable[[str], str | None] = shutil.which) -> None:
        self._run = run
        self._sleep = sleep
        self.attempts = attempts
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self._which = which

    def check_installed(self) -> None:
        missing = [c for c in ("scontrol", "srun", "sinfo") if self._which(c) is None]
        if missing:
            raise SlurmMissingError(f"PATH: expected the Slurm commands {', '.join(missing)}, actual "
                                    "not found (is this a Slurm node?)")

    def call(self, *args: str) -> str:
        last = ""
        for attempt in range(1, self.attempts + 1):
            try:
                proc = self._run(list(args), capture_output=True, text=True, timeout=self.timeout_s,
                                 check=False)
            except subprocess.TimeoutExpired:
                last = f"timed out after {self.timeout_s:g}s"
            except FileNotFoundError as e:
                raise SlurmMissingError(f"{args[0]}: expected a Slurm command, actual not found") from e
            else:
                if proc.returncode == 0:
                    return proc.stdout
                last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
                last = last[0]
            if attempt < self.attempts:
                self._sleep(self.backoff_s * attempt)
        raise SlurmError(f"{' '.join(args)}: expected success, actual {last} "
                         f"(after {self.attempts} tries)")

    def requeue(self, job_id: str) -> None:
        self.call("scontrol", "requeue", job_id)

    def job_nodes(self, job_id: str) -> list[str]:
        """The nodes the job holds now (``scontrol show job``'s NodeList): Slurm removes a failed
        node from a ``--no-kill`` job, and may return it to service, but not to the job."""
        out = self.call("scontrol", "show", "job", "-o", job_id)
        for item in out.split():
            if item.startswith("NodeList="):
                value = item.split("=", 1)[1]
                return [] if value in ("", "(null)") else parse_nodelist(value)
        raise SlurmError(f"scontrol show job {job_id}: expected a NodeList field, actual none")

    def job_steps(self, job_id: str) -> list[str]:
        """The job's running srun steps (``JOB.N``; not its batch or extern step)."""
        out = self.call("squeue", "-h", "-s", "-j", job_id, "-o", "%i")
        steps = [line.strip() for line in out.splitlines()]
        return [st for st in steps if st.startswith(f"{job_id}.") and st.split(".", 1)[1].isdigit()]

    def signal_step(self, step: str, sig: str) -> None:
        """``sig`` to every task of ``step`` (KILL ends a stopped task too)."""
        self.call("scancel", f"--signal={sig}", step)

    def node_states(self, nodes: list[str]) -> dict[str, str]:
        """Node -> state (``idle``, ``allocated``, ``down*``, ``drained``...), lower case."""
        out = self.call("sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %T")
        states: dict[str, str] = {}
        for line in out.splitlines():
            fields = line.split()
            if len(fields) >= 2:
                states[fields[0]] = fields[1].lower()
        return states

    def node_addresses(self, nodes: list[str]) -> dict[str, str]:
        out = self.call("scontrol", "show", "node", ",".join(nodes), "-o")
        addresses = {}
        for line in out.splitlines():
            kv = dict(item.split("=", 1) for item in line.split() if "=" in item)
            if "NodeName" in kv:
                addresses[kv["NodeName"]] = kv.get("NodeAddr", kv["NodeName"])
        return addresses


BAD_STATES = ("down", "drain", "fail", "not_responding", "no_respond", "maint", "reboot", "unknown",
              "inval")


def is_bad_state(state: str) -> bool:
    """Down, drained, failing, or not responding (sinfo marks that with a trailing ``*``)."""
    return state.endswith("*") or any(s in state for s in BAD_STATES)
