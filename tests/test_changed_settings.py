"""A setting in the code that differs from the checkpoint: refused by default, accepted on request.

One process, no process group, real DCP. Every kind of setting (the peak LR, weight decay,
betas, eps, momentum, a key of the user's own, a scheduler's configuration, a hand-set LR
schedule) is first refused with a ContinuityError that names the item and both values, with
nothing loaded and the checkpoint untouched; then accepted (``accept_changes`` or
``RESUME_ACCEPT_CHANGES``): training goes on with the code's value, and the change is recorded
in the next manifest and carried by the ones after it. A structure the checkpoint does not hold
(another number of optimizers or groups) is refused the same way and never taken for damage.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from resume.adapters.data import GlobalPositionSampler, StatefulLoader
from resume.adapters.torch_native import NativeTorchAdapter

from resume import ContinuityError, Coordinator, Run, UsageError
from resume.changes import ACCEPT_ENV
from resume.cli import cli

GLOBAL_BATCH = 4
EVERY = 2
FIRST_RUN = 4  # iterations before the restart: checkpoints at 2 and 4, restored from 4


class Points:
    """64 samples of 4 features and 2 targets, fixed by a seed."""

    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 4, generator=g)
        self.y = torch.randn(n, 2, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i]}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def weights(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.dim() == 2]


def biases(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.dim() < 2]


def two_groups(model: torch.nn.Module, no_decay_wd: float = 0.0) -> list[dict]:
    return [{"params": weights(model), "name": "decay"},
            {"params": biases(model), "name": "no_decay", "weight_decay": no_decay_wd}]


@dataclass
class Job:
    coord: Coordinator
    model: torch.nn.Module
    optimizers: list[torch.optim.Optimizer]
    schedulers: Any
    lr_at: Callable[[int], list[float]] | None = None
    """A hand-set schedule: the loop sets every group's LR from it before each step."""
    momentum_at: Callable[[int], float] | None = None
    """A hand-set momentum warm-up: the loop sets every group's momentum before each step."""
    applied: list[list[float]] = field(default_factory=list)
    """The LR of every group at each step the loop took, as the optimizer saw it."""

    def groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def train(self, until: int) -> None:
        for batch in self.coord.batches():
            done = self.coord.state.updates_successful
            if self.lr_at is not None:
                for g, lr in zip(self.groups(), self.lr_at(done), strict=True):
                    g["lr"] = lr
            if self.momentum_at is not None:
                for g in self.groups():
                    g["momentum"] = self.momentum_at(done)
            loss = torch.nn.functional.mse_loss(self.model(batch["x"]), batch["y"])
            loss.backward()
            self.applied.append([float(g["lr"]) for g in self.groups()])
            for opt in self.optimizers:
                opt.step()
            if self.lr_at is None:
                for s in self.schedulers:
                    s.step()
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
            self.coord.update(applied=True)
            if self.coord.iteration >= until:
                break


def build(run: str, optimizers: Callable[[torch.nn.Module], list], *,
          schedulers: Callable[[list], Any] = lambda opts: [], accept: Any = None,
          moving: tuple[str, ...] = (), lr_at: Callable | None = None,
          momentum_at: Callable | None = None) -> Job:
    model = make_model()
    opts = optimizers(model)
    scheds = schedulers(opts) if lr_at is None else lr_at
    sampler = GlobalPositionSampler(64, GLOBAL_BATCH, seed=3)
    adapter = NativeTorchAdapter(model, opts, scheds, StatefulLoader(Points(), sampler),
                                 moving_settings=moving)
    coord = Coordinator(run, adapter, global_batch=GLOBAL_BATCH, every=EVERY, handle_signals=False,
                        accept_changes=accept)
    return Job(coord, model, opts, scheds if lr_at is None else [], lr_at=lr_at, momentum_at=momentum_at)


def first_run(run: str, optimizers, **kw) -> dict[str, torch.Tensor]:
    """Train FIRST_RUN iterations from scratch; the trained weights."""
    job = build(run, optimizers, **kw)
    job.coord.restore()
    job.train(FIRST_RUN)
    job.coord.close()
    assert Run.open(run).committed_steps() == [2, 4]
    return {k: v.clone() for k, v in job.model.state_dict().items()}


def tree_digest(path: str) -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
    return out


def refused(run: str, optimizers, trained: dict, **kw) -> ContinuityError:
    """Restore with the code's settings: the ContinuityError, after checking that nothing was
    loaded and that the checkpoint is where it was, unchanged and committed."""
    before = tree_digest(run)
    job = build(run, optimizers, **kw)
    fresh = {k: v.clone() for k, v in job.model.state_dict().items()}
    try:
        with pytest.raises(ContinuityError) as info:
            job.coord.restore()
    finally:
        job.coord.close()
    now = job.model.state_dict()
    assert all(torch.equal(now[k], fresh[k]) for k in fresh), "weights were loaded before the refusal"
    assert any(not torch.equal(fresh[k], trained[k]) for k in fresh)  # the check above means something
    assert all(not opt.state for opt in job.optimizers), "optimizer state was loaded before the refusal"
    assert job.coord.iteration == 0
    assert not [n for n in os.listdir(run) if n.startswith("quarantine")]
    assert {k: v for k, v in tree_digest(run).items() if not k.startswith("lease")} == \
        {k: v for k, v in before.items() if not k.startswith("lease")}
    assert Run.open(run).check(FIRST_RUN).committed
    return info.value


def manifest(run: str, step: int) -> dict:
    with open(os.path.join(run, f"step-{step:09d}", "manifest.json")) as f:
        return json.load(f)


def resumed(run: str, optimizers, **kw) -> Job:
    """Restore with the opt-in; the job, restored from FIRST_RUN."""
    job = build(run, optimizers, **kw)
    job.coord.restore()
    assert job.coord.restored_from == FIRST_RUN
    return job


def train_two_more_saves(job: Job) -> None:
    job.train(FIRST_RUN + 2 * EVERY)
    job.coord.close()
    assert Run.open(job.coord.run.url).committed_steps()[-2:] == [FIRST_RUN + EVERY, FIRST_RUN + 2 * EVERY]


def assert_recorded(run: str, item: str, saved: Any, live: Any) -> None:
    """The next manifest records the change, and the one after it still carries it."""
    want = {"step": FIRST_RUN, "item": item, "from": saved, "to": live}
    for step in (FIRST_RUN + EVERY, FIRST_RUN + 2 * EVERY):
        changes = manifest(run, step)["changes"]
        assert want in changes, (step, changes)
    # The checkpoint restored from holds no record: the change happened after it.
    assert manifest(run, FIRST_RUN)["changes"] == []


@pytest.fixture(autouse=True)
def no_accepted_changes_from_outside(monkeypatch):
    monkeypatch.delenv(ACCEPT_ENV, raising=False)


# -- the peak LR ---------------------------------------------------------------------------------


def warmup_decay(update: int) -> float:
    return min(1.0, (update + 1) / 3) * 0.9 ** max(0, update - 2)


def adamw_at(peak: float):
    return lambda model: [torch.optim.AdamW(model.parameters(), lr=peak, betas=(0.9, 0.95),
                                            weight_decay=0.1)]


def lambda_lr(opts: list) -> list:
    return [torch.optim.lr_scheduler.LambdaLR(opts[0], warmup_decay)]


@pytest.mark.parametrize("name", ["initial_lr", "lr"])
def test_a_new_peak_lr_is_refused_then_accepted_and_moves_the_schedule(run_dir, name):
    trained = first_run(run_dir, adamw_at(2e-2), schedulers=lambda_lr)

    error = refused(run_dir, adamw_at(1e-2), trained, schedulers=lambda_lr)
    assert error.item == "optimizer[0].group[0].initial_lr"
    assert (error.expected, error.actual) == ("0.02", "0.01") and "AdamW" in str(error)

    job = resumed(run_dir, adamw_at(1e-2), schedulers=lambda_lr, accept=[name])
    group, sched = job.optimizers[0].param_groups[0], job.schedulers[0]
    assert group["initial_lr"] == 1e-2 and sched.base_lrs == [1e-2]
    train_two_more_saves(job)
    # From the second update on the scheduler computes from the new peak.
    assert job.applied[1:] == [[pytest.approx(1e-2 * warmup_decay(FIRST_RUN + k))] for k in range(1, 4)]
    assert_recorded(run_dir, "optimizer[0].group[0].initial_lr", 2e-2, 1e-2)
    assert_recorded(run_dir, "schedule[0].base_lrs", [2e-2], [1e-2])


def test_the_first_update_after_an_accepted_peak_applies_the_new_peak(run_dir):
    first_run(run_dir, adamw_at(2e-2), schedulers=lambda_lr)
    job = resumed(run_dir, adamw_at(1e-2), schedulers=lambda_lr, accept=["lr"])
    assert job.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-2 * warmup_decay(FIRST_RUN))
    job.train(FIRST_RUN + 1)
    job.coord.close()
    assert job.applied == [[pytest.approx(1e-2 * warmup_decay(FIRST_RUN))]]


def test_a_new_peak_without_a_scheduler_moves_the_lr_by_the_same_factor(run_dir):
    """No torch scheduler: the group's LR is the peak itself; an accepted peak sets it."""
    def plain(peak):
        return lambda model: [torch.optim.AdamW([{"params": list(model.parameters()), "initial_lr": peak}],
                                                lr=peak)]

    first_run(run_dir, plain(2e-2))
    job = resumed(run_dir, plain(1e-2), accept="initial_lr")
    assert job.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-2)
    train_two_more_saves(job)
    assert job.applied == [[pytest.approx(1e-2)]] * 4
    assert_recorded(run_dir, "optimizer[0].group[0].initial_lr", 2e-2, 1e-2)


# -- param-group settings ------------------------------------------------------------------------


def adamw_groups(*, no_decay_wd: float = 0.0, betas=(0.9, 0.95), eps: float = 1e-8):
    return lambda model: [torch.optim.AdamW(two_groups(model, no_decay_wd), lr=1e-2, betas=betas,
                                            eps=eps, weight_decay=0.1)]


def test_a_new_weight_decay_is_refused_then_accepted(run_dir):
    trained = first_run(run_dir, adamw_groups(no_decay_wd=0.0))

    error = refused(run_dir, adamw_groups(no_decay_wd=0.05), trained)
    assert error.item == "optimizer[0].group[1].weight_decay"
    assert (error.expected, error.actual) == ("0.0", "0.05")
    assert "AdamW" in str(error) and "'no_decay'" in str(error)

    job = resumed(run_dir, adamw_groups(no_decay_wd=0.05), accept=["weight_decay"])
    assert job.optimizers[0].param_groups[1]["weight_decay"] == 0.05
    assert job.optimizers[0].param_groups[0]["weight_decay"] == 0.1
    train_two_more_saves(job)
    assert_recorded(run_dir, "optimizer[0].group[1].weight_decay", 0.0, 0.05)


def test_new_betas_are_refused_then_accepted_from_the_environment(run_dir, monkeypatch):
    trained = first_run(run_dir, adamw_groups(betas=(0.9, 0.95)))

    error = refused(run_dir, adamw_groups(betas=(0.9, 0.99)), trained)
    assert error.item == "optimizer[0].group[0].betas"
    assert "0.95" in str(error) and "0.99" in str(error)
    assert "AdamW" in str(error) and "'decay'" in str(error)

    monkeypatch.setenv(ACCEPT_ENV, "betas")
    job = resumed(run_dir, adamw_groups(betas=(0.9, 0.99)))
    assert [g["betas"] for g in job.optimizers[0].param_groups] == [(0.9, 0.99)] * 2
    train_two_more_saves(job)
    for j in (0, 1):
        assert_recorded(run_dir, f"optimizer[0].group[{j}].betas", [0.9, 0.95], [0.9, 0.99])


def test_a_new_eps_is_refused_then_accepted_from_the_environment(run_dir, monkeypatch):
    trained = first_run(run_dir, adamw_groups(eps=1e-8))

    error = refused(run_dir, adamw_groups(eps=1e-6), trained)
    assert error.item == "optimizer[0].group[0].eps"
    assert (error.expected, error.actual) == ("1e-08", "1e-06")
    assert "AdamW" in str(error)

    # A full name accepts that group only: the other group's eps is still refused.
    monkeypatch.setenv(ACCEPT_ENV, "optimizer[0].group[0].eps")
    assert refused(run_dir, adamw_groups(eps=1e-6), trained).item == "optimizer[0].group[1].eps"

    monkeypatch.setenv(ACCEPT_ENV, "optimizer[0].group[0].eps, optimizer[0].group[1].eps")
    job = resumed(run_dir, adamw_groups(eps=1e-6))
    assert [g["eps"] for g in job.optimizers[0].param_groups] == [1e-6, 1e-6]
    train_two_more_saves(job)
    assert_recorded(run_dir, "optimizer[0].group[0].eps", 1e-8, 1e-6)
    assert_recorded(run_dir, "optimizer[0].group[1].eps", 1e-8, 1e-6)


def sgd_at(momentum: float):
    return lambda model: [torch.optim.SGD(model.parameters(), lr=1e-2, momentum=momentum)]


def test_a_new_sgd_momentum_is_refused_then_accepted(run_dir):
    trained = first_run(run_dir, sgd_at(0.9))

    error = refused(run_dir, sgd_at(0.8), trained)
    assert error.item == "optimizer[0].group[0].momentum"
    assert (error.expected, error.actual) == ("0.9", "0.8") and "SGD" in str(error)

    job = resumed(run_dir, sgd_at(0.8), accept=["momentum"])
    assert job.optimizers[0].param_groups[0]["momentum"] == 0.8
    train_two_more_saves(job)
    assert_recorded(run_dir, "optimizer[0].group[0].momentum", 0.9, 0.8)


def muon_and_adamw(momentum: float = 0.95):
    return lambda model: [torch.optim.Muon(weights(model), lr=1e-2, momentum=momentum),
                          torch.optim.AdamW(biases(model), lr=1e-2)]


def test_a_new_muon_momentum_is_refused_then_accepted_for_that_optimizer(run_dir, monkeypatch):
    trained = first_run(run_dir, muon_and_adamw(0.95))

    error = refused(run_dir, muon_and_adamw(0.9), trained)
    assert error.item == "optimizer[0].group[0].momentum"
    assert "0.95" in str(error) and "0.9" in str(error) and "Muon" in str(error)

    monkeypatch.setenv(ACCEPT_ENV, "optimizer[0]")
    job = resumed(run_dir, muon_and_adamw(0.9))
    assert job.optimizers[0].param_groups[0]["momentum"] == 0.9
    train_two_more_saves(job)
    assert_recorded(run_dir, "optimizer[0].group[0].momentum", 0.95, 0.9)


def layer_decay(value: float):
    return lambda model: [torch.optim.AdamW([{"params": weights(model), "name": "matrices",
                                              "layer_decay": value},
                                             {"params": biases(model), "name": "vectors"}], lr=1e-2)]


def test_a_key_of_the_users_own_in_a_group_is_a_setting_too(run_dir):
    trained = first_run(run_dir, layer_decay(0.8))

    error = refused(run_dir, layer_decay(0.9), trained)
    assert error.item == "optimizer[0].group[0].layer_decay"
    assert (error.expected, error.actual) == ("0.8", "0.9")
    assert "AdamW" in str(error) and "'matrices'" in str(error)

    job = resumed(run_dir, layer_decay(0.9), accept="layer_decay")
    assert job.optimizers[0].param_groups[0]["layer_decay"] == 0.9
    train_two_more_saves(job)
    assert_recorded(run_dir, "optimizer[0].group[0].layer_decay", 0.8, 0.9)


def warm_momentum(updates: int) -> float:
    """A hand-set momentum warm-up, 0.85 to 0.95."""
    return min(0.95, 0.85 + 0.02 * updates)


def test_a_setting_the_loop_moves_is_restored_not_compared(run_dir):
    """The code builds the optimizer with the warm-up's start; the checkpoint holds where the
    warm-up got to. Declared moving, the checkpoint's value is restored and nothing is a change."""
    first_run(run_dir, sgd_at(0.85), momentum_at=warm_momentum, moving=("momentum",))

    job = resumed(run_dir, sgd_at(0.85), momentum_at=warm_momentum, moving=("momentum",))
    assert job.optimizers[0].param_groups[0]["momentum"] == warm_momentum(FIRST_RUN - 1)
    train_two_more_saves(job)
    assert job.optimizers[0].param_groups[0]["momentum"] == warm_momentum(FIRST_RUN + 2 * EVERY - 1)
    assert manifest(run_dir, FIRST_RUN + 2 * EVERY)["changes"] == []


def test_a_hand_set_momentum_not_declared_moving_is_refused(run_dir):
    trained = first_run(run_dir, sgd_at(0.85), momentum_at=warm_momentum)

    error = refused(run_dir, sgd_at(0.85), trained, momentum_at=warm_momentum)
    assert error.item == "optimizer[0].group[0].momentum"
    assert error.expected == repr(warm_momentum(FIRST_RUN - 1)) and error.actual == "0.85"


def test_declaring_a_setting_moving_after_it_was_refused_lets_the_run_go_on(run_dir):
    """What the refusal above leads to: the user declares the warm-up's field moving."""
    first_run(run_dir, sgd_at(0.85), momentum_at=warm_momentum)
    job = build(run_dir, sgd_at(0.85), momentum_at=warm_momentum, moving=("momentum",))
    try:
        job.coord.restore()
    finally:
        job.coord.close()
    assert job.optimizers[0].param_groups[0]["momentum"] == warm_momentum(FIRST_RUN - 1)


# -- schedule settings ---------------------------------------------------------------------------


def cosine(t_max: int):
    return lambda opts: [torch.optim.lr_scheduler.CosineAnnealingLR(opts[0], T_max=t_max, eta_min=1e-4)]


def cosine_lr(t: int, t_max: int, peak: float = 1e-2, floor: float = 1e-4) -> float:
    return floor + (peak - floor) * (1 + math.cos(math.pi * t / t_max)) / 2


def test_a_scheduler_rebuilt_with_another_length_is_refused_then_accepted(run_dir):
    trained = first_run(run_dir, adamw_at(1e-2), schedulers=cosine(10))

    error = refused(run_dir, adamw_at(1e-2), trained, schedulers=cosine(20))
    assert error.item == "schedule[0].T_max"
    assert (error.expected, error.actual) == ("10", "20") and "CosineAnnealingLR" in str(error)

    job = resumed(run_dir, adamw_at(1e-2), schedulers=cosine(20), accept=["T_max"])
    assert job.schedulers[0].T_max == 20
    train_two_more_saves(job)
    assert_recorded(run_dir, "schedule[0].T_max", 10, 20)


def test_an_accepted_scheduler_length_sets_the_lr_of_the_new_schedule(run_dir):
    first_run(run_dir, adamw_at(1e-2), schedulers=cosine(10))
    job = resumed(run_dir, adamw_at(1e-2), schedulers=cosine(20), accept=["T_max"])
    train_two_more_saves(job)
    for k, lrs in enumerate(job.applied):
        assert lrs == [pytest.approx(cosine_lr(FIRST_RUN + k, 20))], k


def linear_decay_over(total: int):
    def factor(update: int) -> float:
        return max(0.0, 1 - update / total)
    return factor


def decay_over(total: int):
    return lambda opts: [torch.optim.lr_scheduler.LambdaLR(opts[0], linear_decay_over(total))]


def test_a_lambda_closing_over_another_total_is_refused_then_accepted(run_dir, monkeypatch):
    trained = first_run(run_dir, adamw_at(1e-2), schedulers=decay_over(100))

    error = refused(run_dir, adamw_at(1e-2), trained, schedulers=decay_over(200))
    assert error.item == "schedule[0].lr_lambdas"
    assert "100" in str(error.expected) and "200" in str(error.actual) and "LambdaLR" in str(error)

    monkeypatch.setenv(ACCEPT_ENV, "schedule[0].lr_lambdas")
    job = resumed(run_dir, adamw_at(1e-2), schedulers=decay_over(200))
    assert job.schedulers[0].lr_lambdas[0](50) == 0.75  # the code's lambda, not the saved one
    train_two_more_saves(job)
    change = next(c for c in manifest(run_dir, FIRST_RUN + EVERY)["changes"]
                  if c["item"] == "schedule[0].lr_lambdas")
    assert change["step"] == FIRST_RUN
    assert change["from"][0]["closure"] == [100] and change["to"][0]["closure"] == [200]
    assert change in manifest(run_dir, FIRST_RUN + 2 * EVERY)["changes"]


def test_an_accepted_lambda_sets_the_lr_of_the_new_schedule(run_dir):
    first_run(run_dir, adamw_at(1e-2), schedulers=decay_over(100))
    job = resumed(run_dir, adamw_at(1e-2), schedulers=decay_over(200), accept=["lr_lambdas"])
    job.train(FIRST_RUN + 1)
    job.coord.close()
    assert job.applied[0] == [pytest.approx(1e-2 * (1 - FIRST_RUN / 200))]


def hand_set(peak: float):
    """A speed-run trainer's schedule: the LR of every group from the count of updates."""
    def lr_at(updates: int) -> list[float]:
        return [peak * min(1.0, (updates + 1) / 3)] * 2
    return lr_at


def test_a_hand_set_schedule_with_another_peak_is_refused_then_accepted(run_dir, monkeypatch):
    trained = first_run(run_dir, adamw_groups(), lr_at=hand_set(2e-2))

    error = refused(run_dir, adamw_groups(), trained, lr_at=hand_set(1e-2))
    assert error.item == "schedule[0].lr_at"
    assert "0.02" in str(error.expected) and "0.01" in str(error.actual)

    monkeypatch.setenv(ACCEPT_ENV, "lr_at")
    job = resumed(run_dir, adamw_groups(), lr_at=hand_set(1e-2))
    train_two_more_saves(job)
    assert job.applied[0] == [pytest.approx(1e-2)] * 2  # the code's peak from the first update on
    changes = manifest(run_dir, FIRST_RUN + EVERY)["changes"]
    assert [c["item"] for c in changes] == ["schedule[0].lr_at"]
    assert changes[0]["step"] == FIRST_RUN
    assert changes[0]["from"]["closure"] == [2e-2] and changes[0]["to"]["closure"] == [1e-2]
    assert manifest(run_dir, FIRST_RUN + 2 * EVERY)["changes"] == changes


# -- changes carried over, and more of them later ---------------------------------------------------


def test_a_second_accepted_change_is_added_to_the_first(run_dir):
    first_run(run_dir, adamw_groups(no_decay_wd=0.0))
    job = resumed(run_dir, adamw_groups(no_decay_wd=0.05), accept=["weight_decay"])
    train_two_more_saves(job)
    # The next restart changes eps; the weight-decay change stays on record.
    job = build(run_dir, adamw_groups(no_decay_wd=0.05, eps=1e-6), accept=["eps"])
    job.coord.restore()
    assert job.coord.restored_from == FIRST_RUN + 2 * EVERY
    job.train(FIRST_RUN + 3 * EVERY)
    job.coord.close()
    items = [(c["step"], c["item"]) for c in manifest(run_dir, FIRST_RUN + 3 * EVERY)["changes"]]
    assert items == [(FIRST_RUN, "optimizer[0].group[1].weight_decay"),
                     (FIRST_RUN + 2 * EVERY, "optimizer[0].group[0].eps"),
                     (FIRST_RUN + 2 * EVERY, "optimizer[0].group[1].eps")]


def test_an_unchanged_restart_records_no_change_even_with_the_opt_in(run_dir):
    first_run(run_dir, adamw_groups())
    job = resumed(run_dir, adamw_groups(), accept=["weight_decay", "betas"])
    train_two_more_saves(job)
    assert manifest(run_dir, FIRST_RUN + 2 * EVERY)["changes"] == []


# -- structure -----------------------------------------------------------------------------------


def adamw_one_group(model):
    return [torch.optim.AdamW(model.parameters(), lr=1e-2)]


def adamw_two_groups(model):
    return [torch.optim.AdamW(two_groups(model), lr=1e-2)]


def assert_structure_refusal_leaves_the_run_sound(run: str) -> None:
    result = CliRunner().invoke(cli, ["verify", run])
    assert result.exit_code == 0, result.output


def test_another_number_of_param_groups_is_a_continuity_error_not_damage(run_dir):
    trained = first_run(run_dir, adamw_one_group)

    error = refused(run_dir, adamw_two_groups, trained)
    assert error.item == "optimizer[0].param_groups (AdamW)"
    assert "1 groups" in str(error) and "2 groups" in str(error)
    assert "'decay'" in str(error) and "'no_decay'" in str(error)
    assert_structure_refusal_leaves_the_run_sound(run_dir)

    # No opt-in makes another structure acceptable: it is another program.
    with pytest.raises(ContinuityError, match="param_groups"):
        job = build(run_dir, adamw_two_groups, accept=["optimizer", "optimizer[0]"])
        try:
            job.coord.restore()
        finally:
            job.coord.close()
    assert Run.open(run_dir).check(FIRST_RUN).committed


def test_other_parameters_in_a_group_are_a_continuity_error(run_dir):
    trained = first_run(run_dir, adamw_two_groups)

    def swapped(model):
        groups = two_groups(model)
        groups[0]["params"], groups[1]["params"] = groups[1]["params"], groups[0]["params"]
        return [torch.optim.AdamW(groups, lr=1e-2)]

    # Same counts would not do: the groups hold 2 parameters each, only their names differ.
    assert len(weights(make_model())) == len(biases(make_model())) == 2
    error = refused(run_dir, swapped, trained)
    assert error.item.startswith("optimizer[0] (AdamW) group[0] 'decay'")
    assert error.item.endswith(".params")
    assert_structure_refusal_leaves_the_run_sound(run_dir)


def test_an_optimizer_added_since_the_checkpoint_is_a_continuity_error(run_dir):
    trained = first_run(run_dir, adamw_one_group)

    error = refused(run_dir, muon_and_adamw(), trained)
    assert error.item == "optimizers"
    assert (error.expected, error.actual) == ("1 (AdamW)", "2 (Muon, AdamW)")
    assert_structure_refusal_leaves_the_run_sound(run_dir)


def test_another_optimizer_class_is_a_continuity_error(run_dir):
    trained = first_run(run_dir, adamw_one_group)

    error = refused(run_dir, sgd_at(0.9), trained)
    assert error.item == "optimizer[0].class"
    assert (error.expected, error.actual) == ("AdamW", "SGD")
    assert_structure_refusal_leaves_the_run_sound(run_dir)


# -- the opt-in itself ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["a b", "weight_decay;rm -rf", "optimizer[x]", "1abc", ".eps"])
def test_a_garbage_name_in_the_environment_is_a_usage_error(run_dir, monkeypatch, value):
    monkeypatch.setenv(ACCEPT_ENV, value)
    with pytest.raises(UsageError, match=ACCEPT_ENV):
        build(run_dir, adamw_one_group)
    assert not os.path.exists(run_dir)  # refused before the run was touched


def test_a_garbage_name_given_to_the_constructor_is_a_usage_error(run_dir):
    with pytest.raises(UsageError, match="accept_changes"):
        build(run_dir, adamw_one_group, accept=["weight decay"])


def test_the_environment_adds_to_the_constructor(run_dir, monkeypatch):
    monkeypatch.setenv(ACCEPT_ENV, "betas,,eps")
    job = build(run_dir, adamw_one_group, accept=["weight_decay"])
    job.coord.close()
    assert job.coord.accept.names == ("weight_decay", "betas", "eps")
