"""torch.distributed.checkpoint (DCP) as the adapters use it (imported as ``resume.adapters.dcp``).

- ``filesystem``: the writer's and reader's file systems (checksummed while written, durable,
  retried on object stores); ``make_writer``, ``make_reader``.
- ``plan_cache``: DCP's save-plan caching, with keys of our own and dropped after a failure.
- ``unpickle``: ``.metadata`` unpickled with the metadata classes only.
- ``metadata_check``: the shape and bounds of the unpickled ``.metadata``.
- ``reader``: the data items read within bounds, ``weights_only``; ``SafeLoadPlanner``.
"""
