"""Megatron save directories written by megatron.training alone, without resume installed: what
an operator has on disk when adopting resume in the middle of a run (no resume manifest)."""

from __future__ import annotations

import types

from support import megatron_training_run as m


def plain_save(save_dir: str, extra: tuple[str, ...] = (), *, iterations: int = 3,
               skip_at: frozenset[int] = frozenset()) -> dict:
    """Train ``iterations`` iterations with Megatron's own code and save once, nothing of ours
    installed. ``skip_at``: iterations whose update is skipped (an overflow). Megatron's
    ``--iterations-to-skip`` style skips are booked by the caller through ``extra``."""
    args, model, optimizer, scheduler = m.fresh(save_dir, extra)
    m.load(args, model, optimizer, scheduler)
    counter = types.SimpleNamespace(count_iteration=lambda *, skipped: None)
    it = m.train(args, model, optimizer, scheduler, counter, until=iterations, start=0, overflow_at=skip_at)
    lrs = {}
    m.save(it, model, optimizer, scheduler)
    return {"iteration": it, "consumed": args.consumed_train_samples, "num_steps": scheduler.num_steps,
            "lr_now": scheduler.get_lr(optimizer.param_groups[0]), "lrs": lrs}
