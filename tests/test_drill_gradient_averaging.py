"""The drill's gradient averaging: exact, and independent of when DDP was constructed.

With more than 2 ranks a bucketed all-reduce sums each element in an order
that depends on its place in DDP's bucket, and DDP lays buckets out
differently in its first iteration than after; a restarted job constructs DDP
anew. The drill averages parameter by parameter, so a resumed run stays
bitwise identical at any data-parallel size.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from resume.adapters.torch_native import allreduce_each_gradient
from resume.drill.model import GPTConfig, SyntheticTokens, TinyGPT
from support.ranks import run_ranks
from support.workloads import next_token_loss
from torch.nn.parallel import DistributedDataParallel as DDP

pytestmark = pytest.mark.multiprocess

CFG = GPTConfig(vocab=32, seq_len=8, width=16, layers=1, heads=2)


def losses(rank: int, world: int, rebuild_at: int) -> list[float]:
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = SyntheticTokens(64, CFG).tokens
    out = []
    ddp = None
    for it in range(1, 9):
        if ddp is None or it == rebuild_at:  # a restarted job builds DDP again
            ddp = DDP(model)
            ddp.register_comm_hook(state=None, hook=allreduce_each_gradient)
        tokens = data[(it * world + rank) % 60: (it * world + rank) % 60 + 2]
        loss = next_token_loss(ddp, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def averaged_gradients_are_exact(rank: int, world: int) -> bool:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    ddp = DDP(model)
    ddp.register_comm_hook(state=None, hook=allreduce_each_gradient)
    ok = True
    for it in range(3):  # the first iteration and the ones after DDP rebuilt its buckets
        x = torch.full((3, 4), float(rank + 1 + it))
        ddp(x).pow(2).sum().backward()
        got = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model(x).pow(2).sum().backward()  # local gradient, no DDP
        for g, p in zip(got, model.parameters(), strict=True):
            expected = p.grad.clone()
            dist.all_reduce(expected)
            ok &= torch.allclose(g, expected / world)
        model.zero_grad()
    return bool(ok)


def test_per_parameter_averaging_is_the_true_mean():
    assert run_ranks(averaged_gradients_are_exact, 3) == [True, True, True]


def test_rebuilding_ddp_mid_run_changes_nothing_at_four_ranks():
    straight = run_ranks(losses, 4, 0)
    rebuilt = run_ranks(losses, 4, 5)
    assert straight == rebuilt
