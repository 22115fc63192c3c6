"""The rewind's skip through torchdata's StatefulDataLoader with worker processes, a loader that
cannot skip, an interrupted rewind, and a journal a hostile hand edited (issue 26)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from resume.adapters.data import GlobalPositionSampler, IndexedDataset, StatefulLoader
from resume.adapters.torch_native import NativeTorchAdapter
from resume.drill.model import TinyGPT, warmup_cosine
from support.cli import resume
from support.workloads import next_token_loss
from test_rewind import CFG, GB, Poisoned, poisoned_ids

from resume import ContinuityError, Coordinator, Run, UsageError
from resume.rewind import RewindRefused, apply_rewind, plan_rewind

torchdata = pytest.importorskip("torchdata.stateful_dataloader")


def _job(run: str, loader_kind: str, skips=()):
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(3, 40))
    sampler = GlobalPositionSampler(64, GB, seed=0, skips=skips)
    dataset = Poisoned(poisoned_ids())
    if loader_kind == "torchdata":
        data = torchdata.StatefulDataLoader(IndexedDataset(dataset), batch_sampler=sampler, num_workers=2)
    elif loader_kind == "plain":
        data = torch.utils.data.DataLoader(IndexedDataset(dataset), batch_size=GB)
    else:
        data = StatefulLoader(dataset, sampler)
    return Coordinator(run, NativeTorchAdapter(model, opt, sched, data), global_batch=GB, every=3,
                       seq_len=CFG.seq_len, handle_signals=False, keep=10, lease_ttl_s=30), model, opt, sched


def _train(coord, model, opt, sched, until: int) -> list[list[int]]:
    ids = []
    for batch in coord.batches():
        next_token_loss(model, batch["tokens"]).backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        ids.append(sorted(batch["ids"].tolist()))
        coord.update(loss=1.0)
        if coord.iteration >= until:
            break
    return ids


def _trained(run: str, kind: str, until: int) -> None:
    coord, *parts = _job(run, kind)
    coord.restore()
    _train(coord, *parts, until)
    coord.close()


def test_statefuldataloader_with_workers_passes_over_the_skip_right_after_the_checkpoint(tmp_path):
    run = str(tmp_path / "run")
    _trained(run, "torchdata", 12)
    # Step 9's next batch is samples [36, 40): skipped, so the first batch after the rewind changes;
    # the continuity check expects exactly that break (the abandoned line's journal read [40, 44)).
    r = Run.open(run)
    records = json.loads(resume("journal", run, "--json").stdout)["branches"][0]["records"]
    record = apply_rewind(r, plan_rewind(r, to=9, skips=[(36, 40)], reason="x", journal_records=records))
    assert record["expect_next"]["at"] == 40 and len(record["expect_next"]["ids"]) == GB
    coord, *parts = _job(run, "torchdata")
    coord.restore()
    ids = _train(coord, *parts, 12)
    coord.close()
    sampler = iter(GlobalPositionSampler(64, GB, seed=0, skips=[(36, 40)]))
    expected = [sorted(next(sampler)) for _ in range(12)]
    assert ids == expected[9:]
    assert Run.open(run).read_manifest(12).train_state.samples_skipped == GB


def test_a_loader_that_cannot_skip_is_refused_at_the_restore(tmp_path):
    run = str(tmp_path / "run")
    _trained(run, "plain", 12)
    r = Run.open(run)
    apply_rewind(r, plan_rewind(r, to=9, skips=[(40, 44)], reason="x"))
    coord, *_ = _job(run, "plain")
    with pytest.raises(UsageError, match=r"DataLoader.*GlobalPositionSampler|GlobalPositionSampler.*DataLoader"):
        coord.restore()
    coord.close()


def test_a_batch_that_is_not_the_one_after_the_skip_is_refused(tmp_path):
    run = str(tmp_path / "run")
    _trained(run, "ours", 12)
    r = Run.open(run)
    records = json.loads(resume("journal", run, "--json").stdout)["branches"][0]["records"]
    apply_rewind(r, plan_rewind(r, to=9, skips=[(36, 40)], reason="x", journal_records=records))
    # The record says which batch the run read at 40; a loader that skipped elsewhere is refused.
    path = os.path.join(run, "rewinds", "rewind-0001.json")
    with open(path) as f:
        body = json.load(f)
    body["expect_next"]["ids"] = [i + 1000 for i in body["expect_next"]["ids"]]
    with open(path, "w") as f:
        json.dump(body, f)
    coord, *_ = _job(run, "ours")
    with pytest.raises(ContinuityError, match="next_batch.ids"):
        coord.restore()
    coord.close()


def test_an_interrupted_rewind_is_refused_until_it_is_run_again(tmp_path):
    run = str(tmp_path / "run")
    _trained(run, "ours", 12)
    r = Run.open(run)
    plan = plan_rewind(r, to=9, reason="x")
    os.makedirs(os.path.join(run, "rewinds"))
    with open(os.path.join(run, "rewinds", "rewind-0001.json"), "w") as f:
        json.dump(plan.record(), f)  # written, nothing moved yet: the rewinder died here
    coord, *_ = _job(run, "ours")
    with pytest.raises(RewindRefused, match="interrupted"):
        coord.restore()
    coord.close()
    proc = resume("rewind", run, "--to", "10", "--reason", "another")
    assert proc.returncode == 1 and "interrupted" in proc.stderr
    assert resume("rewind", run, "--to", "9", "--reason", "x").returncode == 0
    coord, *_ = _job(run, "ours")
    coord.restore()
    assert coord.restored_from == 9 and coord.rewinds[0]["n"] == 1
    coord.close()


def test_a_tampered_journal_segment_ends_the_sealed_chain_with_a_problem(tmp_path):
    run = str(tmp_path / "run")
    _trained(run, "ours", 12)
    segment = os.path.join(run, "journal", "sealed-000000006.jsonl")
    with open(segment, "rb+") as f:
        data = f.read()
        f.seek(len(data) - 10)
        f.write(b"9")
    out = json.loads(resume("journal", run, "--json").stdout)
    main = out["branches"][0]
    assert [r["it"] for r in main["records"]] == [7, 8, 9, 10, 11, 12]
    assert any("sealed-000000006.jsonl" in p and "checksum" in p for p in main["problems"])
    text = resume("journal", run)
    assert text.returncode == 0 and "PROBLEM" in text.stdout
