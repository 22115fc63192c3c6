"""Run a function on several real processes with torch.distributed (gloo)."""

from __future__ import annotations

import gc
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, store: str, fn, args: tuple, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        with open(os.path.join(out_dir, f"result-{rank}.json"), "w") as f:
            json.dump(result, f)
        del result
        # DDP/FSDP objects caught in reference cycles (optimizer hooks) must
        # die before the process group does, or gloo can abort at exit.
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int, *args) -> list:
    """Call ``fn(rank, world, *args)`` in ``world`` spawned processes; their JSON results."""
    with tempfile.TemporaryDirectory(prefix="resume-mp-") as tmp:
        store = os.path.join(tmp, "store")
        mp.spawn(_entry, args=(world, store, fn, args, tmp), nprocs=world, join=True)
        results = []
        for rank in range(world):
            with open(os.path.join(tmp, f"result-{rank}.json")) as f:
                results.append(json.load(f))
        return results
