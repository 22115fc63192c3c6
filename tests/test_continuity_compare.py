"""The continuity check's comparison: the merged next batch, and the Expectation a restart is held to
(what differs is named, with the expected and actual values; a resize compares what it keeps)."""

from __future__ import annotations

import copy
import json

import pytest

from resume.continuity import Expectation, compare, compare_config, merge_batch_descriptions
from resume.errors import ContinuityError, ManifestError

A, B, C, D = (0, "d0"), (1, "d1"), (2, "d2"), (3, "d3")


def test_merged_batch_is_independent_of_how_pairs_are_split_across_ranks():
    two_ranks = merge_batch_descriptions([[A, B], [C, D]])
    four_ranks_shuffled = merge_batch_descriptions([[C], [A], [D], [B]])
    uneven = merge_batch_descriptions([[D, A], [], [C, B]])
    assert two_ranks == four_ranks_shuffled == uneven
    assert two_ranks["ids"] == [0, 1, 2, 3]
    assert two_ranks["samples"] == 4


def test_merged_batch_digest_depends_on_content():
    same_ids_other_content = merge_batch_descriptions([[A, B], [C, (3, "changed")]])
    original = merge_batch_descriptions([[A, B], [C, D]])
    assert same_ids_other_content["ids"] == original["ids"]
    assert same_ids_other_content["digest"] != original["digest"]


def test_merged_batch_of_nothing_is_none():
    assert merge_batch_descriptions([[], []]) is None


def fp(replicated: int = 0, sharded: int = 0, numel: int = 10) -> dict:
    """A moment fingerprint: bit sums of plain (replicated) and DTensor (sharded) moments."""
    return {"replicated": {"bits": {"exp_avg": replicated} if replicated else {}, "numel": numel if replicated else 0},
            "sharded": {"bits": {"exp_avg": sharded} if sharded else {}, "numel": numel if sharded else 0}}


def expectation() -> Expectation:
    return Expectation(
        next_batch=merge_batch_descriptions([[A, B], [C, D]]),
        lr_ahead=[[1e-4, 1e-5], [2e-4, 2e-5], [3e-4, 3e-5]],
        schedule=[{"kind": "cosine", "warmup": 10, "total": 1000, "peak": 3e-4}],
        optimizer_steps=[7],
        optimizer=[[fp(replicated=0xAAAA, sharded=0x1111)], [fp(replicated=0xAAAA, sharded=0x2222)]],
        rng=["r0", "r1"],
        world_size=2,
    )


def changed(mutate) -> Expectation:
    e = copy.deepcopy(expectation())
    mutate(e)
    return e


def _bump_ids(e):
    e.next_batch = merge_batch_descriptions([[B, C], [D, (4, "d4")]])


def _bump_digest(e):
    e.next_batch = dict(e.next_batch, digest="0" * 16)


CASES = {
    "schedule[0].total": lambda e: e.schedule[0].update(total=2000),
    "optimizer.steps": lambda e: setattr(e, "optimizer_steps", [8]),
    "optimizer[0].moments (rank 0, replicated)": lambda e: e.optimizer[0][0]["replicated"]["bits"].update(
        exp_avg=0xBBBB),
    "lr_ahead[+1]": lambda e: e.lr_ahead[1].__setitem__(1, 9e-9),
    "rng (rank 1)": lambda e: e.rng.__setitem__(1, "reseeded"),
    "next_batch.ids": _bump_ids,
    "next_batch.digest": _bump_digest,
}


def test_identical_expectations_compare_equal():
    compare(expectation(), expectation())
    compare(expectation(), expectation(), resized=True)


@pytest.mark.parametrize("item", list(CASES))
def test_compare_names_the_item_that_differs(item):
    actual = changed(CASES[item])
    with pytest.raises(ContinuityError) as info:
        compare(expectation(), actual)
    err = info.value
    assert err.item == item
    assert item in str(err)
    assert err.expected != err.actual


def test_compare_reports_expected_and_actual_values():
    with pytest.raises(ContinuityError) as info:
        compare(expectation(), changed(CASES["optimizer.steps"]))
    assert info.value.expected == [7] and info.value.actual == [8]
    assert "expected [7], actual [8]" in str(info.value)


def test_zeroed_moments_hint_at_reinitialised_optimizer():
    actual = changed(lambda e: e.optimizer[1][0]["sharded"]["bits"].update(exp_avg=0))
    with pytest.raises(ContinuityError) as info:
        compare(expectation(), actual)
    assert info.value.item == "optimizer[0].moments (rank 1, sharded)"
    assert "re-initialised" in str(info.value)


def test_shorter_lr_ahead_names_the_first_missing_update():
    actual = changed(lambda e: e.lr_ahead.pop())
    with pytest.raises(ContinuityError) as info:
        compare(expectation(), actual)
    assert info.value.item == "lr_ahead[+2]"
    assert info.value.actual is None


def test_missing_scheduler_names_schedule():
    with pytest.raises(ContinuityError) as info:
        compare(expectation(), changed(lambda e: e.schedule.clear()))
    assert info.value.item == "schedule"


def test_end_of_data_versus_a_batch_names_next_batch():
    with pytest.raises(ContinuityError) as info:
        compare(expectation(), changed(lambda e: setattr(e, "next_batch", None)))
    assert info.value.item == "next_batch"


def test_resized_compare_ignores_rng_and_per_rank_moments():
    def resize(e):
        # The sharded sums 0x1111 + 0x2222 spread over 4 ranks; the replicated one on each.
        e.rng = ["x0", "x1", "x2", "x3"]
        e.optimizer = [[fp(replicated=0xAAAA, sharded=s, numel=5)] for s in (0x1000, 0x0111, 0x2000, 0x0222)]
        for r in e.optimizer:
            r[0]["replicated"]["numel"] = 10
        e.world_size = 4

    actual = changed(resize)
    compare(expectation(), actual, resized=True)
    with pytest.raises(ContinuityError):
        compare(expectation(), actual, resized=False)


@pytest.mark.parametrize("item", ["schedule[0].total", "optimizer.steps", "lr_ahead[+1]",
                                  "next_batch.ids", "next_batch.digest"])
def test_resized_compare_still_checks_what_a_resize_keeps(item):
    with pytest.raises(ContinuityError) as info:
        compare(expectation(), changed(CASES[item]), resized=True)
    assert info.value.item == item


def test_expectation_round_trips_through_dict_and_requires_core_fields():
    e = expectation()
    assert Expectation.from_dict(json.loads(json.dumps(e.to_dict())), source="m.json") == e
    with pytest.raises(ManifestError, match="m.json: expectation"):
        Expectation.from_dict({"next_batch": None}, source="m.json")
    with pytest.raises(ManifestError, match="expected an object"):
        Expectation.from_dict([], source="m.json")


def test_compare_config_names_the_key():
    compare_config({"seed": 1, "global_batch": 4}, {"global_batch": 4, "seed": 1})
    with pytest.raises(ContinuityError) as info:
        compare_config({"seed": 1, "global_batch": 4}, {"seed": 2, "global_batch": 4})
    assert info.value.item == "config.seed"


def test_resize_still_catches_moments_that_were_not_loaded():
    from resume.continuity import Expectation, compare

    def exp(sums):
        return Expectation(next_batch=None, lr_ahead=[[0.1], [0.1]], optimizer_steps=[3],
                           optimizer=[[fp(sharded=a, numel=4 * 2 // len(sums))] for a in sums])

    compare(exp([1, 2]), exp([3]), resized=True)  # reshaped, the same total: fine
    with pytest.raises(ContinuityError, match=r"optimizer\[0\]\.moments.*re-initialised"):
        compare(exp([1, 2]), exp([0]), resized=True)


def test_moment_sums_wrap_and_do_not_depend_on_sharding():
    import torch
    from resume.adapters.torch.fingerprint import bits_view

    values = torch.randn(1000)
    whole, acc = bits_view(values)
    total = int(whole.sum(dtype=acc)) & 0xFFFFFFFF
    for cut in (1, 333, 999):
        parts = [int(bits_view(p)[0].sum(dtype=acc)) & 0xFFFFFFFF for p in (values[:cut], values[cut:])]
        assert (parts[0] + parts[1]) & 0xFFFFFFFF == total
    assert int(bits_view(torch.zeros(10))[0].sum(dtype=acc)) == 0


def test_end_of_data_at_save_does_not_constrain_the_next_pass():
    from resume.continuity import Expectation, compare

    saved = Expectation(next_batch=None, lr_ahead=[[0.1], [0.1]])
    now = Expectation(next_batch={"ids": [0], "digest": "d", "samples": 1}, lr_ahead=[[0.1], [0.1]])
    compare(saved, now)
    with pytest.raises(ContinuityError, match="next_batch"):
        compare(now, saved)


def test_ranks_that_describe_the_same_batch_are_replicas_counted_once():
    """TP and PP peers of one data-parallel rank read the same samples: their batch counts once."""
    dp0, dp1 = [A, B], [C, D]
    tp2 = merge_batch_descriptions([dp0, dp0, dp1, dp1])
    assert tp2["ids"] == [0, 1, 2, 3] and tp2["samples"] == 4 and tp2["replicas"] == 2
    plain = merge_batch_descriptions([dp0, dp1])
    assert tp2["digest"] == plain["digest"] and "replicas" not in plain
    # A sample two data-parallel ranks both read (a sampler's padding) still counts twice.
    padded = merge_batch_descriptions([[A, B], [C, A]])
    assert padded["ids"] == [0, 0, 1, 2] and "replicas" not in padded
    # Lists as they come back from JSON or a pickle are the same pairs.
    assert merge_batch_descriptions([[list(A), list(B)], [A, B], [C, D]])["ids"] == [0, 1, 2, 3]


def _parts(batches: list[list[tuple[int, str]]]) -> list[dict]:
    return [{"batch": b, "lr_ahead": [[1e-4]], "lr_groups": [], "structure": [], "schedule": [],
             "optimizer_steps": [1], "optimizer": [], "rng": f"r{i}"} for i, b in enumerate(batches)]


def test_a_manifest_written_before_replicas_were_folded_still_restarts():
    """A manifest of a run with replicas, written before folding, records every rank's pairs;
    the restart compares its next batch the same way, and a changed batch is still refused."""
    replicated = [[A, B], [A, B], [C, D], [C, D]]
    saved = Expectation.assemble(_parts(replicated), world_size=4)
    assert saved.next_batch["ids"] == [0, 1, 2, 3]
    older = Expectation.from_dict(json.loads(json.dumps(saved.to_dict())), source="manifest.json")
    older.next_batch = merge_batch_descriptions(replicated, replicas=False)
    assert older.next_batch["ids"] == [0, 0, 1, 1, 2, 2, 3, 3] and "replicas" not in older.next_batch
    after = Expectation.assemble(_parts(replicated), world_size=4, to_compare=True)
    compare(saved, after)
    compare(older, after)
    moved = Expectation.assemble(_parts([[B, C], [B, C], [D, (4, "d4")], [D, (4, "d4")]]), world_size=4,
                                 to_compare=True)
    for expected in (saved, older):
        with pytest.raises(ContinuityError, match="next_batch.ids"):
            compare(expected, moved)
    assert "before_replicas" not in saved.to_dict()
