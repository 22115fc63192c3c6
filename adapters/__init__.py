"""Framework adapters (imported as ``resume.adapters``).

``resume.adapters.torch_native``: native PyTorch (plain module, DDP, FSDP2),
saved through torch.distributed.checkpoint; its parts in ``resume.adapters.torch``, DCP as
it uses it in ``resume.adapters.dcp``. Imported lazily so that the core and the CLI start
without importing torch.
"""

__all__ = ["data", "dcp", "jsonstate", "torch", "torch_native"]
