"""The checkpoint's typed-array index (issue 28): round trips for every kind of state, each rank
answered with its own entries only, and a damaged or forged index refused as corruption.

Metadata for layouts of several ranks is made as DCP makes it (``DefaultSavePlanner``'s global
plan over each rank's local plan, and the write results of each rank's file); the index of it
must answer any set of boxes (the same layout, another data-parallel size, the whole tensors)
with exactly the chunks a brute-force overlap finds, and ``partial_metadata`` of that answer must
equal the original metadata restricted to those chunks.
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
import re
import struct

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from resume.adapters.dcp import index as ix
from resume.adapters.dcp.reader import SafeFileSystemReader, SafeLoadPlanner
from support.checkpoints import drop_index, edit_manifest, replace_listed_file
from support.hostile import restore_in_subprocess, resume_cli
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from resume.errors import CorruptCheckpointError, UnsafeCheckpointError

STEP4 = "step-000000004"


# -- metadata as DCP makes it, for layouts of several ranks ------------------------------------------

def shard_item(name: str, offsets, sizes, size, dtype=torch.float32) -> WriteItem:
    chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
    return WriteItem(index=MetadataIndex(name, torch.Size(offsets)), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=dtype),
                                                 size=torch.Size(size)))


def bytes_item(name: str) -> WriteItem:
    return WriteItem(index=MetadataIndex(name), type=WriteItemType.BYTE_IO)


def even(n: int, parts: int) -> list[tuple[int, int]]:
    """(offset, size) of ``parts`` chunks of ``n`` as torch.chunk cuts them (the last shorter)."""
    step = -(-n // parts)
    return [(min(o, n), max(0, min(step, n - o))) for o in range(0, parts * step, step)]


def layout_plans(ranks: int) -> list[SavePlan]:
    """Each rank's local plan: TP-sharded 2-D weights (Shard(0) and Shard(1)) replicated over the
    data-parallel ranks, an FSDP2-style Shard(0) over all ranks (uneven), a Megatron-shaped flat
    optimizer buffer (1-D ranges of different lengths), a replicated 0-d tensor and bytes entries."""
    tp, plans = 2, []
    dp = ranks // tp
    flat_chunks = even(60, ranks)
    for r in range(ranks):
        t, d = r % tp, r // tp
        items = [shard_item("model.qkv.weight", (t * 6, 0), (6, 4), (12, 4)),
                 shard_item("model.proj.weight", (0, t * 3), (4, 3), (4, 6), torch.bfloat16),
                 shard_item("model.scale", (), (), ()),
                 bytes_item("optim.param_groups.0.lr"), bytes_item("extra.loader")]
        o, n = even(10, ranks)[r]
        items.append(shard_item("model.embed.weight", (o, 0), (n, 5), (10, 5)))
        items.append(shard_item("optim.state.flat.exp_avg", (flat_chunks[r][0],), (flat_chunks[r][1],), (60,)))
        items = [i for i in items if i.type == WriteItemType.BYTE_IO or d == 0 or not i.index.fqn.startswith("model.")
                 or i.index.fqn == "model.embed.weight"] if dp > 1 else items
        plans.append(SavePlan(items))
    return plans


def finished_metadata(ranks: int):
    """DCP's global plan and Metadata over ``layout_plans``, storage_data as ``finish`` fills it."""
    global_plan, metadata = DefaultSavePlanner(flatten_state_dict=False).create_global_plan(layout_plans(ranks))
    storage, sizes = {}, {}
    for rank, plan in enumerate(global_plan):
        name, offset = f"__{rank}_0.distcp", 0
        for item in plan.items:
            length = (item.tensor_storage_size() or 1) + 100
            storage[item.index] = _StorageInfo(name, offset, length)
            offset += length
        sizes[name] = offset
    metadata.storage_data = storage
    return metadata, sizes


def whole_boxes(metadata) -> dict[str, object]:
    """A flattened state dict holding every entry whole (meta tensors: no memory)."""
    return {name: (torch.empty(entry.size, dtype=entry.properties.dtype, device="meta")
                   if hasattr(entry, "size") else "x") for name, entry in metadata.state_dict_metadata.items()}


class Boxes:
    """Requests for explicit boxes (what a rank of another layout holds)."""

    def __init__(self, boxes: list[tuple[str, tuple | None, tuple | None]]) -> None:
        names, hashes, nds, at, coords = [], [], [], [], []
        for name, offsets, sizes in boxes:
            names.append(name)
            hashes.append(ix.key_hash(name))
            at.append(len(coords))
            nds.append(-1 if offsets is None else len(offsets))
            coords += [] if offsets is None else [*offsets, *sizes]
        self.requests = ix.Requests(names, np.array(hashes, np.int64), np.array(nds, np.int64),
                                    np.array(at, np.int64), np.array(coords, np.int64))


def overlapping(metadata, name: str, offsets, sizes) -> set[tuple]:
    entry = metadata.state_dict_metadata[name]
    if isinstance(entry, BytesStorageMetadata):
        return {()}
    found = set()
    for chunk in entry.chunks:
        if all(max(a, o) < min(a + n, o + s) for a, n, o, s in zip(offsets, sizes, chunk.offsets, chunk.sizes)) \
                and all(s > 0 for s in chunk.sizes):
            found.add(tuple(chunk.offsets))
    if not entry.size:  # a 0-d tensor: its one chunk
        found = {()}
    return found


def answered(index, boxes_per_rank: list[Boxes], hashed=()) -> list:
    answers = ix.select(index, [b.requests.wire() for b in boxes_per_rank], list(hashed))
    return [ix.partial_metadata(a, b.requests, source="answer") for a, b in zip(answers, boxes_per_rank)]


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_the_index_round_trips_every_kind_of_entry(ranks):
    metadata, sizes = finished_metadata(ranks)
    index = ix.CheckpointIndex.parse(ix.encode_index(metadata), source="index", file_sizes=sizes)
    whole = ix.requests_for(whole_boxes(metadata))
    answers = ix.select(index, [whole.wire()], [])
    back, _ = ix.partial_metadata(answers[0], whole, source="answer")
    assert set(back.state_dict_metadata) == set(metadata.state_dict_metadata)
    for name, entry in metadata.state_dict_metadata.items():
        got = back.state_dict_metadata[name]
        assert type(got) is type(entry)
        if isinstance(entry, BytesStorageMetadata):
            continue
        assert got.size == entry.size and got.properties.dtype == entry.properties.dtype
        # Every chunk that holds data (an empty one, as a rank past the end of an uneven split
        # saves, overlaps nothing: neither DCP's planner nor the index reads it).
        assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in got.chunks) == \
            sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks if c.sizes.numel() or not c.sizes)
    empty = {(i.fqn, tuple(c.offsets)) for i in metadata.storage_data for e in [metadata.state_dict_metadata[i.fqn]]
             if hasattr(e, "chunks") for c in e.chunks if c.sizes and not c.sizes.numel()}
    assert {(i.fqn, tuple(i.offset or ())): (s.relative_path, s.offset, s.length) for i, s in back.storage_data.items()} \
        == {(i.fqn, tuple(i.offset or ())): (s.relative_path, s.offset, s.length) for i, s in metadata.storage_data.items()
            if (i.fqn, tuple(i.offset or ())) not in empty}


def rank_boxes(ranks: int) -> list[Boxes]:
    """What each rank of ``layout_plans(ranks)`` holds (its own write items' chunks; every
    data-parallel replica holds the TP shards of the model)."""
    out = []
    for plan, replica in zip(layout_plans(ranks), layout_plans(2) * ranks):
        held = {(i.index.fqn, tuple(i.index.offset) if i.index.offset is not None else None,
                 tuple(i.tensor_data.chunk.sizes) if i.tensor_data else None) for i in plan.items}
        held |= {(i.index.fqn, tuple(i.index.offset), tuple(i.tensor_data.chunk.sizes))
                 for i in replica.items if i.index.fqn in ("model.qkv.weight", "model.proj.weight")}
        out.append(Boxes(sorted(held, key=lambda b: (b[0], b[1] or ()))))
    return out


@pytest.mark.parametrize("saved, restored", [(4, 4), (4, 2), (2, 8), (8, 1)])
def test_each_rank_gets_exactly_the_chunks_overlapping_its_boxes(saved, restored):
    metadata, sizes = finished_metadata(saved)
    index = ix.CheckpointIndex.parse(ix.encode_index(metadata), source="index", file_sizes=sizes)
    boxes = rank_boxes(restored)
    for own, (partial, _) in zip(boxes, answered(index, boxes)):
        for row, name in enumerate(own.requests.names):
            nd = int(own.requests.ndim[row])
            at = int(own.requests.coords_at[row])
            offsets = tuple(own.requests.coords[at:at + nd].tolist()) if nd >= 0 else None
            sizes_ = tuple(own.requests.coords[at + nd:at + 2 * nd].tolist()) if nd >= 0 else None
            expected = overlapping(metadata, name, offsets, sizes_) if nd >= 0 else {()}
            entry = partial.state_dict_metadata[name]
            got = {()} if isinstance(entry, BytesStorageMetadata) else \
                {tuple(c.offsets) for c in entry.chunks if overlapping(metadata, name, offsets, sizes_) >= {tuple(c.offsets)}}
            assert expected <= got, (name, offsets)
        # Only its own: no chunk it does not overlap.
        for name, entry in partial.state_dict_metadata.items():
            if isinstance(entry, BytesStorageMetadata):
                continue
            mine = [(int(own.requests.coords[int(own.requests.coords_at[r]):][0]) if int(own.requests.ndim[r]) else 0)
                    for r, n in enumerate(own.requests.names) if n == name]
            assert mine
            union = set().union(*(overlapping(metadata, name, *box) for box in own_boxes(own, name)))
            assert {tuple(c.offsets) for c in entry.chunks} == union


def own_boxes(own: Boxes, name: str) -> list[tuple]:
    boxes = []
    for row, n in enumerate(own.requests.names):
        nd, at = int(own.requests.ndim[row]), int(own.requests.coords_at[row])
        if n == name and nd >= 0:
            boxes.append((tuple(own.requests.coords[at:at + nd].tolist()),
                          tuple(own.requests.coords[at + nd:at + 2 * nd].tolist())))
    return boxes


def test_the_answer_to_a_rank_does_not_grow_with_the_ranks():
    sizes_of = {}
    for ranks in (2, 8):
        metadata, sizes = finished_metadata(ranks)
        index = ix.CheckpointIndex.parse(ix.encode_index(metadata), source="index", file_sizes=sizes)
        boxes = rank_boxes(ranks)
        answers = ix.select(index, [b.requests.wire() for b in boxes], [])
        sizes_of[ranks] = max(len(a) for a in answers)
    assert sizes_of[8] <= sizes_of[2] + 512, sizes_of


def test_each_file_is_hashed_by_one_rank_the_one_reading_most_of_it():
    metadata, sizes = finished_metadata(4)
    index = ix.CheckpointIndex.parse(ix.encode_index(metadata), source="index", file_sizes=sizes)
    boxes = rank_boxes(4)
    hashed = [hashed for _, hashed in answered(index, boxes, hashed=sorted(sizes) + ["__9_0.distcp"])]
    assert sorted(itertools.chain(*hashed)) == sorted([*sizes, "__9_0.distcp"])  # each once, the stray too
    for rank in range(4):
        assert f"__{rank}_0.distcp" in hashed[rank]  # a rank reads its own file most


# -- a damaged or forged index, in memory ---------------------------------------------------------

def forged(edit) -> tuple[bytes, dict]:
    metadata, sizes = finished_metadata(4)
    data = bytearray(ix.encode_index(metadata))
    head_len = struct.unpack_from("<I", data, 12)[0]
    header = json.loads(bytes(data[16:16 + head_len]))
    body = np.frombuffer(bytes(data[16 + head_len:]), dtype="<i8").copy()
    arrays = {name: body[at // 8: at // 8 + n] for name, (at, n) in header["arrays"].items()}
    arrays["keys"] = arrays["keys"].reshape(-1, 7)
    arrays["chunks"] = arrays["chunks"].reshape(-1, 5)
    edit(header, arrays)
    header.pop("arrays")
    return ix._pack(header, arrays), sizes


@pytest.mark.parametrize("edit, needle", [
    (lambda h, a: a["chunks"].__setitem__((0, 2), 1 << 40), "offset + length within the file's size"),
    (lambda h, a: a["chunks"].__setitem__((0, 1), 99), "a listed file"),
    (lambda h, a: a["keys"].__setitem__((0, 1), 77), "dtype"),
    (lambda h, a: a["keys"].__setitem__((0, 5), 99), "chunks in order"),
    (lambda h, a: a["coords"].__setitem__(slice(None), 1 << 40), "within the tensor's shape"),
    (lambda h, a: h["keys"].__setitem__(1, h["keys"][0]), "distinct names"),
    (lambda h, a: h["dtypes"].__setitem__(0, "object"), "header.dtypes"),
    (lambda h, a: h.__setitem__("keys", h["keys"][:-1]), "one per key"),
    (lambda h, a: a["chunks"].__setitem__((slice(None), 4), 1), "transform 0"),
])
def test_a_forged_index_is_refused_naming_the_field(edit, needle):
    data, sizes = forged(edit)
    with pytest.raises(CorruptCheckpointError, match=re.escape(needle)):
        ix.CheckpointIndex.parse(data, source="step/index.resume", file_sizes=sizes)


def test_a_path_out_of_the_step_directory_is_unsafe():
    data, sizes = forged(lambda h, a: h["files"].__setitem__(0, "../../etc/passwd"))
    with pytest.raises(UnsafeCheckpointError, match="header.files"):
        ix.CheckpointIndex.parse(data, source="index.resume", file_sizes=sizes)


@pytest.mark.parametrize("cut", [0, 7, 15, 40, 400, -8])
def test_a_truncated_index_is_refused_not_crashed(cut):
    metadata, sizes = finished_metadata(2)
    data = ix.encode_index(metadata)
    with pytest.raises(CorruptCheckpointError, match="index.resume"):
        ix.CheckpointIndex.parse(data[:cut], source="index.resume", file_sizes=sizes)


def test_overlapping_one_dimensional_chunks_are_refused():
    def overlap(h, a):
        # The flat buffer's second chunk starts inside the first.
        k = h["keys"].index("optim.state.flat.exp_avg")
        first = a["keys"][k, 4]
        a["coords"][a["chunks"][first + 1, 0]] -= 1
    data, sizes = forged(overlap)
    with pytest.raises(CorruptCheckpointError, match="disjoint"):
        ix.CheckpointIndex.parse(data, source="index.resume", file_sizes=sizes)


def saved_items(index: ix.CheckpointIndex) -> dict[tuple, tuple]:
    """{(key, chunk offsets): (file, offset, length, transform)} of a parsed index."""
    out = {}
    for k, name in enumerate(index.names):
        kind, _, nd, _, first, count, _ = index.keys[k].tolist()
        for c in range(first, first + count):
            at, file, offset, length, transform = index.chunks[c].tolist()
            out[name, tuple(index.coords[at:at + nd].tolist()) if kind == 0 else None] = (
                index.files[file], offset, length, transform)
    return out


def test_a_later_save_of_the_plan_places_its_entries_by_value_in_any_order():
    # Rank 0 receives every rank's write results unpickled: new objects at every save, in
    # whatever order the ranks' lists come. The plan's tables are reused; the entries are
    # placed by key and offsets, never by the objects' identity or order.
    metadata, sizes = finished_metadata(4)
    first = saved_items(ix.CheckpointIndex.parse(ix.encode_index(metadata), source="i", file_sizes=sizes))
    again = pickle.loads(pickle.dumps(metadata.storage_data))
    metadata.storage_data = dict(reversed(list(again.items())))
    later = saved_items(ix.CheckpointIndex.parse(ix.encode_index(metadata), source="i", file_sizes=sizes))
    assert later == first and len(first) == len(metadata.storage_data)


def test_entries_that_are_not_the_plans_chunks_write_no_index():
    metadata, _ = finished_metadata(2)
    entry = next(i for i in metadata.storage_data if i.fqn == "model.embed.weight")
    info = metadata.storage_data[entry]
    metadata.storage_data[MetadataIndex(entry.fqn, torch.Size([1, 0]))] = info  # no chunk starts there
    with pytest.raises(ValueError, match="model.embed.weight"):
        ix.encode_index(metadata)
    del metadata.storage_data[entry]  # one entry short
    metadata.storage_data.pop(MetadataIndex(entry.fqn, torch.Size([1, 0])))
    with pytest.raises(ValueError, match="chunks once each"):
        ix.encode_index(metadata)


def test_two_chunks_of_a_matrix_from_one_element_are_refused():
    def same_start(h, a):
        # The embedding's second shard forged to start where the first does (both then
        # claim that element: a box matching the second exactly would skip the first).
        k = h["keys"].index("model.embed.weight")
        first, nd = a["keys"][k, 4], a["keys"][k, 2]
        one, two = a["chunks"][first, 0], a["chunks"][first + 1, 0]
        a["coords"][two:two + nd] = a["coords"][one:one + nd]
    data, sizes = forged(same_start)
    with pytest.raises(CorruptCheckpointError, match="disjoint"):
        ix.CheckpointIndex.parse(data, source="index.resume", file_sizes=sizes)


def test_a_gap_in_the_chunks_is_refused_by_the_rank_it_would_leave_unread():
    metadata, sizes = finished_metadata(4)
    embed = metadata.state_dict_metadata["model.embed.weight"]
    gone = embed.chunks[0]
    embed.chunks = embed.chunks[1:]  # rows 0-2 of the embedding saved nowhere
    del metadata.storage_data[MetadataIndex("model.embed.weight", gone.offsets)]
    index = ix.CheckpointIndex.parse(ix.encode_index(metadata), source="index", file_sizes=sizes)
    boxes = [Boxes([("model.embed.weight", (0, 0), (10, 5))])]
    answers = ix.select(index, [b.requests.wire() for b in boxes], [])
    with pytest.raises(CorruptCheckpointError, match="cover this rank's 50 elements exactly once, actual 35"):
        ix.partial_metadata(answers[0], boxes[0].requests, source="answer")


# -- a real checkpoint: the load reads only through the index, and checks it ---------------------------

def test_a_load_through_the_index_hashes_what_it_reads_and_matches_dcp(tmp_path):
    state = {"model": {"w": torch.randn(16, 8), "b": torch.randn(8), "s": torch.tensor(3.0)},
             "optim": {"state": {"w": {"exp_avg": torch.randn(16, 8), "step": torch.tensor(4.0)}},
                       "param_groups": [{"lr": 0.1, "params": ["w"]}]}}
    metadata = dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    files = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)}
    index = ix.CheckpointIndex.parse(ix.encode_index(metadata), source="index",
                                     file_sizes={n: len(d) for n, d in files.items()})
    target = {"model": {"w": torch.zeros(16, 8), "b": torch.zeros(8), "s": torch.tensor(0.0)},
              "optim": {"state": {"w": {"exp_avg": torch.zeros(16, 8), "step": torch.tensor(0.0)}},
                        "param_groups": [{"lr": 0.0, "params": ["w"]}]}}
    requests = ix.requests_for(flatten_state_dict(target)[0])
    (answer,) = ix.select(index, [requests.wire()], ["__0_0.distcp"])
    partial, hashed = ix.partial_metadata(answer, requests, source="answer")
    from resume.checksum import checksum_bytes

    reader = SafeFileSystemReader(str(tmp_path))
    reader.preloaded_metadata = partial
    reader.hash_files = {h: (len(files[h]), checksum_bytes(files[h])) for h in hashed}
    dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    assert reader.verify_hashed(str) == []
    assert torch.equal(target["model"]["w"], state["model"]["w"])
    assert torch.equal(target["optim"]["state"]["w"]["exp_avg"], state["optim"]["state"]["w"]["exp_avg"])
    assert target["optim"]["param_groups"][0]["lr"] == 0.1
    reader.hash_files = {h: (len(files[h]), "xxh3:0000000000000000") for h in hashed}
    dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    expected = f"__0_0.distcp: checksum: expected xxh3:0000000000000000, actual {checksum_bytes(files['__0_0.distcp'])}"
    assert reader.verify_hashed(str) == [expected]


def step4(run: str, *parts: str) -> str:
    return os.path.join(run, STEP4, *parts)


def test_a_forged_index_passes_the_checkpoint_over_as_a_forged_metadata_does(run_copy):
    with open(step4(run_copy, "index.resume"), "rb") as f:
        data = bytearray(f.read())
    data[:8] = b"NOTANIDX"
    replace_listed_file(step4(run_copy), "index.resume", bytes(data))
    verdict = resume_cli("verify", run_copy, "--deep")
    assert verdict.returncode == 1 and f"{STEP4}/index.resume: magic" in verdict.stdout + verdict.stderr
    outcome = restore_in_subprocess(run_copy)
    assert outcome.get("restored_from") == 2, outcome
    assert f"passing over {STEP4}" in outcome["log"] and "index.resume: magic" in outcome["log"], outcome["log"]


def test_a_damaged_shard_found_by_the_load_falls_back_to_the_previous_checkpoint(run_copy):
    path = step4(run_copy, "__0_0.distcp")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    outcome = restore_in_subprocess(run_copy)
    assert outcome.get("restored_from") == 2, outcome
    assert "shards damaged, found while loading (nothing loaded)" in outcome["log"], outcome["log"]
    assert any(n.startswith("quarantine-step-000000004") for n in os.listdir(run_copy))


def test_a_checkpoint_written_before_the_index_restores_from_metadata(run_copy):
    drop_index(step4(run_copy))
    edit_manifest(step4(run_copy), lambda body: body)  # still a valid manifest after the edit
    outcome = restore_in_subprocess(run_copy)
    assert outcome.get("restored_from") == 4, outcome


def small_job(run: str, width: int):
    from resume.adapters.data import GlobalPositionSampler, StatefulLoader
    from resume.adapters.torch_native import NativeTorchAdapter

    from resume import Coordinator

    class Samples(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict:
            return {"x": torch.full((4,), float(i))}

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = StatefulLoader(Samples(), GlobalPositionSampler(64, 4, rank=0, world_size=1))
    coord = Coordinator(run, NativeTorchAdapter(model, optim, None, loader), global_batch=4, every=2,
                        handle_signals=False)
    return coord, model, optim


def test_another_model_shape_is_refused_as_before_and_no_checkpoint_is_moved_aside(tmp_path):
    """A wider layer than saved is the program's change, not damage: the load names the sizes,
    and no checkpoint is passed over or moved aside for it."""
    run = str(tmp_path / "run")
    coord, model, optim = small_job(run, 8)
    coord.restore()
    for batch in coord.batches():
        model(batch["x"]).sum().backward()
        optim.step()
        optim.zero_grad()
        coord.update()
        if coord.state.updates_successful == 4:
            break
    coord.close()
    coord, _, _ = small_job(run, 16)
    with pytest.raises(Exception, match="(?i)size") as raised:
        coord.restore()
    assert type(raised.value).__name__ != "DamagedShardsError"
    coord.close()
    assert sorted(n for n in os.listdir(run) if n.startswith(("step-", "quarantine"))) == \
        ["step-000000002", "step-000000004"]


def test_the_legacy_check_of_a_tensor_of_many_chunks_looks_each_up_once():
    """``.metadata``'s check of storage_data against a tensor of 20,000 chunks (the legacy path):
    each entry's chunk found by its offsets in a table made once, not by a walk over every chunk
    (minutes before)."""
    from resume.adapters.dcp.metadata_check import stored_bytes
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    n = 20_000
    entry = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([n, 4]),
                                  [ChunkStorageMetadata(torch.Size([i, 0]), torch.Size([1, 4])) for i in range(n)])
    entry.chunks.append(ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 4])))  # the first of equal wins
    chunks_at: dict = {}
    found = [stored_bytes(entry, MetadataIndex("w", torch.Size([i, 0])), chunks_at) for i in range(n)]
    assert found == [16] * n
    assert stored_bytes(entry, MetadataIndex("w", torch.Size([n, 0])), chunks_at) is None
    assert stored_bytes(entry, MetadataIndex("w", torch.Size([0, 0]))) == 16
    (table_entry, table), = chunks_at.values()  # one table, of every distinct offset
    assert table_entry is entry and len(table) == n


def test_a_later_save_whose_ranks_wrote_the_same_encodes_the_same_index_and_a_changed_one_its_own():
    """The index is kept with the plan's tables and the save's columns: the same columns
    (``written_of`` hands them back) give the same bytes without encoding; other columns are
    encoded, and the index says their values."""
    from resume.adapters.dcp.written import Written

    metadata, _ = finished_metadata(4)
    written = ix.columns_of(metadata.storage_data)
    data = ix.encode_index(metadata, written)
    assert ix.encode_index(metadata, written) is data
    moved = Written(**{**vars(written), "offset": written.offset + 64})
    other = ix.encode_index(metadata, moved)
    assert other != data
    assert ix.encode_index(metadata, written) == data  # equal columns, another object: encoded again
    before = ix.CheckpointIndex.parse(data, source="i", file_sizes=None, compression=None)
    after = ix.CheckpointIndex.parse(other, source="i", file_sizes=None, compression=None)
    assert (after.chunks[:, 2][before.chunks[:, 2] >= 0] == before.chunks[:, 2][before.chunks[:, 2] >= 0] + 64).all()
