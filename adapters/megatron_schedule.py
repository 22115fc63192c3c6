"""Megatron-Core's learning-rate schedule, computed without Megatron.

``resume verify``, ``inspect`` and the pre-load check read a Megatron
checkpoint on machines without megatron-core installed, and must still say
what the LR at the next updates will be. This is the arithmetic of
``megatron.core.optimizer_param_scheduler.OptimizerParamScheduler.get_lr``
(0.19.2), operation for operation, so that the values are *equal* to
Megatron's, not merely close (tests compare them with ``==`` at the reference
schedule's corners and at 1,000 random points against the real class).

Positions are in Megatron's own unit: ``num_steps`` counts samples (each
successful update advances it by the global batch, in sample-based and in
iteration-based training alike).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from resume.errors import ManifestError, UsageError

__all__ = ["MegatronSchedule"]

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
    def from_args(cls, args: Any) -> MegatronSchedule:
        """The schedule ``megatron.training`` builds from its arguments (get_optimizer_param_scheduler)."""
        gbs = args.global_batch_size
        # Samples first: Megatron fills in args.train_iters from train_samples
        # while it builds the scheduler, so both are set afterwards.
        if getattr(args, "train_samples", None):
            decay = args.lr_decay_samples or args.train_samples
            wsd = getattr(args, "lr_wsd_decay_samples", None)
            warmup = (args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None
                      else args.lr_warmup_samples)
        elif getattr(args, "train_iters", None):
            decay = (args.lr_decay_iters or args.train_iters) * gbs
            wsd = args.lr_wsd_decay_iters * gbs if getattr(args, "lr_wsd_decay_iters", None) is not None else None
            warmup = (args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None
                      else args.lr_warmup_iters * gbs)
        else:
            raise UsageError("arguments: expected --train-iters or --train-samples, actual neither")
        wsd_style = getattr(args, "lr_wsd_decay_style", None)
        if args.lr_decay_style != "WSD":  # the WSD fields are read only by that style
            wsd, wsd_style = None, None
        return cls(init_lr=args.lr_warmup_init, max_lr=float(args.lr), min_lr=args.min_lr,
                   lr_warmup_steps=warmup, lr_decay_steps=decay, lr_decay_style=args.lr_decay_style,
                   wsd_decay_steps=wsd, lr_wsd_decay_style=wsd_style)

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
