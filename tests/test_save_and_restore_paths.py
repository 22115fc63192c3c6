"""The path of a save and of a restore through the code: how many modules a save crosses from
update() to the manifest, and what a restore reads and parses (once each)."""

from __future__ import annotations

import inspect
import os

import pytest
from resume.adapters.dcp import reader as dcp_reader
from resume.adapters.torch import metadata as torch_metadata
from support.checkpoints import drop_index
from support.workloads import Setup, build, train, trained

import resume.manifest
from resume import Run
from resume.run import Run as RunClass

MAX_MODULES = 8


def _resume_modules_on_stack() -> list[str]:
    """The resume modules on the call stack, outermost first, each once."""
    seen: list[str] = []
    for frame in reversed(inspect.stack()):
        name = frame.frame.f_globals.get("__name__", "")
        if name.startswith("resume") and name not in seen:
            seen.append(name)
    return seen


def test_a_save_crosses_at_most_eight_modules_from_update_to_the_manifest(run_dir, monkeypatch):
    coord, parts = build(0, 1, run_dir, Setup(every=2))
    coord.restore()
    stacks: list[list[str]] = []
    original = RunClass.write_manifest

    def write_manifest(self, manifest):
        stacks.append([*_resume_modules_on_stack(), "resume.run"])  # the callee: Run.write_manifest
        return original(self, manifest)
    monkeypatch.setattr(RunClass, "write_manifest", write_manifest)
    train(coord, parts, until=2)
    coord.close()
    assert len(stacks) == 1, stacks
    modules = stacks[0]
    assert modules[0] == "resume.coordinator" and modules[-1] == "resume.run", modules
    assert len(modules) <= MAX_MODULES, f"a save crosses {len(modules)} modules: {modules}"


@pytest.mark.parametrize("written", ["with the index", "before the index"])
def test_a_restore_parses_the_manifest_and_its_index_once(run_dir, monkeypatch, written):
    """The manifest once; the index once (``index.resume``), and DCP's ``.metadata`` never read;
    a checkpoint written before the index: ``.metadata`` read and unpickled once."""
    trained(run_dir, until=4, every=2)
    if written == "before the index":
        drop_index(os.path.join(run_dir, "step-000000004"))
    counts = {"from_json": 0, "metadata": 0, "metadata_reads": 0, "index": 0, "index_reads": 0}
    from_json = resume.manifest.Manifest.from_json.__func__
    unpickle = torch_metadata.restricted_load_metadata
    parse = torch_metadata.CheckpointIndex.parse.__func__

    def counting_from_json(cls, *a, **kw):
        counts["from_json"] += 1
        return from_json(cls, *a, **kw)

    def counting_unpickle(*a, **kw):
        counts["metadata"] += 1
        return unpickle(*a, **kw)

    def counting_parse(cls, *a, **kw):
        counts["index"] += 1
        return parse(cls, *a, **kw)
    monkeypatch.setattr(resume.manifest.Manifest, "from_json", classmethod(counting_from_json))
    monkeypatch.setattr(dcp_reader, "restricted_load_metadata", counting_unpickle)
    monkeypatch.setattr(torch_metadata, "restricted_load_metadata", counting_unpickle)
    monkeypatch.setattr(torch_metadata.CheckpointIndex, "parse", classmethod(counting_parse))
    restored, _ = build(0, 1, run_dir, Setup(every=2))
    read_bytes = restored.run.storage.read_bytes

    def counting_read(path, *a, **kw):
        counts["metadata_reads"] += path.endswith(".metadata")
        counts["index_reads"] += path.endswith("index.resume")
        return read_bytes(path, *a, **kw)
    monkeypatch.setattr(restored.run.storage, "read_bytes", counting_read)
    restored.restore()
    restored.close()
    assert restored.restored_from == 4
    once = 1 if written == "with the index" else 0
    assert counts == {"from_json": 1, "metadata": 1 - once, "metadata_reads": 1 - once, "index": once,
                      "index_reads": once}, counts


@pytest.mark.parametrize("newest_torn", [False, True])
def test_discovery_reads_no_manifest_older_than_the_one_it_takes(run_dir, monkeypatch, newest_torn):
    trained(run_dir, until=5, every=1, keep=5)
    run = Run.open(run_dir)
    if newest_torn:
        run.storage.delete(run.manifest_path(5))
    read: list[int] = []
    original = RunClass.read_manifest

    def read_manifest(self, step, **kwargs):
        read.append(step)
        return original(self, step, **kwargs)
    monkeypatch.setattr(RunClass, "read_manifest", read_manifest)
    manifest, rejected = run.find_latest()
    assert manifest.step == (4 if newest_torn else 5)
    assert read == ([5, 4] if newest_torn else [5]) and len(rejected) == int(newest_torn)
