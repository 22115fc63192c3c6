"""The update journal and the rewind past a loss spike, in one process with real DCP (issue 26).

A run reads poisoned samples at a known place and spikes; ``resume journal --spikes`` names the
update and its batch; ``resume rewind`` goes back with the poisoned range skipped; the resumed
run is bitwise the run that read the same data with that range skipped and never spiked.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from resume.adapters.data import GlobalPositionSampler, StatefulLoader
from resume.adapters.torch_native import NativeTorchAdapter
from resume.drill.model import GPTConfig, SyntheticTokens, TinyGPT, warmup_cosine
from support.cli import resume
from support.workloads import moment_digests, next_token_loss, param_digests

from resume import ContinuityError, Coordinator, Run

CFG = GPTConfig(vocab=32, seq_len=8, width=16, layers=1, heads=2)
GB = 4
POISON_AT = 40  # samples [40, 44): the batch of update 11
EVERY = 3


class Poisoned:
    """SyntheticTokens whose items at the given dataset indices carry ``poison`` = 1."""

    def __init__(self, poisoned: set[int]) -> None:
        self.inner = SyntheticTokens(num_samples=64, cfg=CFG)
        self.poisoned = poisoned

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> dict:
        return {**self.inner[i], "poison": torch.tensor(float(i in self.poisoned))}


def poisoned_ids() -> set[int]:
    sampler = GlobalPositionSampler(64, GB, seed=0)
    return {sampler.index_at(p) for p in range(POISON_AT, POISON_AT + GB)}


def job(run: str, *, peak_lr: float = 1e-2, skips=(), **options):
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(3, 40))
    sampler = GlobalPositionSampler(64, GB, seed=0, skips=skips)
    data = StatefulLoader(Poisoned(poisoned_ids()), sampler)
    coord = Coordinator(run, NativeTorchAdapter(model, opt, sched, data), global_batch=GB, every=EVERY,
                        seq_len=CFG.seq_len, handle_signals=False, keep=10, lease_ttl_s=30, **options)
    return coord, model, opt


def train(coord, model, opt, until: int, *, crash_after: int | None = None) -> list[dict]:
    trace = []
    for batch in coord.batches():
        loss = next_token_loss(model, batch["tokens"]) * (1 + 1000 * batch["poison"].max())
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        lr = opt.param_groups[0]["lr"]
        opt.step()
        coord.adapter.schedulers[0].step()
        opt.zero_grad(set_to_none=True)
        trace.append({"it": coord.iteration + 1, "loss": loss.item(), "lr": lr})
        coord.update(loss=loss.item(), grad_norm=norm, clipped=norm > 1.0)
        if crash_after is not None and coord.iteration == crash_after:
            coord.journal.flush()  # what a killed process leaves: the lines written so far
            return trace  # no close(): the process "dies" here
        if coord.iteration >= until:
            break
    coord.close()
    return trace


def journal_json(run: str, *args: str) -> dict:
    proc = resume("journal", run, "--json", *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture
def spiked(tmp_path):
    run = str(tmp_path / "run")
    coord, model, opt = job(run)
    coord.restore()
    trace = train(coord, model, opt, until=15)
    return run, trace


def test_spike_is_found_rewound_past_and_the_resumed_run_is_the_one_that_never_read_it(spiked, tmp_path):
    run, spiked_trace = spiked
    assert spiked_trace[10]["loss"] > 100 * spiked_trace[9]["loss"]  # update 11 read the poison
    spikes = journal_json(run, "--spikes")["spikes"]
    assert [s["iteration"] for s in spikes][:1] == [11]
    first = spikes[0]
    assert set(first["ids"]) == poisoned_ids() and first["samples"] == [POISON_AT, POISON_AT + GB]
    assert first["checkpoint_before"] == 9 and first["branch"] == "main"

    proc = resume("rewind", run, "--to", "9", "--skip-batches", "11:12", "--reason", "poisoned batch at 11", "--json")
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)["rewind"]
    assert record["skips"] == [[POISON_AT, POISON_AT + GB]] and record["done"] is True
    assert Run.open(run).committed_steps() == [3, 6, 9]
    branch = os.path.join(run, "abandoned", "rewind-0001")
    assert sorted(n for n in os.listdir(branch) if n.startswith("step-")) == ["step-000000012", "step-000000015"]

    coord, model, opt = job(run)
    coord.restore()
    assert coord.restored_from == 9
    resumed = train(coord, model, opt, until=15)
    ours = {"params": param_digests(model), "moments": moment_digests(opt)}

    ref_coord, ref_model, ref_opt = job(str(tmp_path / "reference"), skips=[(POISON_AT, POISON_AT + GB)])
    ref_coord.restore()
    reference = train(ref_coord, ref_model, ref_opt, until=15)
    assert resumed == reference[9:]  # losses and LRs of updates 10..15, bitwise
    assert ours == {"params": param_digests(ref_model), "moments": moment_digests(ref_opt)}

    m = Run.open(run).read_manifest(15)
    assert m.train_state.samples_skipped == GB and m.train_state.samples_read == 15 * GB + GB
    assert [(r["n"], r["to"], r["skips"]) for r in m.rewinds] == [(1, 9, [[POISON_AT, POISON_AT + GB]])]
    # The abandoned line is still there, in the journal too, and listed by ls.
    branches = {b["name"]: b for b in journal_json(run)["branches"]}
    assert [r["it"] for r in branches["rewind 1"]["records"]][-1] == 15 and branches["rewind 1"]["abandoned"]
    main = [r for r in branches["main"]["records"]]
    assert [r["it"] for r in main] == list(range(1, 16))
    assert main[10]["at"] == POISON_AT + GB and main[10]["skipped"] == GB
    listing = json.loads(resume("ls", run, "--json").stdout)
    assert [a["steps"] for a in listing["abandoned"]] == [[12, 15]]


def test_a_rewind_with_a_lower_peak_lr_resumes_on_the_new_schedule(spiked):
    run, _ = spiked
    assert resume("rewind", run, "--to", "9", "--accept", "lr", "--reason", "lower the peak").returncode == 0
    coord, model, opt = job(run, peak_lr=5e-3)
    coord.restore()
    trace = train(coord, model, opt, until=12)
    lam = warmup_cosine(3, 40)
    assert [t["lr"] for t in trace] == [5e-3 * lam(k) for k in (9, 10, 11)]
    m = Run.open(run).read_manifest(12)
    assert any(c["item"].endswith("initial_lr") and c["to"] == 5e-3 for c in m.changes)
    assert m.rewinds[0]["accept"] == ["lr"]


def test_without_the_rewind_the_lower_lr_is_refused(spiked):
    run, _ = spiked
    coord, _, _ = job(run, peak_lr=5e-3)
    with pytest.raises(ContinuityError, match="initial_lr"):
        coord.restore()
    coord.close()


def test_records_of_updates_a_crash_lost_are_kept_as_abandoned(tmp_path):
    run = str(tmp_path / "run")
    coord, model, opt = job(run)
    coord.restore()
    train(coord, model, opt, until=15, crash_after=11)  # the spike at 11, then the process dies
    coord.watchdog.close()
    coord._lease.release()
    coord, model, opt = job(run)
    coord.restore()
    assert coord.restored_from == 9
    coord.close()
    branches = journal_json(run)["branches"]
    lost = [b for b in branches if b["name"].startswith("lost")]
    assert len(lost) == 1 and lost[0]["abandoned"]
    assert [r["it"] for r in lost[0]["records"]] == [10, 11]
    assert lost[0]["records"][1]["loss"] > 100 * lost[0]["records"][0]["loss"]
    spikes = journal_json(run, "--spikes")["spikes"]
    assert [(s["iteration"], s["branch"]) for s in spikes] == [(11, lost[0]["name"])]
    assert [r["it"] for r in branches[0]["records"]] == list(range(1, 10))  # main: sealed by step 9


def test_bad_rewinds_are_refused_and_change_nothing(spiked):
    run, _ = spiked

    def tree() -> list[str]:
        return sorted(os.path.relpath(os.path.join(d, f), run) for d, _, fs in os.walk(run) for f in fs)
    before = tree()
    cases = [
        (["--to", "10", "--reason", "x"], 3, "step-000000010"),  # no such checkpoint
        (["--to", "9", "--skip-samples", "20:24", "--reason", "x"], 1, "--skip-samples 20:24"),  # before step 9's data
        (["--to", "9", "--skip-samples", "60:900", "--reason", "x"], 1, "--skip-samples 60:900"),  # past what was read
        (["--to", "9", "--skip-samples", "44:40", "--reason", "x"], 2, "--skip-samples"),
        (["--to", "9", "--accept", "no such!", "--reason", "x"], 2, "accept_changes"),
        (["--to", "9", "--reason", " "], 2, "--reason"),
    ]
    for args, code, needle in cases:
        proc = resume("rewind", run, *args)
        assert proc.returncode == code, (args, proc.stderr)
        assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    os.unlink(os.path.join(run, "step-000000012", "manifest.json"))
    proc = resume("rewind", run, "--to", "12", "--reason", "x")
    assert proc.returncode == 1 and "uncommitted" in proc.stderr
    assert tree() == [p for p in before if p != "step-000000012/manifest.json"]


def test_a_rewind_while_a_job_holds_the_run_is_refused(spiked):
    run, _ = spiked
    coord, _, _ = job(run)  # holds the lease from here
    try:
        proc = resume("rewind", run, "--to", "9", "--reason", "x")
        assert proc.returncode == 1 and "lease" in proc.stderr, proc.stderr
        assert Run.open(run).committed_steps() == [3, 6, 9, 12, 15]
        assert not os.path.exists(os.path.join(run, "abandoned"))
    finally:
        coord.close()


def test_a_later_rewind_goes_back_to_a_checkpoint_of_the_abandoned_branch(spiked):
    run, _ = spiked
    assert resume("rewind", run, "--to", "9", "--skip-samples", "40:44", "--reason", "skip it").returncode == 0
    coord, model, opt = job(run)
    coord.restore()
    train(coord, model, opt, until=15)  # the new line saves 12 and 15 again
    new_12 = Run.open(run).read_manifest(12).created_at
    proc = resume("rewind", run, "--to", "12", "--branch", "1", "--reason", "the spike was harmless after all")
    assert proc.returncode == 0, proc.stderr
    r = Run.open(run)
    assert r.committed_steps() == [3, 6, 9, 12] and r.read_manifest(12).rewinds == []  # rewind 1's branch
    listing = {a["rewind"]: a["steps"] for a in json.loads(resume("ls", run, "--json").stdout)["abandoned"]}
    assert listing == {1: [15], 2: [12, 15]}
    assert Run.open(os.path.join(run, "abandoned", "rewind-0002")).read_manifest(12).created_at == new_12
    coord, model, opt = job(run)
    coord.restore()
    assert coord.restored_from == 12 and [rw["n"] for rw in coord.rewinds] == [2]
    assert coord.state.samples_skipped == 0 and coord.state.samples_read == 12 * GB
    coord.close()
