"""Our Megatron schedule arithmetic equals Megatron-Core's OptimizerParamScheduler, exactly."""

from __future__ import annotations

import random

import pytest
from resume.adapters.megatron.args import REFERENCE
from resume.adapters.megatron.schedule import MegatronSchedule
from support.megatron import require_megatron, stub_optimizer

GBS = REFERENCE.global_batch
# Updates -> LR of the reference schedule, as Megatron-Core 0.19.2 computes it (notes/megatron.md).
NOTES_TABLE = {0: 0.0, 1: 6.289308176100629e-08, 1272: 8e-05, 1273: 7.999999999955875e-05,
               317891: 4.41133627311159e-05, 635782: 8e-06}


def reference_schedule() -> MegatronSchedule:
    return MegatronSchedule(init_lr=0.0, max_lr=REFERENCE.lr, min_lr=REFERENCE.min_lr,
                            lr_warmup_steps=REFERENCE.warmup_samples,
                            lr_decay_steps=REFERENCE.decay_samples, lr_decay_style="cosine")


def megatron_scheduler(**overrides):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    kwargs = {"init_lr": 0.0, "max_lr": REFERENCE.lr, "min_lr": REFERENCE.min_lr,
                  "lr_warmup_steps": REFERENCE.warmup_samples, "lr_decay_steps": REFERENCE.decay_samples,
                  "lr_decay_style": "cosine", "start_wd": 0.1, "end_wd": 0.1,
                  "wd_incr_steps": REFERENCE.train_samples, "wd_incr_style": "constant"}
    kwargs.update(overrides)
    return OptimizerParamScheduler(stub_optimizer(1), **kwargs)


def megatron_lr(scheduler, updates: int) -> float:
    scheduler.num_steps = updates * GBS
    return scheduler.get_lr(scheduler.optimizer.param_groups[0])


@pytest.mark.megatron
def test_reference_table_matches_the_notes_and_megatron_exactly():
    require_megatron()
    ours, theirs = reference_schedule(), megatron_scheduler()
    for updates, lr in NOTES_TABLE.items():
        assert ours.lr(updates * GBS) == lr, updates
        assert megatron_lr(theirs, updates) == lr, updates


@pytest.mark.megatron
def test_reference_schedule_equals_megatron_at_1000_random_points():
    require_megatron()
    ours, theirs = reference_schedule(), megatron_scheduler()
    rng = random.Random(20261129)
    points = [rng.randrange(0, 700_000) for _ in range(1000)]  # past the end of decay too
    mismatches = [(u, ours.lr(u * GBS), megatron_lr(theirs, u)) for u in points
                  if ours.lr(u * GBS) != megatron_lr(theirs, u)]
    assert mismatches == []


@pytest.mark.megatron
@pytest.mark.parametrize("style", ["linear", "constant", "inverse-square-root", "WSD"])
def test_other_decay_styles_and_group_overrides_equal_megatron(style):
    require_megatron()
    extra = {"wsd_decay_steps": 100_000, "lr_wsd_decay_style": "cosine"} if style == "WSD" else {}
    theirs = megatron_scheduler(lr_decay_style=style, init_lr=1e-7, **extra)
    ours = MegatronSchedule.from_scheduler(theirs)
    rng = random.Random(style)
    group = {"max_lr": 3e-4, "min_lr": 1e-6}
    for _ in range(300):
        n = rng.randrange(0, REFERENCE.decay_samples + 10 * GBS)
        theirs.num_steps = n
        assert ours.lr(n) == theirs.get_lr({}), (style, n)
        assert ours.lr(n, group) == theirs.get_lr(group), (style, n)


@pytest.mark.megatron
def test_schedule_from_args_equals_the_one_megatron_training_builds():
    require_megatron()
    from resume.adapters.megatron.args import check_with_megatron_parser

    args = check_with_megatron_parser(REFERENCE)
    assert MegatronSchedule.from_args(args) == reference_schedule()


def test_lr_ahead_steps_by_the_global_batch():
    s = reference_schedule()
    rows = s.lr_ahead(1271 * GBS, GBS, 3, [{}, {"max_lr": 1.6e-4}])
    assert [r[0] for r in rows] == [s.lr(1271 * GBS), s.lr(1272 * GBS), s.lr(1273 * GBS)]
    assert rows[1] == [8e-05, 1.6e-4]
