"""``dumps_metadata`` (DCP's ``.metadata`` laid out by numpy): every unpickler reads it back to
the Metadata ``pickle.dumps`` gives, and anything it does not reproduce goes to ``pickle.dumps``.
Given the columns the ranks' write results arrive as (``written``), it reads back to the entries
``StorageEntries.as_dict`` makes of them.

Checkpoints are real single-process DCP saves: tensors of 0 to 3 dims, bytes entries, tensors
saved in row chunks (a planner that splits them, as a sharded save would), zstd-compressed
items; plain ``dcp.load`` reads them with our bytes in place of ``.metadata``. Metadata built by
hand covers what one process cannot save: offsets past 2**32, many files, mixed index hints.
"""

from __future__ import annotations

import dataclasses
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from resume.adapters.dcp.metadata_pickle import dumps_metadata
from resume.adapters.dcp.plan_cache import kept
from resume.adapters.dcp.unpickle import restricted_load_metadata
from resume.adapters.dcp.written import PackedWrites, StorageEntries, Written, as_write_results, written_of
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

ROWS = 3
"""Rows per chunk of a tensor saved by ``RowChunks``."""


class RowChunks(DefaultSavePlanner):
    """Saves each tensor of 2 dims or more as chunks of ``ROWS`` rows, each its own item with
    its own index hint: the entries a sharded save writes, from one process."""

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = [chunk for item in plan.items for chunk in self._chunks(item)]
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    @staticmethod
    def _chunks(item: WriteItem) -> list[WriteItem]:
        if item.type != WriteItemType.TENSOR or len(item.tensor_data.size) < 2:
            return [item]
        size = item.tensor_data.size
        chunks = []
        for start in range(0, size[0], ROWS):
            offsets = torch.Size([start] + [0] * (len(size) - 1))
            sizes = torch.Size([min(ROWS, size[0] - start), *size[1:]])
            data = TensorWriteData(chunk=ChunkStorageMetadata(offsets, sizes),
                                   properties=item.tensor_data.properties, size=size)
            chunks.append(WriteItem(index=MetadataIndex(item.index.fqn, offsets), type=WriteItemType.SHARD,
                                    tensor_data=data))
        return chunks

    def resolve_data(self, write_item: WriteItem):
        if write_item.type != WriteItemType.SHARD:
            return super().resolve_data(write_item)
        chunk = write_item.tensor_data.chunk
        return self.lookup_object(MetadataIndex(write_item.index.fqn)).narrow(
            0, chunk.offsets[0], chunk.sizes[0]).clone()


def state() -> dict:
    torch.manual_seed(0)
    return {"model": {"scale": torch.tensor(1.5), "bias": torch.randn(5), "w": torch.randn(8, 4),
                      "conv": torch.randn(7, 2, 3).to(torch.bfloat16), "mask": torch.rand(4, 4) > 0.5},
            "step": 7, "run": "café"}


def zeros() -> dict:
    live = state()
    model = {k: torch.zeros_like(v) for k, v in live["model"].items()}
    return {"model": model, "step": 0, "run": ""}


def save(path, *, chunked: bool = False, zstd: bool = False) -> Metadata:
    extensions = None
    if zstd:
        from torch.distributed.checkpoint._extension import ZStandard
        extensions = [ZStandard()]
    writer = FileSystemWriter(str(path), _extensions=extensions)
    return dcp.save(state(), storage_writer=writer, planner=RowChunks() if chunked else None, no_dist=True)


def plan_fields(plan: dict) -> list:
    """Each entry of ``state_dict_metadata``, in order, with the types a comparison by ``==``
    does not see (a ``torch.Size`` equals its tuple): its own, its chunk list's, each chunk's
    and its offsets' and sizes'."""
    out = []
    for name, entry in plan.items():
        chunks = getattr(entry, "chunks", None)
        out.append((name, type(entry), list(vars(entry)), type(chunks),
                    [(type(c), vars(c), type(c.offsets), type(c.sizes)) for c in chunks or []]))
    return out


def fields(metadata: Metadata) -> tuple:
    """Every field, storage_data in order, each key's and value's attributes with their types."""
    keys, values = list(metadata.storage_data), list(metadata.storage_data.values())
    return (type(metadata), metadata.state_dict_metadata, plan_fields(metadata.state_dict_metadata),
            metadata.planner_data, metadata.storage_meta,
            metadata.version, vars(metadata).keys(), list(metadata.storage_data.items()),
            [(type(k), vars(k), type(k.offset), k.index) for k in keys],
            [(type(v), vars(v), v.transform_descriptors) for v in values])


def assert_reads_back_alike(metadata: Metadata, *, file_sizes: dict | None = None) -> bytes:
    """Ours is not the standard stream (the fast path ran), and both the plain unpickler and our
    restricted one read it to what the standard stream reads to."""
    ours, standard = dumps_metadata(metadata), pickle.dumps(metadata)
    assert ours != standard, "expected the fast path, actual pickle.dumps' bytes"
    expected = fields(pickle.loads(standard))
    assert fields(pickle.loads(ours)) == expected
    assert fields(restricted_load_metadata(ours, source="ours", file_sizes=file_sizes)) == expected
    return ours


def assert_read_alike(ours: bytes, standard: bytes) -> None:
    """Both unpicklers read ``ours`` as they read ``standard``: the plain one to equal fields,
    the restricted one to equal fields or the same refusal."""
    assert fields(pickle.loads(ours)) == fields(pickle.loads(standard))
    try:
        expected = fields(restricted_load_metadata(standard, source="standard"))
    except Exception as e:  # noqa: BLE001 - a class or value it refuses: ours is refused alike
        with pytest.raises(type(e)):
            restricted_load_metadata(ours, source="ours")
    else:
        assert fields(restricted_load_metadata(ours, source="ours")) == expected


def sizes(path) -> dict[str, int]:
    return {n: os.path.getsize(path / n) for n in os.listdir(path) if n.endswith(".distcp")}


@pytest.mark.parametrize("chunked, zstd", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["whole", "row-chunks", "zstd", "row-chunks-zstd"])
def test_a_real_save_reads_back_alike_and_dcp_loads_it(tmp_path, chunked, zstd):
    saved = save(tmp_path, chunked=chunked, zstd=zstd)
    on_disk = pickle.loads((tmp_path / ".metadata").read_bytes())  # as a later process reads it
    for metadata in (saved, on_disk):
        ours = assert_reads_back_alike(metadata, file_sizes=sizes(tmp_path))
    assert any(k.offset == torch.Size([]) for k in on_disk.storage_data)  # the 0-d tensor
    assert any(k.offset is None and k.index is None for k in on_disk.storage_data)  # bytes entries
    if chunked:
        assert sum(k.fqn == "model.w" for k in on_disk.storage_data) == 3
    if zstd:
        assert all(v.transform_descriptors for v in on_disk.storage_data.values())
    (tmp_path / ".metadata").write_bytes(ours)
    target = zeros()
    dcp.load(target, storage_reader=FileSystemReader(str(tmp_path)), no_dist=True)
    live = state()
    assert (target["step"], target["run"]) == (7, "café")
    for name, tensor in live["model"].items():
        assert torch.equal(target["model"][name], tensor), name


def by_hand(files: int = 40, chunks: int = 6) -> Metadata:
    """Two tensors in many chunks over many files, offsets past 2**32 (in the tensor and in the
    file), a 1-d tensor without index hints, a bytes entry: what no single process saves."""
    big, flat = 2**33, 2**34
    entries = {"big.w": TensorStorageMetadata(TensorProperties(dtype=torch.uint8), torch.Size([big, 4]), []),
               "flat": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([flat]), []),
               "extra": BytesStorageMetadata()}
    storage, position = {}, dict.fromkeys(range(files), 2**32 + 17)
    for i in range(chunks * files):
        rows = big // (chunks * files)
        offset = torch.Size([i * rows, 0])
        entries["big.w"].chunks.append(ChunkStorageMetadata(offset, torch.Size([rows, 4])))
        f = i % files
        storage[MetadataIndex("big.w", offset, i)] = _StorageInfo(f"__{f}_0.distcp", position[f], rows * 4)
        position[f] += rows * 4
        if i % chunks == 0:
            part = flat // files
            chunk = ChunkStorageMetadata(torch.Size([i // chunks * part]), torch.Size([part]))
            entries["flat"].chunks.append(chunk)
            storage[MetadataIndex("flat", chunk.offsets)] = _StorageInfo(f"__{f}_1.distcp", 3, part * 4)
    storage[MetadataIndex("extra")] = _StorageInfo("__0_0.distcp", 0, 9)
    return Metadata(entries, planner_data={"big.w": ("big", "w")}, storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id="/ckpt", save_id="s1", modules=["m"]), version="1.0.0")


def test_metadata_by_hand_with_large_offsets_and_many_files_reads_back_alike():
    metadata = by_hand()
    assert_reads_back_alike(metadata)
    # unpickled as rank 0 holds DCP's write results: keys and values made by the unpickler
    assert_reads_back_alike(pickle.loads(pickle.dumps(metadata)))


@pytest.mark.parametrize("length", [-5, -(2**40)], ids=["int32", "int64"])
def test_descriptors_of_several_kinds_and_odd_values_read_back_alike(length):
    """Transform descriptors on some entries only and of two kinds, a name no codec but
    surrogatepass encodes, an empty name, a key whose offset was set to None explicitly,
    negative ints and the largest (in the records padded to one width: sign-extended)."""
    metadata = by_hand(files=3, chunks=2)
    items = list(metadata.storage_data.items())
    for i, (_, value) in enumerate(items):
        value.transform_descriptors = [None, ["stream.zstd/1"], ["a", "b"]][i % 3]
    odd = MetadataIndex("\udcff odd")
    object.__setattr__(odd, "offset", None)
    biggest = 2**63 - 1 if length < -(2**31) else 2**31 - 1
    items += [(odd, _StorageInfo("", -1, length)), (MetadataIndex("", torch.Size([0]), 0), _StorageInfo("x", 0, biggest))]
    metadata.storage_data = dict(items)
    ours = dumps_metadata(metadata)
    assert ours != pickle.dumps(metadata)
    assert fields(pickle.loads(ours)) == fields(pickle.loads(pickle.dumps(metadata)))


def test_a_large_payload_in_the_head_is_extended_past():
    """A value of 64 KiB or more in the rest of the metadata: protocol 4 writes it between frames."""
    metadata = by_hand(files=2, chunks=2)
    metadata.planner_data = {"blob": b"x" * (1 << 17), "text": "y" * (1 << 17)}
    ours = dumps_metadata(metadata)
    assert ours != pickle.dumps(metadata)
    assert fields(pickle.loads(ours)) == fields(pickle.loads(pickle.dumps(metadata)))


class OtherInfo(_StorageInfo):
    """A storage value of another type: the records would write it as a _StorageInfo."""


def _other_value(m: Metadata) -> None:
    key = next(iter(m.storage_data))
    m.storage_data[key] = OtherInfo(**vars(m.storage_data[key]))


def _extra_attribute(m: Metadata) -> None:
    object.__setattr__(next(iter(m.storage_data)), "note", 1)


def _attribute_in_place_of_offset(m: Metadata) -> None:
    key = MetadataIndex("extra")  # no offset: its __dict__ holds fqn and index
    object.__setattr__(key, "note", torch.Size([1]))
    m.storage_data[key] = m.storage_data.pop(key)


def _bool_offset(m: Metadata) -> None:
    next(iter(m.storage_data.values())).offset = True


def _numpy_dim(m: Metadata) -> None:
    import numpy as np
    key = next(iter(m.storage_data))
    m.storage_data[MetadataIndex(key.fqn, torch.Size([np.int64(0), 0]), 1)] = m.storage_data.pop(key)


def _past_64_bits(m: Metadata) -> None:
    next(iter(m.storage_data.values())).length = 2**64


def _tuple_descriptors(m: Metadata) -> None:
    next(iter(m.storage_data.values())).transform_descriptors = ("stream.zstd/1",)


def _shared_storage(m: Metadata) -> None:
    m.planner_data = {"storage": m.storage_data}


def _kept(m: Metadata) -> Metadata:
    return kept(m)


@pytest.mark.parametrize("surprise", [_other_value, _extra_attribute, _attribute_in_place_of_offset,
                                      _bool_offset, _numpy_dim, _past_64_bits,
                                      _tuple_descriptors])
def test_storage_entries_the_records_do_not_reproduce_are_pickled_by_pickle(surprise):
    """``storage_data`` goes in the head, whole, by the standard pickler; the chunk lists are
    still laid out."""
    metadata = by_hand(files=2, chunks=2)
    surprise(metadata)
    ours, standard = dumps_metadata(metadata), pickle.dumps(metadata)
    assert ours != standard
    assert_read_alike(ours, standard)


class OtherChunk(ChunkStorageMetadata):
    """A chunk of another type: the records would write it as a ChunkStorageMetadata."""


def _other_chunk(m: Metadata) -> None:
    chunks = m.state_dict_metadata["flat"].chunks
    chunks[1] = OtherChunk(chunks[1].offsets, chunks[1].sizes)


def _chunk_attribute(m: Metadata) -> None:
    m.state_dict_metadata["flat"].chunks[0].note = 1


def _tuple_offsets(m: Metadata) -> None:
    m.state_dict_metadata["flat"].chunks[0].offsets = (0,)


def _chunks_a_tuple(m: Metadata) -> None:
    m.state_dict_metadata["flat"].chunks = tuple(m.state_dict_metadata["flat"].chunks)


class OtherTensor(TensorStorageMetadata):
    """An entry of another type."""


def _other_entry(m: Metadata) -> None:
    m.state_dict_metadata["flat"] = OtherTensor(**vars(m.state_dict_metadata["flat"]))


@pytest.mark.parametrize("surprise", [_other_chunk, _chunk_attribute, _tuple_offsets, _chunks_a_tuple, _other_entry])
def test_a_chunk_list_the_records_do_not_reproduce_is_pickled_by_pickle(surprise):
    """That key's entry goes in the head as it is; the other key's chunks are laid out."""
    metadata = by_hand(files=2, chunks=2)
    surprise(metadata)
    ours, standard = dumps_metadata(metadata), pickle.dumps(metadata)
    assert ours != standard
    assert_read_alike(ours, standard)


def _shared_plan(m: Metadata) -> None:
    m.planner_data = {"plan": m.state_dict_metadata}


@pytest.mark.parametrize("surprise", [_kept, _shared_plan, _shared_storage])
def test_a_metadata_the_records_do_not_reproduce_is_pickled_by_pickle(surprise):
    metadata = by_hand(files=2, chunks=2)
    metadata = surprise(metadata) or metadata
    assert dumps_metadata(metadata) == pickle.dumps(metadata)


def test_chunks_of_every_dimensionality_and_empty_lists_read_back_alike():
    """0 to 4 dims, a tensor of no chunks, a shared chunk list: every unpickler reads it alike."""
    metadata = by_hand(files=2, chunks=2)
    plan = metadata.state_dict_metadata
    for nd in range(5):
        size = torch.Size([6] * nd)
        plan[f"t{nd}"] = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), size,
                                               [ChunkStorageMetadata(torch.Size([0] * nd), size)])
    plan["empty"] = TensorStorageMetadata(TensorProperties(), torch.Size([0]), [])
    assert_reads_back_alike(metadata)


def test_a_storage_value_of_a_subclass_round_trips_as_itself():
    metadata = by_hand(files=2, chunks=2)
    _other_value(metadata)
    loaded = pickle.loads(dumps_metadata(metadata))
    assert fields(loaded) == fields(pickle.loads(pickle.dumps(metadata)))
    assert type(next(iter(loaded.storage_data.values()))) is OtherInfo


def test_empty_or_absent_storage_data_is_pickled_by_pickle():
    for storage in ({}, None):
        metadata = Metadata({}, storage_data=storage)
        assert dumps_metadata(metadata) == pickle.dumps(metadata)


# -- from the columns the write results arrive as ---------------------------------------------------

def gathered(metadata: Metadata) -> Written:
    """``storage_data`` as rank 0 receives it: each file's write results packed by its rank,
    pickled, and joined."""
    by_file: dict[str, list] = {}
    for key, info in metadata.storage_data.items():
        by_file.setdefault(info.relative_path, []).append(WriteResult(key, info.length, info))
    return written_of([pickle.loads(pickle.dumps(PackedWrites(results))) for results in by_file.values()])


def with_storage(metadata: Metadata, storage) -> Metadata:
    other = Metadata.__new__(Metadata)
    vars(other).update(vars(metadata))
    other.storage_data = storage
    return other


def assert_columns_read_back_alike(metadata: Metadata, *, file_sizes: dict | None = None) -> None:
    written = gathered(metadata)
    standard = pickle.dumps(with_storage(metadata, StorageEntries(written).as_dict()))
    ours = dumps_metadata(with_storage(metadata, StorageEntries(written)), written)
    assert ours != standard, "expected the fast path, actual pickle.dumps' bytes"
    expected = fields(pickle.loads(standard))
    assert fields(pickle.loads(ours)) == expected
    assert fields(restricted_load_metadata(ours, source="ours", file_sizes=file_sizes)) == expected


@pytest.mark.parametrize("chunked, zstd", [(True, False), (True, True)], ids=["row-chunks", "row-chunks-zstd"])
def test_the_columns_of_a_real_save_read_back_as_its_entries(tmp_path, chunked, zstd):
    save(tmp_path, chunked=chunked, zstd=zstd)
    assert_columns_read_back_alike(pickle.loads((tmp_path / ".metadata").read_bytes()), file_sizes=sizes(tmp_path))


def test_the_columns_of_metadata_by_hand_read_back_as_its_entries():
    assert_columns_read_back_alike(by_hand())


def test_columns_the_records_do_not_reproduce_are_pickled_as_their_entries():
    """By the standard pickler, in the head; the chunk lists are still laid out."""
    metadata = by_hand(files=2, chunks=2)
    written = gathered(metadata)  # the columns written_of keeps: changed in a copy
    written = dataclasses.replace(written, transforms=[("stream.zstd/1",)] * len(written))  # a tuple, not a list
    entries = StorageEntries(written)
    ours = dumps_metadata(with_storage(metadata, entries), written)
    assert_read_alike(ours, pickle.dumps(with_storage(metadata, entries.as_dict())))
    assert type(next(iter(pickle.loads(ours).storage_data.values())).transform_descriptors) is tuple


def test_a_plan_whose_chunk_lists_changed_since_its_last_save_reads_back_as_it_is_now():
    """The plan's tables are kept from one save to the next of the same plan; a chunk list
    replaced or grown since is seen, and that plan pickled as it now is."""
    metadata = by_hand(files=2, chunks=2)
    assert_reads_back_alike(metadata)
    flat = metadata.state_dict_metadata["flat"]
    flat.chunks = flat.chunks[:1]
    assert_read_alike(dumps_metadata(metadata), pickle.dumps(metadata))
    flat.chunks.append(ChunkStorageMetadata(torch.Size([5]), torch.Size([1])))
    assert_read_alike(dumps_metadata(metadata), pickle.dumps(metadata))
    assert len(pickle.loads(dumps_metadata(metadata)).state_dict_metadata["flat"].chunks) == 2


def test_the_next_save_of_a_plan_reuses_its_chunk_records_and_reads_back_alike():
    """A later save of the same plan (new storage entries and storage_meta, as every save has)
    writes the chunk records of the save before: still read back as the standard stream."""
    first = by_hand(files=2, chunks=2)
    assert_reads_back_alike(first)
    later = pickle.loads(pickle.dumps(first))
    later.state_dict_metadata = first.state_dict_metadata
    later.storage_meta = StorageMeta(checkpoint_id="/ckpt/later", save_id="s2", modules=["m", "n"])
    later.planner_data = {"other": ("x",)}
    ours = assert_reads_back_alike(later)
    assert ours == dumps_metadata(later)


def packed_by_file(metadata: Metadata) -> list:
    """Each file's write results, packed and pickled by its rank, as rank 0 receives them."""
    by_file: dict[str, list] = {}
    for key, info in metadata.storage_data.items():
        by_file.setdefault(info.relative_path, []).append(WriteResult(key, info.length, info))
    return [pickle.dumps(PackedWrites(results)) for results in by_file.values()]


def assert_gathered_reads_back_alike(metadata: Metadata, blobs: list[bytes]) -> tuple[Written, bytes]:
    written = written_of([pickle.loads(b) for b in blobs])
    standard = pickle.dumps(with_storage(metadata, StorageEntries(written).as_dict()))
    ours = dumps_metadata(with_storage(metadata, StorageEntries(written)), written)
    assert_read_alike(ours, standard)
    return written, ours


def test_a_later_save_whose_ranks_wrote_the_same_writes_the_same_records_and_a_changed_one_its_own():
    """The storage records are kept with the columns they came from: the next save of the plan
    whose every rank wrote the same writes them again (the same bytes); a save where one rank's
    entry grew (its later offsets shifted) is laid out anew and reads back its own values; the
    same columns under a head of another length still read back alike."""
    from resume.adapters.dcp import metadata_pickle

    metadata = by_hand(files=3, chunks=2)
    blobs = packed_by_file(metadata)
    written, ours = assert_gathered_reads_back_alike(metadata, blobs)
    kept = metadata_pickle._STORAGE[0].parts
    again, ours_again = assert_gathered_reads_back_alike(metadata, blobs)
    assert again is written and ours_again == ours and metadata_pickle._STORAGE[0].parts is kept

    rank = as_write_results(pickle.loads(blobs[1]))
    rank[0].storage_data.length += 40  # its first entry grew: every later entry of its file moves on
    for result in rank[1:]:
        result.storage_data.offset += 40
    changed, ours_changed = assert_gathered_reads_back_alike(metadata, [blobs[0], pickle.dumps(PackedWrites(rank)), *blobs[2:]])
    assert changed is not written and ours_changed != ours
    loaded = pickle.loads(ours_changed).storage_data
    assert loaded[rank[0].index].length == rank[0].storage_data.length
    assert all(loaded[r.index].offset == r.storage_data.offset for r in rank)

    base = metadata_pickle._STORAGE[0].base
    busier = with_storage(metadata, metadata.storage_data)
    busier.planner_data = {f"k{i}": (f"k{i}", str(i)) for i in range(300)}  # the head's memo grows
    same, _ = assert_gathered_reads_back_alike(busier, [blobs[0], pickle.dumps(PackedWrites(rank)), *blobs[2:]])
    assert same is changed and metadata_pickle._STORAGE[0].base > base
