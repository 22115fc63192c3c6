"""The parts of ``resume.adapters.torch_native.NativeTorchAdapter`` (imported as ``resume.adapters.torch``).

- ``comm``: ``TorchDistComm`` (``resume.comm.Comm`` over torch.distributed), ``allreduce_each_gradient``.
- ``objects``: the model parts, optimizers and schedulers given, unpacked and checked.
- ``shards``, ``metadata``, ``failures``: shard I/O through DCP; ``.metadata`` checked against
  the verified manifest; DCP's failures as our errors.
- ``state``: the small per-rank state and the sharded state dicts.
- ``view``, ``fingerprint``, ``schedules``: LRs, counters and moment fingerprints.
- ``settings``: optimizer structure and settings, accepted changes put back.
- ``batches``: sample ids and row digests of a batch.
"""
