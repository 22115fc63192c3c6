"""The optimizer and schedule view of ``NativeTorchAdapter`` (``resume.adapter.OptimizerView``)."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch.optim.lr_scheduler import ReduceLROnPlateau

from resume.errors import UsageError
from resume.schedule import describe_lr_schedule, lr_schedule_values

from .fingerprint import moment_fingerprint
from .objects import is_torch_scheduler
from .schedules import describe_scheduler, lr_label, scheduler_position

__all__ = ["OptimizerViewMixin"]


class OptimizerViewMixin:
    """LRs, counters and moment fingerprints read from the live objects. Expects ``optimizers``,
    ``schedulers``, ``_function_schedule`` (a schedule of ours or None), ``_steps`` (updates per
    optimizer) and ``_applied`` (the LRs of each optimizer's last step), set by the adapter."""

    optimizers: list[torch.optim.Optimizer]
    schedulers: list[Any]
    _function_schedule: Any
    _steps: list[int]
    _applied: list[list[float] | None]

    def describe_schedule(self) -> list[dict]:
        return [describe_scheduler(s) if is_torch_scheduler(s) else describe_lr_schedule(s)
                for s in self.schedulers]

    def current_lrs(self) -> list[float]:
        return [float(g["lr"]) for opt in self.optimizers for g in opt.param_groups]

    def lr_ahead(self, k: int) -> list[list[float]]:
        if self._function_schedule is not None:
            return self._lr_ahead_of_function(k)
        # Step the real schedulers k-1 times and put everything back: cheaper
        # and more faithful than deep-copying optimizers with their parameters.
        saved_groups = [[{key: v for key, v in g.items() if key != "params"} for g in opt.param_groups]
                        for opt in self.optimizers]
        saved_schedulers = [copy.deepcopy(s.state_dict()) for s in self.schedulers]
        out = [self.current_lrs()]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for _ in range(k - 1):
                    for s in self.schedulers:
                        if not isinstance(s, ReduceLROnPlateau):  # moves on metrics only
                            s.step()
                    out.append(self.current_lrs())
        except (ValueError, IndexError, ZeroDivisionError):
            # A schedule with a fixed end (OneCycleLR) cannot step past it: the
            # look-ahead stops there, the same way at save and at restore.
            pass
        finally:
            for opt, groups in zip(self.optimizers, saved_groups):
                for g, saved in zip(opt.param_groups, groups):
                    g.update(saved)
            for s, state in zip(self.schedulers, saved_schedulers):
                s.load_state_dict(state)
        return out

    def _lr_ahead_of_function(self, k: int) -> list[list[float]]:
        schedule = self._function_schedule
        done = self._steps[0] if self._steps else 0
        groups = sum(len(opt.param_groups) for opt in self.optimizers)
        out = []
        for n in range(done, done + k):
            lrs = lr_schedule_values(schedule, n)
            if len(lrs) != groups:
                raise UsageError(f"schedule: expected {groups} LRs from lr_at({n}) (one per param group, "
                                 f"all optimizers in order), actual {len(lrs)}")
            out.append(lrs)
        return out

    def optimizer_steps(self) -> list[int]:
        return list(self._steps)

    def scheduler_positions(self) -> list[int]:
        # A schedule of ours has no position of its own: it is the count of successful updates.
        return [scheduler_position(s) for s in self.schedulers if is_torch_scheduler(s)]

    def optimizer_fingerprint(self) -> list[dict]:
        """Per optimizer: the sum of the bit patterns of every moment, per state key, mod 2**32.

        Computed where each tensor lives (one reduction per tensor, no host copy; the
        partial sums stay on the device until one transfer per optimizer). Integer
        addition does not depend on order, so the sum over a sharded tensor's shards is
        the same for any sharding: ``sharded`` (DTensor shards, each element counted on
        one rank) survives an elastic restart as a total over the ranks, ``replicated``
        (plain tensors: every data-parallel rank holds the whole) as each rank's value.
        """
        names = self._param_names()
        return [moment_fingerprint(opt, names) for opt in self.optimizers]

    def lr_groups(self) -> list[str]:
        """A label per param group, in the order of ``current_lrs()``."""
        return [lr_label(i, j, g) for i, opt in enumerate(self.optimizers)
                for j, g in enumerate(opt.param_groups)]

    def applied_lrs(self) -> list[float | None]:
        """Per param group (as ``lr_groups()``): the LR its optimizer's last step applied, None
        if it has not stepped since the adapter was built (or the group is newer than that step)."""
        out: list[float | None] = []
        for opt, applied in zip(self.optimizers, self._applied):
            out += [applied[j] if applied is not None and j < len(applied) else None
                    for j in range(len(opt.param_groups))]
        return out

    @property
    def lr_set_by_loop(self) -> bool:
        """True when a schedule of ours (``resume.schedule.LRSchedule``) is declared: the loop sets
        the LR just before each step, so the groups hold the previous update's LR in between."""
        return self._function_schedule is not None
