"""Framework adapters (imported as ``resume.adapters``).

``resume.adapters.torch_native``: native PyTorch (plain module, DDP, FSDP2),
saved through torch.distributed.checkpoint. Imported lazily so that the core
and the CLI start without importing torch.
"""

__all__ = ["data", "dcp_safe", "jsonstate", "torch_native"]
