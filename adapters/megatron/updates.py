"""The update journal of a Megatron run (``resume.journal``), fed from Megatron's own ``train_step``.

Rank 0 only, one record per iteration ``train_step`` counted (``install``):

- ``it``: the iteration after it (``args.curr_iteration + 1``); ``ok``: not ``skipped_iter``;
- ``at``: ``args.consumed_train_samples`` before the step (train() adds the batch after
  ``train_step`` returns); ``n``: ``args.global_batch_size`` (constant: ``check_supported``);
- ``lr``: every param group's ``lr`` in ``optimizer.param_groups`` (what Megatron's log reads),
  taken before the step: the LR the update applied (the scheduler steps inside ``train_step``);
  left out for a skipped update;
- ``loss``: the ``'lm loss'`` entry of the loss dict ``train_step`` returns, else its first
  entry (its mean when it holds several values); absent where rank 0 holds no loss (a pipeline's
  first stage: Megatron reduces the loss on the last stage only);
- ``grad_norm``: ``train_step``'s, before clipping; ``clipped``: ``grad_norm > args.clip_grad``
  when ``--clip-grad`` is above 0 (Megatron's ``clip_grad_norm`` clips then), else false.

No batch ids: Megatron draws its batches inside ``train_step``; ``at``/``n`` name them.

Cost per step: no collective and no device sync of its own. ``grad_norm`` is already a Python
float (Megatron's ``.item()``); the loss is a reduced tensor Megatron has not read back, so a
record is written one step late, when the next step's ``grad_norm`` has synchronised past it
(or at the save that takes it, or at the end of ``train()``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from resume.journal import Journal, number_or_text
from resume.storage import Storage

__all__ = ["LOSS_KEY", "MegatronUpdates"]

log = logging.getLogger("resume")

LOSS_KEY = "lm loss"
"""The loss recorded (pretrain_gpt.py's); a loss dict without it gives its first entry."""


class MegatronUpdates:
    """Rank 0's journal of a Megatron run: started at the load, one record per counted
    ``train_step``, sealed by each commit, closed at the end of ``train()``."""

    def __init__(self, storage: Storage, *, clock: Callable[[], float] | None = None) -> None:
        self.journal = Journal(storage, clock=clock)
        self._held: tuple[dict, dict] | None = None  # the newest record, its loss not read back yet
        self._started = False
        self._closed = False
        self._entry: dict | None = None  # the newest segment of this line (restored or sealed)
        self._sealed = 0  # records up to this iteration are sealed

    def start(self, restored: dict | None, step: int | None) -> None:
        """Once per launch, at the load (``step``: the iteration loaded, None: a fresh start):
        the chain continues from ``restored`` (the loaded manifest's ``journal``)."""
        if self._started:
            return
        self._started = True
        self._entry, self._sealed = restored, step or 0
        self.journal.start(restored, step)

    @staticmethod
    def lrs(optimizer: Any) -> list[Any] | None:
        """Before the step: every param group's LR (the ones the update applies)."""
        groups = getattr(optimizer, "param_groups", None) if optimizer is not None else None
        return [g.get("lr") for g in groups] if groups else None

    def record(self, result: tuple, args: Any, lrs: list[Any] | None, *, skipped: bool) -> None:
        """After a counted ``train_step`` (``result``: what it returned); written one step late."""
        self.start(None, None)  # no load before the first step: a fresh start
        record: dict[str, Any] = {"it": int(args.curr_iteration) + 1, "ok": not skipped,
                                  "at": int(args.consumed_train_samples), "n": int(args.global_batch_size)}
        if lrs is not None and not skipped:
            record["lr"] = lrs
        raw = {"loss": _loss(result[0]), "grad_norm": result[5] if len(result) > 5 else None,
               "clip": float(getattr(args, "clip_grad", 0.0) or 0.0)}
        self._write_held()
        self._held = (record, raw)

    def _write_held(self) -> None:
        held, self._held = self._held, None
        if held is None:
            return
        record, raw = held
        try:
            record = _with_numbers(record, raw)
        except (TypeError, ValueError, RuntimeError) as e:  # the journal never stops training
            log.warning("resume: update %d: recorded without its loss, LR or norm: %s", record["it"], e)
            record = {k: record[k] for k in ("it", "ok", "at", "n")}
        self.journal.record(record)

    # -- the commit -------------------------------------------------------------------------

    def snapshot(self, step: int) -> list[bytes]:
        """At the save of ``step``, when it takes its state: the records up to it not sealed yet."""
        self._write_held()
        return self.journal.snapshot(step)

    def seal(self, step: int, lines: list[bytes]) -> dict | None:
        """At the commit of ``step`` (rank 0, before the manifest is written): the manifest's
        ``journal`` entry. A second save of a step already sealed keeps its segment; records
        an earlier save in flight seals (``--async-save``) are left to it. None while nothing was
        ever recorded (a loop that does not feed the journal: no empty segments)."""
        if self._entry is not None and step <= self._entry["step"]:
            return self._entry
        lines = [line for line in lines if json.loads(line)["it"] > self._sealed]
        if not lines and self._entry is None:
            return None
        self._entry, self._sealed = self.journal.seal(step, lines), step
        if self._closed:  # a save after train() returned (pretrain()'s last one)
            self.journal.close()
        return self._entry

    def close(self) -> None:
        """The end of ``train()``: the open file goes once every record in it is sealed."""
        self._write_held()
        self._closed = True
        self.journal.close()


def _with_numbers(record: dict, raw: dict) -> dict:
    """The record with its LRs, loss, gradient norm and ``clipped`` as JSON numbers."""
    if "lr" in record:
        record["lr"] = [number_or_text(x) for x in record["lr"]]
    loss, grad_norm = _as_float(raw["loss"]), _as_float(raw["grad_norm"])
    if loss is not None:
        record["loss"] = number_or_text(loss)
    if grad_norm is not None:
        record["grad_norm"] = number_or_text(grad_norm)
        record["clipped"] = bool(raw["clip"] > 0 and grad_norm > raw["clip"])
    return record


def _loss(loss_dict: Any) -> Any:
    """The recorded entry of train_step's loss dict (``LOSS_KEY``, else the first); None: none."""
    if not isinstance(loss_dict, dict) or not loss_dict:
        return None
    return loss_dict[LOSS_KEY] if LOSS_KEY in loss_dict else next(iter(loss_dict.values()))


def _as_float(value: Any) -> float | None:
    """A number, a tensor (its mean) or a list of them (their mean); None when empty or None."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        values = [_as_float(v) for v in value]
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None
    if hasattr(value, "detach"):
        value = value.detach()
        return float(value.float().mean()) if value.numel() else None
    return float(value)
