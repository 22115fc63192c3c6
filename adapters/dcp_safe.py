"""Old path of ``resume.adapters.dcp.unpickle`` and ``resume.adapters.dcp.reader``: re-exports
only, for code not yet moved to the new modules; new code imports those."""

from .dcp.reader import SafeFileSystemReader, SafeLoadPlanner, Window, check_archive, read_stored_tensor_into
from .dcp.reader import Window as _Window  # noqa: F401  the Megatron check's name until it moves
from .dcp.unpickle import METADATA_CAP, ZSTD, pickle_refusal, read_step_metadata, restricted_load_metadata

__all__ = ["METADATA_CAP", "ZSTD", "SafeFileSystemReader", "SafeLoadPlanner", "Window", "check_archive",
           "pickle_refusal", "read_step_metadata", "read_stored_tensor_into", "restricted_load_metadata"]
