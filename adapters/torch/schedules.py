"""Schedulers and param groups read as values: positions, configurations, settings, LRs."""

from __future__ import annotations

import math
from typing import Any

import torch

from resume.schedule import describe_callable

from .. import jsonstate

__all__ = ["DYNAMIC_SCHEDULER_KEYS", "closed_form_lrs", "describe_scheduler", "group_settings", "json_scalar",
           "lr_label", "lr_value", "rescale_lrs", "scheduler_position"]

DYNAMIC_SCHEDULER_KEYS = {"last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step",
                           "_is_initial", "verbose", "_schedulers", "_milestones_reached",
                           "best", "num_bad_epochs", "cooldown_counter", "last_epoch_", "T_cur",
                           "T_i", "_initial_step"}
_NOT_SETTINGS = {"params", "param_names", "lr", "foreach", "capturable", "differentiable", "fused"}


def lr_value(lr: Any) -> float:
    return float(lr.item() if isinstance(lr, torch.Tensor) else lr)


def lr_label(i: int, j: int, group: dict) -> str:
    name = group.get("name")
    return f"optimizer[{i}].group[{j}]" + (f" {name!r}" if isinstance(name, str) else "")


def json_scalar(value: Any) -> Any:
    """A setting as JSON keeps it (tuples as lists, non-finite floats as text); None if it has no
    JSON form (a callable, a tensor of several values)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return None
        value = value.item()
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (tuple, list)):
        items = [json_scalar(v) for v in value]
        return None if any(v is None and x is not None for v, x in zip(items, value)) else items
    return None


def group_settings(group: dict, moving: set[str]) -> dict:
    out = {}
    for key, value in group.items():
        if key in _NOT_SETTINGS or key in moving or not isinstance(key, str):
            continue
        as_json = json_scalar(value)
        if as_json is not None or value is None:
            out[key] = as_json
    return out


def rescale_lrs(opt: torch.optim.Optimizer, old: list[float], new: list[float]) -> None:
    """After a changed peak: each group's LR scaled by new/old peak (exact for every schedule that
    multiplies the peak by a factor of the position, as LambdaLR and most of torch's do)."""
    for g, before, after in zip(opt.param_groups, old, new):
        if before and before != after:
            g["lr"] = lr_value(g["lr"]) * float(after) / float(before)


def closed_form_lrs(s: Any) -> list[float] | None:
    if isinstance(s, torch.optim.lr_scheduler.LambdaLR):
        return [float(v) for v in s.get_lr()]
    closed = getattr(s, "_get_closed_form_lr", None)
    if callable(closed):
        try:
            return [float(v) for v in closed()]
        except (TypeError, AttributeError):
            return None
    return None


def scheduler_position(scheduler: Any) -> int:
    """Updates a scheduler has taken; a chain of schedulers is where its children are."""
    if hasattr(scheduler, "last_epoch"):
        return int(scheduler.last_epoch)
    children = getattr(scheduler, "_schedulers", [])
    return min((scheduler_position(c) for c in children), default=0)


def describe_scheduler(scheduler: Any) -> dict:
    """A scheduler's configuration (no position), children of SequentialLR/ChainedScheduler included."""
    entry: dict[str, Any] = {"class": type(scheduler).__name__}
    for key, value in sorted(scheduler.state_dict().items()):
        if key in DYNAMIC_SCHEDULER_KEYS or key == "optimizer":
            continue
        if key == "lr_lambdas":
            value = [describe_callable(fn) for fn in getattr(scheduler, "lr_lambdas", [])]
        entry[key] = jsonstate.encode(value)
    children = getattr(scheduler, "_schedulers", None)
    if children:
        entry["children"] = [describe_scheduler(c) for c in children]
    return entry
