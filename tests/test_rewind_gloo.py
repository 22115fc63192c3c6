"""The rewind on 2 gloo ranks with DDP, then an elastic restart on 1 (issue 26)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from resume.adapters.data import GlobalPositionSampler, StatefulLoader
from resume.adapters.torch_native import NativeTorchAdapter
from resume.drill.model import TinyGPT, warmup_cosine
from support.ranks import run_ranks
from support.workloads import moment_digests, next_token_loss, param_digests
from test_rewind import CFG, GB, POISON_AT, Poisoned, poisoned_ids
from torch.nn.parallel import DistributedDataParallel as DDP

from resume import Coordinator, Run
from resume.rewind import apply_rewind, plan_rewind

SKIP = [(POISON_AT, POISON_AT + GB)]


def _job(rank: int, world: int, run: str, skips=()):
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    ddp = DDP(model) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(3, 40))
    sampler = GlobalPositionSampler(64, GB, rank=rank, world_size=world, seed=0, skips=skips)
    coord = Coordinator(run, NativeTorchAdapter(ddp, opt, sched, StatefulLoader(Poisoned(poisoned_ids()), sampler)),
                        global_batch=GB, every=3, seq_len=CFG.seq_len, handle_signals=False, keep=10)
    coord.restore()
    return coord, ddp, model, opt, sched


def _train(rank: int, world: int, run: str, until: int, skips=()) -> dict:
    coord, ddp, model, opt, sched = _job(rank, world, run, skips)
    restored, trace = coord.restored_from, []
    for batch in coord.batches():
        loss = next_token_loss(ddp, batch["tokens"]) * (1 + 1000 * batch["poison"].max())
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        ids = [None] * world
        dist.all_gather_object(ids, batch["ids"].tolist()) if world > 1 else ids.__setitem__(0, batch["ids"].tolist())
        trace.append({"it": coord.iteration + 1, "ids": sorted(i for part in ids for i in part), "loss": loss.item()})
        coord.update(loss=loss.item(), grad_norm=norm)
        if coord.iteration >= until:
            break
    state = coord.state.to_dict()
    coord.close()
    return {"restored": restored, "trace": trace, "state": state, "params": param_digests(model),
            "moments": moment_digests(opt)}


def spiked_then_rewound(rank: int, world: int, run: str) -> dict:
    _train(rank, world, run, 15)
    dist.barrier()
    if rank == 0:
        r = Run.open(run)
        apply_rewind(r, plan_rewind(r, to=9, skips=SKIP, reason="poisoned samples [40, 44)"))
    dist.barrier()
    return _train(rank, world, run, 12)


def trained(rank: int, world: int, run: str, until: int, skips: list) -> dict:
    return _train(rank, world, run, until, skips)


def test_rewind_on_two_ranks_then_an_elastic_restart_on_one(tmp_path):
    run = str(tmp_path / "run")
    resumed = run_ranks(spiked_then_rewound, 2, run)
    reference = run_ranks(trained, 2, str(tmp_path / "ref2"), 12, SKIP)
    assert resumed[0]["restored"] == 9
    for ours, ref in zip(resumed, reference):  # every rank, bitwise
        assert ours["trace"] == ref["trace"][9:]
        assert ours["params"] == ref["params"] and ours["moments"] == ref["moments"]
    assert resumed[0]["state"]["samples_skipped"] == GB

    # Elastic: the same run on 1 rank from step 12 (its manifest carries the rewind and its skip):
    # the batches are the ones the sampler gives past the skip, whatever the data-parallel size.
    elastic = run_ranks(trained, 1, run, 15, [])[0]
    assert elastic["restored"] == 12
    batches = iter(GlobalPositionSampler(64, GB, seed=0, skips=SKIP))
    expected = [sorted(next(batches)) for _ in range(15)]
    assert [t["ids"] for t in elastic["trace"]] == expected[12:]
    assert [t["ids"] for t in resumed[0]["trace"]] == expected[9:12]
    assert elastic["state"] == {**elastic["state"], "iteration": 15, "updates_successful": 15,
                                "samples_read": 15 * GB + GB, "samples_skipped": GB}
