"""A trainer in the shape many people write, with resume: gradient accumulation, fp16 autocast
with a loss scaler, an EMA of the weights, AdamW with two groups, a warm-up + cosine LambdaLR,
torchdata's StatefulDataLoader with workers, DDP.

- One update accumulates ``accumulation`` micro-batches, each an item of ``coord.batches()``
  (``Coordinator(accumulation=...)``); DDP synchronises the gradients on the last one only.
- ``torch.autocast("cpu", dtype=torch.float16)`` and ``torch.amp.GradScaler``: the loss is
  scaled, the gradients unscaled before clipping, ``scaler.step`` skips the update when a
  gradient is not finite, which the loop reports as ``update(applied=False)``. An overflow is
  forced at the updates in ``OVERFLOW`` (one micro-batch's loss times inf).
- ``torch.optim.swa_utils.AveragedModel``: an EMA of the weights, updated after each applied step.
- The scaler and the EMA are registered (``coord.register``); ``register=()`` leaves them out.

``run_job(rank, world, run, out, kill)`` runs one job's rank; it appends one JSON line per update
to ``out/trace-<rank>.jsonl`` and writes the final state's digests to ``out/final-<rank>.json``.
``kill``: ``(update, micro)``: SIGKILL every rank after that many micro-batches of that update
(0: right after the update, its save included), as a node failure takes the job. ``until``: stop
after that many updates (closing the coordinator) instead of at the run's end.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from resume.adapters.data import GlobalPositionSampler
from resume.adapters.torch_native import NativeTorchAdapter
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torchdata.stateful_dataloader import StatefulDataLoader

from resume import Coordinator
from support.traces import LogToFile

VOCAB, WIDTH, SEQ = 32, 16, 8
MICRO = 2            # samples per micro-batch on each rank
UPDATES = 12
EVERY = 3
OVERFLOW = {6}       # updates whose loss overflows (a skipped update; 6 is saved)
WARMUP = 3
SAMPLES = 512


class Tokens(torch.utils.data.Dataset):
    """Deterministic token rows; each item carries its index as its sample id."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict:
        g = torch.Generator().manual_seed(index)
        return {"ids": torch.tensor(index), "tokens": torch.randint(0, VOCAB, (SEQ + 1,), generator=g)}


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.block = torch.nn.TransformerEncoderLayer(WIDTH, 2, 2 * WIDTH, dropout=0.0, batch_first=True)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.block(self.embed(tokens))))


def lr_lambda(update: int) -> float:
    if update < WARMUP:
        return (update + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (update - WARMUP) / (UPDATES - WARMUP))))


class Trainer:
    def __init__(self, rank: int, world: int, run: str, accumulation: int, register: tuple[str, ...]) -> None:
        torch.manual_seed(1234)
        self.rank, self.world, self.accumulation = rank, world, accumulation
        self.model = TinyLM()
        self.ddp = torch.nn.parallel.DistributedDataParallel(self.model) if dist.is_initialized() else None
        decay = [p for n, p in self.model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.ndim < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=3e-3, betas=(0.9, 0.95))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
        self.ema = AveragedModel(self.model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        sampler = GlobalPositionSampler(SAMPLES, MICRO * world, rank=rank, world_size=world, seed=7)
        self.loader = StatefulDataLoader(Tokens(), batch_sampler=sampler, num_workers=2)
        adapter = NativeTorchAdapter(self.ddp or self.model, self.opt, self.sched, self.loader)
        self.coord = Coordinator(run, adapter, global_batch=MICRO * world * accumulation,
                                 accumulation=accumulation, every=EVERY, seq_len=SEQ, config={"seed": 1234},
                                 handle_signals=False, keep=10, total_iterations=UPDATES)
        if "scaler" in register:
            self.coord.register("scaler", self.scaler)
        if "ema" in register:
            self.coord.register("ema", self.ema)

    def micro_step(self, batch: dict, index: int, update: int) -> float:
        """One micro-batch's forward and backward; its loss (unscaled, as a float)."""
        tokens = batch["tokens"]
        last = index == self.accumulation - 1
        sync = self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext()
        with sync:
            with torch.autocast("cpu", dtype=torch.float16):
                logits = (self.ddp or self.model)(tokens[:, :-1])
                loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            scaled = loss / self.accumulation
            if update in OVERFLOW and index == 0:
                scaled = scaled * float("inf")
            self.scaler.scale(scaled).backward()
        return loss.item()

    def finish_update(self) -> tuple[bool, float, float]:
        """Unscale, clip, step through the scaler; (applied, grad norm, lr)."""
        self.scaler.unscale_(self.opt)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        lr = self.opt.param_groups[0]["lr"]
        before = self.scaler.get_scale()
        self.scaler.step(self.opt)
        self.scaler.update()
        applied = self.scaler.get_scale() >= before  # a skipped step backs the scale off
        self.opt.zero_grad(set_to_none=True)
        if applied:
            self.sched.step()
            self.ema.update_parameters(self.model)
        return applied, float(norm), lr

    def final_state(self) -> dict:
        from resume.drill.worker import tensor_digest

        params = {n: tensor_digest(p) for n, p in sorted(self.model.named_parameters())}
        names = {p: n for n, p in self.model.named_parameters()}
        moments = {f"{names[p]}.{k}": tensor_digest(v) for g in self.opt.param_groups for p in g["params"]
                   for k, v in sorted(self.opt.state.get(p, {}).items())}
        ema = {n: tensor_digest(t) for n, t in sorted(self.ema.state_dict().items())}
        return {"params": params, "moments": moments, "ema": ema, "scaler": self.scaler.state_dict(),
                "iteration": self.coord.iteration}


def run_job(rank: int, world: int, run: str, out: str, kill: tuple[int, int] | None, *, accumulation: int = 4,
            register: tuple[str, ...] = ("scaler", "ema"), until: int | None = None) -> dict:
    import resume.journal

    resume.journal.WRITE_EVERY = 1
    logger = logging.getLogger("resume")
    logger.setLevel(logging.INFO)
    logger.addHandler(LogToFile(os.path.join(out, f"log-{rank}.txt"), with_level=True))
    trainer = Trainer(rank, world, run, accumulation, register)
    coord = trainer.coord
    coord.restore()
    restored = coord.restored_from
    trace_path = os.path.join(out, f"trace-{rank}.jsonl")
    batches = coord.batches()
    while not coord.complete and (until is None or coord.iteration < until):
        update = coord.iteration + 1
        losses, ids = [], []
        for index in range(accumulation):
            batch = next(batches)
            ids += batch["ids"].tolist()
            losses.append(trainer.micro_step(batch, index, update))
            if kill == (update, index + 1):
                os.kill(os.getpid(), signal.SIGKILL)
        applied, norm, lr = trainer.finish_update()
        with open(trace_path, "a") as f:
            f.write(json.dumps({"update": update, "losses": [x.hex() for x in losses], "ids": ids,
                                "lr": lr.hex(), "applied": applied, "scale": trainer.scaler.get_scale(),
                                "restored_from": restored}) + "\n")
        coord.update(applied=applied, loss=sum(losses) / len(losses), grad_norm=norm)
        if kill == (update, 0):
            os.kill(os.getpid(), signal.SIGKILL)
    coord.close()
    final = trainer.final_state()
    with open(os.path.join(out, f"final-{rank}.json"), "w") as f:
        json.dump(final, f)
    return final
