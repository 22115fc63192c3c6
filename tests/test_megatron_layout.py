"""A Megatron restart on another parallel layout (issue 27): the layout recorded from Megatron's
arguments, and a restart with another TP let through where the checkpoint's format reshards,
refused before Megatron's load, naming both layouts and the flag, where it does not.

The recorded facts need no megatron-core; the restarts run real Megatron-Core on gloo ranks
(``support.megatron_core_run``): saved at TP1 on one rank, restarted at TP2 on two. The
distributed optimizer does not build on CPU (notes/megatron.md): its save records the format its
arguments name (``--use-distributed-optimizer`` without ``--dist-ckpt-optim-fully-reshardable``),
and that record is what the restart decides on, before Megatron's load reads anything.
"""

from __future__ import annotations

import argparse
import json
import os
import types

import pytest
from resume.adapters.megatron.parallel import fixed_degrees, formats, megatron_layout, saved_layout_change
from resume.adapters.megatron.record import same_degrees, topology

from resume.errors import ContinuityError
from resume.layout import LayoutChange, ParallelLayout, layout_change
from resume.manifest import Manifest

FLAG = "--dist-ckpt-optim-fully-reshardable"


def _args(tp: int = 1, pp: int = 1, dp: int | None = 1, **settings) -> argparse.Namespace:
    """Megatron's argument names for the layout and the checkpoint format (its defaults else)."""
    args = argparse.Namespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              context_parallel_size=1, expert_model_parallel_size=1, ckpt_format="torch_dist",
                              use_distributed_optimizer=False, dist_ckpt_optim_fully_reshardable=False,
                              ckpt_fully_parallel_save=True)
    if dp is not None:
        args.data_parallel_size = dp
    for k, v in settings.items():
        setattr(args, k, v)
    return args


def _saved(args: argparse.Namespace, world_size: int) -> ParallelLayout:
    """The layout as a manifest records it and a restart reads it back."""
    return ParallelLayout.from_dict(json.loads(json.dumps(topology(args, world_size)["layout"])), source="test")


# -- what is recorded --------------------------------------------------------------------------------


def test_topology_records_the_layout_and_the_format_settings_read_from_the_arguments():
    t = topology(_args(tp=2, pp=2, dp=2, use_distributed_optimizer=True), 8)
    assert {k: t[k] for k in ("world_size", "tensor_parallel", "pipeline_parallel", "context_parallel",
                              "data_parallel")} == {"world_size": 8, "tensor_parallel": 2, "pipeline_parallel": 2,
                                                    "context_parallel": 1, "data_parallel": 2}
    layout = t["layout"]
    assert {k: layout[k] for k in ("world_size", "dp_replicate", "dp_shard", "tensor", "pipeline", "context",
                                   "expert", "data_parallel", "how")} == {
        "world_size": 8, "dp_replicate": 1, "dp_shard": 2, "tensor": 2, "pipeline": 2, "context": 1, "expert": 1,
        "data_parallel": 2, "how": "read"}
    assert layout["formats"] == {"ckpt_format": "torch_dist", "use_distributed_optimizer": True,
                                 "dist_ckpt_optim_fully_reshardable": False, "ckpt_fully_parallel_save": True}
    assert sorted(layout["fixed"]) == ["expert", "pipeline", "tensor"]
    assert all(FLAG in why and "dp_reshardable" in why for why in layout["fixed"].values())


def test_the_recorded_layout_passes_the_manifests_own_check():
    from support.checkpoints import make_manifest

    manifest = make_manifest(4, topology=topology(_args(tp=2, dp=4, use_distributed_optimizer=True), 8))
    again = Manifest.from_json(manifest.to_json(), source="test")
    assert ParallelLayout.from_dict(again.topology["layout"], source="test") == _saved(
        _args(tp=2, dp=4, use_distributed_optimizer=True), 8)


def test_data_parallel_is_what_tp_pp_and_cp_leave_when_the_arguments_do_not_name_it():
    layout = megatron_layout(_args(tp=2, dp=None, context_parallel_size=2), 8)
    assert (layout.data_parallel, layout.dp_replicate, layout.dp_shard, layout.context) == (2, 2, 1, 2)


def test_the_distributed_optimizer_shards_over_dp_within_each_of_its_instances():
    layout = megatron_layout(_args(dp=8, use_distributed_optimizer=True, num_distributed_optimizer_instances=2), 8)
    assert (layout.dp_replicate, layout.dp_shard) == (2, 4)
    assert (megatron_layout(_args(dp=8), 8).dp_replicate, megatron_layout(_args(dp=8), 8).dp_shard) == (8, 1)


@pytest.mark.parametrize("settings, fixed, flag", [
    ({}, [], None),
    ({"use_distributed_optimizer": True, "dist_ckpt_optim_fully_reshardable": True}, [], None),
    ({"use_distributed_optimizer": True}, ["expert", "pipeline", "tensor"], FLAG),
    ({"use_distributed_optimizer": True, "ckpt_fully_parallel_save": False}, ["expert", "pipeline", "tensor"], FLAG),
    ({"use_layer_wise_distributed_optimizer": True}, ["expert", "pipeline", "tensor"], FLAG),
    ({"ckpt_format": "torch"}, ["expert", "pipeline", "tensor"], "--ckpt-format torch_dist"),
    ({"ckpt_format": "torch_dcp"}, ["*"], "--ckpt-format torch_dist"),
    ({"ckpt_format": "fsdp_dtensor", "use_distributed_optimizer": True}, [], None),
])
def test_which_degrees_each_checkpoint_format_fixes(settings, fixed, flag):
    found = fixed_degrees(formats(_args(**settings)))
    assert sorted(found) == fixed
    assert all(flag in why for why in found.values())


# -- what a restart lets through, and what it refuses ------------------------------------------------


def test_another_tp_is_let_through_where_the_format_reshards():
    change = layout_change(_saved(_args(tp=1), 1), megatron_layout(_args(tp=2), 2))
    assert isinstance(change, LayoutChange) and set(change.changed) == {"world_size", "tensor"}
    assert change.record(4) == {"step": 4, "item": "layout", "from": "DP1 on 1 rank" + _formats(),
                                "to": "DP1 x TP2 on 2 ranks" + _formats()}
    full = _args(tp=2, dp=2, use_distributed_optimizer=True, dist_ckpt_optim_fully_reshardable=True)
    assert layout_change(_saved(full, 4), megatron_layout(_args(tp=4, dp=1, use_distributed_optimizer=True), 4))


def _formats(**settings) -> str:
    return ", " + ", ".join(f"{k}={v}" for k, v in sorted(formats(_args(**settings)).items()))


def test_another_tp_with_a_dp_reshardable_distributed_optimizer_is_refused_naming_both_layouts_and_the_flag():
    saved = _saved(_args(tp=1, dp=2, use_distributed_optimizer=True), 2)
    with pytest.raises(ContinuityError) as refused:
        layout_change(saved, megatron_layout(_args(tp=2, dp=1, use_distributed_optimizer=True), 2))
    e = refused.value
    assert e.item == "layout"
    assert e.expected.startswith("DP2 (shard 2) on 2 ranks") and e.actual.startswith("DP1 x TP2 on 2 ranks")
    assert FLAG in str(e) and "TP (--tensor-model-parallel-size)" in str(e)


@pytest.mark.parametrize("degree", ["pipeline_model_parallel_size", "expert_model_parallel_size"])
def test_another_pp_or_ep_with_a_dp_reshardable_distributed_optimizer_is_refused(degree):
    saved = _saved(_args(dp=4, use_distributed_optimizer=True), 4)
    with pytest.raises(ContinuityError, match=FLAG):
        layout_change(saved, megatron_layout(_args(dp=2, use_distributed_optimizer=True, **{degree: 2}), 4))


def test_another_dp_or_cp_with_a_dp_reshardable_distributed_optimizer_is_let_through():
    saved = _saved(_args(tp=2, dp=2, use_distributed_optimizer=True), 4)
    wider = layout_change(saved, megatron_layout(_args(tp=2, dp=4, use_distributed_optimizer=True), 8))
    assert wider is not None and "dp_shard" in wider.changed
    cp = _args(tp=2, dp=1, use_distributed_optimizer=True, context_parallel_size=2)
    assert layout_change(saved, megatron_layout(cp, 4)) is not None


def test_a_torch_dcp_checkpoint_loads_on_its_own_layout_only():
    with pytest.raises(ContinuityError, match="--ckpt-format torch_dist"):
        layout_change(_saved(_args(dp=1, ckpt_format="torch_dcp"), 1), megatron_layout(_args(dp=2,
                                                                                            ckpt_format="torch_dcp"), 2))


def test_the_same_layout_with_other_format_settings_is_no_change():
    saved = _saved(_args(tp=2, use_distributed_optimizer=True), 2)
    assert layout_change(saved, megatron_layout(_args(tp=2, use_distributed_optimizer=True,
                                                      dist_ckpt_optim_fully_reshardable=True), 2)) is None


def test_a_manifest_recorded_before_layouts_were_is_not_checked():
    older = types.SimpleNamespace(topology={"world_size": 1, "tensor_parallel": 1, "pipeline_parallel": 1,
                                            "context_parallel": 1, "data_parallel": 1})
    assert saved_layout_change(older, _args(tp=2), 2, source="test") is None


def test_the_rng_check_compares_degrees_not_the_format_settings_beside_them():
    now = topology(_args(tp=2, dp=2), 4)
    assert same_degrees(topology(_args(tp=2, dp=2, ckpt_fully_parallel_save=False), 4), now)
    older = {k: v for k, v in now.items() if k != "layout"}
    assert same_degrees(older, now)
    assert not same_degrees(topology(_args(tp=1, dp=4), 4), now)


# -- real Megatron-Core: saved at TP1 on one rank, restarted at TP2 on two ---------------------------------


SAVED_AT = 5


def _save_tp1(rank: int, world: int, save_dir: str, settings: dict) -> dict:
    from megatron.core import parallel_state
    from resume.adapters.megatron import MegatronRecorder
    from support import megatron_core_run as w

    model = w.setup(tp=1)
    args = w.make_args(tp=1, dp=1, **settings)
    scheduler = w.build_scheduler(args)
    recorder = MegatronRecorder(save_dir, lease_ttl_s=None)
    w.train(args, scheduler, recorder, SAVED_AT)
    recorder.before_save(SAVED_AT)
    w.save(save_dir, SAVED_AT, model, args, scheduler)
    manifest = recorder.after_save(SAVED_AT, args, scheduler, scheduler.optimizer)
    parallel_state.destroy_model_parallel()
    return {"layout": manifest.topology["layout"]}


def _restart_tp2(rank: int, world: int, save_dir: str, settings: dict) -> dict:
    """A restart at TP2 in the order ``install()`` wires it: the recorder's checks, then Megatron's
    load (here ``dist_checkpointing.load``, counted), then the continuity check; then one more
    iteration and a save."""
    import logging

    import torch
    from megatron.core import dist_checkpointing, parallel_state
    from resume.adapters.megatron import MegatronRecorder
    from support import megatron_core_run as w

    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("resume").addHandler(handler)
    loads = []
    real_load = dist_checkpointing.load
    dist_checkpointing.load = lambda *a, **k: loads.append(1) or real_load(*a, **k)
    model = w.setup(tp=2, seed=999)
    fresh = w.full_weights(model)
    args = w.make_args(tp=2, dp=1, **settings)
    scheduler = w.build_scheduler(args)
    recorder = MegatronRecorder(save_dir, lease_ttl_s=None)
    out: dict = {"warnings": warnings}
    try:
        step = recorder.before_load(args)
        iteration = w.load(save_dir, step, model, args, scheduler)
        recorder.after_load(iteration, args, scheduler, scheduler.optimizer)
        w.train(args, scheduler, recorder, 1, start=iteration)
        recorder.before_save(iteration + 1)
        w.save(save_dir, iteration + 1, model, args, scheduler)
        manifest = recorder.after_save(iteration + 1, args, scheduler, scheduler.optimizer)
        out["changes"] = manifest.changes if manifest is not None else None
    except ContinuityError as e:
        out["error"] = {"item": e.item, "expected": e.expected, "actual": e.actual, "message": str(e)}
    out["loads"] = len(loads)
    out["weights_untouched"] = all(torch.equal(t, fresh[n]) for n, t in w.full_weights(model).items())
    parallel_state.destroy_model_parallel()
    return out


def _restart_at_tp2(tmp_path, settings: dict) -> tuple[dict, list[dict]]:
    from support.megatron import require_megatron
    from support.ranks import run_ranks

    require_megatron()
    save_dir = str(tmp_path / "save")
    os.makedirs(save_dir)
    saved = run_ranks(_save_tp1, 1, save_dir, settings)[0]
    return saved, run_ranks(_restart_tp2, 2, save_dir, settings)


@pytest.mark.megatron
@pytest.mark.multiprocess
def test_megatron_restart_at_another_tp_is_let_through_logged_and_recorded(tmp_path):
    saved, outs = _restart_at_tp2(tmp_path, {})
    assert saved["layout"]["tensor"] == 1 and "fixed" not in saved["layout"]
    assert all("error" not in out for out in outs), outs
    assert [out["loads"] for out in outs] == [1, 1] and not any(out["weights_untouched"] for out in outs)
    change = outs[0]["changes"]
    assert [(c["step"], c["item"]) for c in change] == [(SAVED_AT, "layout")]
    assert change[0]["from"].startswith("DP1 on 1 rank") and change[0]["to"].startswith("DP1 x TP2 on 2 ranks")
    assert [w for w in outs[0]["warnings"] if "layout changed" in w] == [
        f"resume: iter_{SAVED_AT:07d}: layout changed: {change[0]['from']} -> {change[0]['to']}, resharded"]
    assert not any("layout changed" in w for w in outs[1]["warnings"])  # rank 0 alone logs it


@pytest.mark.megatron
@pytest.mark.multiprocess
def test_megatron_restart_at_another_tp_of_a_dp_reshardable_save_is_refused_before_megatrons_load(tmp_path):
    saved, outs = _restart_at_tp2(tmp_path, {"use_distributed_optimizer": True})
    assert sorted(saved["layout"]["fixed"]) == ["expert", "pipeline", "tensor"]
    for out in outs:
        assert out["error"]["item"] == "layout", out
        assert out["error"]["expected"].startswith("DP1 on 1 rank")
        assert out["error"]["actual"].startswith("DP1 x TP2 on 2 ranks")
        assert FLAG in out["error"]["message"]
        assert out["loads"] == 0 and out["weights_untouched"]
