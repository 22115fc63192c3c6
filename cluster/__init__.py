"""Cluster integration (imported as ``resume.cluster``): the edge that knows the cluster.

The core (``resume``) reads no cluster's environment variables; the modules here
read them and pass facts in. Import the module you need:

- ``environment``: the job's identity from its environment (``JobEnvironment``),
  which the adapters hand to the lease;
- ``slurm``: the Slurm boundary: the batch job's facts (``SlurmJob``) and the few
  commands the hook runs, with timeouts and bounded retries;
- ``hook``: the requeue hook, ``resume slurm run``: saves on USR1/TERM, relaunches
  on spares, shrinks, requeues, stops a crash loop;
- ``events``, ``hook_state``, ``watch``, ``step``: the parts the hook's decision loop
  uses: its event log, its state file, what it reads of the run, the srun launcher;
- ``hangs``: hang detection's side in the hook: rank 0's progress read, the ranks' stack
  reports collected, the suspect named (the ranks' side is ``resume.watchdog``);
- ``straggler_watch``: each new checkpoint's stragglers as an event, and the replacement policy;
- ``status``: ``resume slurm status``, the last launch and hang from the event log;
- ``task``: how each task of the step starts (``python -m resume.cluster.task --
  COMMAND``): torchrun's variables from srun's, the launch contract;
- ``grace``: the grace budget, one formula over the run's measured save times;
- ``crash_loop``: the policy that stops the requeueing;
- ``template``: the sbatch script ``resume slurm template`` writes;
- ``layout``: the parallel layout (rank <-> node <-> tp, cp, dp, pp) and the valid
  data-parallel sizes, for ``resume plan``;
- ``simulate``: failures, checkpoint stalls and restarts of a long run, for the
  best checkpoint interval and the number of spares (``resume simulate``).
- ``reference``: the reference run's save stall and restart times, each figure
  measured, assumed or computed and saying which (``resume simulate --reference``;
  ``simulate``'s defaults).
"""

__all__: list[str] = []
