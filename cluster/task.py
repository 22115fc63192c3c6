"""One task of the training step: ``python -m resume.cluster.task -- COMMAND...``.

The hook starts every task of the step through this. It sets torchrun's variables from srun's
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``NNODES``), then
``exec``s the command, which thus gets srun's signals directly. ``MASTER_ADDR``/``MASTER_PORT``,
``RESUME_DP`` and ``RESUME_LAUNCH`` come from the hook. The launch contract: docs/slurm.md.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping

from resume.watchdog import TASK_PID_ENV

__all__ = ["TORCHRUN_FROM_SLURM", "main", "torchrun_env"]

TORCHRUN_FROM_SLURM = {
    "RANK": "SLURM_PROCID",
    "WORLD_SIZE": "SLURM_NTASKS",
    "LOCAL_RANK": "SLURM_LOCALID",
    "NODE_RANK": "SLURM_NODEID",
    "NNODES": "SLURM_NNODES",
}


def torchrun_env(env: Mapping[str, str]) -> dict[str, str]:
    """torchrun's variables for this task, from srun's in ``env`` (those srun did not set: absent)."""
    out = {name: env[slurm] for name, slurm in TORCHRUN_FROM_SLURM.items() if env.get(slurm)}
    per_node = env.get("SLURM_NTASKS_PER_NODE", "")
    if not per_node.isdigit():  # "2(x3),1": the first node's count
        match = re.match(r"\d+", env.get("SLURM_TASKS_PER_NODE", ""))
        per_node = match.group(0) if match else ""
    if per_node:
        out["LOCAL_WORLD_SIZE"] = per_node
    if env.get("SLURMD_NODENAME"):  # the node a hang report names (resume.watchdog)
        out["RESUME_NODE"] = env["SLURMD_NODENAME"]
    return out


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("resume: error: resume.cluster.task: expected -- COMMAND..., actual no command", file=sys.stderr)
        return 2
    os.environ.update(torchrun_env(os.environ))
    os.environ[TASK_PID_ENV] = str(os.getpid())  # exec keeps the pid: the watched task (resume.watchdog)
    try:
        os.execvp(args[0], args)
    except OSError as e:
        print(f"resume: error: {args[0]}: expected a command to run, actual {e.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
