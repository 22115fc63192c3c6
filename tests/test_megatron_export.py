"""``resume export`` on a Megatron save directory (megatron.training's own torch_dist save with
our manifests): the model's sharded tensors as global tensors under their keys, each equal to what
Megatron loads into the model."""

from __future__ import annotations

import json
import os

import pytest
from support.cli import resume
from support.ranks import run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.megatron]


def _compare_with_megatrons_load(rank: int, world: int, save_dir: str, out: str) -> dict:
    """Megatron loads the save into a fresh model; each of the model's sharded tensors is compared
    with its box of the exported global tensor."""
    import torch
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from resume.adapters.megatron import install
    from safetensors.torch import load_file
    from support import megatron_training_run as m

    install()
    args, model, optimizer, scheduler = m.fresh(save_dir)
    iteration = m.load(args, model, optimizer, scheduler)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        shards = set(json.load(f)["weight_map"].values())
    exported = {}
    for shard in shards:
        exported.update(load_file(os.path.join(out, shard)))
    compared, differ, keys = 0, [], set()
    for st in nested_values(model[0].module.sharded_state_dict()):
        if not isinstance(st, ShardedTensor) or st.flattened_range is not None:
            continue
        keys.add(st.key)
        box = exported[st.key]
        for dim, at in enumerate(st.global_offset):
            n = 1 if dim < st.prepend_axis_num else st.data.shape[dim - st.prepend_axis_num]
            box = box.narrow(dim, at, n)
        compared += 1
        if box.dtype != st.data.dtype or not torch.equal(box.reshape(st.data.shape), st.data.detach()):
            differ.append(st.key)
    return {"iteration": iteration, "compared": compared, "differ": differ, "model_keys": sorted(keys),
            "exported": sorted(exported)}


def test_a_megatron_save_exports_its_global_tensors_as_megatron_loads_them(megatron_save, tmp_path):
    save_dir, _ = megatron_save
    out = str(tmp_path / "out")
    proc = resume("export", save_dir, out, "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["step"] == 6
    with open(os.path.join(out, "resume-export.json")) as f:
        assert json.load(f)["source"]["adapter"].startswith("megatron")

    seen = run_ranks(_compare_with_megatrons_load, 1, save_dir, out)[0]
    assert seen["iteration"] == 6
    assert seen["compared"] >= 10 and seen["differ"] == []
    assert seen["exported"] == seen["model_keys"]  # the model's tensors, and no optimizer state
