"""Real Megatron-Core on CPU for the tests: import, test-only CUDA stand-ins, tiny models.

megatron-core is an optional test dependency (README: Megatron-Core). The
tests skip without it, except in CI, where ``RESUME_REQUIRE_MEGATRON=1`` turns
a missing package into a failure.
"""

from __future__ import annotations

import os
import types
import typing

import pytest
import torch


def alias_typing_override() -> None:
    """Python 3.11 only: ``typing.override`` as ``typing_extensions.override``.

    megatron-core 0.19.2 declares Python >= 3.12 and ``megatron.training`` imports
    ``typing.override`` (new in 3.12); the rest of its code runs on 3.11, where the tests
    run (notes/megatron.md). This test-only shim stands in for the newer Python; the
    product (``resume.adapters.megatron``) patches nothing. It is applied when this module
    is imported, so every process that imports the tests' Megatron helpers
    (``support.megatron_training_run``, ``support.megatron_core_run``, spawned ranks too) has it before
    ``install()`` imports ``megatron.training``.
    """
    if not hasattr(typing, "override"):
        try:
            import typing_extensions
        except ImportError:  # then megatron-core is not installed either (its extra brings it)
            return
        typing.override = typing_extensions.override  # type: ignore[attr-defined]


alias_typing_override()


def require_megatron() -> None:
    """Import megatron.core (``megatron.training`` importable on Python 3.11 too), or skip."""
    alias_typing_override()
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        if os.environ.get("RESUME_REQUIRE_MEGATRON") == "1":
            raise
        pytest.skip(f"megatron-core not installed ({e})")


def cpu_patches() -> None:
    """Test-only stand-ins for the CUDA calls Megatron-Core makes, only when CUDA is absent.

    From notes/megatron.md: dist_checkpointing's save calls
    ``torch.cuda.synchronize()`` (strategies/filesystem_async.py, preload_tensors)
    and ``torch.cuda.current_device()`` (strategies/state_dict_saver.py, the
    failure-flag tensor); seeding and ``get_rng_state`` read the CUDA RNG
    (tensor_parallel/random.py). On CPU these become a no-op, 'cpu', and a
    CPU generator's state.
    """
    if torch.cuda.is_available():
        return
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    state = {"gen": torch.Generator()}

    def get_rng_state(device: object = None) -> torch.Tensor:
        return state["gen"].get_state()

    def set_rng_state(new_state: torch.Tensor, device: object = None) -> None:
        state["gen"].set_state(new_state)

    def manual_seed(seed: int) -> None:
        state["gen"].manual_seed(int(seed))

    torch.cuda.get_rng_state = get_rng_state
    torch.cuda.set_rng_state = set_rng_state
    torch.cuda.manual_seed = manual_seed
    torch.cuda.manual_seed_all = manual_seed
    torch.cuda.random.get_rng_state = get_rng_state
    torch.cuda.random.set_rng_state = set_rng_state


def stub_optimizer(n_groups: int = 2) -> types.SimpleNamespace:
    """What OptimizerParamScheduler needs of an optimizer: param groups (Megatron's optimizer
    itself does not build on CPU, notes/megatron.md)."""
    return types.SimpleNamespace(param_groups=[{"lr": 0.0, "weight_decay": 0.0} for _ in range(n_groups)])


def saved_manifest(save_dir: str, iteration: int) -> dict:
    """Our manifest beside Megatron's save of ``iteration``, as JSON."""
    import json

    with open(os.path.join(save_dir, f"iter_{iteration:07d}", "resume-manifest.json")) as f:
        return json.load(f)
