"""torchdata's StatefulDataLoader with worker processes: exact next batch across a SIGKILL and
an elastic restart, on real gloo processes with the coordinator.

Two ranks train a small model with AdamW on ``StatefulDataLoader(num_workers=2)`` and save
every 2 iterations; the workers prefetch, so at any moment the sampler in the training
process is batches ahead of what the loop got. The job is killed (SIGKILL of rank 0 in the
middle of iteration 7, the other rank half a second later, as Slurm ends a step) and
restarted by fresh processes: on 2 ranks it must see, rank by rank, the batches the
uninterrupted run saw; on 1 rank (global batch kept) the same global batches; and grown back
to 2 ranks from a checkpoint the 1-rank job wrote, the same again.

With ``GlobalPositionSampler`` as the batch sampler that holds on any data-parallel size.
With torch's ``DistributedSampler`` it holds on the same size; on another size the restore is
refused, naming the item and what to use instead (adapters/data.py).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import tempfile

import pytest

pytest.importorskip("torchdata.stateful_dataloader")

import torch
from resume.adapters.data import (
    GlobalPositionSampler,
    IndexedDataset,
    StatefulLoader,
    load_loader_state,
    loader_state,
)
from resume.adapters.torch_native import NativeTorchAdapter
from resume.drill.model import GPTConfig, SyntheticTokens, TinyGPT, warmup_cosine
from support.ranks import end_like_slurm, init_gloo, run_ranks
from support.traces import read_jsonl
from support.workloads import next_token_loss
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from resume import ContinuityError, Coordinator, ResumeError, UsageError

pytestmark = [pytest.mark.multiprocess,
              # torchdata 0.11 calls torch.set_vital, deprecated in torch 2.13, in every loader
              pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")]

CFG = GPTConfig(vocab=32, seq_len=8, width=16, layers=1, heads=2)
GLOBAL_BATCH = 4
EVERY = 2
UNTIL = 12
DIE_AT = 7          # rank 0 dies in the middle of this iteration (the save of 6 is committed)
SHRUNK_UNTIL = 10   # the 1-rank job trains to here (and saves 10), the grown job on to UNTIL
WORKERS = 2
# The global-position sampler wraps around its epoch (24 samples = 6 iterations) inside the
# test; DistributedSampler, whose epoch the user sets, stays inside one.
SAMPLES = {"global": 24, "distributed": 48}
GRACE_S = 0.5


def build(rank: int, world: int, run: str, kind: str, *, num_workers: int = WORKERS):
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    ddp = DDP(model) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(3, UNTIL))
    dataset = IndexedDataset(SyntheticTokens(num_samples=SAMPLES[kind], cfg=CFG))
    # Workers forked, as under torchrun on Linux (the ranks here are spawned, and workers
    # spawned from them would import everything again: seconds each).
    workers = {"num_workers": num_workers, "multiprocessing_context": "fork" if num_workers else None}
    if kind == "global":
        loader = StatefulDataLoader(dataset, **workers, batch_sampler=GlobalPositionSampler(
            len(dataset), GLOBAL_BATCH, rank=rank, world_size=world, seed=5))
    else:
        loader = StatefulDataLoader(dataset, **workers, batch_size=GLOBAL_BATCH // world,
                                    sampler=DistributedSampler(dataset, num_replicas=world, rank=rank, seed=5))
    adapter = NativeTorchAdapter(ddp, opt, sched, loader)
    coord = Coordinator(run, adapter, global_batch=GLOBAL_BATCH, every=EVERY, seq_len=CFG.seq_len,
                        config={"seed": 0}, handle_signals=False, keep=10, async_save=False)
    return coord, (ddp, opt, sched)


def train(coord: Coordinator, parts, until: int, *, die_at: int | None = None, log: str | None = None):
    ddp, opt, sched = parts
    trace = []
    while coord.iteration < until:
        for batch in coord.batches():
            iteration = coord.iteration + 1
            loss = next_token_loss(ddp, batch["tokens"])
            loss.backward()
            if iteration == die_at:
                os.kill(os.getpid(), signal.SIGKILL)  # mid-iteration: gradients there, no update
            entry = {"iteration": iteration, "ids": batch["ids"].tolist(), "loss": loss.item(),
                     "lr": opt.param_groups[0]["lr"]}
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            trace.append(entry)
            if log is not None:
                with open(log, "a") as f:
                    f.write(json.dumps(entry) + "\n")
            coord.update()
            if coord.iteration >= until:
                break
    return trace


# -- one job per phase --------------------------------------------------------------------------


def references(rank: int, world: int, tmp: str) -> dict:
    out = {}
    for kind in SAMPLES:
        coord, parts = build(rank, world, f"{tmp}/ref-{kind}", kind)
        coord.restore()
        out[kind] = train(coord, parts, UNTIL)
        coord.close()
    return out


def _killed_rank(rank: int, world: int, store: str, run: str, kind: str, out: str) -> None:
    os.dup2(os.open(os.path.join(out, f"rank-{rank}.log"), os.O_WRONLY | os.O_CREAT), 2)
    init_gloo(rank, world, store, timeout_s=60)
    coord, parts = build(rank, world, run, kind)
    coord.restore()
    train(coord, parts, UNTIL, die_at=DIE_AT if rank == 0 else None,
          log=os.path.join(out, f"trace-{rank}.jsonl"))
    os._exit(3)  # not reached: rank 0 dies, the other is killed while waiting for it


def killed_jobs(runs: dict[str, str], world: int = 2, timeout_s: float = 90.0) -> dict:
    """One job per (kind, run), all at once: in each, rank 0 SIGKILLs itself in iteration
    DIE_AT and the other ranks of that job are killed GRACE_S later (as Slurm ends a step)."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="resume-sdl-") as tmp:
        jobs = {}
        for kind, run in runs.items():
            out = os.path.join(tmp, kind)
            os.mkdir(out)
            procs = [ctx.Process(target=_killed_rank, args=(rank, world, os.path.join(out, "store"), run,
                                                            kind, out)) for rank in range(world)]
            for p in procs:
                p.start()
            jobs[kind] = (out, procs)
        # Its ranks never exit 0 (rank 0 dies, the other ends by os._exit(3) or is killed).
        overdue = end_like_slurm([procs for _, procs in jobs.values()], grace_s=GRACE_S, timeout_s=timeout_s)
        results = {}
        for kind, (out, procs) in jobs.items():
            traces, logs = [], []
            for rank in range(world):
                traces.append(read_jsonl(os.path.join(out, f"trace-{rank}.jsonl"), missing_ok=True))
                with open(os.path.join(out, f"rank-{rank}.log"), errors="replace") as f:
                    logs.append(f.read()[-3000:])
            results[kind] = {"codes": [p.exitcode for p in procs], "traces": traces, "logs": logs}
        assert not overdue, f"killed jobs ran past {timeout_s} s: {results}"
        return results


def _resume(rank: int, world: int, run: str, kind: str, until: int) -> dict:
    coord, parts = build(rank, world, run, kind)
    try:
        coord.restore()
    except ResumeError as e:
        coord.close()
        item = e.item if isinstance(e, ContinuityError) else None
        return {"error": f"{type(e).__name__}: {e}", "item": item}
    restored = coord.restored_from
    trace = train(coord, parts, until)
    coord.close()
    return {"restored_from": restored, "trace": trace}


def on_one_rank(rank: int, world: int, tmp: str) -> dict:
    return {"global": _resume(rank, world, f"{tmp}/shrunk-global", "global", SHRUNK_UNTIL),
            "distributed": _resume(rank, world, f"{tmp}/shrunk-distributed", "distributed", UNTIL)}


def on_two_ranks(rank: int, world: int, tmp: str) -> dict:
    return {kind: _resume(rank, world, f"{tmp}/killed-{kind}", kind, UNTIL) for kind in SAMPLES} | {
        "grown": _resume(rank, world, f"{tmp}/shrunk-global", "global", UNTIL)}


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("sdl"))
    refs = run_ranks(references, 2, tmp)
    killed = killed_jobs({kind: f"{tmp}/killed-{kind}" for kind in SAMPLES})
    for kind in SAMPLES:  # two restarts of the same killed run
        shutil.copytree(f"{tmp}/killed-{kind}", f"{tmp}/shrunk-{kind}")
    one = run_ranks(on_one_rank, 1, tmp)[0]
    two = run_ranks(on_two_ranks, 2, tmp)
    return {"refs": refs, "killed": killed, "one": one, "two": two}


def _global(traces: list[list[dict]], first: int, last: int) -> dict[int, list[int]]:
    """Iteration -> the global batch's sample ids (all ranks, sorted)."""
    out: dict[int, list[int]] = {}
    for trace in traces:
        for entry in trace:
            if first <= entry["iteration"] <= last:
                out.setdefault(entry["iteration"], []).extend(entry["ids"])
    return {i: sorted(ids) for i, ids in out.items()}


def _ids(trace: list[dict]) -> list[tuple[int, list[int]]]:
    return [(e["iteration"], e["ids"]) for e in trace]


@pytest.mark.parametrize("kind", list(SAMPLES))
def test_the_job_was_killed_mid_iteration_after_a_committed_save(outcome, kind):
    job, refs = outcome["killed"][kind], outcome["refs"]
    assert job["codes"][0] == -signal.SIGKILL, job["logs"]
    # Rank 0 got through iteration 6; the other may have finished 7 before it waited for rank 0.
    assert [e["iteration"] for e in job["traces"][0]] == list(range(1, DIE_AT)), job["logs"][0]
    for rank, trace in enumerate(job["traces"]):
        assert len(trace) in (DIE_AT - 1, DIE_AT), job["logs"][rank]
        assert trace == refs[rank][kind][:len(trace)]


@pytest.mark.parametrize("kind", list(SAMPLES))
def test_killed_and_resumed_on_two_ranks_sees_identical_batches(outcome, kind):
    for rank, out in enumerate(outcome["two"]):
        resumed = out[kind]
        assert "error" not in resumed, resumed
        assert resumed["restored_from"] == DIE_AT - 1
        reference = outcome["refs"][rank][kind][DIE_AT - 1:]
        assert _ids(resumed["trace"]) == _ids(reference)  # rank by rank, in order
        assert resumed["trace"] == reference               # and loss and LR, bitwise


def test_killed_and_resumed_on_one_rank_sees_identical_global_batches(outcome):
    resumed = outcome["one"]["global"]
    assert "error" not in resumed, resumed
    assert resumed["restored_from"] == DIE_AT - 1
    assert [e["iteration"] for e in resumed["trace"]] == list(range(DIE_AT, SHRUNK_UNTIL + 1))
    reference = [r["global"] for r in outcome["refs"]]
    assert _global([resumed["trace"]], DIE_AT, SHRUNK_UNTIL) == _global(reference, DIE_AT, SHRUNK_UNTIL)
    assert [e["lr"] for e in resumed["trace"]] == [e["lr"] for e in reference[0][DIE_AT - 1:SHRUNK_UNTIL]]


def test_grown_back_to_two_ranks_from_the_one_rank_checkpoint_sees_identical_batches(outcome):
    for rank, out in enumerate(outcome["two"]):
        grown = out["grown"]
        assert "error" not in grown, grown
        assert grown["restored_from"] == SHRUNK_UNTIL
        assert _ids(grown["trace"]) == _ids(outcome["refs"][rank]["global"][SHRUNK_UNTIL:])


def test_distributed_sampler_on_another_data_parallel_size_is_refused_naming_the_way(outcome):
    refused = outcome["one"]["distributed"]
    assert refused["item"] == "data.sampler.num_replicas", refused
    assert "expected 2 (as saved), actual 1" in refused["error"]
    assert "batch_sampler=resume.adapters.data.GlobalPositionSampler" in refused["error"]
    assert "\n" not in refused["error"]


# -- the state itself, one process ---------------------------------------------------------------


def _loader(num_workers: int = WORKERS, **kwargs) -> StatefulDataLoader:
    dataset = IndexedDataset(SyntheticTokens(num_samples=24, cfg=CFG))
    kwargs.setdefault("batch_sampler", GlobalPositionSampler(len(dataset), GLOBAL_BATCH, seed=5))
    return StatefulDataLoader(dataset, num_workers=num_workers, **kwargs)


def test_state_is_the_global_offset_of_the_next_batch_yielded_not_of_the_prefetch():
    loader = _loader()
    it = iter(loader)
    seen = [next(it)["ids"].tolist() for _ in range(3)]
    state = json.loads(json.dumps(loader_state(loader), allow_nan=False))  # as the coordinator stores it
    expected_next = next(it)["ids"].tolist()
    assert loader.batch_sampler.offset > 4 * GLOBAL_BATCH  # the workers' prefetch ran ahead
    inner = state["state"]["_snapshot"]["_main_snapshot"]["_index_sampler_state"]
    assert inner["offset"] == 3 * GLOBAL_BATCH
    restored = _loader()
    load_loader_state(restored, state)
    assert next(iter(restored))["ids"].tolist() == expected_next
    assert expected_next not in seen


def test_another_worker_count_is_refused_before_loading():
    loader = _loader()
    next(iter(loader))
    state = loader_state(loader)
    with pytest.raises(ContinuityError) as e:
        load_loader_state(_loader(num_workers=0), state)
    assert e.value.item == "data.num_workers" and "restart with num_workers=2" in str(e.value)


def test_a_state_saved_by_another_loader_is_refused():
    state = loader_state(_loader())
    with pytest.raises(ContinuityError) as e:
        load_loader_state(StatefulLoader(SyntheticTokens(num_samples=24, cfg=CFG),
                                         GlobalPositionSampler(24, GLOBAL_BATCH)), state)
    assert e.value.item == "data.loader"


def test_loaders_whose_state_would_not_be_exact_are_refused_when_iterated_or_saved():
    model = TinyGPT(CFG)
    opt = torch.optim.AdamW(model.parameters())
    unordered = NativeTorchAdapter(model, opt, data=_loader(in_order=False))
    with pytest.raises(UsageError, match="in_order=True"):
        unordered.data_iterator()
    with pytest.raises(UsageError, match="in_order=True"):
        unordered.data_state()
    dataset = IndexedDataset(SyntheticTokens(num_samples=24, cfg=CFG))
    as_sampler = NativeTorchAdapter(model, opt, data=StatefulDataLoader(
        dataset, sampler=GlobalPositionSampler(24, GLOBAL_BATCH), batch_size=None, num_workers=WORKERS))
    with pytest.raises(UsageError, match="batch_sampler="):
        as_sampler.data_iterator()


def test_a_restored_iterator_draws_no_random_number_the_saving_run_did_not():
    # The saving run made its iterator (one draw from torch's generator) long before the save.
    torch.manual_seed(1)
    loader = _loader()
    it = iter(loader)
    next(it)
    saved_rng = torch.get_rng_state()  # what the coordinator saves, before the look-ahead
    state = loader_state(loader)
    expected = next(it)["ids"].tolist()
    assert torch.equal(torch.get_rng_state(), saved_rng)
    # The restart: load, then the coordinator puts the random state back, then fetches.
    restored = _loader()
    load_loader_state(restored, state)
    torch.set_rng_state(saved_rng)
    loader_state(restored)  # the restore's own look-ahead snapshot
    assert next(iter(restored))["ids"].tolist() == expected
    assert torch.equal(torch.get_rng_state(), saved_rng)


def test_a_state_taken_before_the_first_iteration_draws_as_the_saving_run_did():
    torch.manual_seed(1)
    loader = _loader()
    saved_rng = torch.get_rng_state()
    state = loader_state(loader)  # makes the iterator: one draw, after the random state was taken
    expected = next(iter(loader))["ids"].tolist()
    after = torch.get_rng_state()
    assert not torch.equal(after, saved_rng)
    restored = _loader()
    load_loader_state(restored, state)
    torch.set_rng_state(saved_rng)
    loader_state(restored)
    assert next(iter(restored))["ids"].tolist() == expected
    assert torch.equal(torch.get_rng_state(), after)
