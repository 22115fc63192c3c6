"""Structure and settings of ``NativeTorchAdapter``'s optimizers, and accepted changes put back
(``resume.adapter.SettingsView``; resume.changes compares them)."""

from __future__ import annotations

import copy
import logging
import re
from typing import Any

import torch
import xxhash

from .objects import is_torch_scheduler
from .schedules import (
    DYNAMIC_SCHEDULER_KEYS,
    closed_form_lrs,
    group_settings,
    json_scalar,
    lr_value,
    rescale_lrs,
)

log = logging.getLogger("resume")

__all__ = ["SettingsMixin"]

_GROUP_ITEM = re.compile(r"^optimizer\[(\d+)\]\.group\[(\d+)\]\.(.+)$")
_SCHEDULE_ITEM = re.compile(r"^schedule\[(\d+)\]\.")


class SettingsMixin:
    """Expects ``optimizers``, ``schedulers``, ``moving_settings`` and ``_param_names()``."""

    optimizers: list[torch.optim.Optimizer]
    schedulers: list[Any]
    moving_settings: set[str]

    def describe_structure(self) -> list[dict]:
        """Per optimizer: its class and, per param group, its name, its parameters (count and a
        digest of their checkpoint names) and its settings (every scalar but the LR itself)."""
        names = self._param_names()
        out = []
        for opt in self.optimizers:
            groups = []
            for g in opt.param_groups:
                fqns = sorted(n for p in g["params"] for n in names.get(p, ("?",)))
                groups.append({"name": json_scalar(g.get("name")), "params": len(g["params"]),
                               "names": xxhash.xxh3_64_hexdigest("\n".join(fqns).encode()),
                               "settings": group_settings(g, self.moving_settings)})
            out.append({"class": type(opt).__name__, "groups": groups, "moving": sorted(self.moving_settings)})
        return out

    def snapshot_settings(self) -> Any:
        """The code's settings, taken before a load overwrites them (for ``apply_changes``)."""
        groups = [[{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
                  for opt in self.optimizers]
        return {"groups": groups, "schedulers": [copy.deepcopy(s.state_dict()) if is_torch_scheduler(s)
                                                 else None for s in self.schedulers]}

    def apply_changes(self, items: list[str], snapshot: Any) -> None:
        """After a load: put the code's values back for the accepted ``items`` (resume.changes),
        then set each affected optimizer's current LR once, from its schedule as it now is."""
        old_lrs = {i: [lr_value(g["lr"]) for g in opt.param_groups] for i, opt in enumerate(self.optimizers)}
        old_peaks = {i: [g.get("initial_lr", g["lr"]) for g in opt.param_groups]
                     for i, opt in enumerate(self.optimizers)}
        peaks_moved, reconfigured = self._put_back(items, snapshot)
        for k in sorted(reconfigured):
            s, code_state = self.schedulers[k], snapshot["schedulers"][k]
            loaded = s.state_dict()
            merged = {key: v for key, v in code_state.items() if key not in DYNAMIC_SCHEDULER_KEYS}
            merged.update({key: v for key, v in loaded.items() if key in DYNAMIC_SCHEDULER_KEYS})
            s.load_state_dict(merged)
        for i, opt in enumerate(self.optimizers):
            driving = [k for k, s in enumerate(self.schedulers)
                       if is_torch_scheduler(s) and getattr(s, "optimizer", None) is opt]
            touched = [k for k in driving if k in reconfigured]
            if i not in peaks_moved and not touched:
                continue
            new_peaks = [g.get("initial_lr", g["lr"]) for g in opt.param_groups]
            if i in peaks_moved:
                for k in driving:
                    if hasattr(self.schedulers[k], "base_lrs"):
                        self.schedulers[k].base_lrs = list(new_peaks)
            closed = closed_form_lrs(self.schedulers[driving[0]]) if len(driving) == 1 else None
            if closed is not None:
                for g, lr in zip(opt.param_groups, closed):
                    g["lr"] = lr
            elif i in peaks_moved:
                for g, lr in zip(opt.param_groups, old_lrs[i]):
                    g["lr"] = lr
                rescale_lrs(opt, old_peaks[i], new_peaks)
            else:
                log.warning("resume: the schedule of optimizer[%d] changed and has no closed form: its "
                            "current LR stays %s until the schedule moves it", i, old_lrs[i])

    def _put_back(self, items: list[str], snapshot: Any) -> tuple[set[int], set[int]]:
        """The code's param-group values for the accepted group items; (the optimizers whose
        peak moved, the torch schedulers whose configuration is the code's)."""
        peaks_moved: set[int] = set()
        reconfigured: set[int] = set()
        for item in items:
            m = _GROUP_ITEM.match(item)
            if m:
                i, j, key = int(m[1]), int(m[2]), m[3]
                group, code = self.optimizers[i].param_groups[j], snapshot["groups"][i][j]
                if key in code:
                    group[key] = copy.deepcopy(code[key])
                else:
                    group.pop(key, None)
                if key == "initial_lr":
                    peaks_moved.add(i)
                continue
            m = _SCHEDULE_ITEM.match(item)
            if m and snapshot["schedulers"][int(m[1])] is not None:  # ours: the code's already
                reconfigured.add(int(m[1]))
        return peaks_moved, reconfigured
