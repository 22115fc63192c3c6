"""The job as its launcher describes it: a mapping of environment variables in, facts out.

The one place that reads a launcher's variables (Slurm's, torchrun's), built from
a mapping (``os.environ`` by default) so a test passes a dict. The core
(``resume/``) reads none of them; an adapter asks this class and hands the facts
in (``Adapter.job_id`` -> ``Lease.take(..., job_id=...)``). It lives with the
adapters, which never import ``resume.cluster``; ``resume.cluster.environment``
re-exports it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from resume.lease import JOB_ID_ENV

__all__ = ["JOB_ID_VARIABLES", "JobEnvironment"]

JOB_ID_VARIABLES = (JOB_ID_ENV, "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")
"""Where the job's identity is read, first set wins: ours (set by hand), Slurm's (kept
across a requeue), torchrun's (kept across its restarts)."""


@dataclass(frozen=True)
class JobEnvironment:
    """What the cluster's environment says about this job."""

    env: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> JobEnvironment:
        """A snapshot of ``env``, by default this process's environment."""
        return cls(dict(os.environ if env is None else env))

    @property
    def job_id(self) -> str | None:
        """The job's identity, the same in every copy of it across requeues and restarts
        (``JOB_ID_VARIABLES``, first set wins); None outside any such job."""
        return next((self.env[name] for name in JOB_ID_VARIABLES if self.env.get(name)), None)
