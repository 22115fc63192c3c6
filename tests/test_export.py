"""``resume export``: a committed checkpoint's tensors out as sharded safetensors (or torch files),
read with the safetensors library into fresh models; checked against what DCP loads; a damaged
checkpoint refused with the file named and nothing written; the output's own record."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from resume.drill.model import GPTConfig, TinyGPT
from safetensors.torch import load_file
from support.checkpoints import drop_index, flip_byte, plant_metadata_pickle
from support.cli import assert_one_line_error, resume
from support.ranks import run_ranks
from support.workloads import ListData

from resume.checksum import checksum_bytes

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def drilled(tmp_path_factory):
    """A run written by ``resume drill`` (2 ranks, a kill and a resume on the way)."""
    run = str(tmp_path_factory.mktemp("export") / "run")
    proc = resume("drill", "--run", run, "--iterations", "10", "--every", "5", "--kills", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    return run


def _step_dir(run: str, step: int) -> str:
    return os.path.join(run, f"step-{step:09d}")


def _dcp_model(run: str, step: int, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What DCP itself loads for the model's keys (``model.`` + name), into zeroed tensors."""
    import torch.distributed.checkpoint as dcp

    state = {"model": {k: torch.zeros_like(v) for k, v in like.items()}}
    dcp.load(state, checkpoint_id=_step_dir(run, step), no_dist=True)
    return state["model"]


def _exported(out: str) -> dict[str, torch.Tensor]:
    """Every tensor of an export, by the safetensors library, through the index's weight map."""
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        part = load_file(os.path.join(out, shard))
        assert all(index["weight_map"][name] == shard for name in part)
        tensors.update(part)
    assert set(tensors) == set(index["weight_map"])  # the index lists every tensor, and only those
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    return tensors


def test_a_drill_checkpoint_exports_to_safetensors_that_load_into_a_fresh_model_bitwise(drilled, tmp_path):
    out = str(tmp_path / "out")
    proc = resume("export", drilled, out, "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["ok"] and result["step"] == 10

    tensors = _exported(out)
    model = TinyGPT(GPTConfig())
    model.load_state_dict(tensors, strict=True)  # the model's own names, every one of them
    loaded = _dcp_model(drilled, 10, tensors)
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert t.dtype == loaded[name].dtype and torch.equal(t, loaded[name]), name

    with open(os.path.join(out, "resume-export.json")) as f:
        record = json.load(f)
    with open(os.path.join(_step_dir(drilled, 10), "manifest.json"), "rb") as f:
        assert record["source"]["manifest_checksum"] == checksum_bytes(f.read())
    assert record["source"]["step"] == 10 and record["source"]["run"] == drilled
    assert record["dtype"] == "keep" and record["selection"]["part"] == "model"
    for name, entry in record["files"].items():
        with open(os.path.join(out, name), "rb") as f:
            data = f.read()
        assert (len(data), checksum_bytes(data)) == (entry["size"], entry["checksum"])
    assert set(os.listdir(out)) == set(record["files"]) | {"resume-export.json"}


def test_another_dtype_is_a_plain_cast_and_small_shards_split_the_tensors(drilled, tmp_path):
    out = str(tmp_path / "bf16")
    proc = resume("export", drilled, out, "--dtype", "bf16", "--max-shard-size", "20KB", "--step", "5")
    assert proc.returncode == 0, proc.stderr
    tensors = _exported(out)
    shards = [n for n in os.listdir(out) if n.endswith(".safetensors")]
    assert len(shards) > 2
    for shard in shards:
        part = load_file(os.path.join(out, shard))
        assert len(part) == 1 or sum(t.numel() * t.element_size() for t in part.values()) <= 20_000
    kept = _dcp_model(drilled, 5, {k: torch.zeros(v.shape) for k, v in tensors.items()})
    for name, t in tensors.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, kept[name].to(torch.bfloat16)), name


def test_torch_format_optimizer_part_and_name_filters(drilled, tmp_path):
    out = str(tmp_path / "optim")
    proc = resume("export", drilled, out, "--format", "torch", "--what", "optimizer",
                  "--include", "optim.state.blocks.0.", "--strip-prefix", "optim.state.")
    assert proc.returncode == 0, proc.stderr
    with open(os.path.join(out, "pytorch_model.bin.index.json")) as f:
        names = set(json.load(f)["weight_map"])
    tensors = {}
    for shard in sorted(n for n in os.listdir(out) if n.endswith(".bin")):
        tensors.update(torch.load(os.path.join(out, shard), weights_only=True))
    assert set(tensors) == names and names
    assert all(n.startswith("blocks.0.") for n in names)
    assert {"blocks.0.qkv.weight.exp_avg", "blocks.0.qkv.weight.exp_avg_sq"} <= names


@pytest.mark.parametrize("victim", ["__1_0.distcp", "index.resume"])
def test_a_flipped_byte_refuses_the_export_naming_the_file_and_writes_nothing(drilled, tmp_path, victim):
    run = str(tmp_path / "run")
    shutil.copytree(drilled, run)
    flip_byte(os.path.join(_step_dir(run, 10), victim))
    out = str(tmp_path / "out")
    proc = resume("export", run, out, "--step", "10")
    assert_one_line_error(proc, 1, victim, "checksum")
    assert not os.path.exists(out)
    assert os.listdir(tmp_path) == ["run"]  # no partial directory left beside it


def test_a_step_without_the_index_exports_from_dcps_metadata_alike(drilled, tmp_path):
    run = str(tmp_path / "run")
    shutil.copytree(drilled, run)
    drop_index(_step_dir(run, 10))
    with_index, without = str(tmp_path / "a"), str(tmp_path / "b")
    assert resume("export", drilled, with_index).returncode == 0
    proc = resume("export", run, without)
    assert proc.returncode == 0, proc.stderr
    a, b = _exported(with_index), _exported(without)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_metadata_pickle_that_runs_code_is_refused_and_nothing_runs(drilled, tmp_path):
    run = str(tmp_path / "run")
    shutil.copytree(drilled, run)
    marker = tmp_path / "ran"
    plant_metadata_pickle(_step_dir(run, 10), str(marker))
    out = str(tmp_path / "out")
    proc = resume("export", run, out, "--step", "10")
    assert_one_line_error(proc, 1, ".metadata")
    assert not marker.exists() and not os.path.exists(out)


def test_an_out_directory_with_files_is_never_replaced(drilled, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    proc = resume("export", drilled, str(out))
    assert_one_line_error(proc, 2, "OUT", "expected a new or empty directory")
    assert os.listdir(out) == ["mine.txt"] and (out / "mine.txt").read_text() == "keep me"


def test_nothing_selected_and_bad_sizes_are_usage_errors(drilled, tmp_path):
    proc = resume("export", drilled, str(tmp_path / "a"), "--include", "no.such.prefix")
    assert_one_line_error(proc, 2, "selection", "none")
    proc = resume("export", drilled, str(tmp_path / "b"), "--max-shard-size", "lots")
    assert_one_line_error(proc, 2, "--max-shard-size", "'lots'")
    proc = resume("export", str(tmp_path / "nothing"), str(tmp_path / "c"))
    assert proc.returncode == 3
    assert not any(p.name in ("a", "b", "c") for p in tmp_path.iterdir())


def _fsdp2_job(rank: int, world: int, run: str) -> dict:
    """TinyGPT with every block and the whole model fully_shard'ed over 2 ranks, 4 updates, a save
    at 4; the full (gathered) parameters at the save."""
    from resume.adapters.torch_native import NativeTorchAdapter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from resume import Coordinator

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig())
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = ListData([{"ids": torch.tensor([i]), "tokens": torch.randint(0, GPTConfig().vocab, (1, 16))}
                     for i in range(64)])
    coord = Coordinator(run, NativeTorchAdapter(model, opt, [], data), global_batch=world, every=4,
                        handle_signals=False)
    coord.restore()
    for batch in coord.batches():
        logits = model(batch["tokens"])
        logits.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        coord.update(applied=True)
        if coord.iteration == 4:
            break
    full = {n: p.full_tensor().tolist() for n, p in model.named_parameters()}
    coord.close()
    return {"full": full, "dtensor": type(next(model.parameters())).__name__}


def test_an_fsdp2_checkpoint_exports_whole_tensors(tmp_path):
    run = str(tmp_path / "run")
    outs = run_ranks(_fsdp2_job, 2, run)
    assert outs[0]["dtensor"] == "DTensor"
    out = str(tmp_path / "out")
    proc = resume("export", run, out)
    assert proc.returncode == 0, proc.stderr
    tensors = _exported(out)
    model = TinyGPT(GPTConfig())
    model.load_state_dict(tensors, strict=True)
    for name, values in outs[0]["full"].items():
        assert torch.equal(tensors[name], torch.tensor(values, dtype=tensors[name].dtype)), name


def test_files_read_out_of_order_are_verified_whole_first_and_export_the_same(drilled, tmp_path, monkeypatch):
    """A checkpoint whose chunks an export needs out of order (here: every tensor in reverse)."""
    from resume.adapters import export

    from resume.errors import CorruptCheckpointError

    in_order = str(tmp_path / "in-order")
    export.export_checkpoint(drilled, in_order)
    plan_reads = export.plan_reads

    def reversed_plan(entries):
        plan = plan_reads(entries)
        return export.reading.Plan(plan.entries[::-1], sorted({c.file for e in plan.entries for c in e.chunks}))
    monkeypatch.setattr(export, "plan_reads", reversed_plan)
    out = str(tmp_path / "reversed")
    result = export.export_checkpoint(drilled, out)
    assert result.rereads == ["__0_0.distcp", "__1_0.distcp"]
    a, b = _exported(in_order), _exported(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    run = str(tmp_path / "run")
    shutil.copytree(drilled, run)
    flip_byte(os.path.join(_step_dir(run, 10), "__1_0.distcp"))
    with pytest.raises(CorruptCheckpointError, match=r"__1_0\.distcp: checksum"):
        export.export_checkpoint(run, str(tmp_path / "damaged"), step=10)
    assert not os.path.exists(tmp_path / "damaged")
