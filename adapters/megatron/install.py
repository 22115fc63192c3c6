"""``install()``: the recorder wired into ``megatron.training`` for the stock entry point.

Import ``resume.adapters.megatron`` in the launch script (``pretrain_gpt.py``) and call
``install()`` before ``pretrain(...)``. ``megatron.training`` of megatron-core 0.19.2 needs
Python >= 3.12 (it imports ``typing.override``); nothing of the standard library is
patched here (the tests, on 3.11, alias it in ``tests/support/megatron.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from resume.storage import open_storage
from resume.watchdog import HangBounds

from .args import check_supported
from .asyncsave import AsyncCommits
from .recorder import MegatronRecorder
from .watch import LoopWatch

__all__ = ["count_train_step", "install"]

log = logging.getLogger("resume")


# -- megatron.training ------------------------------------------------------------------------------


def install(*, recorder: MegatronRecorder | None = None, hang: HangBounds | None = None,
            **options: Any) -> MegatronRecorder:
    """Wire the recorder and hang detection into ``megatron.training`` (save, load, the step,
    the exit decision, the evaluation, the end of ``train()``).

    Call once, before ``pretrain(...)``. The wrapped ``train_step`` also feeds rank 0's update
    journal (``updates``), closed at the end of ``train()``. Wraps, by name, in both modules that
    bind them: ``checkpointing.save_checkpoint``/``load_checkpoint`` and
    ``training.save_checkpoint``/``load_checkpoint``/``train_step``/
    ``checkpoint_and_decide_exit``/``evaluate_and_print_results``/
    ``maybe_finalize_async_save``/``train``, and ``checkpointing.schedule_async_save``
    (``--async-save``: the commit runs in Megatron's finalize step). ``options`` go to ``MegatronRecorder``
    when it is created here (from ``args.save`` at the first call). ``hang``: the watchdog's
    bounds (``watch``); None: the Slurm hook's, or the defaults.
    """
    if _INSTALLED:  # once per process: wrapping the wrappers would record every save twice
        return _INSTALLED[0]
    checkpointing, training, get_args = _import_megatron_training()
    wiring = _Wiring(checkpointing, training, get_args, recorder, options, LoopWatch(bounds=hang))
    for module in (checkpointing, training):
        if hasattr(module, "save_checkpoint"):
            module.save_checkpoint = wiring.save_checkpoint
        if hasattr(module, "load_checkpoint"):
            module.load_checkpoint = wiring.load_checkpoint
    # --async-save: commit at finalize
    wiring.async_commits = AsyncCommits.install(checkpointing, watchdog=wiring.watch.watchdog)
    training.train_step = wiring.train_step
    training.checkpoint_and_decide_exit = wiring.checkpoint_and_decide_exit
    training.evaluate_and_print_results = wiring.evaluate_and_print_results
    training.maybe_finalize_async_save = wiring.maybe_finalize_async_save
    training.train = wiring.train
    log.info("resume: Megatron integration installed (manifests beside each torch_dist save)")
    handle = _Lazy(wiring.recorder)
    _INSTALLED.append(handle)
    return handle  # type: ignore[return-value]


_INSTALLED: list[Any] = []


def _import_megatron_training() -> tuple[Any, Any, Callable[[], Any]]:
    """``megatron.training``'s checkpointing and training modules and its ``get_args``."""
    try:
        from megatron.training import checkpointing, training
        from megatron.training.global_vars import get_args
    except ImportError as e:
        raise ImportError(f"resume.adapters.megatron.install(): expected megatron.training (megatron-core, "
                          f"on Python >= 3.12), actual {type(e).__name__}: {e}") from e
    return checkpointing, training, get_args


class _Wiring:
    """What ``install()`` puts in place of megatron.training's functions: each wrapper calls the
    original it holds, with the recorder's steps and the watchdog's phases (``watch``) around it.
    The recorder is made at first use, from Megatron's arguments (``install()`` may run before
    ``pretrain()`` parses them); the watchdog is taken over then too."""

    def __init__(self, checkpointing: Any, training: Any, get_args: Callable[[], Any],
                 recorder: MegatronRecorder | None, options: dict, watch: LoopWatch) -> None:
        self._training = training
        self._get_args = get_args
        self._recorder = recorder
        self._options = options
        self.watch = watch
        self._save = checkpointing.save_checkpoint
        self._load = checkpointing.load_checkpoint
        self._train_step = training.train_step
        self._decide = training.checkpoint_and_decide_exit
        self._evaluate = training.evaluate_and_print_results
        self._finalize = training.maybe_finalize_async_save
        self._train = training.train

    def recorder(self) -> MegatronRecorder | None:
        """The recorder; None until Megatron's arguments name a save (or load) directory."""
        if self._recorder is None:
            try:
                args = self._get_args()
            except AssertionError:  # install() runs before pretrain() parses the arguments
                return None
            save_dir = args.save or args.load
            if save_dir:
                self._recorder = MegatronRecorder(save_dir, **self._options)
        if not self.watch.attached:  # the reports go to the save directory (unless the hook's run)
            self.watch.maybe_attach(self._recorder.run.storage if self._recorder is not None else None)
        return self._recorder

    def save_checkpoint(self, *a: Any, **kw: Any):
        with self.watch.phase("save", measure="save"):
            return self._recorded_save(*a, **kw)

    def _recorded_save(self, iteration, model, optimizer, opt_param_scheduler, *a: Any, **kw: Any):
        args = self._get_args()
        r = self.recorder()
        recorded = (r is not None and not kw.get("non_persistent_ckpt") and args.ckpt_format == "torch_dist"
                    and opt_param_scheduler is not None)  # upcycling saves a model alone
        if recorded:
            check_supported(args)
            if args.async_save:  # committed when Megatron finalizes the save (asyncsave)
                return self.async_commits.save(
                    r, iteration, args, opt_param_scheduler, optimizer,
                    lambda: self._save(iteration, model, optimizer, opt_param_scheduler, *a, **kw))
            r.before_save(iteration)
        result = self._save(iteration, model, optimizer, opt_param_scheduler, *a, **kw)
        if recorded:
            r.after_save(iteration, args, opt_param_scheduler, optimizer)
        return result

    def load_checkpoint(self, *a: Any, **kw: Any):
        with self.watch.phase("restore", measure="restore"):
            return self._checked_load(*a, **kw)

    def _checked_load(self, model, optimizer, opt_param_scheduler, *a: Any, **kw: Any):
        args = self._get_args()
        load_dir = getattr(args, kw.get("load_arg", "load"), None)
        r = self.recorder()
        if r is None or not load_dir or open_storage(load_dir).root != r.run.storage.root:
            return self._load(model, optimizer, opt_param_scheduler, *a, **kw)
        pinned = getattr(args, "ckpt_step", None)
        r.before_load(args)  # also refuses settings it cannot record, before any training
        try:
            result = self._load(model, optimizer, opt_param_scheduler, *a, **kw)
        finally:
            args.ckpt_step = pinned  # a choice made for this load only
        iteration = result[0] if isinstance(result, tuple) else result
        r.after_load(iteration, args, opt_param_scheduler, optimizer)
        return result

    def train_step(self, *a: Any, **kw: Any):
        r = self.recorder()
        updates = r.updates if r is not None else None  # rank 0's journal (``updates``)
        # The LR the update applies: the scheduler steps inside train_step.
        lrs = updates.lrs(a[3] if len(a) > 3 else kw.get("optimizer")) if updates is not None else None
        result = self._train_step(*a, **kw)
        skipped = _skipped(result)
        if skipped is not None:
            args = self._get_args()
            if r is not None:
                r.count_iteration(skipped=skipped)
            if updates is not None:  # train() adds the batch to consumed_train_samples after the step
                updates.record(result, args, lrs, skipped=skipped)
            # train() sets curr_iteration before the step and counts it once the step returns.
            self.watch.progress.progress(args.curr_iteration + 1)
        return result

    def evaluate_and_print_results(self, *a: Any, **kw: Any):
        with self.watch.evaluation():
            return self._evaluate(*a, **kw)

    def maybe_finalize_async_save(self, *a: Any, **kw: Any):
        """Megatron's finalize: a blocking one (the end of ``train()``) waits for the saves in flight."""
        if not (kw.get("blocking") or (a and a[0])):
            return self._finalize(*a, **kw)
        with self.watch.phase("save"):
            return self._finalize(*a, **kw)

    def train(self, *a: Any, **kw: Any):
        r = self.recorder()  # taken over, if no load or save came first
        self.watch.reopen()
        try:
            return self._train(*a, **kw)
        finally:  # returned, exited (sys.exit at an exit signal or duration) or failed
            self.watch.close()
            if r is not None:
                r.close_journal()

    def checkpoint_and_decide_exit(self, model, optimizer, opt_param_scheduler, iteration,
                                   num_floating_point_operations_so_far, checkpointing_context,
                                   train_data_iterator):
        """Megatron's own decision first (interval, exit signal, duration): a save it makes at
        this iteration answers pending ``resume save`` requests too, without a second save."""
        r = self.recorder()
        requests: list = []
        if r is not None and self._get_args().save:
            requests = r.poll_control()
            self.watch.progress.synced()  # the poll is a collective: the ranks agreed here
        try:
            exit_now = self._decide(model, optimizer, opt_param_scheduler, iteration,
                                    num_floating_point_operations_so_far, checkpointing_context,
                                    train_data_iterator)
            if requests:
                # --async-save: answered only once the step is committed (Megatron's own save of
                # this iteration, or ours below): its finalize is waited for here.
                self.async_commits.maybe_wait_for_commit(iteration)
                if r.last_committed != iteration:
                    self._training.save_checkpoint_and_time(iteration, model, optimizer, opt_param_scheduler,
                                                            num_floating_point_operations_so_far,
                                                            checkpointing_context,
                                                            train_data_iterator=train_data_iterator)
                    self.async_commits.maybe_wait_for_commit(iteration)
        except Exception as e:
            if requests:
                r.answer(requests, step=None, error=str(e))
            raise
        if requests:
            r.answer(requests, step=iteration)
        return exit_now or any(q.stop for q in requests)


def count_train_step(recorder: MegatronRecorder, result: Any) -> None:
    """Count what megatron.training's ``train_step`` returned (``_skipped``)."""
    skipped = _skipped(result)
    if skipped is not None:
        recorder.count_iteration(skipped=skipped)


def _skipped(result: Any) -> bool | None:
    """Whether the iteration ``train_step`` returned (``(losses, skipped_iter, should_checkpoint,
    should_exit, ...)``) skipped its update; None when it was no iteration: an early return that
    asks to checkpoint and exit (a rerun from a checkpoint), for which train() does not advance."""
    if not isinstance(result, tuple) or len(result) < 2:
        return None
    if len(result) > 3 and result[3]:
        return None
    return bool(result[1])


class _Lazy:
    """The recorder, resolved at first use (``install()`` may run before ``args`` exist)."""

    def __init__(self, get: Callable[[], MegatronRecorder | None]) -> None:
        self._get = get

    def __getattr__(self, name: str) -> Any:
        recorder = self._get()
        if recorder is None:
            raise AttributeError(f"resume: no recorder yet (args.save is not set): {name}")
        return getattr(recorder, name)
