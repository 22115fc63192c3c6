"""The counters (TrainState): how an update advances them, their invariants, their JSON form."""

from __future__ import annotations

import json

import pytest

from resume.errors import InvariantError, ManifestError
from resume.state import TrainState

REQUIRED = {"iteration": 3, "samples_read": 12, "updates_successful": 2, "updates_skipped": 1}


def test_advance_counts_applied_update_as_successful():
    state = TrainState()
    state.advance(applied=True, samples=4, tokens=32, tokens_in_loss=30)
    assert (state.iteration, state.samples_read, state.updates_successful, state.updates_skipped) == (1, 4, 1, 0)
    assert state.tokens_read == 32 and state.tokens_in_loss == 30


def test_advance_counts_skipped_update_and_its_samples_as_read():
    state = TrainState()
    state.advance(applied=True, samples=4)
    state.advance(applied=False, samples=4)
    assert (state.iteration, state.samples_read, state.updates_successful, state.updates_skipped) == (2, 8, 1, 1)
    assert state.tokens_read is None and state.tokens_in_loss is None
    state.check_invariants(global_batch=4)


def test_consistent_counters_pass_the_invariants():
    TrainState(**REQUIRED).check_invariants(global_batch=4)
    TrainState().check_invariants(global_batch=1920)


def test_iteration_not_equal_to_successful_plus_skipped_names_iteration():
    state = TrainState(iteration=5, samples_read=20, updates_successful=3, updates_skipped=1)
    with pytest.raises(InvariantError) as info:
        state.check_invariants(where="step-000000005/manifest.json")
    message = str(info.value)
    assert "iteration" in message and "= 4" in message and "actual 5" in message
    assert "step-000000005/manifest.json" in message


def test_samples_read_not_iteration_times_global_batch_names_samples_read():
    state = TrainState(iteration=3, samples_read=11, updates_successful=3, updates_skipped=0)
    state.check_invariants()  # no global batch: nothing to say about samples
    with pytest.raises(InvariantError) as info:
        state.check_invariants(global_batch=4)
    message = str(info.value)
    assert "samples_read" in message and "12" in message and "actual 11" in message


def test_negative_counter_is_an_invariant_error():
    with pytest.raises(InvariantError, match="updates_skipped"):
        TrainState(iteration=0, samples_read=0, updates_successful=1, updates_skipped=-1).check_invariants()


def test_train_state_round_trips_through_dict():
    state = TrainState(**REQUIRED, tokens_read=100)
    assert TrainState.from_dict(json.loads(json.dumps(state.to_dict()))) == state


@pytest.mark.parametrize("missing", sorted(REQUIRED))
def test_from_dict_rejects_missing_counter(missing):
    data = {k: v for k, v in REQUIRED.items() if k != missing}
    with pytest.raises(ManifestError) as info:
        TrainState.from_dict(data, source="m.json")
    assert f"m.json: train_state.{missing}" in str(info.value) and "missing" in str(info.value)


def test_from_dict_rejects_unknown_field():
    with pytest.raises(ManifestError, match=r"unknown fields \['consumed'\]"):
        TrainState.from_dict({**REQUIRED, "consumed": 1}, source="m.json")


@pytest.mark.parametrize("value", ["3", 3.0, True, [3]], ids=["str", "float", "bool", "list"])
def test_from_dict_rejects_non_integer_counter(value):
    with pytest.raises(ManifestError, match=r"train_state\.iteration: expected a non-negative integer"):
        TrainState.from_dict({**REQUIRED, "iteration": value}, source="m.json")


def test_from_dict_rejects_non_object():
    with pytest.raises(ManifestError, match="train_state: expected an object, actual list"):
        TrainState.from_dict([1, 2], source="m.json")


def test_from_dict_rejects_null_required_counter():
    with pytest.raises(ManifestError, match=r"train_state\.iteration"):
        TrainState.from_dict({**REQUIRED, "iteration": None}, source="m.json")


def test_from_dict_accepts_null_optional_token_counters():
    state = TrainState.from_dict({**REQUIRED, "tokens_read": None, "tokens_in_loss": None})
    assert state.tokens_read is None and state.tokens_in_loss is None
