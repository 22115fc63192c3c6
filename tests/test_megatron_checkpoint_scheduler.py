"""--use-checkpoint-opt_param-scheduler: Megatron keeps the checkpoint's schedule and ignores the
command line's. resume lets the restart go on, names each ignored argument with both values, and
still refuses what changes the LR (--lr and --min-lr live in the optimizer's param groups too).

The unit tests run without megatron-core; those marked ``megatron`` hold the argument table to
Megatron's own parser and scheduler, and restart megatron.training for real at world size 1.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys

import pytest
from resume.adapters.megatron.schedule import MegatronSchedule, ignored_schedule_arguments, schedule_arguments
from support.ranks import run_ranks

FLAG = "--use-checkpoint-opt_param-scheduler"

# OptimizerParamScheduler.state_dict() of megatron_training_run's arguments (what iteration 6 saved).
SAVED = {"max_lr": 1e-3, "min_lr": 1e-5, "lr_warmup_steps": 8, "num_steps": 16, "lr_decay_style": "cosine",
         "lr_decay_steps": 320, "start_wd": 0.1, "end_wd": 0.1, "wd_incr_style": "constant",
         "wd_incr_steps": 400}


def megatron_args(**changes) -> argparse.Namespace:
    """megatron_training_run's arguments as the scheduler reads them after validate_args and
    get_optimizer_param_scheduler (which sets train_iters from train_samples)."""
    args = argparse.Namespace(
        global_batch_size=4, train_samples=400, train_iters=100, lr_decay_samples=320, lr_decay_iters=None,
        lr_warmup_samples=8, lr_warmup_iters=0, lr_warmup_fraction=None, lr_warmup_init=0.0, lr=1e-3,
        min_lr=1e-5, lr_decay_style="cosine", lr_wsd_decay_samples=None, lr_wsd_decay_iters=None,
        lr_wsd_decay_style="exponential", weight_decay=0.1, start_weight_decay=0.1, end_weight_decay=0.1,
        weight_decay_incr_style="constant")
    for k, v in changes.items():
        setattr(args, k, v)
    return args


ITERATION_BASED = {"train_samples": None, "lr_decay_samples": None, "lr_warmup_samples": 0, "train_iters": 100,
                   "lr_decay_iters": 80, "lr_warmup_iters": 2}


@pytest.mark.parametrize("changes, given, kept", [
    ({"lr_decay_samples": 480}, "--lr-decay-samples 480 from the command line for the LR decay length",
     "checkpoint's 320 "),
    ({"lr_warmup_samples": 12}, "--lr-warmup-samples 12 from", "checkpoint's 8 "),
    ({"lr_decay_style": "linear"}, "--lr-decay-style linear from", "checkpoint's cosine "),
    ({"weight_decay": 0.2, "start_weight_decay": 0.2, "end_weight_decay": 0.2}, "--weight-decay 0.2 from",
     "checkpoint's 0.1 "),
    ({"lr_warmup_fraction": 0.05, "lr_warmup_samples": 0}, "--lr-warmup-fraction 0.05 (16.0 samples) from",
     "checkpoint's 0.025 (8 samples)"),
    ({"lr_decay_samples": 400}, "--lr-decay-samples 400 (= --train-samples, its default) from",
     "checkpoint's 320 "),
    ({**ITERATION_BASED, "lr_decay_iters": 120}, "--lr-decay-iters 120 (480 samples) from",
     "checkpoint's 80 (320 samples)"),
], ids=["decay", "warmup", "style", "weight-decay", "warmup-fraction", "decay-as-its-default", "decay-iters"])
def test_each_ignored_argument_is_named_with_both_values(changes, given, kept):
    (line,) = ignored_schedule_arguments(megatron_args(**changes), SAVED)
    assert line.startswith("Megatron ignores " + given), line
    assert kept in line and FLAG in line


def test_unchanged_arguments_and_lr_or_min_lr_are_not_named():
    """--lr and --min-lr still apply (every param group carries them): refused by the LR check instead."""
    assert ignored_schedule_arguments(megatron_args(), SAVED) == []
    assert ignored_schedule_arguments(megatron_args(**ITERATION_BASED), SAVED) == []
    assert ignored_schedule_arguments(megatron_args(lr=2e-3, min_lr=2e-5), SAVED) == []


def test_weight_decay_names_the_first_update_that_still_applies_the_command_lines():
    (line,) = ignored_schedule_arguments(megatron_args(weight_decay=0.2, start_weight_decay=0.2,
                                                       end_weight_decay=0.2), SAVED)
    assert "first update after the restart still applies the command line's weight decay" in line
    (line,) = ignored_schedule_arguments(megatron_args(lr_decay_samples=480), SAVED)
    assert "weight decay" not in line


def test_a_longer_run_is_named_only_where_its_length_sets_a_weight_decay_increment():
    assert ignored_schedule_arguments(megatron_args(train_samples=800), SAVED) == []
    linear = {"weight_decay_incr_style": "linear", "start_weight_decay": 0.05, "end_weight_decay": 0.1}
    saved = {**SAVED, "wd_incr_style": "linear", "start_wd": 0.05}
    (line,) = ignored_schedule_arguments(megatron_args(train_samples=800, **linear), saved)
    assert line.startswith("Megatron ignores --train-samples 800 from the command line for the weight-decay "
                           "increment length and continues with the checkpoint's 400"), line


def test_fields_a_checkpoint_lacks_or_garbles_are_not_named():
    """Megatron keeps the argument's value for a field the state lacks (older checkpoints); the
    state comes from a file, so a value that is not plain is passed over, not formatted."""
    older = {k: v for k, v in SAVED.items() if k not in ("start_wd", "end_wd", "wd_incr_style", "wd_incr_steps")}
    assert ignored_schedule_arguments(megatron_args(weight_decay=0.2, start_weight_decay=0.2,
                                                    end_weight_decay=0.2), older) == []
    garbled = {**SAVED, "lr_decay_steps": [320], "lr_warmup_steps": True, "lr_decay_style": "cosine\nFAKE LOG"}
    assert ignored_schedule_arguments(megatron_args(lr_decay_samples=480, lr_warmup_samples=12,
                                                    lr_decay_style="linear"), garbled) == []
    assert ignored_schedule_arguments(megatron_args(lr_decay_samples=480), None) == []


def test_schedule_with_the_checkpoints_keeps_its_lengths_and_style_but_the_arguments_lr():
    kept = MegatronSchedule(init_lr=0.0, max_lr=1e-3, min_lr=1e-5, lr_warmup_steps=8, lr_decay_steps=320,
                            lr_decay_style="cosine")
    args = megatron_args(lr_decay_samples=480, lr_warmup_samples=12, lr_decay_style="linear", min_lr=2e-5)
    schedule = MegatronSchedule.from_args(args, checkpoint=kept)
    assert (schedule.lr_warmup_steps, schedule.lr_decay_steps, schedule.lr_decay_style) == (8, 320, "cosine")
    assert (schedule.max_lr, schedule.min_lr) == (1e-3, 2e-5)
    assert MegatronSchedule.from_args(megatron_args(), checkpoint=kept) == kept


# -- the table against Megatron's own parser and scheduler ---------------------------------------------


def _without(argv: list[str], *flags: str) -> list[str]:
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word in flags:
            skip = True
        else:
            out.append(word)
    return out


def _base_argv(kind: str) -> list[str]:
    from support.megatron_training_run import argv

    base = argv("/nonexistent")[1:]
    if kind == "iterations":
        return _without(base, "--train-samples", "--lr-decay-samples", "--lr-warmup-samples") + [
            "--train-iters", "100", "--lr-decay-iters", "80", "--lr-warmup-iters", "2"]
    if kind == "decay-default":
        return _without(base, "--lr-decay-samples")
    if kind == "linear-weight-decay":
        return base + ["--weight-decay-incr-style", "linear", "--start-weight-decay", "0.05",
                       "--end-weight-decay", "0.1"]
    return base


def _megatron_scheduler(argv: list[str]):
    """Megatron's parse_args and validate_args, then get_optimizer_param_scheduler, in this process."""
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.training import get_optimizer_param_scheduler
    from support.megatron import stub_optimizer

    saved_argv, sys.argv = sys.argv, ["pretrain_gpt.py", *argv]
    previous = global_vars._GLOBAL_ARGS
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            args = parse_args()
            validate_args(args, {})
            global_vars.set_args(args)
            scheduler = get_optimizer_param_scheduler(stub_optimizer(1))
    finally:
        sys.argv = saved_argv
        global_vars.set_args(previous)
    return args, scheduler


@pytest.mark.megatron
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("kind, change, named", [
    ("samples", ["--lr-decay-samples", "480"], ["--lr-decay-samples"]),
    ("samples", ["--lr-warmup-samples", "12"], ["--lr-warmup-samples"]),
    ("samples", ["--lr-warmup-fraction", "0.05", "--lr-warmup-samples", "0"], ["--lr-warmup-fraction"]),
    ("samples", ["--lr-decay-style", "linear"], ["--lr-decay-style"]),
    ("samples", ["--weight-decay", "0.2"], ["--weight-decay"]),
    ("samples", ["--train-samples", "800"], []),  # constant weight decay: its increment length does nothing
    ("samples", ["--lr", "2e-3"], []),  # kept in every param group: still applies
    ("samples", ["--min-lr", "2e-5"], []),
    ("decay-default", ["--train-samples", "800"], ["--lr-decay-samples"]),
    ("iterations", ["--lr-decay-iters", "120"], ["--lr-decay-iters"]),
    ("iterations", ["--lr-warmup-iters", "3"], ["--lr-warmup-iters"]),
    ("linear-weight-decay", ["--start-weight-decay", "0.07"], ["--start-weight-decay"]),
    ("linear-weight-decay", ["--end-weight-decay", "0.2"], ["--end-weight-decay"]),
    ("linear-weight-decay", ["--weight-decay-incr-style", "cosine"], ["--weight-decay-incr-style"]),
    ("linear-weight-decay", ["--train-samples", "800"], ["--train-samples"]),
])
def test_table_matches_megatrons_parser_and_scheduler(kind, change, named):
    from support.megatron import require_megatron

    require_megatron()
    from resume.adapters.megatron.args import import_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    import_megatron_arguments().add_megatron_arguments(parser)
    options = parser._option_string_actions
    _, base = _megatron_scheduler(_base_argv(kind))
    saved = base.state_dict()
    args, plain = _megatron_scheduler(_base_argv(kind) + change)
    assert MegatronSchedule.from_args(args) == MegatronSchedule.from_scheduler(plain)
    changed_args, scheduler = _megatron_scheduler(_base_argv(kind) + change + [FLAG])
    state = scheduler.state_dict()
    table = schedule_arguments(args)
    for entry in table:
        # Megatron's own flag, read from the attribute its parser fills ...
        assert entry.flag in options and entry.given == getattr(args, options[entry.flag].dest), entry
        # ... giving the value Megatron's scheduler holds.
        assert entry.fields == {f: state[f] for f in entry.fields}, entry
    assert set().union(*(e.fields for e in table)) == set(state) - {"num_steps"}
    # With the flag Megatron's scheduler takes every saved field from the checkpoint.
    scheduler.load_state_dict(saved)
    assert scheduler.state_dict() == saved
    assert [line.split()[2] for line in ignored_schedule_arguments(changed_args, saved)] == named


# -- megatron.training, restarted for real -------------------------------------------------------------


def _restart(rank: int, world: int, save_dir: str, extra: list[str]) -> dict:
    import logging

    from resume.adapters.megatron import install
    from support import megatron_training_run as m

    from resume.errors import ContinuityError

    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("resume").addHandler(Keep(logging.WARNING))
    recorder = install()
    args, model, optimizer, scheduler = m.fresh(save_dir, tuple(extra))
    try:
        iteration = m.load(args, model, optimizer, scheduler)
    except ContinuityError as e:
        return {"error": {"item": e.item, "expected": e.expected, "actual": e.actual, "message": str(e)},
                "warnings": warnings}
    expected = recorder.loaded.manifest.expectation
    decayed = next(g for g in optimizer.param_groups if g["wd_mult"] == 1.0)
    wd_first_update = decayed["weight_decay"]
    m.train(args, model, optimizer, scheduler, recorder, until=iteration + 1, start=iteration)
    return {"iteration": iteration, "warnings": warnings, "schedule": scheduler.state_dict(),
            "lr_applied": optimizer.param_groups[0]["lr"], "promised": expected["lr_ahead"][1][0],
            "wd_first_update": wd_first_update, "wd_after": decayed["weight_decay"]}


@pytest.fixture
def save(megatron_save, tmp_path):
    copy = str(tmp_path / "save")
    shutil.copytree(megatron_save[0], copy)
    return copy


def _ignored(out: dict) -> list[str]:
    return [w for w in out["warnings"] if "Megatron ignores" in w]


@pytest.mark.megatron
@pytest.mark.multiprocess
def test_restart_with_the_flag_goes_on_and_names_each_ignored_argument_with_both_values(save):
    extra = [FLAG, "--lr-decay-samples", "480", "--lr-warmup-samples", "12", "--weight-decay", "0.2"]
    out = run_ranks(_restart, 1, save, extra)[0]
    assert "error" not in out, out
    lines = _ignored(out)
    assert len(lines) == 3, out["warnings"]
    for given, kept in [("--lr-decay-samples 480 ", "checkpoint's 320 "), ("--lr-warmup-samples 12 ", "checkpoint's 8 "),
                        ("--weight-decay 0.2 ", "checkpoint's 0.1 ")]:
        assert sum(given in line and kept in line for line in lines) == 1, (given, lines)
    assert all(line.startswith("resume: iter_0000006: Megatron ignores ") for line in lines), lines
    # Megatron went on with the checkpoint's schedule, so the LR continues as recorded.
    assert out["iteration"] == 6 and out["lr_applied"] == out["promised"]
    assert (out["schedule"]["lr_decay_steps"], out["schedule"]["lr_warmup_steps"],
            out["schedule"]["end_wd"]) == (320, 8, 0.1)
    # What the warning says of weight decay: the first update still gets the command line's.
    assert (out["wd_first_update"], out["wd_after"]) == (0.2, 0.1)


@pytest.mark.megatron
@pytest.mark.multiprocess
def test_with_the_flag_a_changed_min_lr_is_still_refused_naming_both_values(save):
    """Megatron-Core keeps --min-lr in every param group: it would apply (or fail to match the
    checkpoint's groups), so the flag does not make it ignorable."""
    out = run_ranks(_restart, 1, save, [FLAG, "--min-lr", "2e-5"])[0]
    err = out["error"]
    assert err["item"] == "lr_ahead[+0]" and err["expected"] != err["actual"]
    assert "--min-lr 2e-05 (the checkpoint's 1e-05)" in err["message"], err["message"]
    assert _ignored(out) == []


@pytest.mark.megatron
@pytest.mark.multiprocess
def test_without_the_flag_a_changed_schedule_is_still_refused(save):
    out = run_ranks(_restart, 1, save, ["--lr-decay-samples", "480", "--lr-warmup-samples", "12"])[0]
    err = out["error"]
    with open(os.path.join(save, "iter_0000006", "resume-manifest.json")) as f:
        recorded = json.load(f)["expectation"]["megatron"]["lr_schedule_ahead"][0]
    assert err["item"] == "lr_ahead[+0]" and err["expected"] == recorded and err["actual"] != recorded
    assert str(recorded) in err["message"] and str(err["actual"]) in err["message"]
    assert _ignored(out) == []

