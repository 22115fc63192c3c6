"""Megatron-Core's learning-rate schedule, computed without Megatron.

The arithmetic of ``OptimizerParamScheduler.get_lr`` (megatron-core 0.19.2), operation for
operation: the values are *equal* to Megatron's (the tests compare with ``==`` against the
real class), so ``verify``, ``inspect`` and the pre-load check need no megatron-core.
``schedule_arguments`` maps ``megatron.training`` arguments to the fields of the
scheduler's saved state; ``ignored_schedule_arguments`` names those Megatron ignores under
``--use-checkpoint-opt_param-scheduler``. Positions are in samples (``num_steps``: each
successful update advances it by the global batch).
"""


from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from resume.errors import ManifestError, UsageError

__all__ = ["MegatronSchedule", "ScheduleArgument", "ignored_schedule_arguments", "schedule_arguments"]

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronSchedule:
    """The static configuration of an ``OptimizerParamScheduler`` (no position)."""

    init_lr: float
    """LR at num_steps 0 (``--lr-warmup-init``); not saved by Megatron, taken from the arguments."""
    max_lr: float
    """Peak LR (``--lr``)."""
    min_lr: float
    """LR after the decay (``--min-lr``)."""
    lr_warmup_steps: float
    """Warm-up length in samples (``--lr-warmup-samples``, or iterations x global batch)."""
    lr_decay_steps: float
    """End of the decay in samples (``--lr-decay-samples``, or iterations x global batch)."""
    lr_decay_style: str
    """``constant``, ``linear``, ``cosine``, ``inverse-square-root`` or ``WSD``."""
    wsd_decay_steps: float | None = None
    lr_wsd_decay_style: str | None = None

    def __post_init__(self) -> None:
        if self.lr_decay_style not in DECAY_STYLES:
            raise UsageError(f"lr_decay_style: expected one of {DECAY_STYLES}, actual {self.lr_decay_style!r}")
        if not self.lr_decay_steps > 0:
            raise UsageError(f"lr_decay_steps: expected > 0, actual {self.lr_decay_steps}")
        if not self.lr_warmup_steps < self.lr_decay_steps:
            raise UsageError(f"lr_warmup_steps: expected < lr_decay_steps ({self.lr_decay_steps}), "
                             f"actual {self.lr_warmup_steps}")
        if not 0.0 <= self.min_lr <= self.max_lr or self.init_lr > self.max_lr:
            raise UsageError(f"lr: expected 0 <= min_lr <= max_lr and init_lr <= max_lr, actual "
                             f"min {self.min_lr}, max {self.max_lr}, init {self.init_lr}")
        if self.lr_decay_style == "WSD" and (self.wsd_decay_steps is None
                                             or self.lr_wsd_decay_style not in WSD_STYLES):
            raise UsageError(f"WSD: expected wsd_decay_steps and lr_wsd_decay_style in {WSD_STYLES}, "
                             f"actual {self.wsd_decay_steps}, {self.lr_wsd_decay_style!r}")

    # -- the arithmetic ---------------------------------------------------------------

    def lr(self, num_steps: float, group: dict | None = None) -> float:
        """The LR Megatron sets at position ``num_steps`` for a param group.

        ``group`` may carry per-group ``max_lr``/``min_lr`` overrides, as in Megatron.
        """
        group = group or {}
        max_lr = group.get("max_lr", self.max_lr)
        min_lr = group.get("min_lr", self.min_lr)
        if self.lr_warmup_steps > 0 and num_steps <= self.lr_warmup_steps:
            return self.init_lr + ((max_lr - self.init_lr) * float(num_steps) / float(self.lr_warmup_steps))
        if self.lr_decay_style == "constant":
            return max_lr
        if num_steps > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            warmup_steps = max(self.lr_warmup_steps, 1)
            steps = max(num_steps, 1)
            return max(min_lr, max_lr * warmup_steps**0.5 / (steps**0.5))
        decay_ratio = float(num_steps - self.lr_warmup_steps) / float(self.lr_decay_steps - self.lr_warmup_steps)
        delta_lr = max_lr - min_lr
        if self.lr_decay_style == "linear":
            coeff = 1.0 - decay_ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        else:
            coeff = self._wsd_coeff(num_steps)
        return min_lr + coeff * delta_lr

    def _wsd_coeff(self, num_steps: float) -> float:
        assert self.wsd_decay_steps is not None  # checked in __post_init__
        anneal_start = self.lr_decay_steps - self.wsd_decay_steps
        if num_steps <= anneal_start:
            return 1.0
        ratio = float(num_steps - anneal_start) / float(self.wsd_decay_steps)
        if self.lr_wsd_decay_style == "linear":
            return 1.0 - ratio
        if self.lr_wsd_decay_style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        if self.lr_wsd_decay_style == "exponential":
            return (2.0 * math.pow(0.5, ratio)) - 1.0
        return 1.0 - math.sqrt(ratio)

    def lr_ahead(self, num_steps: float, increment: int, k: int,
                 groups: list[dict] | None = None) -> list[list[float]]:
        """LR of every group now and after each of the next ``k - 1`` successful updates."""
        groups = groups or [{}]
        return [[self.lr(num_steps + i * increment, g) for g in groups] for i in range(k)]

    # -- where the configuration comes from ----------------------------------------------

    @classmethod
    def from_args(cls, args: Any, *, checkpoint: MegatronSchedule | None = None) -> MegatronSchedule:
        """The schedule ``megatron.training`` builds from its arguments (get_optimizer_param_scheduler).

        With ``checkpoint``: the schedule it runs after loading that checkpoint with
        ``--use-checkpoint-opt_param-scheduler``. The warm-up, the decay length and the
        decay style are the checkpoint's; ``--lr`` and ``--min-lr`` stay the arguments'
        (Megatron-Core's optimizer keeps them in every param group, and ``get_lr`` reads
        them there first), as do ``--lr-warmup-init`` and the WSD arguments (the scheduler
        does not save them).
        """
        saved = {f: v for argument in schedule_arguments(args) for f, v in argument.fields.items()}
        if checkpoint is not None:
            saved.update(lr_warmup_steps=checkpoint.lr_warmup_steps, lr_decay_steps=checkpoint.lr_decay_steps,
                         lr_decay_style=checkpoint.lr_decay_style)
        wsd, wsd_style = None, None
        if saved["lr_decay_style"] == "WSD":  # the WSD fields are read only by that style
            wsd_style = getattr(args, "lr_wsd_decay_style", None)
            if getattr(args, "train_samples", None):
                wsd = getattr(args, "lr_wsd_decay_samples", None)
            elif getattr(args, "lr_wsd_decay_iters", None) is not None:
                wsd = args.lr_wsd_decay_iters * args.global_batch_size
        return cls(init_lr=args.lr_warmup_init, max_lr=saved["max_lr"], min_lr=saved["min_lr"],
                   lr_warmup_steps=saved["lr_warmup_steps"], lr_decay_steps=saved["lr_decay_steps"],
                   lr_decay_style=saved["lr_decay_style"], wsd_decay_steps=wsd, lr_wsd_decay_style=wsd_style)

    @classmethod
    def from_scheduler(cls, scheduler: Any) -> MegatronSchedule:
        """The configuration of a live ``OptimizerParamScheduler``."""
        wsd = scheduler.lr_decay_style == "WSD"
        return cls(init_lr=scheduler.init_lr, max_lr=scheduler.max_lr, min_lr=scheduler.min_lr,
                   lr_warmup_steps=scheduler.lr_warmup_steps, lr_decay_steps=scheduler.lr_decay_steps,
                   lr_decay_style=scheduler.lr_decay_style,
                   wsd_decay_steps=getattr(scheduler, "wsd_decay_steps", None) if wsd else None,
                   lr_wsd_decay_style=getattr(scheduler, "lr_wsd_decay_style", None) if wsd else None)

    @classmethod
    def from_state_dict(cls, state: Any, *, init_lr: float, source: str,
                        wsd_decay_steps: float | None = None,
                        lr_wsd_decay_style: str | None = None) -> MegatronSchedule:
        """The configuration saved in a checkpoint's ``opt_param_scheduler`` entry.

        ``init_lr`` and the WSD fields are not part of Megatron's state dict;
        pass them from the checkpoint's arguments.
        """
        if not isinstance(state, dict):
            raise ManifestError(f"{source}: opt_param_scheduler: expected a dict, actual {type(state).__name__}")
        if state.get("lr_decay_style") != "WSD":  # as a live scheduler has them (from_scheduler)
            wsd_decay_steps = lr_wsd_decay_style = None
        try:
            return cls(init_lr=init_lr, max_lr=float(state["max_lr"]), min_lr=state["min_lr"],
                       lr_warmup_steps=state["lr_warmup_steps"], lr_decay_steps=state["lr_decay_steps"],
                       lr_decay_style=state["lr_decay_style"], wsd_decay_steps=wsd_decay_steps,
                       lr_wsd_decay_style=lr_wsd_decay_style)
        except KeyError as e:
            raise ManifestError(f"{source}: opt_param_scheduler.{e.args[0]}: expected a value, "
                                "actual missing") from e
        except UsageError as e:
            raise ManifestError(f"{source}: opt_param_scheduler: {e}") from e

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, *, source: str) -> MegatronSchedule:
        if not isinstance(data, dict):
            raise ManifestError(f"{source}: schedule: expected an object, actual {type(data).__name__}")
        try:
            return cls(**data)
        except (TypeError, UsageError) as e:
            raise ManifestError(f"{source}: schedule: {e}") from e


# -- the arguments behind the scheduler's saved fields ------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleArgument:
    """A ``megatron.training`` argument, and the fields of ``OptimizerParamScheduler.state_dict()`` it sets."""

    flag: str
    """As Megatron's parser spells it, e.g. ``--lr-decay-samples``."""
    given: Any
    """Its value in the run's arguments."""
    fields: dict[str, Any]
    """State-dict field -> the value ``get_optimizer_param_scheduler`` builds from ``given``."""
    unit: str = "value"
    """``samples``, ``iterations`` (x the global batch), ``fraction`` (of the decay length) or ``value``."""
    in_param_groups: bool = False
    """Megatron-Core's optimizer also keeps it in every param group, where the scheduler reads it
    first (``--lr``, ``--min-lr``): the scheduler's own copy does not decide the LR."""
    default_of: str | None = None
    """The argument whose value it took by default (``--train-samples`` for ``--lr-decay-samples``)."""

    def checkpoint_value(self, state: dict, global_batch: int) -> Any:
        """What the checkpoint's ``state`` holds for this argument, in the argument's unit."""
        values = [state[f] for f in self.fields]
        decay = state.get("lr_decay_steps")
        if all(map(_is_number, values)):
            if self.unit == "fraction" and _is_number(decay) and decay:
                values = [values[0] / decay]
            elif self.unit == "iterations":
                values = [v // global_batch if v % global_batch == 0 else v / global_batch for v in values]
        if len(set(map(repr, values))) == 1:
            return values[0]
        return dict(zip(self.fields, values))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def schedule_arguments(args: Any) -> list[ScheduleArgument]:
    """The arguments ``megatron.training`` turns into the fields ``OptimizerParamScheduler`` saves.

    As 0.19.2 does it: ``get_optimizer_param_scheduler`` (training.py) for the lengths, in
    samples; ``validate_args`` (arguments.py) sets both weight-decay ends from ``--weight-decay``
    when the increment style is ``constant``. One entry per argument; a test holds the table to
    Megatron's own parser and scheduler, argument by argument.
    """
    gbs = args.global_batch_size
    if getattr(args, "train_samples", None):  # first: Megatron sets train_iters from it as well
        per_unit, unit, kind = 1, "samples", "samples"
        decay_given, total, warmup_given = args.lr_decay_samples, args.train_samples, args.lr_warmup_samples
    elif getattr(args, "train_iters", None):
        per_unit, unit, kind = gbs, "iterations", "iters"
        decay_given, total, warmup_given = args.lr_decay_iters, args.train_iters, args.lr_warmup_iters
    else:
        raise UsageError("arguments: expected --train-iters or --train-samples, actual neither")
    train_flag = f"--train-{kind}"
    decay = (decay_given or total) * per_unit
    train_fields = {"wd_incr_steps": total * per_unit}
    out = [ScheduleArgument(flag="--lr", given=args.lr, fields={"max_lr": float(args.lr)}, in_param_groups=True),
           ScheduleArgument(flag="--min-lr", given=args.min_lr, fields={"min_lr": args.min_lr},
                            in_param_groups=True)]
    if decay_given is None:
        train_fields["lr_decay_steps"] = decay
    else:
        # Megatron writes the default into args (lr_decay_* = train_*) while it builds the
        # scheduler, before it loads: an equal value may have been that default.
        out.append(ScheduleArgument(flag=f"--lr-decay-{kind}", given=decay_given, fields={"lr_decay_steps": decay},
                                    unit=unit, default_of=train_flag if decay_given == total else None))
    if args.lr_warmup_fraction is not None:
        out.append(ScheduleArgument(flag="--lr-warmup-fraction", given=args.lr_warmup_fraction,
                                    fields={"lr_warmup_steps": args.lr_warmup_fraction * decay}, unit="fraction"))
    else:
        out.append(ScheduleArgument(flag=f"--lr-warmup-{kind}", given=warmup_given,
                                    fields={"lr_warmup_steps": warmup_given * per_unit}, unit=unit))
    out.append(ScheduleArgument(flag="--lr-decay-style", given=args.lr_decay_style,
                                fields={"lr_decay_style": args.lr_decay_style}))
    out += _weight_decay_arguments(args)
    out.append(ScheduleArgument(flag=train_flag, given=total, fields=train_fields, unit=unit))
    return out


def _weight_decay_arguments(args: Any) -> list[ScheduleArgument]:
    """The weight-decay entries, with the parser's defaults where a caller's arguments have none."""
    style = getattr(args, "weight_decay_incr_style", "constant")
    start, end = getattr(args, "start_weight_decay", None), getattr(args, "end_weight_decay", None)
    if style == "constant":
        wd = getattr(args, "weight_decay", 0.01)
        out = [ScheduleArgument(flag="--weight-decay", given=wd,
                                fields={"start_wd": wd if start is None else start,
                                        "end_wd": wd if end is None else end})]
    else:
        out = [ScheduleArgument(flag="--start-weight-decay", given=start, fields={"start_wd": start}),
               ScheduleArgument(flag="--end-weight-decay", given=end, fields={"end_wd": end})]
    out.append(ScheduleArgument(flag="--weight-decay-incr-style", given=style, fields={"wd_incr_style": style}))
    return out


# -- the arguments Megatron ignores with --use-checkpoint-opt_param-scheduler ---------------------


# What Megatron takes from the arguments even with --use-checkpoint-opt_param-scheduler:
# MegatronSchedule field -> the argument.
STILL_FROM_ARGUMENTS = (("max_lr", "--lr"), ("min_lr", "--min-lr"), ("init_lr", "--lr-warmup-init"),
                        ("wsd_decay_steps", "--lr-wsd-decay-samples/iters"),
                        ("lr_wsd_decay_style", "--lr-wsd-decay-style"))

# What each field of the scheduler's state decides, for the warnings.
FIELD_MEANING = {"lr_decay_steps": "the LR decay length", "lr_warmup_steps": "the LR warm-up length",
                 "lr_decay_style": "the LR decay style", "start_wd": "the weight decay",
                 "end_wd": "the weight decay", "wd_incr_steps": "the weight-decay increment length",
                 "wd_incr_style": "the weight-decay increment style"}

# The fields Megatron-Core 0.19.2's OptimizerParamScheduler.load_state_dict restores only after
# it has stepped to the loaded position, a step that set every group's weight decay from the
# arguments' values: the first update after the restart applies that weight decay.
WEIGHT_DECAY_FIELDS = frozenset({"start_wd", "end_wd", "wd_incr_steps", "wd_incr_style"})


def ignored_schedule_arguments(args: Any, checkpoint: dict | None) -> list[str]:
    """With ``--use-checkpoint-opt_param-scheduler``: a line for each argument whose value
    Megatron ignores for the checkpoint's, naming the argument and both values.

    ``checkpoint`` is the ``opt_param_scheduler`` state Megatron will load. Not named: ``--lr``
    and ``--min-lr`` (the optimizer's param groups carry them, so they still apply, and the LR
    check covers them); a field the checkpoint lacks (Megatron keeps the argument's then) or
    holds no plain value for; the weight-decay increment length while the increment style is
    constant (it has no effect).
    """
    if not checkpoint:
        return []
    lines = []
    for arg in schedule_arguments(args):
        if arg.in_param_groups or not all(_plain(checkpoint.get(f, None)) for f in arg.fields):
            continue
        changed = [f for f, value in arg.fields.items() if checkpoint[f] != value
                   and not (f == "wd_incr_steps" and checkpoint.get("wd_incr_style") == "constant")]
        if changed:
            lines.append(_describe_ignored(arg, checkpoint, args.global_batch_size, changed))
    return lines


def _plain(value: Any) -> bool:
    """A value the comparison and the message can use (the state came from an untrusted file:
    a number, or a short printable word)."""
    if isinstance(value, str):
        return len(value) <= 64 and value.isprintable()
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _describe_ignored(arg: ScheduleArgument, checkpoint: dict, global_batch: int, changed: list[str]) -> str:
    given, kept = f"{arg.flag} {arg.given}", f"{arg.checkpoint_value(checkpoint, global_batch)}"
    if arg.default_of:
        given += f" (= {arg.default_of}, its default)"
    if arg.unit in ("iterations", "fraction") and len(arg.fields) == 1:
        (name,) = arg.fields
        given += f" ({arg.fields[name]} samples)"
        kept += f" ({checkpoint[name]} samples)"
    what = " and ".join(dict.fromkeys(FIELD_MEANING.get(f, f) for f in changed))
    line = (f"Megatron ignores {given} from the command line for {what} and continues with the "
            f"checkpoint's {kept} (--use-checkpoint-opt_param-scheduler)")
    if WEIGHT_DECAY_FIELDS.intersection(changed):
        line += ("; the first update after the restart still applies the command line's weight decay "
                 "(Megatron-Core steps the scheduler before it restores the weight-decay fields)")
    return line
