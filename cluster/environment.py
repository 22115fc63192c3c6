"""The job's identity from its environment: ``resume.adapters.environment``, re-exported here.

The adapters hand the job id to the lease and never import ``resume.cluster``, so
the class lives with them; the cluster layer names it from here as before.
"""

from resume.adapters.environment import JOB_ID_VARIABLES, JobEnvironment

__all__ = ["JOB_ID_VARIABLES", "JobEnvironment"]
