"""The index of a step our manifest describes, read once (rank 0) and checked in shape and bounds
against the verified manifest: the typed-array index (``resume.adapters.dcp.index``) where the
step has one, each rank sent only its own entries; else DCP's ``.metadata``, unpickled with the
allow-list and sent to every rank as the object rank 0 built (checkpoints written before the index)."""

from __future__ import annotations

from typing import Any

from resume.collective import Collective
from resume.comm import Comm
from resume.errors import CorruptCheckpointError, StorageError, UnsafeCheckpointError
from resume.manifest import Manifest
from resume.storage import Storage
from resume.text import clip

from ..dcp.index import INDEX_FILE, CheckpointIndex, Requests, select
from ..dcp.unpickle import restricted_load_metadata

__all__ = ["CheckedMetadata", "has_index", "recorded_for_shards"]


def has_index(manifest: Manifest | None) -> bool:
    """Whether the step has the typed-array index (written since it exists), listed and checksummed."""
    return manifest is not None and INDEX_FILE in manifest.files


def recorded_for_shards(manifest: Manifest | None) -> dict:
    """From the step's verified manifest: each file's size, which bounds every item of .metadata,
    and the compression the save used, the only transform a load honours. None (a step no
    manifest of ours describes): no bounds, no compression."""
    if manifest is None:
        return {"sizes": None, "compression": None}
    compression = manifest.topology.get("compression")
    return {"sizes": {rel: entry.size for rel, entry in manifest.files.items()},
            "compression": compression if compression in ("zstd",) else None}


class CheckedMetadata:
    """The last ``.metadata`` checked by ``problems`` (rank 0, during the restore's choice), kept
    for the load that follows: read and unpickled once per restore."""

    def __init__(self) -> None:
        self._checked: tuple | None = None  # (step_dir, recorded, Metadata)

    def problems(self, storage: Storage, step_dir: str, manifest: Manifest | None) -> list[str]:
        """What makes ``.metadata`` unloadable (shape, bounds); code in it raises instead."""
        self._checked = None
        recorded = recorded_for_shards(manifest)
        try:
            metadata = self._parse(storage, step_dir, recorded, INDEX_FILE if has_index(manifest) else ".metadata")
        except UnsafeCheckpointError:
            raise  # code in a checkpoint: refused loudly, not passed over
        except CorruptCheckpointError as e:
            return [str(e)]
        self._checked = (step_dir, recorded, metadata)
        return []

    def read(self, comm: Comm, storage: Storage, step_dir: str,
             manifest: Manifest | None) -> tuple[Any, dict]:
        """Collective: (the checked ``Metadata``, what the manifest records about the shards), read
        on rank 0 and broadcast: thousands of ranks never open the same file. What the others
        receive is the object rank 0 built, pickled by rank 0 itself: the checkpoint's bytes
        never reach their unpickler."""
        def read() -> tuple[Any, dict]:
            checked = self._checked  # read by problems (this rank 0) just before
            if checked is not None and checked[0] == step_dir:
                return checked[2], checked[1]
            recorded = recorded_for_shards(manifest)
            return self._parse(storage, step_dir, recorded), recorded
        try:
            return Collective(comm).on_rank0(read)
        finally:
            self._checked = None

    def read_own(self, comm: Comm, storage: Storage, step_dir: str, manifest: Manifest, requests: Requests,
                 hashed: set[str]) -> bytes:
        """Collective: this rank's answer (``index.partial_metadata`` makes DCP's Metadata of its
        own load from it, and names the files of ``hashed`` it reads whole and hashes). Every rank
        sends rank 0 what it holds (``requests``: hashes and boxes, not names); rank 0 reads and
        checks the index once and sends each rank only the entries overlapping its boxes (a
        scatter: no rank receives the whole index)."""
        coll = Collective(comm)
        what = f"index of {storage.url(step_dir)}"
        wires = coll.gather(requests.wire, what)

        def answer() -> list[bytes]:
            checked = self._checked
            recorded = recorded_for_shards(manifest)
            index = checked[2] if checked is not None and checked[0] == step_dir else \
                self._parse(storage, step_dir, recorded, INDEX_FILE)
            try:
                return select(index, wires, hashed)
            except ValueError as e:  # a rank's request, not the checkpoint
                raise CorruptCheckpointError(f"{what}: a rank's request: {e}") from e
        try:
            return coll.scatter(answer, what)
        finally:
            self._checked = None

    @staticmethod
    def _parse(storage: Storage, step_dir: str, recorded: dict, name: str = ".metadata") -> Any:
        path = f"{step_dir}/{name}"
        limit = (recorded["sizes"] or {}).get(".metadata")
        try:
            data = storage.read_bytes(path, limit=limit)
        except CorruptCheckpointError:
            raise
        except OSError as e:  # missing: the checkpoint is damaged; else storage trouble
            kind = CorruptCheckpointError if isinstance(e, FileNotFoundError) else StorageError
            raise kind(f"{storage.url(path)}: expected readable DCP metadata, actual "
                       f"{type(e).__name__}: {clip(str(e))}") from e
        if name == INDEX_FILE:
            return CheckpointIndex.parse(data, source=storage.url(path), file_sizes=recorded["sizes"],
                                         compression=recorded["compression"])
        return restricted_load_metadata(data, source=storage.url(path), file_sizes=recorded["sizes"],
                                        compression=recorded["compression"])
