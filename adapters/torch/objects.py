"""The user's objects as the adapter takes them: model parts, optimizers, schedulers, checked once."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.lr_scheduler import ReduceLROnPlateau

from resume.errors import UsageError
from resume.schedule import is_lr_schedule
from resume.text import short

__all__ = ["MODEL_STATE_MODES", "function_schedule", "holds_optimizers", "is_torch_scheduler", "merge_into",
           "model_parts", "optimizer_parts", "renames_state", "unpack_optimizers", "unpack_schedulers"]

MODEL_STATE_MODES = ("auto", "get_state_dict", "module")


def model_parts(model: Any) -> list[torch.nn.Module]:
    """A module, or the model parts this rank holds (pipeline stages), as a list."""
    parts = [model] if isinstance(model, torch.nn.Module) else list(model)
    if not parts or not all(isinstance(m, torch.nn.Module) for m in parts):
        raise UsageError("model: expected a torch.nn.Module or a list of them (model parts), actual "
                         f"{type(model).__name__}")
    return parts


def function_schedule(schedulers: list) -> Any:
    """The one schedule of ours (``lr_at(updates)``) among ``schedulers``, or None when they are
    torch's; refused when mixed, several, or neither."""
    ours = [s for s in schedulers if not is_torch_scheduler(s)]
    for s in ours:
        if not is_lr_schedule(s):
            raise UsageError(f"schedulers: expected torch LR schedulers or schedules with lr_at(updates) "
                             f"(resume.schedule.LRSchedule), actual {type(s).__name__}")
    if ours and (len(ours) > 1 or len(schedulers) > 1):
        raise UsageError("schedulers: expected either torch LR schedulers or one schedule with "
                         "lr_at(updates) giving the LR of every param group, actual both or several "
                         f"({', '.join(type(s).__name__ for s in schedulers)})")
    return ours[0] if ours else None


def unpack_optimizers(optimizers: Any) -> list:
    """The torch optimizers given: one, several, or a container's ``optimizers`` list (checked
    first: torchtitan's container is itself an ``Optimizer``, with an empty state)."""
    inner = getattr(optimizers, "optimizers", None)
    if isinstance(inner, (list, tuple)):
        found = list(inner)
    elif isinstance(optimizers, torch.optim.Optimizer):
        found = [optimizers]
    elif isinstance(optimizers, (list, tuple)):
        found = [o for item in optimizers for o in unpack_optimizers(item)]
    else:
        raise UsageError(f"optimizers: expected a torch optimizer, a list of them or a container with an "
                         f"'optimizers' list, actual {type(optimizers).__name__}")
    for i, opt in enumerate(found):
        if not isinstance(opt, torch.optim.Optimizer):
            raise UsageError(f"optimizers[{i}]: expected a torch.optim.Optimizer, actual {type(opt).__name__}")
        if any("lr" not in g for g in opt.param_groups):
            raise UsageError(
                f"optimizers[{i}] ({type(opt).__name__}): expected param groups with 'lr', actual groups "
                "without: it does not show its optimizers' settings and state (a container?). Pass the "
                "optimizers it holds instead (a list), or give it an 'optimizers' attribute listing them")
    return found


def unpack_schedulers(schedulers: Any) -> list:
    """The schedulers given: none, one, several, or a container's ``schedulers`` list."""
    inner = getattr(schedulers, "schedulers", None)
    if isinstance(inner, (list, tuple)):
        return list(inner)
    if isinstance(schedulers, (list, tuple)):
        return [s for item in schedulers for s in unpack_schedulers(item)]
    return [schedulers] if schedulers else []


def holds_optimizers(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` keeps other optimizers in its attributes (a container)."""
    for value in vars(opt).values():
        items = value if isinstance(value, (list, tuple)) else value.values() if isinstance(value, dict) else [value]
        if any(isinstance(v, torch.optim.Optimizer) for v in items):
            return True
    return False


def _hook_module(hook: Any) -> str:
    for attr in ("hook", "func", "__func__"):  # torch's _WrappedHook, functools.partial, a method
        hook = getattr(hook, attr, hook)
    return getattr(hook, "__module__", None) or ""


def renames_state(model: torch.nn.Module) -> bool:
    """Whether a module of ``model`` has a state-dict hook of its own (one outside torch): its
    ``state_dict()`` may name entries no parameter has, which ``get_model_state_dict`` cannot map."""
    for module in model.modules():
        for hooks in (module._state_dict_hooks, module._load_state_dict_pre_hooks):
            if any(not _hook_module(h).startswith("torch.") for h in hooks.values()):
                return True
    return False


def optimizer_parts(parts: list[torch.nn.Module], optimizers: list) -> dict[int, int]:
    """id(optimizer) -> the index of the model part holding its parameters."""
    owner = {id(p): i for i, part in enumerate(parts) for p in part.parameters()}
    out = {}
    for k, opt in enumerate(optimizers):
        held = {owner.get(id(p)) for g in opt.param_groups for p in g["params"]}
        if len(held) != 1 or None in held:
            where = "none of the model's" if held <= {None} else "several model parts'" if None not in held \
                else "some outside the model"
            raise UsageError(f"optimizers[{k}] ({type(opt).__name__}): expected the parameters of one model "
                             f"part, actual {where}: give each part its own optimizer")
        out[id(opt)] = held.pop()
    return out


def merge_into(target: dict, part: dict, what: str) -> None:
    clash = target.keys() & part.keys()
    if clash:
        raise UsageError(f"{what}: expected names no other model part has, actual {short(sorted(clash)[:3])}")
    target.update(part)


def is_torch_scheduler(s: Any) -> bool:
    return isinstance(s, (torch.optim.lr_scheduler.LRScheduler, ReduceLROnPlateau)) or (
        hasattr(s, "optimizer") and hasattr(s, "step") and hasattr(s, "state_dict") and not hasattr(s, "lr_at"))
