"""No code runs from the pickles inside a DCP shard.

A ``__0_0.distcp`` shard holds one ``torch.save`` zip archive per item, each
with its own ``data.pkl``. Here one item's archive is replaced by one whose
``data.pkl`` calls ``os.system`` when unpickled; the metadata's offsets and
the manifest's sizes and checksums are rewritten to match, so only the
content check can refuse it. Each way a restore reads an item is covered:

- a tensor, read by ``SafeFileSystemReader._read_tensor`` on reader threads (local storage):
  first ``read_stored_tensor_into`` (its ``_RecordUnpickler``), then, since
  that declines, ``torch.load(weights_only=True)``;
- a tensor, read on one reader thread (as for remote storage): the same
  ``SafeFileSystemReader._read_tensor`` (DCP's own ``read_data`` is never used:
  it would decompress and inflate without bounds);
- a non-tensor item (an optimizer hyperparameter, which DCP torch.saves):
  ``SafeLoadPlanner.load_bytes``: ``torch.load(weights_only=True)``.

The refusal is an UnsafeCheckpointError (exit 1) naming the step, and, where
our reader reads the item, the shard file and the item.
"""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from resume.adapters.dcp import reader as dcp_reader
from support.checkpoints import CodeRunningPickle, drop_index
from support.workloads import Setup, build, trained
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from resume import UnsafeCheckpointError
from resume.checksum import checksum_bytes
from resume.cli import cli

SHARD = "__0_0.distcp"
TENSOR_ITEM = "model.blocks.0.qkv.weight"  # a plain contiguous float32 tensor, 48x16
BYTES_ITEM = "optim.param_groups.0.lr"  # a non-tensor entry: DCP writes it with torch.save


def trained_run(tmp_path: Path) -> tuple[str, Path]:
    run = str(tmp_path / "run")
    trained(run, until=2, every=2)
    return run, tmp_path / "run" / "step-000000002"


def stored_entries(archive: bytes) -> dict[str, bytes]:
    """A torch.save zip's entries, read as stored: our shards are written without torch's
    per-record CRC, which zipfile's own reader would reject."""
    out = {}
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        for info in z.infolist():
            assert info.compress_type == zipfile.ZIP_STORED, info
            header = archive[info.header_offset:info.header_offset + 30]
            assert header[:4] == b"PK\x03\x04"
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            start = info.header_offset + 30 + name_len + extra_len
            out[info.filename] = archive[start:start + info.file_size]
    return out


def malicious_record(genuine: bytes, command: str) -> bytes:
    """The genuine record rewritten as a zip laid out like torch.save's (every entry kept,
    all stored), except that its ``data.pkl`` runs ``command`` when unpickled.

    Written by hand, not by torch.save, so it does not depend on what torch.save
    does; a tensor's ``data/0`` is kept, so the direct reader gets as far as the pickle.
    """
    entries = stored_entries(genuine)
    prefix = next(iter(entries)).split("/", 1)[0]
    assert f"{prefix}/data.pkl" in entries, sorted(entries)
    entries[f"{prefix}/data.pkl"] = pickle.dumps(CodeRunningPickle(command), protocol=2)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for name in sorted(entries, key=lambda n: not n.endswith("/data.pkl")):  # data.pkl first
            dst.writestr(name, entries[name])
    return out.getvalue()


def plant(step_dir: Path, fqn: str, command: str) -> tuple[int, bytes]:
    """Replace ``fqn``'s record in the shard by a code-running one; fix the offsets and
    lengths in ``.metadata`` and the sizes and checksums in the manifest.
    Returns the planted record's offset and bytes."""
    metadata = FileSystemReader(str(step_dir)).read_metadata()  # our own file: plain pickle is fine
    (index,) = [i for i in metadata.storage_data if i.fqn == fqn]
    target = metadata.storage_data[index]
    assert target.relative_path == SHARD and not target.transform_descriptors
    shard = (step_dir / SHARD).read_bytes()
    record = malicious_record(shard[target.offset:target.offset + target.length], command)
    (step_dir / SHARD).write_bytes(shard[:target.offset] + record + shard[target.offset + target.length:])
    shift = len(record) - target.length
    for i, info in list(metadata.storage_data.items()):
        if i == index:
            metadata.storage_data[i] = dataclasses.replace(info, length=len(record))
        elif info.relative_path == SHARD and info.offset > target.offset:
            metadata.storage_data[i] = dataclasses.replace(info, offset=info.offset + shift)
    (step_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    # Keep the manifest's sizes and checksums right so only the content check can refuse it.
    manifest = json.loads((step_dir / "manifest.json").read_text())
    for name in (".metadata", SHARD):
        data = (step_dir / name).read_bytes()
        manifest["files"][name] = {"size": len(data), "checksum": checksum_bytes(data)}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    drop_index(str(step_dir))  # the forged .metadata is what a restore reads
    return target.offset, record


def test_the_planted_record_runs_code_when_unpickled_unsafely_and_the_rest_still_loads(tmp_path):
    """The exploit is real, and the splice is right: every other item still reads back."""
    _, step_dir = trained_run(tmp_path)
    marker = tmp_path / "control"
    _, record = plant(step_dir, TENSOR_ITEM, f"touch {marker}")
    torch.load(io.BytesIO(record), weights_only=False)
    assert marker.exists()

    metadata = FileSystemReader(str(step_dir)).read_metadata()
    shard = (step_dir / SHARD).read_bytes()
    for index, info in metadata.storage_data.items():
        if index.fqn != TENSOR_ITEM:
            torch.load(io.BytesIO(shard[info.offset:info.offset + info.length]), weights_only=True)


def test_the_direct_reader_declines_the_record_without_running_it(tmp_path):
    _, step_dir = trained_run(tmp_path)
    marker = tmp_path / "pwned"
    offset, record = plant(step_dir, TENSOR_ITEM, f"touch {marker}")
    target = torch.full((48, 16), 7.0)
    with (step_dir / SHARD).open("rb") as f:
        assert dcp_reader.read_stored_tensor_into(f, offset, len(record), target) is False
    assert torch.equal(target, torch.full((48, 16), 7.0))  # nothing written
    assert not marker.exists()


class _Spy:
    """Records what the readers did: the direct reader's answers, the globals its
    unpickler was asked for, and every torch.load's weights_only and failure."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.direct: list[bool] = []
        self.globals: list[tuple[str, str]] = []
        self.loads: list[tuple[object, str | None]] = []
        spy = self
        real_direct, real_load = dcp_reader.read_stored_tensor_into, torch.load

        class RecordUnpickler(dcp_reader._RecordUnpickler):
            def find_class(self, module: str, name: str):
                spy.globals.append((module, name))
                return super().find_class(module, name)

        def direct(*args, **kwargs):
            answer = real_direct(*args, **kwargs)
            spy.direct.append(answer)
            return answer

        def load(*args, **kwargs):
            try:
                out = real_load(*args, **kwargs)
            except Exception as e:
                spy.loads.append((kwargs.get("weights_only"), f"{type(e).__name__}: {e}"))
                raise
            spy.loads.append((kwargs.get("weights_only"), None))
            return out

        monkeypatch.setattr(dcp_reader, "_RecordUnpickler", RecordUnpickler)
        monkeypatch.setattr(dcp_reader, "read_stored_tensor_into", direct)
        monkeypatch.setattr(torch, "load", load)


@pytest.mark.parametrize(("fqn", "threads", "reader"), [
    (TENSOR_ITEM, 2, "_read_tensor"),  # read_stored_tensor_into, then torch.load(weights_only=True)
    (TENSOR_ITEM, 1, "_read_tensor"),  # the same on one thread (remote storage)
    (BYTES_ITEM, 2, "load_bytes"),      # SafeLoadPlanner.load_bytes: torch.load(weights_only=True)
], ids=["tensor-direct-then-torch-load", "tensor-torch-load", "object-item"])
def test_code_running_record_in_a_shard_is_refused_and_never_run(tmp_path, monkeypatch, fqn, threads, reader):
    run, step_dir = trained_run(tmp_path)
    marker = tmp_path / "pwned"
    plant(step_dir, fqn, f"touch {marker}")
    monkeypatch.setattr(dcp_reader.SafeFileSystemReader, "threads", threads)
    spy = _Spy(monkeypatch)

    coord, _ = build(0, 1, run, Setup(every=2))
    try:
        with pytest.raises(UnsafeCheckpointError, match=r"step-000000002: loading the shards failed on "
                           r"ranks \[0\]: .*pickle: .*posix\.system.*refused, nothing run") as info:
            coord.restore()
    finally:
        coord.close()
    assert not marker.exists()

    assert isinstance(info.value.__cause__, CheckpointException)
    ((failure, trace),) = info.value.__cause__.failures.values()
    error = failure if isinstance(failure, pickle.UnpicklingError) else failure.__cause__
    assert isinstance(error, pickle.UnpicklingError)
    assert "posix.system" in str(error)
    assert reader in [frame.name for frame in trace], [frame.name for frame in trace]
    # Every torch.load was weights_only, and the planted record is what one of them refused.
    assert spy.loads and all(weights_only is True for weights_only, _ in spy.loads), spy.loads
    assert [e for _, e in spy.loads if e] == [f"UnpicklingError: {error}"]
    if reader == "_read_tensor":
        # The direct path is in use (genuine tensors) and declined the planted one,
        # its unpickler refusing the global.
        assert True in spy.direct and False in spy.direct
        assert ("posix", "system") in spy.globals


def test_refusal_is_a_resume_error_naming_the_shard_and_the_item(tmp_path):
    run, step_dir = trained_run(tmp_path)
    marker = tmp_path / "pwned"
    plant(step_dir, TENSOR_ITEM, f"touch {marker}")
    coord, _ = build(0, 1, run, Setup(every=2))
    try:
        with pytest.raises(UnsafeCheckpointError, match=rf"{SHARD}.*{TENSOR_ITEM}.*posix\.system"):
            coord.restore()
    finally:
        coord.close()
    assert not marker.exists()


def test_deep_verify_does_not_run_the_pickles_in_the_shard(tmp_path):
    run, step_dir = trained_run(tmp_path)
    marker = tmp_path / "pwned"
    plant(step_dir, TENSOR_ITEM, f"touch {marker}")
    plant(step_dir, BYTES_ITEM, f"touch {marker}")
    result = CliRunner().invoke(cli, ["verify", run, "--deep"])
    # The attacker rewrote the manifest, so the checksums match and verify may pass;
    # the exit code is not the point here, running nothing is.
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert not marker.exists()
