"""Unit tests for resume.storage and resume.checksum: single process, no sleeping.

The primitives run as one conformance suite against both backends (the POSIX
fast path and fsspec's in-memory file system); retries are exercised through a
fake ``fs`` that fails a chosen number of times before delegating.
"""

from __future__ import annotations

import functools
import os
import uuid

import fsspec
import pytest

from resume.checksum import checksum_bytes, checksum_file, digest_parts
from resume.errors import OversizedFileError, StorageError
from resume.storage import FsspecStorage, LocalStorage, is_transient, join, open_storage


def memory_root() -> str:
    """A fresh root in fsspec's process-wide memory file system (shared between instances)."""
    return f"memory://resume-unit-{uuid.uuid4().hex}"


@pytest.fixture(params=["local", "memory"])
def storage(request, tmp_path):
    if request.param == "local":
        yield LocalStorage(str(tmp_path / "root"))
        return
    root = memory_root()
    yield FsspecStorage(root, sleep=lambda _s: None)
    memfs = fsspec.filesystem("memory")
    if memfs.exists(root):
        memfs.rm(root, recursive=True)


# -- conformance: every backend --------------------------------------------------------------


def test_atomic_write_then_read_returns_the_bytes(storage):
    storage.write_bytes_atomic("a/b/data.bin", b"hello world")
    assert storage.read_bytes("a/b/data.bin") == b"hello world"
    assert storage.exists("a/b/data.bin")
    assert storage.isdir("a/b")
    assert not storage.isdir("a/b/data.bin")


def test_read_bytes_with_a_limit_refuses_a_larger_file_naming_it(storage):
    storage.write_bytes_atomic("LATEST", b"12\n")
    assert storage.read_bytes("LATEST", limit=3) == b"12\n"
    with pytest.raises(OversizedFileError, match=r"LATEST: size: expected at most 2 bytes, actual 3"):
        storage.read_bytes("LATEST", limit=2)


def test_atomic_write_replaces_existing_content(storage):
    storage.write_bytes_atomic("f.txt", b"old content, long")
    storage.write_bytes_atomic("f.txt", b"new")
    assert storage.read_bytes("f.txt") == b"new"
    assert storage.size("f.txt") == 3


def test_listdir_returns_sorted_names_not_paths(storage):
    for name in ("c.bin", "a.bin", "sub/x.bin"):
        storage.write_bytes_atomic(join("d", name), b"x")
    assert storage.listdir("d") == ["a.bin", "c.bin", "sub"]


def test_size_reports_bytes_written(storage):
    storage.write_bytes_atomic("s.bin", b"\0" * 1234)
    assert storage.size("s.bin") == 1234


def test_delete_removes_file_and_whole_directory(storage):
    storage.write_bytes_atomic("d/one", b"1")
    storage.write_bytes_atomic("d/sub/two", b"2")
    storage.write_bytes_atomic("keep", b"k")
    storage.delete("d/one")
    assert not storage.exists("d/one")
    assert storage.exists("d/sub/two")
    storage.delete("d")
    assert not storage.exists("d")
    assert not storage.exists("d/sub/two")
    assert storage.read_bytes("keep") == b"k"


def test_delete_of_missing_path_is_a_no_op(storage):
    storage.delete("never-written")
    assert not storage.exists("never-written")


def test_missing_file_raises_file_not_found_untouched(storage):
    with pytest.raises(FileNotFoundError) as info:
        storage.read_bytes("absent.bin")
    assert not isinstance(info.value, StorageError)
    with pytest.raises(FileNotFoundError):
        storage.size("absent.bin")
    with pytest.raises(FileNotFoundError):
        storage.listdir("absent-dir")


def test_makedirs_creates_nested_directory(storage):
    storage.makedirs("x/y/z")
    assert storage.isdir("x/y/z")
    storage.makedirs("x/y/z")  # exist_ok
    assert storage.isdir("x/y/z")


def test_open_read_streams_the_content(storage):
    storage.write_bytes_atomic("stream.bin", b"abcdef")
    with storage.open_read("stream.bin") as f:
        assert f.read(2) == b"ab"
        assert f.read() == b"cdef"


def test_checksum_file_matches_checksum_bytes_and_reports_progress(storage):
    data = os.urandom(5000)
    storage.write_bytes_atomic("blob", data)
    seen: list[int] = []
    size, checksum = checksum_file(storage, "blob", progress=seen.append)
    assert size == len(data)
    assert checksum == checksum_bytes(data)
    assert sum(seen) == len(data)


# -- LocalStorage specifics ------------------------------------------------------------------


def test_local_atomic_write_leaves_no_temp_files(tmp_path):
    storage = LocalStorage(str(tmp_path))
    storage.write_bytes_atomic("d/f", b"1")
    storage.write_bytes_atomic("d/f", b"22")
    assert sorted(os.listdir(tmp_path / "d")) == ["f"]
    assert (tmp_path / "d" / "f").read_bytes() == b"22"


def test_local_failed_atomic_write_keeps_old_content_and_removes_temp(tmp_path, monkeypatch):
    storage = LocalStorage(str(tmp_path))
    storage.write_bytes_atomic("f", b"old")

    def broken_replace(src, dst, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="No space"):
        storage.write_bytes_atomic("f", b"new")
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["f"]
    assert (tmp_path / "f").read_bytes() == b"old"


def test_local_storage_strips_file_url_and_is_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert LocalStorage("file://" + str(tmp_path)).root == str(tmp_path)
    assert LocalStorage("rel").root == str(tmp_path / "rel")
    assert LocalStorage(str(tmp_path)).local_path("a/b") == str(tmp_path / "a" / "b")


def test_open_storage_picks_posix_path_for_local_and_fsspec_for_urls(tmp_path):
    assert isinstance(open_storage(str(tmp_path)), LocalStorage)
    assert isinstance(open_storage("file://" + str(tmp_path)), LocalStorage)
    remote = open_storage(memory_root())
    assert isinstance(remote, FsspecStorage)
    assert remote.local_path("x") is None


def test_join_uses_slashes_and_drops_empty_parts():
    assert join("step-000000010", "manifest.json") == "step-000000010/manifest.json"
    assert join("a/", "/b/", "", ".", "c") == "a/b/c"
    assert join("", "x") == "x"


def test_fsspec_url_joins_root_and_path():
    storage = FsspecStorage("memory://bucket/run/", sleep=lambda _s: None)
    assert storage.root == "memory://bucket/run"
    assert storage.url("") == "memory://bucket/run"
    assert storage.url("step-000000001/manifest.json") == "memory://bucket/run/step-000000001/manifest.json"


# -- retries -----------------------------------------------------------------------------------


class FlakyFS:
    """fsspec's memory fs, with chosen methods failing a number of times first."""

    def __init__(self, failures: dict[str, tuple[int, BaseException]]) -> None:
        self._fs = fsspec.filesystem("memory")
        self.failures = {name: [count, exc] for name, (count, exc) in failures.items()}
        self.calls: dict[str, int] = {}

    def __getattr__(self, name):
        target = getattr(self._fs, name)
        if name not in self.failures or not callable(target):
            return target

        @functools.wraps(target)
        def flaky(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            remaining, exc = self.failures[name]
            if remaining > 0:
                self.failures[name][0] = remaining - 1
                raise exc
            return target(*args, **kwargs)

        return flaky


def flaky_storage(failures, *, attempts=5, max_wait=10.0):
    sleeps: list[float] = []
    fs = FlakyFS(failures)
    storage = FsspecStorage(memory_root(), attempts=attempts, max_wait=max_wait,
                            sleep=sleeps.append, fs=fs)
    return storage, fs, sleeps


@pytest.mark.parametrize("exc", [ConnectionError("connection reset"), OSError(5, "I/O error"),
                                 TimeoutError("read timed out")], ids=["connection", "oserror", "timeout"])
def test_fsspec_retries_transient_errors_then_succeeds(exc):
    storage, fs, sleeps = flaky_storage({"pipe_file": (2, exc)})
    storage.write_bytes_atomic("f.bin", b"payload")
    assert fs.calls["pipe_file"] == 3
    assert len(sleeps) == 2
    assert storage.read_bytes("f.bin") == b"payload"


def test_fsspec_backoff_is_jittered_under_a_growing_bound_and_capped():
    """Thousands of ranks throttled at once must not retry in step: each wait is drawn below
    an exponentially growing bound, capped."""
    import random

    random.seed(1)
    storage, _, sleeps = flaky_storage({"cat_file": (6, ConnectionError("flaky"))},
                                        attempts=7, max_wait=0.5)
    storage.write_bytes_atomic("f", b"x")
    assert storage.read_bytes("f") == b"x"
    assert len(sleeps) == 6
    bounds = [min(0.5, 0.2 * 2 ** i) for i in range(6)]
    assert all(0 <= s <= b for s, b in zip(sleeps, bounds)), (sleeps, bounds)
    assert len(set(sleeps)) == 6  # drawn, not a fixed ladder


def test_fsspec_does_not_retry_file_not_found():
    storage, fs, sleeps = flaky_storage({"cat_file": (1, FileNotFoundError("gone"))})
    with pytest.raises(FileNotFoundError) as info:
        storage.read_bytes("whatever")
    assert not isinstance(info.value, StorageError)
    assert fs.calls["cat_file"] == 1
    assert sleeps == []


@pytest.mark.parametrize("exc", [PermissionError("denied"), IsADirectoryError("dir")])
def test_fsspec_does_not_retry_permanent_errors(exc):
    storage, fs, sleeps = flaky_storage({"size": (1, exc)})
    with pytest.raises(type(exc)):
        storage.size("x")
    assert fs.calls["size"] == 1
    assert sleeps == []


def test_fsspec_raises_storage_error_after_exhausting_attempts():
    storage, fs, sleeps = flaky_storage({"pipe_file": (100, ConnectionError("endpoint down"))},
                                        attempts=4)
    with pytest.raises(StorageError) as info:
        storage.write_bytes_atomic("step-000000001/manifest.json", b"{}")
    assert fs.calls["pipe_file"] == 4
    assert len(sleeps) == 3
    err = info.value
    assert isinstance(err, OSError)
    assert isinstance(err.__cause__, ConnectionError)
    assert storage.root in str(err)
    assert "pipe_file" in str(err)
    assert "endpoint down" in str(err)
    assert err.exit_code == 1


def test_fsspec_rename_moves_every_object_under_a_prefix_and_a_single_object():
    storage, fs, _ = flaky_storage({"find": (1, OSError(5, "blip"))})
    for rel, data in (("step-000000002/a", b"1"), ("step-000000002/sub/b", b"2"), ("one", b"3"),
                      ("step-0000000020/c", b"4")):
        fs._fs.pipe_file(storage.url(rel), data)
    storage.rename("step-000000002", "quarantine-step-000000002-x")
    storage.rename("one", "two")
    assert storage.read_bytes("quarantine-step-000000002-x/a") == b"1"
    assert storage.read_bytes("quarantine-step-000000002-x/sub/b") == b"2"
    assert storage.read_bytes("two") == b"3"
    assert not storage.exists("step-000000002/a") and not storage.exists("one")
    assert storage.read_bytes("step-0000000020/c") == b"4"  # a longer name with the same start
    with pytest.raises(FileNotFoundError):
        storage.rename("missing", "anywhere")


def test_fsspec_delete_retries_its_listing_and_names_objects_only():
    storage, fs, sleeps = flaky_storage({"find": (1, OSError(5, "blip"))})
    fs._fs.pipe_file(storage.url("d/f"), b"1")
    fs._fs.pipe_file(storage.url("d/sub/g"), b"2")
    fs._fs.pipe_file(storage.url("e"), b"3")
    storage.delete("d")
    storage.delete("e")
    storage.delete("nothing-there")
    assert not fs._fs.exists(storage.url("d/f")) and not fs._fs.exists(storage.url("d/sub/g"))
    assert not fs._fs.exists(storage.url("e"))
    assert len(sleeps) == 1


def test_is_transient_separates_missing_from_broken():
    assert is_transient(ConnectionError())
    assert is_transient(TimeoutError())
    assert is_transient(OSError(5, "EIO"))
    assert not is_transient(FileNotFoundError())
    assert not is_transient(PermissionError())
    assert not is_transient(ValueError())


# -- checksum helpers --------------------------------------------------------------------------


def test_checksum_bytes_format_and_sensitivity():
    a = checksum_bytes(b"abc")
    assert a.startswith("xxh3:") and len(a) == len("xxh3:") + 16
    assert a == checksum_bytes(b"abc")
    assert a != checksum_bytes(b"abd")


def test_digest_parts_is_order_and_boundary_sensitive():
    assert digest_parts(["ab", "c"]) != digest_parts(["a", "bc"])
    assert digest_parts(["a", "b"]) != digest_parts(["b", "a"])
    assert digest_parts(["a", b"b"]) == digest_parts([b"a", "b"])


def test_loads_read_stored_tensors_into_their_targets_exactly(tmp_path):
    """The direct read path and the general one give the same tensors, whatever was stored:
    dtypes, a transposed view, a view with a storage offset, a 0-dim tensor."""
    import torch
    import torch.distributed.checkpoint as dcp
    from resume.adapters.dcp import filesystem as dcp_io
    from resume.adapters.dcp import reader as dcp_reader
    from resume.adapters.dcp.reader import SafeLoadPlanner

    from resume.storage import LocalStorage

    base = torch.arange(40, dtype=torch.float32)
    state = {
        "bf16": torch.randn(64, 33).to(torch.bfloat16),
        "fp32": torch.randn(1000),
        "int": torch.arange(77, dtype=torch.int64),
        "transposed": torch.randn(8, 5).t(),
        "offset_view": base[10:30],
        "scalar": torch.tensor(3.5),
        "bools": torch.rand(17) > 0.5,
    }
    storage = LocalStorage(str(tmp_path))
    writer = dcp_io.make_writer(storage, "step", durable=False)
    with dcp_io.without_torch_crc32():
        dcp.save(state, storage_writer=writer, no_dist=True)
    direct = []
    original = dcp_reader.read_stored_tensor_into

    def counting(*args):
        hit = original(*args)
        direct.append(hit)
        return hit
    dcp_reader.read_stored_tensor_into = counting
    try:
        target = {k: torch.zeros_like(v.contiguous()) for k, v in state.items()}
        dcp.load(target, storage_reader=dcp_io.make_reader(storage, "step"), planner=SafeLoadPlanner(),
                 no_dist=True)
    finally:
        dcp_reader.read_stored_tensor_into = original
    for k, v in state.items():
        assert torch.equal(target[k], v), k
    assert any(direct) and not all(direct)  # plain tensors read directly, the views by torch.load
