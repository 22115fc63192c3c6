"""The jobs most tests train: a tiny GPT through a Coordinator, in one process or on spawned gloo
ranks (which import this module by name), and a 12 MiB job for the file-system tests."""

from __future__ import annotations

import copy
import functools
import random
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from resume.adapters.data import GlobalPositionSampler, StatefulLoader
from resume.adapters.torch_native import NativeTorchAdapter, allreduce_each_gradient
from resume.drill.model import GPTConfig, SyntheticTokens, TinyGPT, warmup_cosine
from torch.nn.parallel import DistributedDataParallel as DDP

from resume import ContinuityError, Coordinator, ResumeError

CFG = GPTConfig(vocab=32, seq_len=8, width=16, layers=1, heads=2)
GLOBAL_BATCH = 4
ITERATIONS = 20


@dataclass
class Setup:
    """What to build; every field a knob a restarted job might get wrong."""

    seed: int = 0
    sampler_seed: int | None = None
    global_batch: int = GLOBAL_BATCH
    total_updates: int = ITERATIONS
    peak_lr: float = 1e-2
    stateless_loader: bool = False
    drop_optimizer_state: bool = False
    every: int = 3
    declare_seed: bool = True
    async_save: bool = False
    keep: int = 3
    on_save_failure: str = "raise"
    extra: dict = field(default_factory=dict)
    warm_start: str | None = None


class ListData:
    """The smallest stateful loader: a list of batches and a position in it."""

    def __init__(self, batches: list) -> None:
        self.batches, self.pos = batches, 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]

    def __iter__(self):
        while self.pos < len(self.batches):
            self.pos += 1
            yield self.batches[self.pos - 1]


class StatelessLoader:
    """A loader without state_dict, like a plain DataLoader: restarts at its epoch start."""

    def __init__(self, inner: StatefulLoader) -> None:
        self.inner = inner

    def __iter__(self):
        return iter(self.inner)


class ForgetfulAdapter(NativeTorchAdapter):
    """Loads the model but not the optimizer state (the classic bug)."""

    def load_shards(self, storage, step_dir, manifest=None):
        # Copies: a state the restore has already created (zero moments) is loaded into in place.
        saved = [copy.deepcopy(opt.state_dict()) for opt in self.optimizers]
        super().load_shards(storage, step_dir, manifest)
        for opt, sd in zip(self.optimizers, saved):
            opt.load_state_dict(sd)  # back to the fresh (empty) moments


def build(rank: int, world: int, run: str, setup: Setup) -> tuple[Coordinator, dict]:
    torch.manual_seed(setup.seed)
    random.seed(setup.seed)
    np.random.seed(setup.seed)
    model = TinyGPT(CFG)
    ddp = DDP(model) if world > 1 else model
    if world > 2:
        # Above 2 ranks a bucketed all-reduce's sums depend on DDP's bucket layout, which a
        # restarted job builds anew: averaged parameter by parameter, a resumed run stays
        # bitwise the run that was never stopped (as the drill does, test_drill_gradient_averaging).
        ddp.register_comm_hook(state=None, hook=allreduce_each_gradient)
    opt = torch.optim.AdamW(model.parameters(), lr=setup.peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(3, setup.total_updates))
    dataset = SyntheticTokens(num_samples=24, cfg=CFG)
    sampler = GlobalPositionSampler(len(dataset), setup.global_batch, rank=rank, world_size=world,
                                    seed=setup.seed if setup.sampler_seed is None else setup.sampler_seed)
    data: Any = StatefulLoader(dataset, sampler)
    if setup.stateless_loader:
        data = StatelessLoader(data)
    cls = ForgetfulAdapter if setup.drop_optimizer_state else NativeTorchAdapter
    adapter = cls(ddp, opt, sched, data)
    config = {"seed": setup.seed} if setup.declare_seed else {}
    config.update(setup.extra)
    coord = Coordinator(run, adapter, global_batch=setup.global_batch, every=setup.every,
                        seq_len=CFG.seq_len, config=config, handle_signals=False,
                        async_save=setup.async_save, keep=setup.keep,
                        on_save_failure=setup.on_save_failure, warm_start=setup.warm_start)
    return coord, {"model": model, "ddp": ddp, "opt": opt, "sched": sched}


def with_coordinator_options(monkeypatch, **options) -> None:
    """For this test, ``build`` passes ``options`` to the Coordinator too."""
    monkeypatch.setattr(sys.modules[__name__], "Coordinator", functools.partial(Coordinator, **options))


def next_token_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each token predicted from the ones before it."""
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             tokens[:, 1:].reshape(-1))


def train(coord: Coordinator, parts: dict, until: int, *, skip: set[int] = frozenset(),
          step_scheduler_on_skip: bool = False) -> list[dict]:
    trace = []
    ddp, opt, sched = parts["ddp"], parts["opt"], parts["sched"]
    for batch in coord.batches():
        iteration = coord.iteration + 1
        loss = next_token_loss(ddp, batch["tokens"])
        loss.backward()
        applied = iteration not in skip
        lr = opt.param_groups[0]["lr"]
        if applied:
            opt.step()
            sched.step()
        elif step_scheduler_on_skip:
            sched.step()
        opt.zero_grad(set_to_none=True)
        trace.append({"iteration": iteration, "loss": loss.item(), "lr": lr,
                      "ids": batch["ids"].tolist()})
        coord.update(applied=applied)
        if coord.iteration >= until:
            break
    return trace


def build_12mib_job(run: str, **options) -> tuple[Coordinator, torch.nn.Module, torch.optim.Optimizer]:
    """12 MiB per checkpoint: 1024 x 1024 fp32 weights and two AdamW moments."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024, bias=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dataset = SyntheticTokens(num_samples=100, cfg=CFG)
    data = StatefulLoader(dataset, GlobalPositionSampler(len(dataset), 1, rank=0, world_size=1, seed=0))
    coord = Coordinator(run, NativeTorchAdapter(model, opt, None, data), global_batch=1, every=2,
                        handle_signals=False, **options)
    return coord, model, opt


def train_12mib_job(coord: Coordinator, model: torch.nn.Module, opt: torch.optim.Optimizer, until: int) -> None:
    for _ in coord.batches():
        model(torch.ones(1, 1024)).sum().backward()
        opt.step()
        opt.zero_grad()
        coord.update()
        if coord.iteration >= until:
            return


def started(run: str, **setup) -> tuple[Coordinator, dict]:
    """One process, no process group: the job of ``Setup(**setup)``, built and restored."""
    coord, parts = build(0, 1, run, Setup(**setup))
    coord.restore()
    return coord, parts


def trained(run: str, until: int, **setup) -> Coordinator:
    """One process: the job of ``Setup(**setup)`` restored, trained to ``until``, closed."""
    coord, parts = started(run, **setup)
    train(coord, parts, until=until)
    coord.close()
    return coord


def restore_outcome(coord: Coordinator) -> str:
    """'ok@<step restored>', or the item a ContinuityError names, or the error and message."""
    try:
        coord.restore()
    except ContinuityError as e:
        return e.item
    except ResumeError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        coord.close()
    return f"ok@{coord.restored_from}"


def param_digests(model: torch.nn.Module) -> dict:
    from resume.drill.worker import tensor_digest

    return {n: tensor_digest(p) for n, p in model.state_dict().items()}


def moment_digests(opt: torch.optim.Optimizer) -> list:
    from resume.drill.worker import tensor_digest

    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            out.append({k: tensor_digest(v) for k, v in sorted(opt.state.get(p, {}).items())
                        if isinstance(v, torch.Tensor)})
    return out
