"""The native PyTorch adapter on real processes and real torch.distributed.checkpoint.

Covered: a plain module in one process (no process group), DDP on 2 ranks,
FSDP2 (fully_shard, DTensor parameters and moments) on 2 CPU ranks with gloo,
AdamW + Muon with two schedulers, and a restart on another data-parallel size.
"""

from __future__ import annotations

import pytest
import torch
from resume.adapters.data import GlobalPositionSampler, StatefulLoader
from resume.adapters.torch_native import NativeTorchAdapter
from resume.drill.model import SyntheticTokens, TinyGPT, warmup_cosine
from resume.drill.worker import tensor_digest
from support.checkpoints import drop_index, plant_metadata_pickle
from support.ranks import run_ranks
from support.workloads import (
    CFG,
    ListData,
    Setup,
    build,
    moment_digests,
    next_token_loss,
    param_digests,
    train,
    trained,
)

from resume import Coordinator, UnsafeCheckpointError

pytestmark = pytest.mark.multiprocess


def ddp_round_trip(rank: int, world: int, tmp: str) -> dict:
    coord, parts = build(rank, world, tmp, Setup(every=4))
    coord.restore()
    train(coord, parts, until=4)
    saved = {"params": param_digests(parts["model"]), "moments": moment_digests(parts["opt"])}
    coord.close()
    # A fresh job: AdamW has no state at all until its first step.
    coord, parts = build(rank, world, tmp, Setup(every=4))
    fresh_state = len(parts["opt"].state)
    coord.restore()
    coord.close()
    loaded = {"params": param_digests(parts["model"]), "moments": moment_digests(parts["opt"])}
    return {"saved": saved, "loaded": loaded, "fresh_state": fresh_state,
            "steps": coord.adapter.optimizer_steps(), "restored": coord.restored_from}


def test_ddp_state_round_trips_bitwise_including_lazily_created_adamw_moments(tmp_path):
    for out in run_ranks(ddp_round_trip, 2, str(tmp_path)):
        assert out["fresh_state"] == 0
        assert out["restored"] == 4
        assert out["loaded"] == out["saved"]
        assert all({"exp_avg", "exp_avg_sq", "step"} <= set(m) for m in out["loaded"]["moments"])
        assert out["steps"] == [4]


def _muon_job(rank: int, world: int, run: str):
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks")]
    others = [p for n, p in model.named_parameters() if not (p.ndim == 2 and n.startswith("blocks"))]
    adamw = torch.optim.AdamW(others, lr=1e-2)
    muon = torch.optim.Muon(matrices, lr=2e-2)
    scheds = [torch.optim.lr_scheduler.LambdaLR(adamw, warmup_cosine(2, 20)),
              torch.optim.lr_scheduler.StepLR(muon, step_size=3, gamma=0.5)]
    dataset = SyntheticTokens(24, CFG)
    data = StatefulLoader(dataset, GlobalPositionSampler(len(dataset), 4, rank=rank, world_size=world))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    adapter = NativeTorchAdapter(ddp, [adamw, muon], scheds, data)
    coord = Coordinator(run, adapter, global_batch=4, every=5, handle_signals=False)
    return coord, model, ddp, [adamw, muon], scheds


def muon_round_trip(rank: int, world: int, tmp: str) -> dict:
    coord, model, ddp, opts, scheds = _muon_job(rank, world, tmp)
    coord.restore()
    for batch in coord.batches():
        next_token_loss(ddp, batch["tokens"]).backward()
        for o in opts:
            o.step()
            o.zero_grad()
        for s in scheds:
            s.step()
        coord.update(applied=True)
        if coord.iteration == 5:
            break
    saved = [moment_digests(o) for o in opts], param_digests(model), [s.last_epoch for s in scheds]
    lrs = coord.adapter.lr_ahead(4)
    coord.close()
    coord, model, ddp, opts, scheds = _muon_job(rank, world, tmp)
    coord.restore()
    loaded = [moment_digests(o) for o in opts], param_digests(model), [s.last_epoch for s in scheds]
    return {"same": saved == loaded, "lrs": lrs, "lrs_after": coord.adapter.lr_ahead(4),
            "muon_state_keys": sorted({k for m in loaded[0][1] for k in m}),
            "steps": coord.adapter.optimizer_steps()}


def test_adamw_and_muon_with_two_schedulers_round_trip(tmp_path):
    for out in run_ranks(muon_round_trip, 2, str(tmp_path)):
        assert out["same"]
        assert out["muon_state_keys"] == ["momentum_buffer"]
        assert out["steps"] == [5, 5]
        assert out["lrs"] == out["lrs_after"]
        # StepLR halves Muon's LR every 3 updates: the look-ahead crosses a boundary.
        assert len({lrs[-1] for lrs in out["lrs"]}) == 2


def fsdp2_round_trip(rank: int, world: int, tmp: str, async_save: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def job():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = ListData([{"ids": torch.tensor([i]), "x": torch.full((1, 8), float(i))} for i in range(100)])
        adapter = NativeTorchAdapter(model, opt, [], data)
        return Coordinator(f"{tmp}/run", adapter, global_batch=world, every=3,
                           handle_signals=False, async_save=async_save), model, opt

    def full(model, opt):
        params = {n: tensor_digest(p.full_tensor()) for n, p in model.named_parameters()}
        moments = {f"{i}.{k}": tensor_digest(v.full_tensor() if hasattr(v, "full_tensor") else v)
                   for i, st in enumerate(opt.state.values()) for k, v in sorted(st.items())}
        return params, moments

    coord, model, opt = job()
    coord.restore()
    saved = None
    # Asynchronously, training goes on to 5 while the save of 3 (staged DTensor shards) is written.
    until = 5 if async_save else 3
    for batch in coord.batches():
        model(batch["x"]).sum().backward()
        opt.step()
        opt.zero_grad()
        coord.update(applied=True)
        if coord.iteration == 3:
            saved = full(model, opt)
        if coord.iteration == until:
            break
    is_dtensor = type(next(model.parameters())).__name__
    coord.close()
    coord, model, opt = job()
    coord.restore()
    return {"same": full(model, opt) == saved, "restored": coord.restored_from, "param_type": is_dtensor}


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_fsdp2_dtensor_state_round_trips(tmp_path, async_save):
    for out in run_ranks(fsdp2_round_trip, 2, str(tmp_path), async_save):
        assert out["param_type"] == "DTensor"
        assert out["restored"] == 3
        assert out["same"]


def save_on_two(rank: int, world: int, tmp: str) -> dict:
    coord, parts = build(rank, world, tmp, Setup(every=5))
    coord.restore()
    trace = train(coord, parts, until=7)
    coord.close()
    return {"trace": trace}


def restore_on(rank: int, world: int, tmp: str) -> dict:
    coord, parts = build(rank, world, tmp, Setup(every=5))
    coord.restore()
    trace = train(coord, parts, until=7)
    coord.close()
    return {"restored": coord.restored_from, "trace": trace}


def test_restart_on_another_data_parallel_size_keeps_batches_and_lr(tmp_path):
    before = run_ranks(save_on_two, 2, str(tmp_path))
    after = run_ranks(restore_on, 1, str(tmp_path))[0]
    assert after["restored"] == 5
    # Iterations 6 and 7 again, on one rank: the same global samples and LR.
    rank0_ids = [r["ids"] for r in before[0]["trace"][5:]]
    rank1_ids = [r["ids"] for r in before[1]["trace"][5:]]
    assert [r["ids"] for r in after["trace"]] == [a + b for a, b in zip(rank0_ids, rank1_ids)]
    assert [r["lr"] for r in after["trace"]] == [r["lr"] for r in before[0]["trace"][5:]]


def test_plain_module_in_one_process_without_a_process_group(tmp_path):
    run = str(tmp_path / "run")
    coord, parts = build(0, 1, run, Setup(every=2))
    coord.restore()
    trace = train(coord, parts, until=3)
    coord.close()
    coord2, parts2 = build(0, 1, run, Setup(every=2))
    coord2.restore()
    assert coord2.restored_from == 2
    trace2 = train(coord2, parts2, until=3)
    coord2.close()
    assert trace2 == trace[2:]


def test_sampler_stream_is_the_same_for_any_data_parallel_size():
    def stream(world: int, batches: int) -> list[list[int]]:
        samplers = [iter(GlobalPositionSampler(10, 4, rank=r, world_size=world, seed=3))
                    for r in range(world)]
        return [[i for s in samplers for i in next(s)] for _ in range(batches)]

    assert stream(1, 6) == stream(2, 6) == stream(4, 6)
    flat = [i for batch in stream(1, 5) for i in batch]
    assert sorted(flat[:10]) == list(range(10))  # each epoch a permutation


def test_malicious_dcp_metadata_is_refused_before_anything_runs(tmp_path):
    run = str(tmp_path / "run")
    trained(run, until=2, every=2)
    step_dir = tmp_path / "run" / "step-000000002"
    marker = tmp_path / "pwned"
    plant_metadata_pickle(str(step_dir), str(marker))

    coord, _ = build(0, 1, run, Setup(every=2))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: pickle global: .*posix\.system"):
        coord.restore()
    assert not marker.exists()


def restore_counting_metadata_parses(rank: int, world: int, tmp: str) -> dict:
    import resume.adapters.torch.metadata as native

    parsed, indexed = [], []
    restricted, parse_index = native.restricted_load_metadata, native.CheckpointIndex.parse

    def counting(data, **kwargs):
        parsed.append(len(data))
        return restricted(data, **kwargs)

    def counting_index(data, **kwargs):
        indexed.append(len(data))
        return parse_index(data, **kwargs)
    native.restricted_load_metadata = counting
    native.CheckpointIndex.parse = counting_index
    try:
        coord, parts = build(rank, world, tmp, Setup(every=5))
        coord.restore()
        trace = train(coord, parts, until=7)
        coord.close()
    finally:
        native.restricted_load_metadata = restricted
        native.CheckpointIndex.parse = parse_index
    return {"parsed": len(parsed), "indexed": len(indexed), "restored": coord.restored_from, "trace": trace}


@pytest.mark.parametrize("written", ["with the index", "before the index"])
def test_only_rank0_parses_dcp_metadata_and_the_others_get_what_it_built(tmp_path, written):
    """At restore rank 0 alone reads the index (typed arrays, each rank sent its own entries); a
    checkpoint written before the index: rank 0 alone reads and vets .metadata (the allow-list
    unpickler, several times slower than pickle: over 600 MiB at 5,120 ranks), the others
    receive the object it built. Either way the load is exactly as before."""
    before = run_ranks(save_on_two, 2, str(tmp_path))
    if written == "before the index":
        for step_dir in tmp_path.glob("step-*"):
            drop_index(str(step_dir))
    after = run_ranks(restore_counting_metadata_parses, 2, str(tmp_path))
    assert [r["restored"] for r in after] == [5, 5]
    if written == "before the index":
        assert after[0]["parsed"] >= 1 and after[1]["parsed"] == 0
    else:
        assert after[0]["indexed"] >= 1 and after[1]["indexed"] == 0
        assert after[0]["parsed"] == after[1]["parsed"] == 0
    for rank in (0, 1):  # iterations 6 and 7 again: the same samples and losses
        assert [(r["ids"], r["loss"]) for r in after[rank]["trace"]] == \
               [(r["ids"], r["loss"]) for r in before[rank]["trace"][5:]]
