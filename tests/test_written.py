"""Write results packed for the gather to rank 0 (adapters/dcp/written.py): what rank 0 reads
from them is exactly what DCP builds from the ``WriteResult`` objects, from a real DCP save."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from resume.adapters.dcp import filesystem
from resume.adapters.dcp.written import Packed, PackedWrites, StorageEntries, columns_of, written_of
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from resume.storage import open_storage


def state() -> dict:
    torch.manual_seed(0)
    return {"w": torch.randn(6, 4), "b": torch.randn(4), "scalar": torch.tensor(3.0), "cube": torch.randn(2, 3, 2),
            "step": 7, "name": "run-a", "empty": torch.zeros(0)}


def saved_results(tmp_path, compression=None) -> list:
    """The write results of a real single-process DCP save through the adapter's writer."""
    seen = []
    writer = filesystem.make_writer(open_storage(str(tmp_path)), "step", compression=compression)
    finish = writer.finish

    def record(metadata, results):
        seen.extend(results)
        return finish(metadata, results)
    writer.finish = record
    dcp.save(state(), storage_writer=writer, planner=DefaultSavePlanner(), no_dist=True)
    return seen


def dcp_dict(results: list) -> dict:
    """``storage_data`` as DCP's own ``finish`` builds it."""
    storage = {}
    for rank_results in results:
        storage.update({w.index: w.storage_data for w in rank_results})
    return storage


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_packed_results_read_back_to_the_entries_dcp_builds_in_its_order(tmp_path, compression):
    results = saved_results(tmp_path, compression)
    assert len(results) == 1 and isinstance(results[0], PackedWrites)  # what write_data returns
    gathered = [pickle.loads(pickle.dumps(r)) for r in results * 3]  # three ranks' worth, as the gather
    assert all(type(g) is Packed for g in gathered)
    entries = StorageEntries(written_of(gathered))
    expected = dcp_dict(results)  # the same keys three times over: the dict keeps one of each
    assert len(entries) == 3 * len(expected)
    got = entries.as_dict()
    assert list(got.items()) == list(expected.items())
    assert all(type(k.offset) is torch.Size for k in got if k.offset is not None)
    if compression:
        assert any(v.transform_descriptors for v in got.values())


def test_columns_of_a_dict_and_of_packed_results_agree(tmp_path):
    results = saved_results(tmp_path)
    packed = written_of([pickle.loads(pickle.dumps(results[0]))])
    plain = columns_of(dcp_dict(results))
    for field in ("ndim", "offsets", "index", "file", "offset", "length"):
        assert (getattr(packed, field) == getattr(plain, field)).all(), field
    assert packed.fqns == plain.fqns and packed.files == plain.files


def test_results_a_packing_cannot_describe_travel_as_dcp_sends_them():
    odd = PackedWrites([WriteResult(index=MetadataIndex("x", torch.Size([0])), size_in_bytes=1,
                                    storage_data=_StorageInfo("__0_0.distcp", 0, 2**70))])
    back = pickle.loads(pickle.dumps(odd))
    assert type(back) is list and back[0].storage_data.length == 2**70
    with pytest.raises(ValueError, match="63 bits"):  # the writer then finishes as DCP does
        written_of([back])


def test_ranks_that_packed_and_a_rank_that_did_not_are_read_together(tmp_path):
    results = saved_results(tmp_path)
    mixed = [pickle.loads(pickle.dumps(results[0])), list(results[0])]
    assert list(StorageEntries(written_of(mixed)).as_dict().items()) == list(dcp_dict(results).items())


def test_a_save_through_the_adapters_writer_loads_with_plain_dcp(tmp_path):
    saved_results(tmp_path)
    into = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None) for k, v in state().items()}
    dcp.load(into, checkpoint_id=str(tmp_path / "step"), no_dist=True)
    for k, v in state().items():
        assert torch.equal(into[k], v) if isinstance(v, torch.Tensor) else into[k] == v, k


def test_a_save_whose_entries_the_columns_cannot_hold_finishes_as_dcp_does(tmp_path, caplog):
    # One rank's results would not pack (a length past 63 bits); the others did. The step still
    # gets DCP's .metadata, holding every entry; no index is written.
    results = saved_results(tmp_path)
    odd = [WriteResult(index=MetadataIndex("odd", None), size_in_bytes=1,
                       storage_data=_StorageInfo("__1_0.distcp", 0, 2**70))]
    writer = filesystem.make_writer(open_storage(str(tmp_path)), "again")
    (tmp_path / "again").mkdir()
    plan = DefaultSavePlanner()
    plan.set_up_planner(state(), is_coordinator=True)
    _, metadata = plan.create_global_plan([plan.create_local_plan()])
    writer.finish(metadata, [pickle.loads(pickle.dumps(results[0])), odd])
    with open(tmp_path / "again" / ".metadata", "rb") as f:
        loaded = pickle.load(f)
    assert loaded.storage_data[MetadataIndex("odd", None)].length == 2**70
    assert set(dcp_dict(results)) <= set(loaded.storage_data)
    assert not (tmp_path / "again" / "index.resume").exists() and "no index" in caplog.text


def _results(names: list[str], path: str) -> PackedWrites:
    return PackedWrites(WriteResult(MetadataIndex(name, torch.Size([i])), 4, _StorageInfo(path, 4 * i, 4))
                        for i, name in enumerate(names))


def test_names_travel_as_one_blob_split_once_per_distinct_blob_and_as_a_list_where_one_holds_a_nul():
    same = ["layers.0.w", "\udcff odd", "café", ""]  # a lone surrogate, an empty name: both kept
    with_nul = ["a\0b", "c"]
    sent = [pickle.loads(pickle.dumps(_results(names, f"__{r}_0.distcp")))
            for r, names in enumerate([same, same, with_nul, same[::-1]])]
    assert isinstance(sent[0].names, bytes) and sent[0].names == sent[1].names
    assert sent[2].names == with_nul  # a NUL inside a name: the list itself
    written = written_of(sent)
    expected = [name for names in (same, same, with_nul, same[::-1]) for name in names]
    assert written.fqns == expected
    assert written.names == list(dict.fromkeys(expected))
    assert [written.files[f] for f in written.file] == [f"__{r}_0.distcp" for r in range(4) for _ in range(
        len(same) if r != 2 else 2)]


def test_results_equal_to_the_last_saves_give_its_columns_back_and_a_changed_rank_is_read_anew(tmp_path):
    """A later save of the same plan whose every rank wrote the same: the same ``Written`` (what
    is laid out from it is reused by identity). One rank whose object entry grew, shifting its
    offsets: the columns are read anew and hold the new values."""
    results = saved_results(tmp_path)
    blob = pickle.dumps(results[0])
    first = written_of([pickle.loads(blob) for _ in range(3)])
    assert written_of([pickle.loads(blob) for _ in range(3)]) is first  # new objects, equal bytes
    grown = [pickle.loads(blob) for _ in range(3)]
    offsets = bytearray(grown[1].arrays[5])  # rank 1's ``offset`` column, every entry 8 bytes on
    shifted = (np.frombuffer(bytes(offsets), np.int64) + 8).tobytes()
    grown[1].arrays = (*grown[1].arrays[:5], shifted, *grown[1].arrays[6:])
    again = written_of(grown)
    assert again is not first
    n = len(first) // 3
    assert (again.offset[n:2 * n] == first.offset[n:2 * n] + 8).all()
    assert (again.offset[:n] == first.offset[:n]).all() and (again.offset[2 * n:] == first.offset[2 * n:]).all()
    assert written_of([pickle.loads(blob) for _ in range(3)]) is not again  # equal to the last call's only
