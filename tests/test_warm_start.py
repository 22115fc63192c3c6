"""Warm start: run B's first weights from run A's committed checkpoint (or from an export of it),
with B's own optimizer, schedule, counters and data; B's restarts restore B's own checkpoints and
never read A again; the origin in every manifest of B and in ``inspect``; a missing, damaged or
ill-fitting source refused before anything loads."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from resume.adapters.torch_native import NativeTorchAdapter
from resume.drill.model import GPTConfig, TinyGPT, warmup_cosine
from support.checkpoints import flip_byte
from support.cli import resume
from support.ranks import run_ranks
from support.workloads import CFG, Setup, build, param_digests, train, trained

from resume import Coordinator
from resume.checksum import checksum_bytes
from resume.errors import WarmStartError

B_SETUP = {"seed": 1, "peak_lr": 5e-3, "total_updates": 30}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """Run A, trained to 6 (committed at 3 and 6): its URL, step 6's weights and manifest checksum."""
    run = str(tmp_path_factory.mktemp("warm") / "A")
    coord = trained(run, until=6)
    with open(os.path.join(run, "step-000000006", "manifest.json"), "rb") as f:
        checksum = checksum_bytes(f.read())
    return {"run": run, "weights": param_digests(coord.adapter.model), "manifest_checksum": checksum}


def _b_job(rank: int, world: int, run: str, warm: str, until: int) -> dict:
    coord, parts = build(rank, world, run, Setup(**B_SETUP, warm_start=warm))
    coord.restore()
    at_start = param_digests(parts["model"])
    trace = train(coord, parts, until)
    return {"restored": coord.restored_from, "at_start": at_start, "trace": trace, "origin": coord.origin}


def _manifest(run: str, step: int) -> dict:
    with open(os.path.join(run, f"step-{step:09d}", "manifest.json")) as f:
        return json.load(f)


@pytest.mark.multiprocess
def test_b_starts_from_a_and_its_restarts_restore_its_own_checkpoint_with_a_gone(source, tmp_path):
    a = str(tmp_path / "A")
    shutil.copytree(source["run"], a)
    b = str(tmp_path / "B")
    first = run_ranks(_b_job, 2, b, a, 5)
    for out in first:
        assert out["restored"] is None and out["at_start"] == source["weights"]  # A's weights, not B's seed
        assert out["origin"]["kind"] == "checkpoint" and out["origin"]["step"] == 6
    # B's own schedule from its start (warm-up of its own peak), B's own counters.
    assert first[0]["trace"][0]["lr"] == pytest.approx(5e-3 * warmup_cosine(3, 30)(0))
    assert [r["iteration"] for r in first[0]["trace"]] == [1, 2, 3, 4, 5]
    committed = _manifest(b, 3)
    assert committed["train_state"]["iteration"] == 3 and committed["train_state"]["samples_read"] == 12
    origin = committed["origin"]
    assert (origin["source"], origin["step"], origin["manifest_checksum"], origin["loaded"]) == (
        a, 6, source["manifest_checksum"], ["model"])

    shutil.rmtree(a)  # A is gone: B's restart must not need it
    second = run_ranks(_b_job, 2, b, a, 5)
    for before, after in zip(first, second):
        assert after["restored"] == 3
        assert after["trace"] == before["trace"][3:]  # iterations 4 and 5 again, bitwise
        assert after["origin"] == origin  # carried from B's own manifest
    proc = resume("inspect", b)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.strip().startswith("origin"))
    assert a in line and "step 6" in line and source["manifest_checksum"] in line


def _fresh_job(run: str, warm: str, cfg: GPTConfig = CFG) -> tuple[Coordinator, torch.nn.Module]:
    torch.manual_seed(1)
    model = TinyGPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return Coordinator(run, NativeTorchAdapter(model, opt), global_batch=4, every=3, handle_signals=False,
                       warm_start=warm), model


def _refused(run: str, warm: str, cfg: GPTConfig = CFG) -> str:
    coord, model = _fresh_job(run, warm, cfg)
    before = param_digests(model)
    with pytest.raises(WarmStartError) as e:
        coord.restore()
    coord.close()
    assert param_digests(model) == before  # nothing loaded
    assert not [n for n in os.listdir(run) if n.startswith("step-")]
    return str(e.value)


def test_a_missing_source_is_refused_before_anything_loads(tmp_path):
    message = _refused(str(tmp_path / "B"), str(tmp_path / "no-such-run"))
    assert "no-such-run" in message and "nothing loaded" in message


def test_a_damaged_source_is_refused_naming_the_file(source, tmp_path):
    a = str(tmp_path / "A")
    shutil.copytree(source["run"], a)
    flip_byte(os.path.join(a, "step-000000006", "__0_0.distcp"))
    message = _refused(str(tmp_path / "B"), a + "@6")
    assert "__0_0.distcp" in message and "checksum" in message


def test_a_model_that_does_not_fit_is_refused_naming_each_difference(source, tmp_path):
    wider = GPTConfig(vocab=32, seq_len=8, width=16, layers=2, heads=2)
    message = _refused(str(tmp_path / "B"), source["run"], wider)
    lines = message.splitlines()
    assert "differences" in lines[0] and "nothing loaded" in lines[0]
    assert any(x.startswith("missing in the source: blocks.1.") for x in lines[1:])
    assert all(x.startswith(("missing in the source:", "not in the model:", "shape of", "...")) for x in lines[1:])


def test_from_an_export_and_a_damaged_export_refused(source, tmp_path):
    export = str(tmp_path / "export")
    proc = resume("export", source["run"], export)
    assert proc.returncode == 0, proc.stderr
    coord, model = _fresh_job(str(tmp_path / "B"), export)
    coord.restore()
    assert param_digests(model) == source["weights"]
    assert coord.origin["kind"] == "export" and coord.origin["step"] == 6
    assert coord.origin["manifest_checksum"] == source["manifest_checksum"]
    coord.save()
    coord.close()
    assert _manifest(str(tmp_path / "B"), 0)["origin"]["source"] == export

    shard = next(n for n in os.listdir(export) if n.endswith(".safetensors"))
    flip_byte(os.path.join(export, shard))
    message = _refused(str(tmp_path / "C"), export)
    assert shard in message and "checksum" in message


def test_the_setting_and_the_environment_variable_parse():
    from resume.warmstart import ENV, WarmStart

    assert WarmStart.parse("s3://b/runs/pre@120000") == WarmStart("s3://b/runs/pre", 120000)
    assert WarmStart.parse("/runs/user@host/pre") == WarmStart("/runs/user@host/pre")  # not a step
    assert WarmStart.parse("  ") is None and WarmStart.parse(None) is None
    assert WarmStart.from_env({ENV: "/runs/a@7"}) == WarmStart("/runs/a", 7)
    assert WarmStart.from_env({}) is None
    with pytest.raises(Exception, match="warm_start: expected a run URL"):
        WarmStart.parse(7)


@pytest.mark.parametrize("origin, field", [(["x"], "origin"), ({"step": "6"}, "origin.step"),
                                           ({"source": 3}, "origin.source"), ({"loaded": "model"}, "origin.loaded")])
def test_a_manifest_whose_origin_is_malformed_is_refused_naming_the_field(origin, field):
    from resume.errors import ManifestError
    from resume.manifest import Manifest
    from resume.state import TrainState

    body = json.loads(Manifest(step=1, train_state=TrainState(), files={"a": _entry()}).to_json())
    body["origin"] = origin
    with pytest.raises(ManifestError, match=f"{field}: expected"):
        Manifest.from_json(json.dumps(body), source="m.json")


def _entry():
    from resume.manifest import FileEntry

    return FileEntry(1, "xxh3:00")


@pytest.mark.parametrize("record, needle", [
    (b"not json", "expected JSON"),
    (json.dumps({"files": []}).encode(), "files: expected an object"),
    (json.dumps({"files": {"../../etc/passwd": {"size": 1, "checksum": "xxh3:0"}}}).encode(), "inside the step"),
    (json.dumps({"files": {"model.safetensors": {"size": "1", "checksum": "x"}}}).encode(), "expected {size, checksum}"),
])
def test_a_hostile_export_record_is_refused_before_anything_is_read(tmp_path, record, needle):
    export = tmp_path / "export"
    export.mkdir()
    (export / "resume-export.json").write_bytes(record)
    message = _refused(str(tmp_path / "B"), str(export))
    assert needle in message
