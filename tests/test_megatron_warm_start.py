"""Megatron's warm start through ``--pretrained-checkpoint`` (megatron.training's own load, with
resume installed): the source save verified before Megatron reads it, the origin in every manifest
of the new run, the new run's restarts loading its own save with the source gone, and a damaged
source refused before anything loads."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest
from support.checkpoints import flip_byte
from support.megatron import saved_manifest
from support.ranks import run_ranks

from resume.checksum import checksum_bytes

pytestmark = [pytest.mark.multiprocess, pytest.mark.megatron]


def _digest(model) -> str:
    h = hashlib.sha256()
    for name, p in model[0].named_parameters():
        h.update(name.encode() + p.detach().float().numpy().tobytes())
    return h.hexdigest()


def _job(rank: int, world: int, save_dir: str, pretrained: str | None, until: int) -> dict:
    """A fresh process: load (the run's own save, else the pretrained one), digest the weights,
    train to ``until`` and save there."""
    from resume.adapters.megatron import install
    from support import megatron_training_run as m

    from resume.errors import ResumeError

    recorder = install()
    extra = ("--pretrained-checkpoint", pretrained) if pretrained else ()
    args, model, optimizer, scheduler = m.fresh(save_dir, extra)
    try:
        start = m.load(args, model, optimizer, scheduler)
    except ResumeError as e:
        return {"error": {"type": type(e).__name__, "message": str(e)}}
    loaded = _digest(model)
    if until > start:
        it = m.train(args, model, optimizer, scheduler, recorder, until=until, start=start)
        m.save(it, model, optimizer, scheduler)
    return {"start": start, "loaded": loaded, "origin": recorder.origin}


def test_a_run_warm_started_from_a_pretrained_megatron_save_records_it_and_restarts_on_its_own(
        megatron_save, tmp_path):
    source = str(tmp_path / "A")
    shutil.copytree(megatron_save[0], source)
    with open(os.path.join(source, "iter_0000006", "resume-manifest.json"), "rb") as f:
        checksum = checksum_bytes(f.read())
    a_weights = run_ranks(_job, 1, source, None, 0)[0]["loaded"]  # A's iteration 6 as Megatron loads it

    b = str(tmp_path / "B")
    first = run_ranks(_job, 1, b, source, 2)[0]
    assert "error" not in first, first
    assert first["start"] == 0 and first["loaded"] == a_weights  # --finetune: A's weights, iteration 0
    origin = saved_manifest(b, 2)["origin"]
    assert (origin["source"], origin["step"], origin["manifest_checksum"], origin["kind"]) == (
        source, 6, checksum, "checkpoint")
    assert origin["through"] == "--pretrained-checkpoint"
    assert saved_manifest(b, 2)["train_state"]["iteration"] == 2

    shutil.rmtree(source)  # the source is gone: B restarts from its own save
    second = run_ranks(_job, 1, b, source, 3)[0]
    assert "error" not in second, second
    assert second["start"] == 2 and second["origin"] == origin
    assert saved_manifest(b, 3)["origin"] == origin


def test_a_damaged_pretrained_save_is_refused_before_megatron_loads_it(megatron_save, tmp_path):
    source = str(tmp_path / "A")
    shutil.copytree(megatron_save[0], source)
    flip_byte(os.path.join(source, "iter_0000006", "__0_0.distcp"))
    out = run_ranks(_job, 1, str(tmp_path / "B"), source, 1)[0]
    assert out["error"]["type"] == "WarmStartError"
    assert "__0_0.distcp" in out["error"]["message"] and "checksum" in out["error"]["message"]
    assert not os.path.exists(os.path.join(str(tmp_path / "B"), "iter_0000001"))
