"""The native adapter on the cases real jobs hit: parameters without gradients,
saves before the first applied update, and the schedulers torch ships."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from resume.adapters.torch_native import NativeTorchAdapter
from resume.drill.worker import tensor_digest

from resume import ContinuityError, Coordinator, UnsafeCheckpointError


class TwoHeads(torch.nn.Module):
    """``unused`` never gets a gradient (an expert no token was routed to)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.body(x)


class Counting:
    """An endless stream of batches whose state is its position."""

    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, s):
        self.pos = s["pos"]

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(self.pos)
            self.pos += 1
            yield {"ids": torch.tensor([self.pos - 1]), "x": torch.randn(2, 4, generator=g)}


def job(run, make_scheduler=None, every=2):
    torch.manual_seed(0)
    model = TwoHeads()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheds = [make_scheduler(opt)] if make_scheduler else []
    adapter = NativeTorchAdapter(model, opt, scheds, Counting())
    coord = Coordinator(run, adapter, global_batch=2, every=every, handle_signals=False)
    return coord, model, opt, scheds


def run_until(coord, model, opt, scheds, until, skip=(), metric=False):
    for batch in coord.batches():
        it = coord.iteration + 1
        model(batch["x"]).pow(2).mean().backward()
        applied = it not in skip
        if applied:
            opt.step()
            for s in scheds:
                s.step(1.0) if metric else s.step()
        opt.zero_grad(set_to_none=True)
        coord.update(applied=applied)
        if coord.iteration >= until:
            break
    coord.close()


def digests(model, opt):
    return ({n: tensor_digest(p) for n, p in model.named_parameters()},
            {id_: {k: tensor_digest(v) for k, v in st.items()}
             for id_, st in enumerate(opt.state.get(p, {}) for p in model.parameters())})


def test_parameter_without_gradient_round_trips_without_state(tmp_path):
    ref = job(str(tmp_path / "ref"), every=0)
    ref[0].restore()
    run_until(*ref, until=6)
    run = str(tmp_path / "run")
    first = job(run)
    first[0].restore()
    run_until(*first, until=3)
    coord, model, opt, scheds = job(run)
    coord.restore()
    assert coord.restored_from == 2
    assert opt.state.get(model.unused.weight) in (None, {})  # none then, none now
    run_until(coord, model, opt, scheds, until=6)
    assert digests(model, opt) == digests(ref[1], ref[2])


def test_save_before_any_applied_update_does_not_change_training(tmp_path):
    ref = job(str(tmp_path / "ref"), every=0)
    ref[0].restore()
    run_until(*ref, until=5, skip={1, 2})
    saved = job(str(tmp_path / "run"), every=2)
    saved[0].restore()
    run_until(*saved, until=5, skip={1, 2})
    assert digests(saved[1], saved[2]) == digests(ref[1], ref[2])
    coord, *_ = job(str(tmp_path / "run"), every=2)
    assert coord.restore().iteration == 4


def test_restore_from_a_checkpoint_taken_before_any_update(tmp_path):
    run = str(tmp_path / "run")
    first = job(run, every=2)
    first[0].restore()
    run_until(*first, until=3, skip={1, 2})
    coord, _, opt, _ = job(run)
    coord.restore()
    assert coord.restored_from == 2 and len(opt.state) == 0
    assert coord.adapter.optimizer_steps() == [0]


SCHEDULERS = {
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=6),
    "plateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0),
    "chained": lambda o: torch.optim.lr_scheduler.ChainedScheduler(
        [torch.optim.lr_scheduler.LinearLR(o, 0.5, total_iters=3),
         torch.optim.lr_scheduler.ExponentialLR(o, 0.9)]),
    "sequential": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o, [torch.optim.lr_scheduler.LinearLR(o, 0.5, total_iters=2),
            torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=20)], milestones=[2]),
    "warm_restarts": lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=2, T_mult=2),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_torch_schedulers_save_through_the_end_and_restore(tmp_path, name):
    run = str(tmp_path / "run")
    make = SCHEDULERS[name]
    first = job(run, make, every=1)
    first[0].restore()
    run_until(*first, until=6, metric=name == "plateau")  # saves every update, the last included
    coord, *_ = job(run, make, every=1)
    coord.restore()
    assert coord.restored_from == 6
    assert coord.adapter.current_lrs() == first[0].adapter.current_lrs()


def test_sequential_scheduler_child_rebuilt_with_another_length_is_caught(tmp_path):
    run = str(tmp_path / "run")
    first = job(run, SCHEDULERS["sequential"], every=2)
    first[0].restore()
    run_until(*first, until=3)

    def longer(o):
        return torch.optim.lr_scheduler.SequentialLR(
            o, [torch.optim.lr_scheduler.LinearLR(o, 0.5, total_iters=2),
                torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=1000)], milestones=[2])

    coord, *_ = job(run, longer, every=2)
    with pytest.raises(ContinuityError) as info:
        coord.restore()
    assert info.value.item == "schedule[0].children"


def test_dcp_metadata_pointing_outside_the_step_directory_is_refused(tmp_path):
    run = str(tmp_path / "run")
    first = job(run, every=2)
    first[0].restore()
    run_until(*first, until=2)
    path = os.path.join(run, "step-000000002", ".metadata")
    from resume.adapters.dcp.unpickle import restricted_load_metadata

    with open(path, "rb") as f:
        metadata = restricted_load_metadata(f.read(), source=path)
    for info in metadata.storage_data.values():
        info.relative_path = "../../elsewhere/__0_0.distcp"
    with pytest.raises(UnsafeCheckpointError, match="storage_data.relative_path"):
        restricted_load_metadata(pickle.dumps(metadata), source=path)


def test_moments_fingerprinted_from_the_staged_copy_equal_the_live_ones():
    """An asynchronous save records the fingerprint of its staged copy; a restore compares it
    with the live optimizers: the two must agree (tied weights, two optimizers, a parameter
    without state)."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(8, 4)
    head = torch.nn.Linear(4, 8, bias=False)
    head.weight = emb.weight
    body = torch.nn.Linear(4, 4)
    idle = torch.nn.Linear(4, 4)  # never gets a gradient: no optimizer state
    model = torch.nn.ModuleDict({"emb": emb, "head": head, "body": body, "idle": idle})
    adam = torch.optim.AdamW([emb.weight, body.bias, idle.bias], lr=1e-2)
    muon = torch.optim.Muon([body.weight, idle.weight], lr=1e-2)
    adapter = NativeTorchAdapter(model, [adam, muon])
    for _ in range(2):
        x = emb(torch.tensor([1, 2, 3]))
        head(body(x)).square().mean().backward()
        adam.step()
        muon.step()
        adam.zero_grad()
        muon.zero_grad()
    live = adapter.optimizer_fingerprint()
    assert all(f["replicated"]["bits"] for f in live)
    first = adapter.stage_shards()
    assert adapter.fingerprint_staged(first) == live
    pointers = {k: v.data_ptr() for k, v in first["state"]["model"].items()}
    with torch.no_grad():
        adam.state[emb.weight]["exp_avg"][0, 0] += 1e-3
    second = adapter.stage_shards()  # copied into the first copy's buffers, with the new values
    assert adapter.fingerprint_staged(second) == adapter.optimizer_fingerprint() != live
    assert {k: v.data_ptr() for k, v in second["state"]["model"].items()} == pointers
