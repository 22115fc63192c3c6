"""A restart on another parallel layout, with torch's own APIs on gloo ranks (issue 27).

One job, as a user writes it: a small transformer-shaped model, AdamW, warm-up + cosine
(LambdaLR), ``GlobalPositionSampler`` over the data-parallel ranks, saved by FSDP2 on 2 ranks at
update 8. The same checkpoint is restored on FSDP2 with 1 and 4 ranks, tensor parallel 2
(``parallelize_module``), DDP on 2 ranks and TP 2 x FSDP 2 on 4 ranks: each restore is let
through, logs the change, continues with the batch and LR the uninterrupted run had, and holds
weights and moments bitwise equal to the saved global tensors (gathered with torch's
``get_model_state_dict``/``get_optimizer_state_dict(full_state_dict=True)``). A TP checkpoint
goes back to FSDP2 the same way. A change that cannot be exact (another pipeline split, the
program's own shard scheme) is refused before any file of the checkpoint is read.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from resume.adapters.data import GlobalPositionSampler, StatefulLoader
from resume.adapters.torch_native import NativeTorchAdapter
from resume.drill.worker import tensor_digest
from support.ranks import run_ranks

from resume import ContinuityError, Coordinator

pytestmark = pytest.mark.multiprocess

VOCAB, WIDTH, SEQ, GLOBAL_BATCH = 32, 16, 8, 4


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.up = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.down = torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(1000 + i)
        return {"ids": torch.tensor(i), "tokens": torch.randint(0, VOCAB, (SEQ,), generator=g)}


def warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return factor


def parallelize(model: Tiny, kind: str, world: int) -> tuple[int, int]:
    """Lay ``model`` out as ``kind`` over ``world`` ranks; (data-parallel rank, size)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    rank = dist.get_rank() if dist.is_initialized() else 0
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    if kind == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return rank, world
    if kind == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        for block in model.blocks:
            parallelize_module(block, mesh, plan)
        return 0, 1
    if kind == "tp_fsdp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], plan)
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return mesh["dp"].get_local_rank(), world // 2
    return rank, world  # ddp: wrapped by build


def build(run: str, kind: str, world: int) -> tuple[Coordinator, dict]:
    torch.manual_seed(0)
    model = Tiny()
    dp_rank, dp_size = parallelize(model, kind, world)
    trained = model
    if kind == "ddp":
        trained = torch.nn.parallel.DistributedDataParallel(model)
        dp_rank, dp_size = dist.get_rank(), world
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(3, 20))
    data = StatefulLoader(Tokens(), GlobalPositionSampler(64, GLOBAL_BATCH, rank=dp_rank, world_size=dp_size))
    coord = Coordinator(run, NativeTorchAdapter(trained, opt, sched, data), global_batch=GLOBAL_BATCH, every=4,
                        seq_len=SEQ, handle_signals=False)
    return coord, {"model": model, "trained": trained, "opt": opt, "sched": sched}


def train(coord: Coordinator, parts: dict, until: int) -> list[dict]:
    seen = []
    for batch in coord.batches():
        logits = parts["trained"](batch["tokens"])
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["tokens"][:, 1:].reshape(-1))
        loss.backward()
        lr = parts["opt"].param_groups[0]["lr"]
        parts["opt"].step()
        parts["sched"].step()
        parts["opt"].zero_grad(set_to_none=True)
        coord.update()
        seen.append({"iteration": coord.iteration, "ids": sorted(_all_ids(batch["ids"])), "lr": lr})
        if coord.iteration >= until:
            break
    return seen


def _all_ids(ids: torch.Tensor) -> list[int]:
    """The global batch's sample ids, from every rank's share."""
    if not dist.is_initialized():
        return ids.tolist()
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, ids.tolist())
    return sorted({i for share in every for i in share})


def global_digests(parts: dict) -> dict:
    """Every weight and moment as a global tensor (torch's full state dicts), digested."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    weights = get_model_state_dict(parts["trained"], options=options)
    moments = get_optimizer_state_dict(parts["trained"], parts["opt"], options=options)["state"]
    return {"weights": {k: tensor_digest(v) for k, v in sorted(weights.items())},
            "moments": {f"{k}.{m}": tensor_digest(v) for k, s in sorted(moments.items())
                        for m, v in sorted(s.items()) if m != "step"}}


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def save_job(rank: int, world: int, run: str, kind: str) -> dict:
    """Train to 8 (committed at 4 and 8) on ``kind``; then, as the uninterrupted run, one update more."""
    coord, parts = build(run, kind, world)
    coord.restore()
    train(coord, parts, until=8)
    saved = global_digests(parts)
    coord.maybe_wait_for_save()
    layout = json.loads((Path(run) / "step-000000008" / "manifest.json").read_text())["topology"]
    after = train(coord, parts, until=9)
    coord.close()
    return {"saved": saved, "next": after[0], "topology": layout}


def restore_job(rank: int, world: int, run: str, kind: str) -> dict:
    """Restore on ``kind``; the global tensors right after, the next update's batch and LR, the
    log's layout line; then a save at 12, whose manifest records the change."""
    from resume.adapters.torch import shards

    lines = Lines()
    logging.getLogger("resume").addHandler(lines)
    answers, partial = [], shards.partial_metadata

    def counted(*args, **kwargs):
        metadata, hashed = partial(*args, **kwargs)
        answers.append({"entries": len(metadata.storage_data), "hashed": hashed})
        return metadata, hashed
    shards.partial_metadata = counted
    try:
        coord, parts = build(run, kind, world)
        coord.restore()
    finally:
        shards.partial_metadata = partial
    loaded = global_digests(parts)
    after = train(coord, parts, until=12)
    coord.close()
    manifest = json.loads((Path(run) / "step-000000012" / "manifest.json").read_text())
    return {"loaded": loaded, "next": after[0], "restored": coord.restored_from,
            "layout_lines": [line for line in lines.lines if "layout changed" in line],
            "changes": manifest["changes"], "topology": manifest["topology"], "answers": answers}


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> tuple[Path, dict]:
    run = tmp_path_factory.mktemp("fsdp2") / "run"
    out = run_ranks(save_job, 2, str(run), "fsdp")
    assert out[0]["saved"] == out[1]["saved"]
    return run, out[0]


def restored_from_copy(run: Path, tmp: Path, kind: str, world: int) -> dict:
    copy = tmp / f"{kind}-{world}"
    shutil.copytree(run, copy)
    return run_ranks(restore_job, world, str(copy), kind)[0]


@pytest.mark.parametrize(("kind", "world", "now"), [
    ("fsdp", 1, "DP1 on 1 rank"),
    ("fsdp", 4, "DP4 (shard 4) on 4 ranks"),
    ("tp", 2, "DP1 x TP2 on 2 ranks"),
    ("ddp", 2, "DP2 on 2 ranks"),
    ("tp_fsdp", 4, "DP2 (shard 2) x TP2 on 4 ranks"),
])
def test_fsdp2_checkpoint_restarts_on_another_layout_exactly(fsdp_run, tmp_path, kind, world, now):
    run, saved = fsdp_run
    assert saved["topology"]["layout"]["dp_shard"] == 2 and saved["topology"]["data_parallel"] == 2
    out = restored_from_copy(run, tmp_path, kind, world)
    assert out["restored"] == 8
    assert out["loaded"] == saved["saved"]  # weights and moments: the saved global tensors, bitwise
    assert out["next"]["ids"] == saved["next"]["ids"] and out["next"]["lr"] == saved["next"]["lr"]
    assert out["layout_lines"] == [f"resume: step-000000008: layout changed: DP2 (shard 2) on 2 ranks -> {now}, resharded"]
    assert [c["item"] for c in out["changes"]] == ["layout"] and out["changes"][0]["to"] == now
    assert out["topology"]["layout"]["world_size"] == world


def test_a_restart_on_another_data_parallel_size_reads_only_its_own_entries(fsdp_run, tmp_path):
    """FSDP2 on 2 ranks restored on 4: each rank is sent the index entries of its own shards only
    (fewer than the checkpoint holds), and each shard file is hashed by exactly one rank."""
    from resume.adapters.dcp.index import CheckpointIndex

    run, _ = fsdp_run
    copy = tmp_path / "fsdp-4"
    shutil.copytree(run, copy)
    outs = run_ranks(restore_job, 4, str(copy), "fsdp")
    step = run / "step-000000008"
    index = CheckpointIndex.parse((step / "index.resume").read_bytes(), source="index", file_sizes=None)
    total = len(index.chunks)
    for out in outs:
        (answer,) = out["answers"]
        assert 0 < answer["entries"] < total, (answer, total)
    hashed = sorted(f for out in outs for f in out["answers"][0]["hashed"])
    assert hashed == sorted(p.name for p in step.glob("*.distcp"))


def test_tensor_parallel_checkpoint_goes_back_to_fsdp2(fsdp_run, tmp_path):
    run, _ = fsdp_run
    tp = tmp_path / "tp"
    shutil.copytree(run, tp)
    on_tp = run_ranks(restore_job, 2, str(tp), "tp")[0]  # saves at 12 on TP 2
    assert on_tp["topology"]["data_parallel"] == 1 and on_tp["topology"]["layout"]["tensor"] == 2
    back = tmp_path / "back"
    shutil.copytree(tp, back)
    again = run_ranks(save_job_from_12, 2, str(back), "fsdp")[0]
    assert again["restored"] == 12
    assert again["loaded"] == again["saved_at_12"]
    assert again["layout_lines"] == [("resume: step-000000012: layout changed: DP1 x TP2 on 2 ranks -> "
                                      "DP2 (shard 2) on 2 ranks, resharded")]


def save_job_from_12(rank: int, world: int, run: str, kind: str) -> dict:
    """FSDP2 restoring the TP run's step 12: its global tensors as the TP run left them (read back
    from the checkpoint itself with DCP into full tensors) against those after the restore."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    lines = Lines()
    logging.getLogger("resume").addHandler(lines)
    coord, parts = build(run, kind, world)
    coord.restore()
    loaded = global_digests(parts)
    coord.close()
    flat = Path(run).parent / f"flat-{rank}.pt"
    dcp_to_torch_save(str(Path(run) / "step-000000012"), str(flat))
    state = torch.load(flat, weights_only=True)
    return {"restored": coord.restored_from, "loaded": loaded,
            "layout_lines": [line for line in lines.lines if "layout changed" in line], "saved_at_12": {
        "weights": {k: tensor_digest(v) for k, v in sorted(state["model"].items())},
        "moments": {f"{k}.{m}": tensor_digest(v) for k, s in sorted(state["optim"]["state"].items())
                    for m, v in sorted(s.items()) if m != "step"}}}


# -- refused: what cannot load exactly --------------------------------------------------------------


class Stages(torch.nn.Module):
    """The model as a pipeline stage holds it: the full model's names, only its own layers."""

    def __init__(self, layers: list[str], *, first: bool, last: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        full = {"0": Block(), "1": Block()}
        self.embed = torch.nn.Embedding(VOCAB, WIDTH) if first else None
        self.layers = torch.nn.ModuleDict({k: full[k] for k in layers})
        self.head = torch.nn.Linear(WIDTH, VOCAB) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x) if self.embed is not None else x
        for layer in self.layers.values():
            x = layer(x)
        return self.head(x) if self.head is not None else x


def pipeline_parts(stages: list[int]) -> list[Stages]:
    return [Stages([str(i)], first=i == 0, last=i == 1) for i in stages]


def pipeline_coordinator(run: str, parts: list[Stages], **adapter) -> tuple[Coordinator, list]:
    opts = [torch.optim.AdamW(p.parameters(), lr=1e-2) for p in parts]
    data = StatefulLoader(Tokens(), GlobalPositionSampler(64, GLOBAL_BATCH, rank=0, world_size=1))
    return Coordinator(run, NativeTorchAdapter(parts, opts, (), data, **adapter), global_batch=GLOBAL_BATCH,
                       every=2, seq_len=SEQ, handle_signals=False), opts


def pipeline_save(rank: int, world: int, run: str) -> dict:
    """Stage ``rank`` of a 2-stage pipeline (each rank its own layer; a stand-in loss per stage)."""
    parts = pipeline_parts([rank])
    coord, opts = pipeline_coordinator(run, parts)
    coord.restore()
    for batch in coord.batches():
        x = batch["tokens"] if rank == 0 else torch.ones(GLOBAL_BATCH, SEQ, WIDTH)
        parts[0](x).float().pow(2).mean().backward()
        opts[0].step()
        opts[0].zero_grad()
        coord.update()
        if coord.iteration >= 2:
            break
    coord.close()
    return {"stages": json.loads((Path(run) / "step-000000002" / "manifest.json").read_text())["topology"]["layout"]}


def _untouched(parts: list[Stages], opts: list) -> tuple[dict, int]:
    return ({f"{i}.{k}": tensor_digest(v) for i, p in enumerate(parts) for k, v in p.state_dict().items()},
            sum(len(o.state) for o in opts))


def test_another_pipeline_split_is_refused_before_any_file_is_read(tmp_path):
    run = tmp_path / "run"
    layout = run_ranks(pipeline_save, 2, str(run))[0]["stages"]
    assert layout["pipeline"] == 2 and [s["first"] for s in layout["stages"]] == ["embed.weight", "head.bias"]
    # Every shard file zeroed (its size kept): a restore that read one would pass it over as damaged.
    for shard in (run / "step-000000002").glob("*.distcp"):
        shard.write_bytes(bytes(shard.stat().st_size))
    parts = pipeline_parts([0, 1])  # one rank, both stages
    coord, opts = pipeline_coordinator(str(run), parts)
    before = _untouched(parts, opts)
    with pytest.raises(ContinuityError) as refused:
        coord.restore()
    coord.close()
    assert refused.value.item == "layout"
    assert refused.value.expected == "DP1 x PP2 on 2 ranks" and refused.value.actual == "DP1 on 1 rank"
    assert "kept per pipeline stage" in refused.value.hint and "embed.weight .. layers.0.up.weight" in refused.value.hint
    assert _untouched(parts, opts) == before == (before[0], 0)
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step-")) == ["step-000000002"]


def scheme_job(run: str, **parallel) -> tuple[Coordinator, list[Stages], list]:
    parts = pipeline_parts([0, 1])
    coord, opts = pipeline_coordinator(run, parts, parallel=parallel)
    return coord, parts, opts


def test_a_program_shard_scheme_loads_on_its_own_layout_only(tmp_path):
    run = str(tmp_path / "run")
    coord, parts, opts = scheme_job(run, scheme="flat-zero1", tensor=1)
    coord.restore()
    for batch in coord.batches():
        parts[1](parts[0](batch["tokens"])).float().pow(2).mean().backward()
        for opt in opts:
            opt.step()
        coord.update()
        if coord.iteration >= 2:
            break
    coord.close()
    coord, parts, opts = scheme_job(run, scheme="flat-zero1", tensor=1)
    coord.restore()  # the same statement: the same layout
    coord.close()
    assert coord.restored_from == 2
    for stated in ({}, {"scheme": "flat-zero2"}):
        coord, parts, opts = scheme_job(run, **stated)
        before = _untouched(parts, opts)
        with pytest.raises(ContinuityError, match="its own scheme 'flat-zero1'") as refused:
            coord.restore()
        coord.close()
        assert refused.value.item == "layout" and _untouched(parts, opts) == before
