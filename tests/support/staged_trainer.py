"""A trainer in the shape of the speed-run GPT trainers (modded-nanogpt and kin), with resume.

What makes it unlike the drill: AdamW for the embedding, the head and the
scalars, Muon for the body's matrices; the embedding tied to the head until a
stage boundary, then untied, with a new AdamW param group that starts from a
copy of the head's moments; the LR set by hand on every group from the count
of successful updates (no torch LRScheduler), a hand-set Muon momentum
warm-up; gradients averaged by hand (no DDP); one skipped update. The stage
travels in ``coord.user``; a restart reads it with ``coord.peek()`` and builds
the structure the checkpoint holds before ``restore()`` loads into it.

Run as ``run_job(rank, world, run, out, kill_at)`` in every rank of a gloo job;
it appends one JSON line per iteration to ``out/trace-<rank>.jsonl`` and writes
the final parameters and moments when it reaches the end. ``kill_at``: SIGKILL
this process right after that iteration's update (every rank does, as a node
failure takes the job).
"""

from __future__ import annotations

import json
import logging
import os
import signal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from resume.adapters.data import GlobalPositionSampler, StatefulLoader
from resume.adapters.torch_native import NativeTorchAdapter
from resume.drill.model import SyntheticTokens

from resume import Coordinator
from support.traces import LogToFile

VOCAB, WIDTH, SEQ = 32, 16, 8
GLOBAL_BATCH = 4
ITERATIONS = 14
EVERY = 3
UNTIE_AT = 5      # successful updates after which the embedding is untied from the head
SKIP = {2}        # iterations whose update is skipped (as a non-finite gradient would)
ADAM_LR, MUON_LR = 0.008, 0.02


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(WIDTH, 2 * WIDTH, bias=False)
        self.proj = torch.nn.Linear(2 * WIDTH, WIDTH, bias=False)
        self.scale = torch.nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * self.proj(F.relu(self.fc(F.rms_norm(x, (WIDTH,)))).square())


class SpeedrunGPT(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied until the stage boundary

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(F.rms_norm(x, (WIDTH,)))


def lr_factor(updates: int) -> float:
    """Constant, then a linear cool-down over the last 40% (the speed runs' shape)."""
    frac = updates / ITERATIONS
    return 1.0 if frac < 0.6 else max(0.1, (1 - frac) / 0.4)


def muon_momentum(updates: int) -> float:
    frac = min(updates / 5, 1)
    return (1 - frac) * 0.85 + frac * 0.95


class Trainer:
    def __init__(self, rank: int, world: int, run: str) -> None:
        torch.manual_seed(1234)
        self.rank, self.world = rank, world
        self.model = SpeedrunGPT()
        m = self.model
        scalars = [b.scale for b in m.blocks]
        matrices = [p for b in m.blocks for p in (b.fc.weight, b.proj.weight)]
        self.adam = torch.optim.AdamW([
            {"params": [m.head.weight], "lr": ADAM_LR, "name": "head"},
            {"params": scalars, "lr": ADAM_LR * 5, "name": "scalars", "weight_decay": 0.0},
        ], betas=(0.8, 0.95), eps=1e-10, weight_decay=0.01)
        self.muon = torch.optim.Muon(matrices, lr=MUON_LR, momentum=0.95, weight_decay=0.0)
        self.optimizers = [self.adam, self.muon]
        for opt in self.optimizers:
            for g in opt.param_groups:
                g["initial_lr"] = g["lr"]
        dataset = SyntheticTokens(num_samples=64, cfg=_Cfg())
        sampler = GlobalPositionSampler(len(dataset), GLOBAL_BATCH, rank=rank, world_size=world, seed=7)
        adapter = NativeTorchAdapter(self.model, self.optimizers, self.lr_at, StatefulLoader(dataset, sampler),
                                     moving_settings=("momentum",))
        self.coord = Coordinator(run, adapter, global_batch=GLOBAL_BATCH, every=EVERY, seq_len=SEQ,
                                 config={"seed": 1234}, handle_signals=False, keep=10)
        self.coord.user["stage"] = 0

    def lr_at(self, updates: int) -> list[float]:
        """The LR of every param group at the update after ``updates`` successful ones."""
        return [g["initial_lr"] * lr_factor(updates) for opt in self.optimizers for g in opt.param_groups]

    @property
    def stage(self) -> int:
        return int(self.coord.user.get("stage", 0))

    def untie(self) -> None:
        """Stage 1: the embedding gets weights of its own and an AdamW group of its own whose
        moments start from the head's."""
        m, adam = self.model, self.adam
        m.embed.weight = torch.nn.Parameter(m.head.weight.detach().clone())
        adam.add_param_group({"params": [m.embed.weight], "lr": ADAM_LR, "initial_lr": ADAM_LR * 0.6,
                              "name": "embed", "betas": (0.8, 0.95), "eps": 1e-10, "weight_decay": 0.0})
        head_state = adam.state.get(m.head.weight, {})
        if head_state:
            adam.state[m.embed.weight] = {k: v.clone() for k, v in head_state.items()}
        self.coord.user["stage"] = 1

    def restore(self) -> int | None:
        checkpoint = self.coord.peek()
        if checkpoint is not None and checkpoint.user.get("stage", 0) >= 1:
            self.untie()  # the structure the checkpoint holds, before its shards load into it
        self.coord.restore()
        return self.coord.restored_from

    def step(self, batch: dict, trace) -> None:
        coord = self.coord
        iteration = coord.iteration + 1
        updates = coord.state.updates_successful
        if self.stage == 0 and updates >= UNTIE_AT:
            self.untie()
        tokens = batch["tokens"]
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        for _, p in sorted(self.model.named_parameters()):  # by hand, in a fixed order
            if p.grad is not None:
                p.grad.div_(self.world)
                dist.all_reduce(p.grad)
        applied = iteration not in SKIP
        lrs = self.lr_at(updates)
        for g, lr in zip([g for opt in self.optimizers for g in opt.param_groups], lrs):
            g["lr"] = lr
        for g in self.muon.param_groups:
            g["momentum"] = muon_momentum(updates)
        if applied:
            for opt in self.optimizers:
                opt.step()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        trace({"iteration": iteration, "loss": loss.item().hex(), "lr": [float(x).hex() for x in lrs],
               "ids": batch["ids"].tolist(), "stage": self.stage})
        coord.update(applied=applied, loss=loss.item())

    def final_state(self) -> dict:
        from resume.drill.worker import tensor_digest

        params = {n: tensor_digest(p) for n, p in sorted(self.model.named_parameters())}
        names = {p: n for n, p in self.model.named_parameters()}
        moments = {f"{names[p]}.{k}": tensor_digest(v) for opt in self.optimizers for g in opt.param_groups
                   for p in g["params"] for k, v in sorted(opt.state.get(p, {}).items())}
        return {"params": params, "moments": moments, "stage": self.stage,
                "iteration": self.coord.iteration}


class _Cfg:
    vocab, seq_len = VOCAB, SEQ


def run_job(rank: int, world: int, run: str, out: str, kill_at: int | None) -> dict:
    # Each journal record written at its update, so that the test sees every iteration the
    # SIGKILL lost (by default a run this fast would lose the last second's: resume.journal).
    import resume.journal

    resume.journal.WRITE_EVERY = 1
    logger = logging.getLogger("resume")
    logger.setLevel(logging.INFO)
    logger.addHandler(LogToFile(os.path.join(out, f"log-{rank}.txt")))
    trainer = Trainer(rank, world, run)
    restored = trainer.restore()
    trace_path = os.path.join(out, f"trace-{rank}.jsonl")

    def trace(entry: dict) -> None:
        with open(trace_path, "a") as f:
            f.write(json.dumps({**entry, "restored_from": restored}) + "\n")

    for batch in trainer.coord.batches():
        trainer.step(batch, trace)
        if kill_at is not None and trainer.coord.iteration == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if trainer.coord.iteration >= ITERATIONS:
            break
    trainer.coord.close()
    final = trainer.final_state()
    with open(os.path.join(out, f"final-{rank}.json"), "w") as f:
        json.dump(final, f)
    return final

