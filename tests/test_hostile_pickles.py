"""Crafted ``.metadata``, rank state and shard items, as an attacker who can write a run makes
them (issue 13, items 2, 3, 4 and J4).

Every case starts from a real run (steps 2 and 4, written by a real training loop through
torch.distributed.checkpoint) and damages step 4; the manifest is recomputed (sizes and
xxh3 rewritten) so only the structural checks can refuse. In every case:

- nothing hangs (each test has a timeout; the CLI and restore run in a subprocess with a
  timeout of their own) and memory stays bounded (the subprocess runs under an address-space
  limit, so inflating a bomb or printing a 2**64-node graph would fail it);
- ``resume verify`` (``--deep`` where only the content is wrong) exits 1 naming the file, with
  one-line errors and no traceback;
- restore passes over step 4 to step 2 (a malformed ``.metadata`` or rank state is found by
  the restore's choice), or refuses with the documented ``CorruptCheckpointError`` naming the
  file (an item found only while loading: a decompression bomb).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import sys
import zipfile

import pytest
import torch
from resume.adapters.dcp import unpickle as dcp_unpickle
from support.checkpoints import edit_manifest, replace_listed_file
from support.hostile import assert_problem, restore_in_subprocess, resume_cli

from resume.errors import CorruptCheckpointError, ManifestError, UnsafeCheckpointError

pytestmark = pytest.mark.timeout(240)

STEP4 = "step-000000004"
SHARD = "__0_0.distcp"
RANK0 = "rank-00000.json"
TENSOR_ITEM = "model.blocks.0.qkv.weight"  # a plain contiguous float32 tensor, 48x16


def step4(run: str, *parts: str) -> str:
    return os.path.join(run, STEP4, *parts)


def real_metadata(run: str):
    with open(step4(run, ".metadata"), "rb") as f:
        return dcp_unpickle.restricted_load_metadata(f.read(), source=".metadata")


def plant_metadata(run: str, data: bytes) -> None:
    replace_listed_file(step4(run), ".metadata", data)


def with_placeholder(metadata, set_placeholder, opcodes: bytes) -> bytes:
    """``metadata`` pickled (protocol 2: no frames to fix up) with the string put in place by
    ``set_placeholder`` replaced by ``opcodes`` (which leave one object on the stack)."""
    marker = "PLACEHOLDER-0123456789"
    set_placeholder(metadata, marker)
    data = pickle.dumps(metadata, protocol=2)
    encoded = b"X" + struct.pack("<I", len(marker)) + marker.encode()
    assert data.count(encoded) == 1
    return data.replace(encoded, opcodes)


def deep_list(depth: int) -> bytes:
    """Opcodes of a list nested ``depth`` deep: a few bytes per level, no recursion to make."""
    return b"]" * depth + b"a" * (depth - 1)


def shared_tuple_graph(levels: int) -> bytes:
    """Opcodes of t = (); t = (t, t) ``levels`` times: tiny, and 2**levels nodes when walked."""
    slot = struct.pack("<I", 999_999)
    return b")r" + slot + (b"0j" + slot + b"j" + slot + b"\x86r" + slot) * levels


def expect_refused_metadata(run: str, *needles: str) -> None:
    """verify --deep exits 1 naming .metadata; restore passes over step 4 to step 2, naming it."""
    assert_problem(resume_cli("verify", run, "--deep"), f"{STEP4}/.metadata", *needles)
    outcome = restore_in_subprocess(run)
    assert outcome.get("restored_from") == 2, outcome
    assert f"passing over {STEP4}" in outcome["log"] and needles[0] in outcome["log"], outcome["log"]


# -- .metadata of the wrong shape ---------------------------------------------------------------------


def test_storage_data_as_a_list_is_refused_naming_the_field(run_copy):
    metadata = real_metadata(run_copy)
    metadata.storage_data = list(metadata.storage_data.values())
    plant_metadata(run_copy, pickle.dumps(metadata))
    expect_refused_metadata(run_copy, "storage_data: expected a dict, actual 'list'")


def test_integer_state_dict_metadata_is_refused_naming_the_field(run_copy):
    metadata = real_metadata(run_copy)
    metadata.state_dict_metadata = 7
    plant_metadata(run_copy, pickle.dumps(metadata))
    expect_refused_metadata(run_copy, "state_dict_metadata: expected a dict")


def test_a_list_nested_200000_deep_is_refused_without_recursion_error(run_copy):
    data = with_placeholder(real_metadata(run_copy), lambda m, s: setattr(m, "planner_data", s),
                            deep_list(200_000))
    plant_metadata(run_copy, data)
    expect_refused_metadata(run_copy, "planner_data: expected plain data at most 32 levels deep")


def test_a_shared_tuple_graph_as_relative_path_is_refused_quickly_and_quoted_bounded(run_copy):
    def set_path(metadata, marker):
        next(iter(metadata.storage_data.values())).relative_path = marker
    plant_metadata(run_copy, with_placeholder(real_metadata(run_copy), set_path, shared_tuple_graph(64)))
    proc = resume_cli("verify", run_copy, "--deep", timeout=60)
    assert_problem(proc, f"{STEP4}/.metadata", "relative_path: expected a string")
    assert len(proc.stderr) < 2000, proc.stderr


def test_a_chunk_larger_than_its_file_can_hold_is_refused(run_copy):
    metadata = real_metadata(run_copy)
    entry = metadata.state_dict_metadata[TENSOR_ITEM]
    entry.size = entry.chunks[0].sizes = torch.Size([1 << 20, 1 << 20])
    plant_metadata(run_copy, pickle.dumps(metadata))
    expect_refused_metadata(run_copy, "length: expected at least the chunk's")


def test_an_item_beyond_the_end_of_its_file_is_refused(run_copy):
    metadata = real_metadata(run_copy)
    info = next(iter(metadata.storage_data.values()))
    info.offset = 1 << 40
    plant_metadata(run_copy, pickle.dumps(metadata))
    expect_refused_metadata(run_copy, "offset + length: expected at most __0_0.distcp's size")


# -- BUILD: never on a class, never changing the process ------------------------------------------------


ALLOWED_MODULES = [sys.modules[m] for m in ("torch.distributed.checkpoint.metadata",
                                            "torch.distributed.checkpoint.filesystem",
                                            "torch.distributed.checkpoint.planner")]


def process_state() -> dict:
    """Every allowed class's and module's attributes (names and the objects they hold)."""
    classes = {f"{c.__module__}.{c.__qualname__}": c for c in dcp_unpickle._ALLOWED.values() if isinstance(c, type)}
    out = {name: dict(vars(c)) for name, c in classes.items()}
    out.update({m.__name__: dict(vars(m)) for m in ALLOWED_MODULES})
    return out


def build_on_class(module: str, name: str, attribute: str) -> bytes:
    """Opcodes that set ``attribute`` = None on the class ``module.name`` (BUILD with a slot
    state, the way setattr reaches a class), leaving nothing on the stack."""
    key = attribute.encode()
    return (b"c" + module.encode() + b"\n" + name.encode() + b"\n"
            + b"N}X" + struct.pack("<I", len(key)) + key + b"Ns\x86b0")


def test_build_on_a_class_before_a_forbidden_global_is_refused_and_changes_nothing():
    before = process_state()
    data = (b"\x80\x02" + build_on_class("torch.distributed.checkpoint.filesystem", "_StorageInfo",
                                          "relative_path") + b"cos\nsystem\n.")
    with pytest.raises((UnsafeCheckpointError, CorruptCheckpointError), match="BUILD on the class"):
        dcp_unpickle.restricted_load_metadata(data, source=".metadata")
    assert process_state() == before


def test_build_on_a_class_in_front_of_a_real_metadata_is_refused_and_changes_nothing(run_copy):
    with open(step4(run_copy, ".metadata"), "rb") as f:
        genuine = f.read()
    assert genuine[:1] == b"\x80" and genuine[2:3] == b"\x95"  # PROTO, then a FRAME to step over
    body = genuine[11:]
    before = process_state()
    for module, name in (("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                         ("torch.distributed.checkpoint.metadata", "Metadata")):
        data = b"\x80\x04" + build_on_class(module, name, "relative_path" if "Storage" in name else "version") + body
        with pytest.raises(CorruptCheckpointError, match=f"BUILD on the class {module}.{name}"):
            dcp_unpickle.restricted_load_metadata(data, source=".metadata")
    assert process_state() == before
    # The genuine metadata still loads, and a save after the refusal still works.
    dcp_unpickle.restricted_load_metadata(genuine, source=".metadata")
    plant_metadata(run_copy, b"\x80\x04" + build_on_class("torch.distributed.checkpoint.filesystem",
                                                         "_StorageInfo", "relative_path") + body)
    expect_refused_metadata(run_copy, "BUILD on the class torch.distributed.checkpoint.filesystem._StorageInfo")


def test_build_on_anything_but_an_instance_of_the_data_classes_is_refused():
    data = b"\x80\x02cpathlib\nPosixPath\n)R}b."  # a PosixPath instance: allowed, but not a data class
    with pytest.raises(CorruptCheckpointError, match="BUILD on a PosixPath"):
        dcp_unpickle.restricted_load_metadata(data, source=".metadata")
    data = b"\x80\x02ctorch.distributed.checkpoint.filesystem\n_StorageInfo\n)\x81}X\x08\x00\x00\x00__dict__Nsb."
    with pytest.raises(CorruptCheckpointError, match="BUILD on _StorageInfo: expected a dict of field names"):
        dcp_unpickle.restricted_load_metadata(data, source=".metadata")


# -- rank state -------------------------------------------------------------------------------------


def edit_rank_state(run: str, edit) -> None:
    with open(step4(run, RANK0)) as f:
        state = json.load(f)
    edit(state)
    replace_listed_file(step4(run), RANK0, json.dumps(state).encode())


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda s: s["data"].__setitem__("offset", float("nan")), "NaN is not a number JSON allows"),
    (lambda s: s["data"].__setitem__("offset", 2**200), "data.offset: expected an integer below 2**128"),
    (lambda s: s["rng"]["user"].__setitem__("g", {"kind": "numpy.Generator", "state": {
        "bit_generator": "MT19937", "state": {"key": {"__array__": [0], "dtype": "(1099511627776,)u4"}, "pos": 0}}}),
     "rng.user['g'].state: expected a flat array"),
    (lambda s: s["rng"]["numpy"].__setitem__("keys", [0] * 3), "rng.numpy.keys: expected 624 integers"),
    (lambda s: s.__setitem__("adapter", [[[[]]]]), "adapter: expected an object"),
    (lambda s: s["adapter"].__setitem__("bomb", {"__tensor__": "", "dtype": "float32", "shape": [2**40]}),
     "adapter.bomb: expected a tensor of at most 0 elements (the bytes it carries), actual shape [1099511627776]"),
    (lambda s: s["adapter"].__setitem__("bomb", {"__tensor__": "AAAA", "dtype": "uint8", "shape": [1 << 20, 8]}),
     "adapter.bomb: expected a tensor of at most 3 elements"),
], ids=["nan-offset", "huge-int", "2**40-shape-dtype", "short-keys", "adapter-list", "2**40-tensor",
        "tensor-larger-than-its-bytes"])
def test_malformed_rank_state_fails_deep_verify_and_restore_falls_back(run_copy, edit, needle):
    edit_rank_state(run_copy, edit)
    assert resume_cli("verify", run_copy).returncode == 0  # sizes and checksums agree
    assert_problem(resume_cli("verify", run_copy, "--deep"), f"{STEP4}/{RANK0}", needle)
    outcome = restore_in_subprocess(run_copy)
    assert outcome.get("restored_from") == 2, outcome
    assert RANK0 in outcome["log"]


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda s: s["adapter"].__setitem__("schedulers", {"0": {}}), "adapter.schedulers: expected a list"),
    (lambda s: s["adapter"].__setitem__("schedulers", [[1, 2]]),
     "adapter.schedulers[0]: expected an object (the scheduler's state_dict) or null, actual [1, 2]"),
    (lambda s: s["adapter"].__setitem__("optimizer_steps", ["3"]), "adapter.optimizer_steps: expected a list"),
    (lambda s: s["adapter"].__setitem__("registered", [1]), "adapter.registered: expected an object"),
], ids=["schedulers-object", "scheduler-list", "steps-strings", "registered-list"])
def test_adapter_state_of_the_wrong_type_is_named_and_restore_falls_back(run_copy, edit, needle):
    edit_rank_state(run_copy, edit)
    outcome = restore_in_subprocess(run_copy)
    assert outcome.get("restored_from") == 2, outcome
    assert needle in outcome["log"] and "AttributeError" not in outcome["log"]


def test_rank_state_nested_past_the_parser_is_refused(run_copy):
    replace_listed_file(step4(run_copy), RANK0, b"[" * 100_000 + b"]" * 100_000)
    assert_problem(resume_cli("verify", run_copy, "--deep"), f"{STEP4}/{RANK0}")
    assert restore_in_subprocess(run_copy).get("restored_from") == 2


# -- decompression bounded by the item's size ---------------------------------------------------------


def zstd_bomb(size: int) -> bytes:
    import zstandard

    out = io.BytesIO()
    writer = zstandard.ZstdCompressor(level=1).stream_writer(out, closefd=False)
    chunk = bytes(4 << 20)
    for _ in range(size // len(chunk)):
        writer.write(chunk)
    writer.flush(zstandard.FLUSH_FRAME)
    return out.getvalue()


def plant_item(run: str, fqn: str, item: bytes, transforms: list[str] | None = None) -> None:
    """Append ``item`` to the shard and point ``fqn``'s storage entry at it."""
    with open(step4(run, SHARD), "rb") as f:
        shard = f.read()
    metadata = real_metadata(run)
    (info,) = [s for i, s in metadata.storage_data.items() if i.fqn == fqn]
    info.offset, info.length, info.transform_descriptors = len(shard), len(item), transforms
    replace_listed_file(step4(run), SHARD, shard + item)
    plant_metadata(run, pickle.dumps(metadata))


def test_zstd_on_a_run_saved_without_compression_is_refused(run_copy):
    plant_item(run_copy, TENSOR_ITEM, zstd_bomb(64 << 20), [dcp_unpickle.ZSTD])
    expect_refused_metadata(run_copy, "transform_descriptors: expected none (the run's manifest records no "
                            "compression), actual ['stream.zstd/1']")


def test_a_zstd_bomb_stops_at_the_tensors_size_under_a_memory_limit(run_copy):
    bomb = zstd_bomb(4 << 30)  # 4 GiB of zeros: past the subprocess's address space with torch in it
    assert len(bomb) < 512 << 10
    plant_item(run_copy, TENSOR_ITEM, bomb, [dcp_unpickle.ZSTD])
    edit_manifest(step4(run_copy), lambda body: body["topology"].__setitem__("compression", "zstd"))
    outcome = restore_in_subprocess(run_copy)
    assert outcome.get("error") == "CorruptCheckpointError", outcome
    assert f"{SHARD}: '{TENSOR_ITEM}': decompressed size: expected at most {48 * 16 * 4 + (64 << 10)}" \
        in outcome["message"]


def deflate_bomb_archive(declared: int) -> bytes:
    """A torch.save archive of the 48x16 tensor whose data record is DEFLATE-compressed zeros
    declaring ``declared`` bytes: torch's reader would inflate it all."""
    genuine = io.BytesIO()
    torch.save(torch.zeros(48, 16), genuine)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(genuine.getvalue())) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            if info.filename.endswith("/data/0"):
                bomb = zipfile.ZipInfo(info.filename)
                bomb.compress_type, bomb._compresslevel = zipfile.ZIP_DEFLATED, 1  # type: ignore[attr-defined]
                with dst.open(bomb, "w", force_zip64=True) as record:
                    chunk = bytes(16 << 20)
                    for _ in range(declared // len(chunk)):
                        record.write(chunk)
            else:
                dst.writestr(info.filename, src.read(info))
    return out.getvalue()


def test_a_deflate_record_bomb_is_refused_before_inflating(run_copy):
    archive = deflate_bomb_archive(1 << 30)
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        record = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    assert record.compress_type == zipfile.ZIP_DEFLATED and record.file_size == 1 << 30
    assert record.compress_size < 8 << 20
    plant_item(run_copy, TENSOR_ITEM, archive)
    outcome = restore_in_subprocess(run_copy)
    assert outcome.get("error") == "CorruptCheckpointError", outcome
    assert "expected a stored record inside the item, actual compress_type 8" in outcome["message"]


# -- J4: counters no message can print -----------------------------------------------------------------


def test_a_4291_digit_iteration_is_a_problem_verify_and_ls_can_print(run_copy):
    huge = 7 * 10**4290

    def edit(body):
        body["train_state"].update(iteration=huge, updates_successful=huge)
        body["config"]["global_batch"] = 10**20
    edit_manifest(step4(run_copy), edit)
    assert_problem(resume_cli("verify", run_copy), f"{STEP4}/manifest.json",
                   "train_state.iteration: expected a non-negative integer below 2**63, actual a 4291-digit number")
    listing = resume_cli("ls", run_copy)
    assert listing.returncode == 0 and "Traceback" not in listing.stderr, listing.stderr
    assert STEP4 in listing.stdout
    assert restore_in_subprocess(run_copy).get("restored_from") == 2


def test_invariant_messages_print_huge_products_by_their_length():
    from resume.state import TrainState

    state = TrainState(iteration=7 * 10**4290, samples_read=1, updates_successful=7 * 10**4290)
    from resume.errors import InvariantError

    with pytest.raises(InvariantError, match=r"= a 4311-digit number, actual 1"):
        state.check_invariants(global_batch=10**20)
    with pytest.raises(ManifestError, match="a 4291-digit number"):
        TrainState.from_dict(state.to_dict())
