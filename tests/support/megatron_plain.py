"""Megatron save directories written by megatron.training alone, without resume installed: what
an operator has on disk when adopting resume in the middle of a run (no resume manifest)."""

from __future__ import annotations

import types

from support import megatron_training_run as m


def plain_save(save_dir: str, extra: tuple[str, ...] = (), *, iterations: int = 3,
               skip_at: frozenset[int] = frozenset()) -> dict:
    """Train ``iterations`` iterations with Megatron's own code and save once, nothing of ours
    installed; the last iteration is skipped as ``--iterations-to-skip`` skips one (Megatron's
    ``skipped_train_samples``). ``skip_at``: iterations whose update is skipped (an overflow)."""
    args, model, optimizer, scheduler = m.fresh(save_dir, extra)
    m.load(args, model, optimizer, scheduler)
    counter = types.SimpleNamespace(count_iteration=lambda *, skipped: None)
    it = m.train(args, model, optimizer, scheduler, counter, until=iterations - 1, start=0, overflow_at=skip_at)
    # The last iteration as --iterations-to-skip runs it (training.py): the batch is read and
    # booked in args.skipped_train_samples, no train_step, no scheduler step.
    it += 1
    args.consumed_train_samples += m.GBS
    args.skipped_train_samples += m.GBS
    m.save(it, model, optimizer, scheduler)
    return {"iteration": it, "consumed": args.consumed_train_samples, "num_steps": scheduler.num_steps,
            "skipped_train_samples": args.skipped_train_samples}
