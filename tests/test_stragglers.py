"""Stragglers (issue 25): the record rank 0 makes of every rank's iteration times, its checks when
read back, the policy that names a node to replace, and where it shows (the manifest, inspect)."""

from __future__ import annotations

import json
import os
import time

import pytest
from support.checkpoints import edit_manifest, make_manifest
from support.cli import invoke

from resume.errors import ManifestError, UsageError
from resume.manifest import Manifest
from resume.stragglers import MAX_LISTED, StragglerPolicy, check_stragglers, describe, summarize

SOURCE = "/runs/r42/step-000000007/manifest.json"


def part(median: float | None, node: str, max_s: float | None = None) -> dict:
    times = {"count": 0} if median is None else {"count": 10, "median_s": median, "max_s": max_s or median}
    return {"times": times, "node": node}


def parts_of(*rows: tuple) -> list[dict]:
    return [{**part(*row), "rank": rank} for rank, row in enumerate(rows)]


def record(*nodes: tuple[str, float], ranks: int = 8) -> dict:
    """A ``stragglers`` record whose slowest nodes are ``nodes`` (name, factor), slowest first."""
    return {"ranks": ranks, "median_s": 0.1,
            "slowest": [{"rank": 0, "node": nodes[0][0], "median_s": 0.1 * nodes[0][1], "max_s": 0.2,
                         "factor": nodes[0][1]}] if nodes else [],
            "nodes": [{"node": n, "factor": f} for n, f in nodes]}


# -- summarize ------------------------------------------------------------------------------------

def test_summary_names_the_slowest_rank_its_node_and_its_factor_over_the_median():
    parts = parts_of((0.10, "n0"), (0.10, "n0"), (0.11, "n1"), (0.20, "n1", 0.5), (0.09, "n2"))
    found = summarize(parts)
    assert found["ranks"] == 5 and found["median_s"] == 0.10
    assert found["slowest"][0] == {"rank": 3, "node": "n1", "median_s": 0.2, "max_s": 0.5, "factor": 2.0}
    assert [s["rank"] for s in found["slowest"]] == [3, 2, 0]
    assert [s["factor"] for s in found["slowest"]] == [2.0, 1.1, 1.0]


def test_summary_lists_at_most_top_ranks_and_nodes():
    parts = parts_of(*[(0.1 + 0.01 * r, f"n{r // 2}") for r in range(10)])
    found = summarize(parts, top=2)
    assert [s["rank"] for s in found["slowest"]] == [9, 8]
    assert [n["node"] for n in found["nodes"]] == ["n4", "n3"]
    assert len(summarize(parts, top=MAX_LISTED)["slowest"]) == 10


def test_a_nodes_factor_is_its_slowest_ranks_over_the_median():
    parts = parts_of((0.1, "a"), (0.1, "a"), (0.1, "b"), (0.3, "b"), (0.1, "c"), (0.12, "c"))
    found = summarize(parts)
    assert found["nodes"] == [{"node": "b", "factor": 3.0}, {"node": "c", "factor": 1.2},
                              {"node": "a", "factor": 1.0}]


def test_ranks_that_measured_nothing_are_left_out():
    parts = parts_of((None, "n0"), (0.1, "n0"), (None, "n1"), (0.3, "n1"))
    parts.append({"rank": 4, "node": "n2"})  # no times at all
    found = summarize(parts)
    assert found["ranks"] == 2 and found["median_s"] == pytest.approx(0.2)
    assert {s["rank"] for s in found["slowest"]} == {1, 3}


def test_nothing_measured_gives_no_record():
    assert summarize([]) is None
    assert summarize(parts_of((None, "n0"), (None, "n1"))) is None


@pytest.mark.parametrize("top", [0, -1, MAX_LISTED + 1, True, 2.5])
def test_a_bad_top_is_refused(top):
    with pytest.raises(UsageError, match="top"):
        summarize(parts_of((0.1, "n0")), top=top)


def test_a_summary_passes_its_own_check_and_survives_a_median_of_zero():
    found = summarize(parts_of((0.0, "n0"), (0.0, "n0"), (0.002, "n1")))
    assert check_stragglers(found, SOURCE) == found
    assert found["slowest"][0]["factor"] == 2000.0  # against the clock's resolution, not a division by 0


def test_summary_of_5120_ranks_is_cheap():
    parts = parts_of(*[(0.1 + (r % 97) * 1e-4, f"node{r // 8:04d}") for r in range(5120)])
    start = time.perf_counter()
    found = summarize(parts)
    took = time.perf_counter() - start
    assert found["ranks"] == 5120 and len(found["slowest"]) == 3 and len(found["nodes"]) == 3
    assert took < 0.5, took


# -- reading it back ------------------------------------------------------------------------------

@pytest.mark.parametrize("edit, field", [
    (lambda r: r.__setitem__("median_s", "NaN"), "stragglers.median_s"),
    (lambda r: r.__setitem__("median_s", -0.1), "stragglers.median_s"),
    (lambda r: r.__setitem__("median_s", 10 ** 400), "stragglers.median_s"),
    (lambda r: r.__setitem__("median_s", True), "stragglers.median_s"),
    (lambda r: r.__setitem__("ranks", 0), "stragglers.ranks"),
    (lambda r: r.__setitem__("ranks", "8"), "stragglers.ranks"),
    (lambda r: r.__setitem__("slowest", [r["slowest"][0]] * (MAX_LISTED + 1)), "stragglers.slowest"),
    (lambda r: r.__setitem__("nodes", {"n1": 2.0}), "stragglers.nodes"),
    (lambda r: r["slowest"].__setitem__(0, "rank 3"), "stragglers.slowest[0]"),
    (lambda r: r["slowest"][0].__setitem__("factor", "Infinity"), "stragglers.slowest[0].factor"),
    (lambda r: r["slowest"][0].__setitem__("rank", -1), "stragglers.slowest[0].rank"),
    (lambda r: r["slowest"][0].__setitem__("rank", 1.5), "stragglers.slowest[0].rank"),
    (lambda r: r["slowest"][0].pop("max_s"), "stragglers.slowest[0].max_s"),
    (lambda r: r["nodes"][0].__setitem__("node", "n1\x1b[2J"), "stragglers.nodes[0].node"),
    (lambda r: r["nodes"][0].__setitem__("node", "x" * 256), "stragglers.nodes[0].node"),
    (lambda r: r["nodes"][0].__setitem__("node", ""), "stragglers.nodes[0].node"),
    (lambda r: r["nodes"][0].__setitem__("node", ["n1"]), "stragglers.nodes[0].node"),
])
def test_a_hostile_record_is_refused_naming_the_field(edit, field):
    value = record(("n1", 1.5), ("n2", 1.1))
    edit(value)
    with pytest.raises(ManifestError) as info:
        check_stragglers(value, SOURCE)
    message = str(info.value)
    assert message.startswith(f"{SOURCE}: {field}: expected ") and ", actual " in message, message
    assert info.value.details()["field"] == field
    assert len(message) < 400


@pytest.mark.parametrize("value", ["fast", 3, [1, 2]])
def test_a_record_that_is_not_an_object_is_refused(value):
    with pytest.raises(ManifestError, match=r"stragglers: expected an object or null"):
        check_stragglers(value, SOURCE)


def test_absent_is_none_and_unknown_keys_are_dropped():
    assert check_stragglers(None, SOURCE) is None
    value = record(("n1", 1.5))
    assert check_stragglers({**value, "extra": [1] * 10}, SOURCE) == value


# -- the manifest ---------------------------------------------------------------------------------

def test_manifest_round_trips_with_and_without_the_record():
    without = make_manifest(7)
    text = without.to_json()
    assert "stragglers" not in json.loads(text)
    assert Manifest.from_json(text, source=SOURCE).stragglers is None
    measured = make_manifest(7, stragglers=summarize(parts_of((0.1, "n0"), (0.15, "n1"))))
    parsed = Manifest.from_json(measured.to_json(), source=SOURCE)
    assert parsed == measured and parsed.stragglers["nodes"][0] == {"node": "n1", "factor": 1.2}


def test_an_older_manifest_with_null_reads_as_not_measured():
    body = json.loads(make_manifest(7).to_json())
    body["stragglers"] = None
    assert Manifest.from_json(json.dumps(body), source=SOURCE).stragglers is None


def test_a_manifest_with_a_bad_record_is_refused_naming_the_file():
    body = json.loads(make_manifest(7).to_json())
    body["stragglers"] = record(("n1", 1.5))
    body["stragglers"]["nodes"][0]["factor"] = -2.0
    with pytest.raises(ManifestError, match=r"step-000000007/manifest.json: stragglers.nodes\[0\].factor"):
        Manifest.from_json(json.dumps(body), source=SOURCE)


# -- the policy -----------------------------------------------------------------------------------

def test_the_same_slowest_node_k_saves_in_a_row_is_replaced():
    policy = StragglerPolicy(factor=1.3, saves=3)
    history = [None, record(("n1", 1.5)), record(("n1", 1.4), ("n2", 1.0)), record(("n1", 2.0))]
    assert policy.decide(history) == "n1"
    assert policy.decide(history[:3]) is None  # only two in a row so far


def test_a_break_in_the_row_resets_it():
    policy = StragglerPolicy(1.3, 2)
    assert policy.decide([record(("n1", 1.5)), record(("n2", 1.5)), record(("n1", 1.5))]) is None
    assert policy.decide([record(("n1", 1.5)), None, record(("n1", 1.5))]) is None
    assert policy.decide([record(("n1", 1.5)), record(), record(("n1", 1.5))]) is None
    assert policy.decide([record(("n1", 1.5)), record(("n2", 1.5)), record(("n2", 1.5))]) == "n2"


def test_a_factor_at_or_below_the_threshold_does_not_replace():
    policy = StragglerPolicy(1.3, 2)
    assert policy.decide([record(("n1", 1.3)), record(("n1", 1.3))]) is None
    assert policy.decide([record(("n1", 1.5)), record(("n1", 1.2))]) is None
    assert policy.decide([]) is None


@pytest.mark.parametrize("factor, saves, field", [
    (1.0, 3, "factor"), (0.5, 3, "factor"), (float("nan"), 3, "factor"), (float("inf"), 3, "factor"),
    ("2", 3, "factor"), (True, 3, "factor"), (1.5, 0, "saves"), (1.5, 2.0, "saves"), (1.5, True, "saves"),
])
def test_bad_policy_settings_are_refused_naming_the_field(factor, saves, field):
    with pytest.raises(UsageError, match=f"straggler policy: {field}: expected"):
        StragglerPolicy(factor, saves)


# -- shown ----------------------------------------------------------------------------------------

def test_describe_gives_the_slowest_rank_the_median_and_the_nodes():
    found = summarize(parts_of((0.153, "n1"), (0.153, "n1"), (0.2173, "n2"), (0.15, "n0")))
    assert describe(found) == ("slowest rank 2 (node n2) x1.42 the median 0.153 s over 4 ranks; "
                               "nodes n2 x1.42, n1 x1.00, n0 x0.98")


def test_inspect_shows_the_stragglers_line_and_json(run_copy):
    measured = summarize(parts_of((0.1, "n1"), (0.142, "n2")))
    edit_manifest(os.path.join(run_copy, "step-000000004"),
                  lambda body: body.__setitem__("stragglers", measured))
    human = invoke("inspect", run_copy)
    assert human.exit_code == 0, human.output
    line = next(line for line in human.stdout.splitlines() if "stragglers" in line)
    assert line.split(None, 1)[1] == "slowest rank 1 (node n2) x1.17 the median 0.121 s over 2 ranks; " \
                                     "nodes n2 x1.17, n1 x0.83"
    shown = json.loads(invoke("inspect", run_copy, "--json").stdout)
    assert shown["stragglers"] == measured
    # A manifest without the field (written before it existed) shows no such line.
    edit_manifest(os.path.join(run_copy, "step-000000002"), lambda body: body.pop("stragglers", None))
    earlier = invoke("inspect", run_copy, "--step", "2")
    assert earlier.exit_code == 0 and "stragglers" not in earlier.stdout
