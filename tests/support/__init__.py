"""What the tests share; test modules import from here and from the product, never each other.

- ``workloads``: the tiny GPT job most tests train (build, train, digests), one process or many;
- ``ranks``: ``run_ranks``, a function on several spawned gloo processes; ``init_gloo`` for a rank
  of one's own; ``end_like_slurm``, a job's other ranks killed shortly after one died;
- ``shared``: ``once``, a result (an uninterrupted reference run) computed once per test session;
- ``traces``: records written one JSON object a line (iteration traces, the hook's events);
- ``crash_jobs``: jobs whose ranks crash inside a save, and the soak built on them;
- ``staged_trainer``: a speed-run-shaped trainer that unties its embedding at a stage boundary;
- ``checkpoints``: checkpoints written by hand, and damage done to them (torn, flipped, planted);
- ``cli``: the ``resume`` command in a subprocess, and its one-line errors;
- ``hostile``: ``resume`` and a job's restore run against hostile files, in bounded subprocesses;
- ``s3``: an S3-compatible server on loopback and a proxy in front of it that injects faults;
- ``ports``: a free TCP port on loopback;
- ``megatron``: Megatron-Core on CPU (import or skip, CUDA stand-ins, optimizer stubs);
- ``megatron_core_run``: a tiny Megatron-Core run with dist_checkpointing on gloo ranks;
- ``megatron_training_run``: megatron.training's own save and load at world size 1;
- ``slurm_cluster.sh``: a throw-away Slurm cluster on loopback (used by .ci/run too).

Spawned processes import these by module name: tests/conftest.py puts tests/ on sys.path, and
multiprocessing's spawn and forkserver start methods hand the parent's sys.path to the child.
"""
