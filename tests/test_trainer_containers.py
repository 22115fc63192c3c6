"""A trainer shaped like torchtitan's, without torchtitan: a fused QKV projection that renames its
weights in state-dict hooks, optimizers and schedulers inside containers, a loader whose state
holds bytes and whose batches carry no sample ids, and a per-rank torchdata loader that wraps its
state in a pickle. One process; the real torchtitan runs in tests/test_torchtitan.py."""

from __future__ import annotations

import logging
import pickle

import pytest
import torch
from resume.adapters.data import load_loader_state, loader_state
from resume.adapters.torch_native import NativeTorchAdapter
from support.workloads import moment_digests, param_digests

from resume import ContinuityError, Coordinator, Run, UsageError

DIM, VOCAB, SEQ, BATCH = 8, 16, 6, 2


class FusedQKV(torch.nn.Module):
    """One matrix for q, k and v; saved as three (``wq``, ``wk``, ``wv``), as torchtitan does."""

    def __init__(self) -> None:
        super().__init__()
        self.wqkv = torch.nn.Linear(DIM, 3 * DIM, bias=False)
        self.register_state_dict_post_hook(self._split)
        self.register_load_state_dict_pre_hook(self._merge)

    @staticmethod
    def _split(module, state_dict, prefix, local_metadata) -> None:
        q, k, v = state_dict.pop(prefix + "wqkv.weight").chunk(3)
        for name, part in zip(("wq", "wk", "wv"), (q, k, v)):
            state_dict[f"{prefix}{name}.weight"] = part.clone()

    @staticmethod
    def _merge(module, state_dict, prefix, *args) -> None:
        parts = [state_dict.pop(f"{prefix}{name}.weight") for name in ("wq", "wk", "wv")]
        state_dict[prefix + "wqkv.weight"] = torch.cat(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wqkv(x).chunk(3, dim=-1)
        weights = torch.softmax(q @ k.transpose(-1, -2) / DIM**0.5, dim=-1)
        return weights @ v


class TinyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.attention = FusedQKV()
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.attention(self.embed(tokens)))


class OptimizersContainer(torch.optim.Optimizer):
    """Like torchtitan's: an Optimizer whose own state is empty and whose groups carry no lr."""

    def __init__(self, model: TinyModel) -> None:
        body = [p for n, p in model.named_parameters() if not n.startswith("head")]
        self.optimizers = [torch.optim.AdamW(body, lr=1e-2, weight_decay=0.1),
                           torch.optim.SGD(model.head.parameters(), lr=5e-2, momentum=0.9)]
        super().__init__([p for o in self.optimizers for g in o.param_groups for p in g["params"]], {})

    def step(self, closure=None) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


class SchedulersContainer:
    def __init__(self, optimizers: OptimizersContainer) -> None:
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda n: 1.0 / (1 + n)) for o in optimizers.optimizers]

    def step(self) -> None:
        for s in self.schedulers:
            s.step()


class OpaqueLoader:
    """Batches ``({"input": ..., "positions": ...}, labels)`` without sample ids; a state with bytes."""

    def __init__(self, seed: int = 0) -> None:
        self.seed, self.position = seed, 0

    def _batch(self, n: int) -> tuple[dict, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1000 + n)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        return {"input": tokens[:, :-1], "positions": torch.arange(SEQ).expand(BATCH, SEQ)}, tokens[:, 1:]

    def __iter__(self):
        while True:
            batch = self._batch(self.position)
            self.position += 1
            yield batch

    def state_dict(self) -> dict:
        return {"position": self.position, "token_buffer": bytes([self.position % 256, 0, 255])}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state
        self.position = state["position"]


def build(run: str, *, seed: int = 0, data_seed: int = 0, **adapter_options):
    torch.manual_seed(seed)
    model = TinyModel()
    optimizers = OptimizersContainer(model)
    schedulers = SchedulersContainer(optimizers)
    adapter = NativeTorchAdapter(model, optimizers, schedulers, OpaqueLoader(data_seed), **adapter_options)
    coord = Coordinator(run, adapter, global_batch=BATCH, every=2, handle_signals=False)
    return coord, {"model": model, "optimizers": optimizers, "schedulers": schedulers}


def train(coord: Coordinator, parts: dict, until: int) -> list[float]:
    losses = []
    model, optimizers, schedulers = parts["model"], parts["optimizers"], parts["schedulers"]
    for inputs, labels in coord.batches():
        loss = torch.nn.functional.cross_entropy(model(inputs["input"]).reshape(-1, VOCAB), labels.reshape(-1))
        loss.backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        losses.append(loss.item())
        coord.update()
        if coord.iteration >= until:
            break
    return losses


def final_state(parts: dict) -> tuple:
    return param_digests(parts["model"]), [moment_digests(o) for o in parts["optimizers"].optimizers]


@pytest.fixture()
def uninterrupted(tmp_path):
    coord, parts = build(str(tmp_path / "straight"))
    coord.restore()
    losses = train(coord, parts, until=8)
    coord.close()
    return losses, final_state(parts)


def test_a_killed_run_restarted_from_its_checkpoint_matches_the_uninterrupted_one_bitwise(tmp_path, uninterrupted,
                                                                                        caplog):
    run = str(tmp_path / "run")
    coord, parts = build(run)
    coord.restore()
    before = train(coord, parts, until=5)  # a checkpoint at 4; iteration 5 is lost with the process
    coord.close()
    assert coord.adapter.model_state == "module"  # picked by itself: the model renames its state
    Run.open(run)  # the checkpoint is there
    coord, parts = build(run, seed=123)  # other initial weights: everything must come from the checkpoint
    with caplog.at_level(logging.WARNING, logger="resume"):
        coord.restore()
    assert coord.restored_from == 4
    line = next(r.getMessage() for r in caplog.records if "continuity ok" in r.getMessage())
    assert "moments of 2 optimizer(s)" in line and "by content: no sample ids" in line
    after = train(coord, parts, until=8)
    coord.close()
    losses, state = uninterrupted
    assert before[:4] + after == losses
    assert final_state(parts) == state


def test_the_containers_moments_are_in_the_checkpoint(tmp_path):
    coord, parts = build(str(tmp_path / "run"))
    coord.restore()
    train(coord, parts, until=2)
    coord.close()
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(tmp_path / "run" / "step-000000002")).read_metadata().state_dict_metadata
    assert any(k.startswith("optim.state.attention.wqkv.weight.exp_avg") for k in keys)  # AdamW's
    assert any(k.startswith("optim.state.head.weight.momentum_buffer") for k in keys)  # SGD's
    assert {"model.attention.wq.weight", "model.attention.wk.weight"} <= set(keys)  # as the model names them


def test_torchs_state_dict_api_on_a_renaming_model_fails_the_save_naming_the_error(tmp_path):
    coord, parts = build(str(tmp_path / "run"), model_state="get_state_dict")
    coord.restore()
    with pytest.raises(Exception) as raised:
        train(coord, parts, until=2)
    coord.close()
    message = str(raised.value)
    assert "step-000000002" in message and "AttributeError" in message and "wq" in message
    assert isinstance(raised.value.__cause__, AttributeError) or "AttributeError" in repr(raised.value.__cause__)
    assert Run.open(str(tmp_path / "run")).committed_steps() == []


class HiddenContainer(torch.optim.Optimizer):
    """A container that keeps its optimizers under another name and shows an lr: its moments are
    nowhere the adapter could see them."""

    def __init__(self, model: TinyModel, *, with_lr: bool) -> None:
        self.inner = [torch.optim.AdamW(model.parameters(), lr=1e-2)]
        super().__init__(list(model.parameters()), {"lr": 1e-2} if with_lr else {})

    def step(self, closure=None) -> None:
        for opt in self.inner:
            opt.step()


def test_a_container_without_lr_is_refused_at_construction_saying_what_to_pass():
    model = TinyModel()
    with pytest.raises(UsageError, match=r"optimizers\[0\] \(HiddenContainer\): expected param groups with 'lr'.*"
                                         r"Pass the optimizers it holds"):
        NativeTorchAdapter(model, HiddenContainer(model, with_lr=False), None, OpaqueLoader())


def test_a_container_hiding_its_moments_is_refused_at_the_first_save_never_saved_without_them(tmp_path):
    torch.manual_seed(0)
    model = TinyModel()
    opt = HiddenContainer(model, with_lr=True)
    coord = Coordinator(str(tmp_path / "run"), NativeTorchAdapter(model, opt, None, OpaqueLoader()),
                        global_batch=BATCH, every=2, handle_signals=False)
    coord.restore()
    with pytest.raises(UsageError, match=r"expected its moments in its state after 2 steps, actual an empty state"):
        for inputs, labels in coord.batches():
            model(inputs["input"]).sum().backward()
            opt.step()
            coord.update()
            if coord.iteration >= 4:
                break
    coord.close()
    assert Run.open(str(tmp_path / "run")).committed_steps() == []


def test_a_loader_state_with_bytes_is_stored_and_given_back_as_bytes(tmp_path):
    run = str(tmp_path / "run")
    coord, parts = build(run)
    coord.restore()
    train(coord, parts, until=2)
    coord.close()
    coord, parts = build(run)
    coord.restore()
    assert coord.adapter.data.loaded == {"position": 2, "token_buffer": bytes([2, 0, 255])}
    coord.close()


def test_batches_without_ids_from_other_data_are_refused_by_content(tmp_path):
    run = str(tmp_path / "run")
    coord, parts = build(run)
    coord.restore()
    train(coord, parts, until=2)
    coord.close()
    coord, parts = build(run, data_seed=7)  # the same position in another data set
    with pytest.raises(ContinuityError) as raised:
        coord.restore()
    coord.close()
    assert raised.value.item == "next_batch.digest" and "carry no sample ids" in str(raised.value)


# -- a per-rank torchdata loader (torchtitan's ParallelAwareDataloader shape) -------------------


def per_rank_loader(dp_rank: int, dp_world_size: int):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    class PerRankLoader(stateful.StatefulDataLoader):
        def __init__(self, dataset, dp_rank: int, dp_world_size: int, **kwargs) -> None:
            self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
            super().__init__(dataset, **kwargs)

        def state_dict(self) -> dict:
            return {f"dp_rank_{self.dp_rank}": pickle.dumps(super().state_dict()), "world_size": self.dp_world_size}

        def load_state_dict(self, state: dict) -> None:
            raise AssertionError("resume must not call the pickle-wrapping load_state_dict")

    return PerRankLoader(list(range(40)), dp_rank, dp_world_size, batch_size=4)


def test_a_per_rank_loader_is_saved_without_its_pickle_and_loaded_on_the_same_rank():
    loader = per_rank_loader(1, 2)
    it = iter(loader)
    first = [next(it).tolist() for _ in range(3)]
    state = loader_state(loader)
    assert state["per_rank"] == {"class": "PerRankLoader", "dp_rank": 1, "dp_world_size": 2}
    assert "__bytes__" not in repr(state)  # torchdata's own state: no pickle stored
    again = per_rank_loader(1, 2)
    load_loader_state(again, state)
    assert next(iter(again)).tolist() == [12, 13, 14, 15] and first[-1] == [8, 9, 10, 11]


@pytest.mark.parametrize(("rank", "size", "item"), [(0, 1, "data.dp_world_size"), (0, 2, "data.dp_rank")])
def test_a_per_rank_loader_state_on_another_size_or_rank_is_refused_with_the_way_out(rank, size, item):
    loader = per_rank_loader(1, 2)
    next(iter(loader))
    with pytest.raises(ContinuityError) as raised:
        load_loader_state(per_rank_loader(rank, size), loader_state(loader))
    assert raised.value.item == item
    if item == "data.dp_world_size":
        assert "GlobalPositionSampler" in str(raised.value) and "PerRankLoader" in str(raised.value)
