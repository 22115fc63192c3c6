"""Registered state (``Coordinator.register``): a loss scaler, an EMA of the weights and an object
of the program's own saved with the checkpoint, restored, compared after the load, and never
left out in silence. One process, real DCP, a real GradScaler (fp16 autocast on CPU) and a real
``AveragedModel``."""

from __future__ import annotations

import gc
import json
import logging
import os

import pytest
import torch
from resume.adapters.torch_native import NativeTorchAdapter
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from resume import ContinuityError, Coordinator, Run, UsageError


class Counter:
    """An object of the program's own: plain values and a tensor."""

    def __init__(self) -> None:
        self.seen, self.name, self.hist = 0, "tokens", torch.zeros(3)

    def state_dict(self) -> dict:
        return {"seen": self.seen, "name": self.name, "hist": self.hist, "pair": (1, 2.5)}

    def load_state_dict(self, state: dict) -> None:
        self.seen, self.name = state["seen"], state["name"]
        self.hist.copy_(state["hist"])
        assert state["pair"] == (1, 2.5)


class HalvingScaler(torch.amp.GradScaler):
    """A scaler whose load does not give back the scale saved (as a program that resets it)."""

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict({**state_dict, "scale": state_dict["scale"] / 2})


class Job:
    def __init__(self, run: str, *, register=("scaler", "ema", "counter"), scaler_cls=torch.amp.GradScaler,
                 accept=None) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scaler = scaler_cls("cpu", init_scale=2.0**10, growth_interval=2)
        self.ema = AveragedModel(self.model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        self.counter = Counter()
        self.coord = Coordinator(run, NativeTorchAdapter(self.model, self.opt), global_batch=4, every=0,
                                 handle_signals=False, lease_ttl_s=None, accept_changes=accept)
        for name in register:
            self.coord.register(name, getattr(self, name))

    def train(self, updates: int, *, overflow: set[int] = frozenset()) -> None:
        g = torch.Generator().manual_seed(100 + self.coord.iteration)
        for _ in range(updates):
            x = torch.randn(4, 8, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = self.model(x).float().pow(2).mean()
            if self.coord.iteration + 1 in overflow:
                loss = loss * float("inf")
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.opt)
            before = self.scaler.get_scale()
            self.scaler.step(self.opt)
            self.scaler.update()
            self.opt.zero_grad(set_to_none=True)
            applied = self.scaler.get_scale() >= before
            if applied:
                self.ema.update_parameters(self.model)
            self.counter.seen += 4
            self.counter.hist[self.coord.iteration % 3] += 1
            self.coord.update(applied=applied)

    def state(self) -> dict:
        return {"scaler": self.scaler.state_dict(), "counter": (self.counter.seen, self.counter.hist.tolist()),
                "ema": {k: v.clone() for k, v in self.ema.state_dict().items()},
                "model": {k: v.clone() for k, v in self.model.state_dict().items()}}


def same(a: dict, b: dict) -> bool:
    return (a["scaler"] == b["scaler"] and a["counter"] == b["counter"]
            and all(torch.equal(a[k][n], b[k][n]) for k in ("ema", "model") for n in a[k]))


@pytest.fixture
def saved(run_dir):
    job = Job(run_dir)
    job.coord.restore()
    job.train(5, overflow={3})
    job.coord.save()
    state = job.state()
    job.train(3)  # beyond the checkpoint: what a restart must do again
    state["after"] = job.state()
    job.coord.close()
    assert state["scaler"]["scale"] != 2.0**10 and int(state["ema"]["n_averaged"]) == 4
    return run_dir, state


def test_registered_objects_come_back_as_saved(saved):
    run, state = saved
    job = Job(run)
    job.coord.restore()
    assert job.coord.restored_from == 5
    assert same(job.state(), state)
    # Training goes on from there exactly as it did without the restart.
    job.train(3)
    assert same(job.state(), state["after"])


def test_inspect_and_the_manifest_show_the_registered_objects(saved):
    run, state = saved
    manifest = Run.open(run).read_manifest(5)
    shown = manifest.expectation["state_shown"]
    assert shown["scaler"] == {"kind": "torch.amp.grad_scaler.GradScaler",
                               "values": {"scale": state["scaler"]["scale"],
                                          "growth_tracker": state["scaler"]["_growth_tracker"]}}
    assert shown["ema"]["values"]["n_averaged"] == 4
    assert shown["counter"] == {"kind": "Counter", "values": {"seen": 20, "name": "tokens"}}
    from support.cli import resume

    out = resume("inspect", run, "--step", "5")
    assert out.returncode == 0, out.stderr
    assert "scaler" in out.stdout and f"scale {state['scaler']['scale']:g}" in out.stdout
    assert "n_averaged 4" in out.stdout


def test_a_name_saved_and_not_registered_at_restore_is_refused(saved):
    run, _ = saved
    job = Job(run, register=("scaler", "counter"))
    with pytest.raises(ContinuityError, match=r"state\.ema: expected registered.*actual not registered"):
        job.coord.restore()


def test_a_name_registered_and_not_saved_is_refused(run_dir):
    job = Job(run_dir, register=("scaler",))
    job.coord.restore()
    job.train(2)
    job.coord.save()
    job.coord.close()
    later = Job(run_dir, register=("scaler", "ema"))
    with pytest.raises(ContinuityError, match=r"state\.ema: expected in the checkpoint.*actual not saved"):
        later.coord.restore()


def test_a_state_the_load_does_not_give_back_is_refused_or_accepted(saved):
    run, state = saved
    job = Job(run, scaler_cls=HalvingScaler)
    with pytest.raises(ContinuityError) as refused:
        job.coord.restore()
    assert refused.value.item == "state.scaler.scale"
    assert (refused.value.expected, refused.value.actual) == (state["scaler"]["scale"], state["scaler"]["scale"] / 2)
    assert "accept_changes=['state.scaler']" in str(refused.value)

    job = Job(run, scaler_cls=HalvingScaler, accept=["state.scaler"])
    job.coord.restore()
    assert job.scaler.get_scale() == state["scaler"]["scale"] / 2
    job.train(1)
    job.coord.save()
    changes = Run.open(run).read_manifest(6).changes
    assert {"step": 5, "item": "state.scaler", "from": state["scaler"]["scale"],
            "to": state["scaler"]["scale"] / 2} in changes


def test_the_first_save_names_a_scaler_and_an_ema_nothing_registered(run_dir, caplog):
    gc.collect()  # what earlier tests left is not in use
    job = Job(run_dir, register=("counter",))
    job.coord.restore()
    job.train(2)
    with caplog.at_level(logging.WARNING, logger="resume"):
        job.coord.save()
        job.train(1)
        job.coord.save()
    lines = [r.getMessage() for r in caplog.records if "is not in the checkpoint" in r.getMessage()]
    assert len(lines) == 2, lines  # once each, at the first save only
    assert any("GradScaler" in line and "coord.register('scaler'" in line for line in lines)
    assert any("AveragedModel" in line and "coord.register('ema'" in line for line in lines)
    job.coord.close()
    del job
    gc.collect()
    registered = Job(run_dir + "-2")
    registered.coord.restore()
    registered.train(1)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="resume"):
        registered.coord.save()
    assert "is not in the checkpoint" not in caplog.text


@pytest.mark.parametrize(("name", "obj", "needle"), [
    ("1st", Counter(), "name: expected letters"),
    ("a.b", Counter(), "name: expected letters"),
    ("x", object(), "expected an object with state_dict"),
], ids=["digit-first", "dot", "no-state-dict"])
def test_register_refuses_what_it_cannot_save(run_dir, name, obj, needle):
    job = Job(run_dir, register=())
    with pytest.raises(UsageError, match=needle):
        job.coord.register(name, obj)


def test_register_refuses_a_second_name_and_a_late_call(run_dir):
    job = Job(run_dir, register=("counter",))
    with pytest.raises(UsageError, match="not registered yet"):
        job.coord.register("counter", Counter())

    class Opaque:
        def state_dict(self) -> dict:
            return {"f": len}

        def load_state_dict(self, state: dict) -> None: ...
    with pytest.raises(UsageError, match=r"register\('o'\).*plain values"):
        job.coord.register("o", Opaque())
    job.coord.restore()
    with pytest.raises(UsageError, match="before coord.restore"):
        job.coord.register("ema", job.ema)


def test_registered_tensors_go_to_the_shards_and_the_rest_to_json(saved):
    run, _ = saved
    step = os.path.join(run, "step-000000005")
    with open(os.path.join(step, "rank-00000.json")) as f:
        registered = json.load(f)["adapter"]["registered"]
    assert registered["counter"]["data"]["seen"] == 20
    assert registered["counter"]["data"]["hist"] == {"__shard__": "hist"}
    assert registered["ema"]["data"]["n_averaged"] == {"__shard__": "n_averaged"}
    from resume.adapters.dcp.unpickle import restricted_load_metadata

    with open(os.path.join(step, ".metadata"), "rb") as f:
        keys = set(restricted_load_metadata(f.read(), source=".metadata").state_dict_metadata)
    assert {"state.counter.hist", "state.ema.n_averaged", "state.ema.module.0.weight"} <= keys
