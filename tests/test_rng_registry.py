"""The RNG registry: every generator captured to plain JSON and replayed exactly."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from resume.rng import RngRegistry


@pytest.fixture
def generators():
    """Registered user generators plus the process-global ones, seeded."""
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    user = {
        "torch": torch.Generator().manual_seed(4),
        "numpy": np.random.default_rng(5),
        "python": random.Random(6),
    }
    registry = RngRegistry()
    for name, gen in user.items():
        registry.register(name, gen)
    return registry, user


def draw_everything(user) -> dict:
    return {
        "python": [random.random() for _ in range(3)] + [random.gauss(0, 1)],
        "numpy": np.random.rand(3).tolist() + [float(np.random.standard_normal())],
        "torch": torch.rand(3).tolist() + torch.randn(1).tolist(),
        "user.torch": torch.rand(3, generator=user["torch"]).tolist(),
        "user.numpy": user["numpy"].random(3).tolist(),
        "user.python": [user["python"].random() for _ in range(3)],
    }


def test_restore_replays_every_generator(generators):
    registry, user = generators
    state = registry.capture()
    first = draw_everything(user)
    registry.restore(state)
    assert draw_everything(user) == first


def test_restore_replays_cached_gaussians(generators):
    # Python's and numpy's legacy gauss keep a cached second value: it is part of the state.
    registry, user = generators
    random.gauss(0, 1)
    np.random.standard_normal()
    state = registry.capture()
    first = draw_everything(user)
    registry.restore(state)
    assert draw_everything(user) == first


def test_state_is_plain_json_and_restores_after_a_round_trip(generators):
    registry, user = generators
    state = registry.capture()
    text = json.dumps(state, allow_nan=False)
    first = draw_everything(user)
    registry.restore(json.loads(text))
    assert draw_everything(user) == first
    assert set(state) >= {"python", "numpy", "torch", "user"}
    assert set(state["user"]) == {"torch", "numpy", "python"}


def test_digest_is_stable_without_draws(generators):
    registry, _ = generators
    assert RngRegistry.digest(registry.capture()) == RngRegistry.digest(registry.capture())


@pytest.mark.parametrize("which", ["python", "numpy", "torch", "user.torch", "user.numpy", "user.python"])
def test_digest_changes_when_any_generator_advances(generators, which):
    registry, user = generators
    before = RngRegistry.digest(registry.capture())
    advance = {
        "python": lambda: random.random(),
        "numpy": lambda: np.random.rand(),
        "torch": lambda: torch.rand(1),
        "user.torch": lambda: torch.rand(1, generator=user["torch"]),
        "user.numpy": lambda: user["numpy"].random(),
        "user.python": lambda: user["python"].random(),
    }[which]
    advance()
    assert RngRegistry.digest(registry.capture()) != before


@pytest.mark.parametrize("gen", [object(), np.random.RandomState(0), 42],
                         ids=["object", "numpy.RandomState", "int"])
def test_registering_an_unsupported_generator_raises_type_error(gen):
    registry = RngRegistry()
    with pytest.raises(TypeError, match="cannot capture"):
        registry.register("bad", gen)
    assert "bad" not in registry.capture()["user"]


@pytest.mark.parametrize("bit_generator", [np.random.MT19937, np.random.Philox, np.random.SFC64])
def test_numpy_generator_with_any_bit_generator_captures_to_json(bit_generator):
    gen = np.random.Generator(bit_generator(7))
    registry = RngRegistry()
    registry.register("data", gen)
    state = json.loads(json.dumps(registry.capture()))
    first = gen.random(3).tolist()
    registry.restore(state)
    assert gen.random(3).tolist() == first


def test_registering_system_random_raises_type_error():
    with pytest.raises(TypeError):
        RngRegistry().register("os", random.SystemRandom())


def test_restore_without_state_for_a_registered_generator_raises(generators):
    registry, _ = generators
    state = registry.capture()
    del state["user"]["numpy"]
    with pytest.raises(KeyError, match="numpy"):
        registry.restore(state)
