"""Megatron's fp16 loss scaler across a restart: megatron.training's own save_checkpoint and
load_checkpoint with --fp16 (Float16OptimizerWithFloat16Params, DynamicGradScaler), real overflows
of fp16 gradients, a save right after one; the scaler continues exactly and the continuity check
refuses a restart whose scaler does not."""

from __future__ import annotations

import hashlib

import pytest
from resume.adapters.megatron.restart import _check_loss_scale
from support.cli import resume
from support.megatron import saved_manifest
from support.ranks import run_ranks

from resume.errors import ContinuityError

# Marked one by one: the unit tests at the end read only our own code and run without megatron-core.

INITIAL_SCALE = 2.0 ** 20  # fp16 gradients of the tiny GPT overflow at this scale in the first steps
FP16 = ("--fp16", "--initial-loss-scale", str(int(INITIAL_SCALE)), "--loss-scale-window", "4")
ITERATIONS = 12


def _digest(model, optimizer) -> str:
    """The fp16 model weights, the fp32 main weights and the Adam moments, bitwise."""
    import torch

    h = hashlib.sha256()
    for name, p in model[0].named_parameters():
        h.update(name.encode() + p.detach().float().numpy().tobytes())
    for part in optimizer.chained_optimizers:
        for group in part.optimizer.param_groups:
            for p in group["params"]:
                h.update(p.detach().numpy().tobytes())
                for key, value in sorted(part.optimizer.state.get(p, {}).items()):
                    if torch.is_tensor(value):
                        h.update(key.encode() + value.numpy().tobytes())
    return h.hexdigest()


def _train(rank: int, world: int, save_dir: str, until: int, save: bool, extra: list[str]) -> dict:
    """A fresh process: load what is there (nothing at first), train to ``until``, maybe save."""
    from resume.adapters.megatron import install
    from support import megatron_training_run as m

    from resume.errors import ContinuityError

    recorder = install()
    args, model, optimizer, scheduler = m.fresh(save_dir, FP16 + tuple(extra))
    try:
        start = m.load(args, model, optimizer, scheduler)
    except ContinuityError as e:
        return {"error": {"item": e.item, "expected": e.expected, "actual": e.actual, "message": str(e)}}
    trace: list = []
    it = m.train(args, model, optimizer, scheduler, recorder, until=until, start=start, trace=trace)
    if save:
        m.save(it, model, optimizer, scheduler)
    return {"start": start, "trace": trace, "digest": _digest(model, optimizer),
            "optimizer": type(optimizer.chained_optimizers[0]).__name__}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted run, and the same run saved right after an overflow that left the scaler
    away from where a fresh one starts."""
    from support.megatron import require_megatron

    require_megatron()
    root = tmp_path_factory.mktemp("megatron-fp16")
    whole = run_ranks(_train, 1, str(root / "whole"), ITERATIONS, False, [])[0]
    fresh = {"scale": INITIAL_SCALE, "growth_tracker": 0, "hysteresis_tracker": 2}
    after = [i for i, (updated, scales) in enumerate(whole["trace"])
             if i >= 4 and not updated and scales[0] != fresh and i + 1 < ITERATIONS]
    assert after, f"no overflow to save after: {whole['trace']}"
    stop = after[0] + 1
    save_dir = str(root / "save")
    first = run_ranks(_train, 1, save_dir, stop, True, [])[0]
    return {"whole": whole, "first": first, "stop": stop, "save_dir": save_dir}


@pytest.mark.multiprocess
@pytest.mark.megatron
def test_a_restart_right_after_an_overflow_continues_the_scaler_weights_and_moments_bitwise(runs):
    whole, first, stop = runs["whole"], runs["first"], runs["stop"]
    assert first["optimizer"] == "Float16OptimizerWithFloat16Params"
    assert first["trace"] == whole["trace"][:stop]
    overflows = [i for i, (updated, _) in enumerate(whole["trace"]) if not updated]
    assert overflows[0] == 0 and stop - 1 in overflows  # real fp16 overflows, the last one right before the save

    manifest = saved_manifest(runs["save_dir"], stop)
    assert manifest["expectation"]["megatron"]["loss_scale"] == whole["trace"][stop - 1][1]
    state, skipped = manifest["train_state"], len([i for i in overflows if i < stop])
    assert (state["updates_successful"], state["updates_skipped"]) == (stop - skipped, skipped)

    second = run_ranks(_train, 1, runs["save_dir"], ITERATIONS, False, [])[0]
    assert "error" not in second, second
    assert second["start"] == stop
    assert second["trace"] == whole["trace"][stop:]  # the scale, its trackers and every skip after it
    assert second["digest"] == whole["digest"]


@pytest.mark.multiprocess
@pytest.mark.megatron
def test_inspect_shows_the_saved_loss_scale(runs):
    proc = resume("inspect", runs["save_dir"])
    assert proc.returncode == 0, proc.stderr
    saved = runs["whole"]["trace"][runs["stop"] - 1][1][0]
    line = next(line for line in proc.stdout.splitlines() if line.strip().startswith("loss scale"))
    assert f"scale {saved['scale']:g}" in line and f"hysteresis_tracker {saved['hysteresis_tracker']}" in line


@pytest.mark.multiprocess
@pytest.mark.megatron
def test_a_constant_loss_scale_at_the_restart_is_refused_naming_the_scaler(runs, tmp_path):
    import shutil

    copy = str(tmp_path / "save")
    shutil.copytree(runs["save_dir"], copy)
    out = run_ranks(_train, 1, copy, ITERATIONS, False, ["--loss-scale", "4096"])[0]
    err = out["error"]
    assert err["item"] == "megatron.loss_scale[0]"
    assert err["expected"] == runs["whole"]["trace"][runs["stop"] - 1][1][0]
    assert err["actual"] == {"scale": 4096.0}
    assert "loss scaler" in err["message"]


class _Scaler:
    def __init__(self, state: dict):
        self.state = state

    def state_dict(self) -> dict:
        import torch

        return {**self.state, "scale": torch.tensor([self.state["scale"]])}


def _optimizer(*states: dict | None):
    import types

    return types.SimpleNamespace(chained_optimizers=[
        types.SimpleNamespace(grad_scaler=_Scaler(s) if s is not None else None) for s in states])


SAVED = {"scale": 262144.0, "growth_tracker": 0, "hysteresis_tracker": 1}


def _saved(record) -> object:
    import types

    return types.SimpleNamespace(expectation={"megatron": {"loss_scale": record}})


def _args(**kw) -> object:
    import types

    return types.SimpleNamespace(**{"no_load_optim": False, "finetune": False, **kw})


def test_the_same_scaler_state_passes_and_each_difference_is_named():
    _check_loss_scale(_saved([SAVED, {}]), _args(), _optimizer(SAVED, None))
    for live, item in (({**SAVED, "hysteresis_tracker": 2}, "megatron.loss_scale[0]"),
                       ({**SAVED, "scale": 4096.0}, "megatron.loss_scale[0]")):
        with pytest.raises(ContinuityError) as e:
            _check_loss_scale(_saved([SAVED]), _args(), _optimizer(live))
        assert e.value.item == item and e.value.expected == SAVED and e.value.actual == live
    with pytest.raises(ContinuityError) as e:  # bf16 or fp32 now: no scaler at all
        _check_loss_scale(_saved([SAVED]), _args(), _optimizer(None))
    assert e.value.actual is None


def test_no_record_or_an_optimizer_not_loaded_on_purpose_is_not_checked():
    _check_loss_scale(_saved(None), _args(), _optimizer({**SAVED, "scale": 1.0}))
    _check_loss_scale(_saved([SAVED]), _args(no_load_optim=True), _optimizer({**SAVED, "scale": 1.0}))
    _check_loss_scale(_saved([SAVED]), _args(finetune=True), _optimizer(None))


@pytest.mark.parametrize("record", ["262144", 7, {"scale": 1.0}])
def test_a_damaged_record_is_a_one_line_continuity_error(record):
    with pytest.raises(ContinuityError) as e:
        _check_loss_scale(_saved(record), _args(), _optimizer(SAVED))
    assert e.value.item.startswith("megatron.loss_scale") and "\n" not in str(e.value)
