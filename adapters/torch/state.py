"""``NativeTorchAdapter``'s objects as state: the small per-rank state (JSON) and the sharded
state dicts DCP saves and loads (model parts and optimizers)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _get_fqns,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from resume.errors import CorruptCheckpointError, UsageError
from resume.text import short

from .. import jsonstate
from .objects import holds_optimizers, merge_into
from .registered import Registered

__all__ = ["StateMixin"]


class StateMixin:
    """Expects ``model_parts``, ``model_state``, ``optimizers``, ``schedulers``, ``_optimizer_part``
    (id(optimizer) -> its model part), ``_steps`` and ``_internal_step`` (set while the adapter
    itself steps an optimizer: the step counters ignore it)."""

    model_parts: list[torch.nn.Module]
    model_state: str
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[Any]
    _optimizer_part: dict[int, int]
    _steps: list[int]
    _internal_step: bool
    registered: Registered

    def state_dict(self) -> dict:
        # Param-group hyperparameters travel here too: an optimizer without
        # state yet is not in the sharded checkpoint, but its LR still moved.
        groups = [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
                  for opt in self.optimizers]
        out = {"schedulers": [jsonstate.encode(s.state_dict()) if hasattr(s, "state_dict") else None
                              for s in self.schedulers],
               "optimizer_steps": list(self._steps), "param_groups": jsonstate.encode(groups)}
        if self.registered:
            out["registered"] = self.registered.state()
        return out

    def check_state(self, state: dict, *, source: str) -> None:
        """The fields ``load_state_dict`` reads, in type, before anything is loaded: a refusal
        names the field (``adapter.schedulers[0]``), never a raw AttributeError."""
        def bad(field: str, expected: str, actual: Any) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"{source}: adapter.{field}: expected {expected}, actual {short(actual)}")
        schedulers = state.get("schedulers")
        if not isinstance(schedulers, list):
            raise bad("schedulers", "a list of scheduler states", schedulers)
        for i, sd in enumerate(schedulers):
            if sd is not None and not isinstance(sd, dict):
                raise bad(f"schedulers[{i}]", "an object (the scheduler's state_dict) or null", sd)
        steps = state.get("optimizer_steps")
        if not (isinstance(steps, list) and all(type(n) is int and n >= 0 for n in steps)):
            raise bad("optimizer_steps", "a list of step counts", steps)
        groups = state.get("param_groups", [])
        if not (isinstance(groups, list) and all(isinstance(o, list) and all(isinstance(g, dict) for g in o)
                                                 for o in groups)):
            raise bad("param_groups", "per optimizer, a list of param groups (objects)", groups)
        if "registered" in state:
            self.registered.check(state["registered"], source=source)

    def load_state_dict(self, state: dict) -> None:
        # The registered objects first: a name saved and not registered (or the other way) is
        # named before the schedulers move.
        self.registered.load(state.get("registered"), source="rank state")
        saved = state["schedulers"]
        if len(saved) != len(self.schedulers):
            raise ValueError(f"schedulers: expected {len(saved)} (as saved), actual {len(self.schedulers)}")
        for s, sd in zip(self.schedulers, saved):
            if sd is not None and hasattr(s, "load_state_dict"):
                s.load_state_dict(jsonstate.decode(sd))
        steps = [int(x) for x in state["optimizer_steps"]]
        if len(steps) != len(self.optimizers):
            raise ValueError(f"optimizers: expected {len(steps)} (as saved), actual {len(self.optimizers)}")
        self._steps = steps
        for opt, groups in zip(self.optimizers, jsonstate.decode(state.get("param_groups", [])),
                               strict=False):
            for g, saved in zip(opt.param_groups, groups, strict=False):
                g.update(saved)

    def _sharded_state(self, optimizers: list) -> dict:
        """Model and optimizer state for DCP. ``get_state_dict`` creates the state of an
        optimizer that has none (a zero-LR step), so only optimizers named here are touched."""
        self._internal_step = True
        model_sd: dict = {}
        optim_sd: dict = {}
        try:
            for index, part in enumerate(self.model_parts):
                merge_into(model_sd, self._part_model_state(part), f"model part {index}")
                mine = [o for o in optimizers if self._optimizer_part[id(o)] == index]
                if mine:
                    part_optim = get_optimizer_state_dict(part, mine)
                    merge_into(optim_sd.setdefault("state", {}), part_optim.get("state", {}),
                                f"optimizer state of model part {index}")
                    optim_sd.setdefault("param_groups", []).extend(part_optim.get("param_groups", []))
        finally:
            self._internal_step = False
        registered = self.registered.tensors()
        return {"model": model_sd, "optim": optim_sd, **({"state": registered} if registered else {})}

    def _part_model_state(self, part: torch.nn.Module) -> dict:
        if self.model_state == "module":
            return part.state_dict()
        return get_model_state_dict(part)

    def _check_visible(self, optimizers: list) -> None:
        """Refuse to save an optimizer whose moments are not in its own ``state``."""
        for opt in optimizers:
            i = self.optimizers.index(opt)
            if self._steps[i] and not opt.state and holds_optimizers(opt):
                raise UsageError(
                    f"optimizers[{i}] ({type(opt).__name__}): expected its moments in its state after "
                    f"{self._steps[i]} steps, actual an empty state: it holds other optimizers, whose "
                    "state it does not show. Pass the optimizers it holds instead (a list), or give it "
                    "an 'optimizers' attribute listing them; saving it would lose the moments")

    def _set_loaded(self, state: dict, saved_optimizers: list) -> None:
        """The loaded ``state`` into every model part and its optimizers (strict for the model;
        parameters that had no optimizer state keep none); the registered objects' tensors kept
        for ``load_state_dict``, which has the rest of their state."""
        self.registered.kept(state.get("state", {}))
        for index, part in enumerate(self.model_parts):
            mine = [o for o in saved_optimizers if self._optimizer_part[id(o)] == index]
            part_keys = self._part_model_state(part).keys() if len(self.model_parts) > 1 else None
            model_sd = state["model"] if part_keys is None else {k: state["model"][k] for k in part_keys}
            if self.model_state == "module":
                part.load_state_dict(model_sd)
            else:
                set_model_state_dict(part, model_sd)
            if mine:
                set_optimizer_state_dict(part, mine, optim_state_dict=self._optim_subset(state["optim"], part),
                                         options=StateDictOptions(strict=False))

    def _optim_subset(self, optim_sd: dict, part: torch.nn.Module) -> dict:
        if len(self.model_parts) == 1:
            return optim_sd
        fqns = {fqn for name, _ in part.named_parameters() for fqn in _get_fqns(part, name)}
        return {"state": {k: v for k, v in optim_sd.get("state", {}).items() if k in fqns},
                "param_groups": [g for g in optim_sd.get("param_groups", []) if set(g["params"]) & fqns]}

    def _param_names(self) -> dict:
        """Parameter -> its checkpoint names (FQNs), worked out again only when the parameters or
        their names changed (every save asks, for the moments' fingerprint and the layout)."""
        named = [(id(part), name, param) for part in self.model_parts for name, param in part.named_parameters()]
        key = tuple((p, n, id(param)) for p, n, param in named)
        cached = getattr(self, "_names_cache", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        parts = {id(part): part for part in self.model_parts}
        names = {param: _get_fqns(parts[p], n) for p, n, param in named}
        self._names_cache = (key, names)
        return names

    def _fqns_per_optimizer(self) -> list[set[str]]:
        """The checkpoint names (FQNs) of each optimizer's parameters."""
        names = self._param_names()
        return [{fqn for g in opt.param_groups for p in g["params"] for fqn in names.get(p, ())}
                for opt in self.optimizers]

    def prepare_load(self) -> list:
        """The state of every optimizer that has none, created (a zero-LR step) so that a load
        can fill it: the part of a restore that costs compute, not I/O."""
        fresh = [o for o in self.optimizers if not o.state]
        if fresh:
            self._sharded_state(fresh)
        self._prepared_ids = {id(o) for o in fresh}
        return fresh

    def discard_prepared(self, token: object) -> None:
        self._prepared_ids = set()
        for opt in token or ():  # type: ignore[union-attr]
            opt.state.clear()
