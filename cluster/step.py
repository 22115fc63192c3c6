"""The training step as the hook starts it: one ``srun`` inside the allocation.

Contract: every task starts through ``TASK`` (``cluster/task.py``: torchrun's variables
from srun's); srun's stderr is passed on to the job's output as it comes, and
``StepLauncher.refused`` says, once the step has ended, whether Slurm refused to create
it (a node left the job), which is no crash of the training.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["STEP_REFUSED", "TASK", "StepLauncher", "master_port", "srun_command"]

TASK = (sys.executable, "-m", "resume.cluster.task", "--")
"""Every task of the step starts through this: torchrun's variables from srun's (cluster/task.py)."""
STEP_REFUSED = b"Unable to create step"
"""What srun says when Slurm will not start the step on the nodes asked (one left the job)."""


def srun_command(nodes: Sequence[str], tasks_per_node: int, command: Sequence[str]) -> list[str]:
    """srun on exactly ``nodes``, ``tasks_per_node`` tasks each; one failed task ends the step."""
    return ["srun", f"--nodes={len(nodes)}", f"--ntasks={len(nodes) * tasks_per_node}",
            f"--ntasks-per-node={tasks_per_node}", f"--nodelist={','.join(nodes)}",
            "--kill-on-bad-exit=1", *TASK, *command]


def master_port(job_id: str, launch: int) -> int:
    """The rendezvous port of a launch: another for each launch and job, so a relaunch never
    meets the last one's sockets."""
    return 20000 + (int(job_id) * 7 + launch) % 20000 if job_id.isdigit() else 29500


class StepLauncher:
    """Starts one step at a time; ``refused`` is about the last one started."""

    def __init__(self, popen: Callable[..., Any] = subprocess.Popen) -> None:
        self.popen = popen
        self._refused = threading.Event()
        self._relay: threading.Thread | None = None

    def start(self, cmd: list[str], env: Mapping[str, str]) -> Any:
        proc = self.popen(cmd, env=env, stderr=subprocess.PIPE)
        self._refused.clear()
        stream = getattr(proc, "stderr", None)
        self._relay = None
        if stream is not None:
            self._relay = threading.Thread(target=self._relay_stderr, args=(stream,), name="srun-stderr",
                                           daemon=True)
            self._relay.start()
        return proc

    def refused(self) -> bool:
        """Whether srun said it could not create the step (its stderr read to the end)."""
        if self._relay is not None:
            self._relay.join(timeout=5.0)
        return self._refused.is_set()

    def _relay_stderr(self, stream: Any) -> None:
        out = getattr(sys.stderr, "buffer", None)
        for line in iter(stream.readline, b""):
            if STEP_REFUSED in line:
                self._refused.set()
            if out is not None:
                out.write(line)
                out.flush()
            else:
                sys.stderr.write(line.decode(errors="replace"))
