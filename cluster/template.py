"""The sbatch script ``resume slurm template`` writes."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass

__all__ = ["SbatchTemplate"]


@dataclass(frozen=True, kw_only=True)
class SbatchTemplate:
    run_url: str
    command: list[str]
    nodes: int
    global_batch: int
    tasks_per_node: int = 1
    micro_batch: int = 1
    nodes_per_replica: int = 1
    spares: int = 0
    grace_s: int = 300
    job_name: str = "resume"
    time: str | None = None
    partition: str | None = None
    output: str = "resume-%j.out"
    exit_signal: str | None = None
    """Megatron-LM's --exit-signal: the hook asks for the save with it."""
    accept_changes: tuple[str, ...] = ()
    """Passed to the hook (``--accept-change``): the step's ``RESUME_ACCEPT_CHANGES`` at every requeue."""
    hook_args: tuple[str, ...] = ()
    """Further ``resume slurm run`` options, as given (hang detection's, the straggler policy's)."""
    python: str = sys.executable
    """The interpreter (and so the environment) the hook runs in: the one writing the script."""

    def render(self) -> str:
        directives = [
            f"--job-name={self.job_name}",
            f"--nodes={self.nodes}",
            f"--ntasks-per-node={self.tasks_per_node}",
            "--requeue",                          # the hook requeues; Slurm may too (node failure)
            "--no-kill",                          # a failed node must not end the allocation: spares
            f"--signal=B:USR1@{self.grace_s}",    # to the batch shell (the hook), grace seconds ahead
            "--open-mode=append",                 # restarts append to the same output
            f"--output={self.output}",
        ]
        if self.time:
            directives.append(f"--time={self.time}")
        if self.partition:
            directives.append(f"--partition={self.partition}")
        hook = [self.python, "-m", "resume.cli", "slurm", "run", "--run", self.run_url,
                "--global-batch", str(self.global_batch), "--micro-batch", str(self.micro_batch),
                "--nodes-per-replica", str(self.nodes_per_replica),
                "--tasks-per-node", str(self.tasks_per_node), "--spares", str(self.spares),
                "--grace", str(self.grace_s),
                *(["--exit-signal", self.exit_signal] if self.exit_signal else []),
                *(a for name in self.accept_changes for a in ("--accept-change", name)), *self.hook_args,
                "--", *self.command]
        lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in directives), "",
                 "# The hook is the batch script's main process (exec): it receives USR1/TERM,",
                 "# starts the training step with srun, saves, relaunches on spares, shrinks,",
                 "# requeues, and stops a crash loop. Its decisions: RUN/cluster/events.jsonl.",
                 "exec " + " ".join(shlex.quote(a) for a in hook), ""]
        return "\n".join(lines)
