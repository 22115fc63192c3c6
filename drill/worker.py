"""One rank of the drill's training run (started by ``resume.drill.runner``).

A plain ``Coordinator`` loop over a tiny GPT in DDP on gloo, AdamW with
warmup + cosine, forced skipped updates, and a self-inflicted SIGKILL on rank 0
at ``--kill-at`` (before that iteration runs). Rank 0 appends one JSON line
per iteration to ``--trace`` and, at the end, writes digests of the final
parameters, moments, counters and LRs to ``--final``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import signal
import sys
import time
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist
from resume.adapters.data import GlobalPositionSampler, StatefulLoader
from resume.adapters.torch_native import NativeTorchAdapter, allreduce_each_gradient
from resume.drill.model import GPTConfig, SyntheticTokens, TinyGPT, warmup_cosine
from torch.nn.parallel import DistributedDataParallel as DDP

from resume import Coordinator, faults
from resume.checksum import digest_parts

GLOBAL_BATCH = 8
PEAK_LR = 3e-3
WARMUP = 5


def tensor_digest(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    return digest_parts([str(t.dtype), str(list(t.shape)), t.reshape(-1).view(torch.uint8).numpy().tobytes()])


def build(args: argparse.Namespace, rank: int, world: int):
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    cfg = GPTConfig()
    model = TinyGPT(cfg)
    ddp = DDP(model)
    ddp.register_comm_hook(state=None, hook=allreduce_each_gradient)
    optimizer = torch.optim.AdamW(model.parameters(), lr=PEAK_LR, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(WARMUP, args.iterations))
    dataset = SyntheticTokens(num_samples=96, cfg=cfg)
    sampler = GlobalPositionSampler(len(dataset), GLOBAL_BATCH, rank=rank, world_size=world,
                                    seed=args.seed)
    data = StatefulLoader(dataset, sampler)
    adapter = NativeTorchAdapter(ddp, optimizer, scheduler, data)
    coord = Coordinator(args.run, adapter, global_batch=GLOBAL_BATCH, every=args.every, keep=3,
                        total_iterations=args.iterations, seq_len=cfg.seq_len,
                        config={"seed": args.seed, "model": asdict(cfg)}, async_save=args.async_save)
    return model, ddp, optimizer, scheduler, coord


def injected(args: argparse.Namespace) -> bool:
    """Whether this launch (``RESUME_LAUNCH``, set by the Slurm hook) is the one whose faults fire."""
    return os.environ.get("RESUME_LAUNCH", "1") == str(args.on_launch)


def misbehave(args: argparse.Namespace, coord: Coordinator, rank: int, iteration: int) -> None:
    """The faults asked for (tests of hang detection): a hang in this rank's own code, a stopped
    process, a declared long phase."""
    if injected(args) and rank == args.hang_rank:
        if iteration == args.hang_at:
            while True:  # blocked in its own code; the others wait in the next collective
                time.sleep(3600)
        if iteration == args.stop_at:
            os.kill(os.getpid(), signal.SIGSTOP)
    if injected(args) and iteration == args.crash_once_at and rank == 0:
        raise RuntimeError(f"drill worker: crashing once at iteration {iteration} (--crash-once-at)")
    if injected(args) and args.declare and iteration == args.declare[0]:
        with coord.watchdog.expect(args.declare[1], "evaluation"):
            time.sleep(args.declare[2])


def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ddp, optimizer, scheduler, coord = build(args, rank, world)
    coord.restore()
    skip = {int(s) for s in args.skip.split(",") if s}
    for batch in coord.batches():
        iteration = coord.iteration + 1
        if rank == 0 and iteration == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if iteration == args.crash_at:
            raise RuntimeError(f"drill worker: crashing at iteration {iteration} as asked (--crash-at)")
        misbehave(args, coord, rank, iteration)
        if args.sleep:
            time.sleep(args.sleep)
        tokens = batch["tokens"]
        logits = ddp(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 tokens[:, 1:].reshape(-1))
        loss.backward()
        if iteration in skip:  # a forced non-finite gradient, the same on every rank
            next(model.parameters()).grad.fill_(float("nan"))
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        applied = bool(torch.isfinite(norm))
        lr = optimizer.param_groups[0]["lr"]
        if applied:
            optimizer.step()
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if args.slow_node and os.environ.get("RESUME_NODE") == args.slow_node:
            time.sleep(args.slow_s)  # a slow host after the gradients' all-reduce (--slow-node)
        coord.update(applied=applied)
        if rank == 0:
            with open(args.trace, "a") as trace:
                trace.write(json.dumps({"iteration": iteration, "loss": loss.item(), "lr": lr,
                                        "applied": applied,
                                        "restored_from": coord.restored_from}) + "\n")
        if coord.iteration >= args.iterations or coord.should_stop:
            break
    if rank == 0:
        write_final(args.final, model, optimizer, coord)
    coord.close()
    if args.linger:  # a slow exit after the run's end (a signal may land meanwhile)
        time.sleep(args.linger)
    # Leave together: a rank that tears gloo down while its peer is still
    # busy can abort ("terminate called without an active exception").
    dist.barrier()


def write_final(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                coord: Coordinator) -> None:
    names = {p: n for n, p in model.named_parameters()}
    params = {n: tensor_digest(p) for n, p in model.named_parameters()}
    moments = {}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                moments[f"{names[p]}.{key}"] = tensor_digest(value)
    final = {"params": params, "moments": moments, "counters": coord.state.to_dict(),
             "lrs": [g["lr"] for g in optimizer.param_groups]}
    with open(path, "w") as f:
        json.dump(final, f, indent=1)


def _env_from_slurm(env: dict) -> None:
    """Under srun: torch.distributed's variables from Slurm's (MASTER_* come from the hook)."""
    if "RANK" in env or "SLURM_PROCID" not in env:
        return
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env.get("SLURM_NTASKS", "1")
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", "29500")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run", required=True)
    parser.add_argument("--iterations", type=int, required=True)
    parser.add_argument("--every", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", default="")
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--trace", required=True)
    parser.add_argument("--final", required=True)
    parser.add_argument("--sleep", type=float, default=0.0,
                        help="Seconds to sleep per iteration (to give a signal time to land).")
    parser.add_argument("--crash-at", type=int, default=0,
                        help="Raise at this iteration, every time (a crash loop).")
    parser.add_argument("--linger", type=float, default=0.0,
                        help="Seconds to wait after the run's end before exiting.")
    parser.add_argument("--on-launch", type=int, default=1,
                        help="The hook's launch (RESUME_LAUNCH) at which the faults below happen.")
    parser.add_argument("--hang-rank", type=int, default=-1, help="The rank that hangs or stops.")
    parser.add_argument("--hang-at", type=int, default=0, help="Block in its own code at this iteration.")
    parser.add_argument("--stop-at", type=int, default=0, help="SIGSTOP itself at this iteration.")
    parser.add_argument("--hang-at-start", type=int, default=0, metavar="LAUNCH",
                        help="At this launch, --hang-rank never joins the rendezvous.")
    parser.add_argument("--crash-once-at", type=int, default=0, help="Rank 0 raises at this iteration.")
    parser.add_argument("--fault", default="", help="RESUME_FAULT's spec, armed at that launch only.")
    parser.add_argument("--declare", type=lambda t: tuple(float(x) for x in t.split(":")), default=None,
                        metavar="ITER:SECONDS:SLEEP", help="At ITER, declare SECONDS expected and sleep SLEEP.")
    parser.add_argument("--slow-node", default="", help="The ranks on this node (RESUME_NODE) are slow.")
    parser.add_argument("--async-save", action="store_true", help="Scheduled saves in the background.")
    parser.add_argument("--slow-s", type=float, default=0.0, help="Their extra seconds per iteration.")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    _env_from_slurm(os.environ)
    if injected(args) and args.fault:
        faults.arm(args.fault)
    if os.environ.get("RESUME_LAUNCH") == str(args.hang_at_start) and os.environ.get("RANK") == str(args.hang_rank):
        while True:  # never joins the rendezvous: the others wait in init_process_group
            time.sleep(3600)
    dist.init_process_group("gloo")
    try:
        train(args)
        # DDP objects kept alive by reference cycles (optimizer hooks) must go
        # before the process group, or gloo can abort at interpreter exit.
        gc.collect()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
