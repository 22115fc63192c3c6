"""Hangs in the plan (issue 25): `resume simulate` draws hangs beside the failures, charges each
its detection time, the work since the last checkpoint and a restart, and says so."""

from __future__ import annotations

import importlib
import json

import pytest
from resume.cluster import reference
from resume.cluster.reference import figures, simulate_defaults
from resume.cluster.simulate import (
    ASSUMED_HANGS_PER_NODE_DAY,
    HANG_RATE_SOURCE,
    Assumptions,
    Interruption,
    best_interval,
    failure_times,
    simulate,
)
from support.cli import assert_one_line_error, invoke, resume

from resume import UsageError

FIXED = {"stall_s": 2.0, "restart_spare_s": 600.0, "restart_requeue_s": 1500.0}
"""Times given, not the reference figures: the recorded results below must not move when a
measured figure does."""

# simulate(Assumptions(**FIXED, seed=7, **kwargs), 1500.0) before hangs were modelled (the commit
# before issue 25): goodput, failures, failures_without_spare, work_lost_s, restart_s,
# stall_total_s, wall_s. Floats as repr() wrote them: a zero hang rate must give them exactly.
BEFORE_HANGS = [
    ({}, (0.8321509388690057, 247, 247, 148432.74088386196, 145590.6561525153, 9922.59183713235,
          7776000.0)),
    ({"spares": 4, "no_spare": "requeue"},
     (0.9418890684569428, 247, 140, 174498.43189635722, 267607.57994532364, 9764.59183713235, 7776000.0)),
    ({"distribution": "weibull", "spares": 2, "days": 30},
     (0.862260460999353, 78, 61, 46405.522115111264, 46264.67314689793, 3318.0, 2592000.0)),
]


def _fields(r) -> tuple:
    return (r.goodput, r.failures, r.failures_without_spare, r.work_lost_s, r.restart_s, r.stall_total_s,
            r.wall_s)


@pytest.mark.parametrize("kwargs, before", BEFORE_HANGS)
def test_a_zero_hang_rate_gives_exactly_the_results_from_before_hangs(kwargs, before):
    r = simulate(Assumptions(**FIXED, seed=7, hang_rate_per_node_day=0, **kwargs), 1500.0)
    assert _fields(r) == before
    assert (r.hangs, r.hang_detect_total_s) == (0, 0.0)


def test_a_zero_hang_rate_searches_the_interval_exactly_as_before():
    a = Assumptions(**FIXED, seed=3, days=30, hang_rate_per_node_day=0)
    best, yd = best_interval(a, replications=4)
    assert (best.interval_s, best.goodput, best.work_lost_s, best.restart_s, best.stall_total_s) == (
        377.5302229125643, 0.8537303049780527, 11861.353475087955, 46497.70530411256, 13339.46630421037)
    assert yd == 377.5302229125643 and a.interruption_mtbf_s == a.system_mtbf_s


def test_hangs_leave_the_failures_as_they_were():
    without = failure_times(Assumptions(hang_rate_per_node_day=0, spares=0))
    both = failure_times(Assumptions(hang_rate_per_node_day=0.01, spares=0))
    assert [e.t for e in both if not e.hang] == [e.t for e in without]
    assert sum(e.hang for e in both) > 0


def test_hangs_match_the_assumed_rate():
    a = Assumptions(days=900, hang_rate_per_node_day=0.002)
    hangs = sum(e.hang for e in failure_times(a))
    assert abs(hangs / (a.days * a.nodes * a.hang_rate_per_node_day) - 1) < 0.1


def test_a_higher_hang_rate_costs_goodput():
    rates = [0.0, ASSUMED_HANGS_PER_NODE_DAY, 0.01]
    runs = [simulate(Assumptions(**FIXED, hang_rate_per_node_day=rate), 1500.0) for rate in rates]
    assert runs[0].goodput > runs[1].goodput > runs[2].goodput
    assert runs[0].hangs < runs[1].hangs < runs[2].hangs
    assert runs[0].failures == runs[1].failures == runs[2].failures


def test_a_longer_hang_detection_costs_goodput_and_is_counted():
    short, long = (simulate(Assumptions(**FIXED, hang_rate_per_node_day=0.005, hang_detect_s=s), 1500.0)
                   for s in (60.0, 1800.0))
    assert short.hangs == long.hangs > 0
    assert long.goodput < short.goodput
    assert long.hang_detect_total_s > short.hang_detect_total_s > 0
    # Each hang is detected once (one that falls into another's detection adds nothing).
    assert long.hang_detect_total_s <= long.hangs * 1800.0


def test_a_hang_costs_its_detection_the_work_since_the_checkpoint_and_a_restart():
    a = Assumptions(**FIXED, nodes=8, node_mtbf_s=1e12, hang_rate_per_node_day=1e-9, days=1)
    hang_at = 10_000.0
    run = simulate(a, 1000.0, [Interruption(hang_at, has_spare=False, hang=True)])
    cycle = 1000.0 + a.stall_s
    lost = hang_at - cycle * (hang_at // cycle)
    assert run.hangs == 1 and run.failures == 0 and run.failures_without_spare == 0
    assert run.work_lost_s == pytest.approx(lost)
    assert run.hang_detect_total_s == a.hang_detect_s
    assert run.restart_s == a.restart_spare_s  # no spare free: the same nodes, no requeue, no shrink
    idle = lost + a.hang_detect_s + a.restart_spare_s
    assert run.goodput == pytest.approx((a.days * 86400 - idle - run.stall_total_s) / (a.days * 86400))


def test_a_crash_during_a_hang_ends_its_detection():
    a = Assumptions(**FIXED, nodes=8, node_mtbf_s=1e12, hang_rate_per_node_day=1e-9, days=1)
    hang, crash = Interruption(10_000.0, has_spare=True, hang=True), Interruption(10_100.0, has_spare=True)
    run = simulate(a, 1000.0, [hang, crash])
    assert run.hang_detect_total_s == pytest.approx(100.0)
    assert run.restart_s == pytest.approx(a.restart_spare_s)
    assert run.hangs == 1 and run.failures == 1


def test_a_hung_node_takes_a_free_spare_and_goes_to_repair():
    a = Assumptions(nodes=64, spares=1, node_mtbf_s=1e12, hang_rate_per_node_day=0.5, days=2,
                    repair_s=10 * 86400)
    events = failure_times(a)
    assert all(e.hang for e in events) and len(events) > 2
    assert [e.has_spare for e in events[:2]] == [True, False]  # the first took the spare, repaired later


@pytest.mark.parametrize("field, value", [("hang_rate_per_node_day", -0.1), ("hang_rate_per_node_day", float("nan")),
                                          ("hang_detect_s", -1.0), ("hang_detect_s", float("inf"))])
def test_bad_hang_assumptions_are_usage_errors_naming_the_field(field, value):
    with pytest.raises(UsageError, match=f"simulate: {field}: "):
        Assumptions(**{field: value})


def test_too_many_hangs_to_simulate_is_a_usage_error():
    with pytest.raises(UsageError, match="simulate: hang_rate_per_node_day: expected at most 50,000"):
        Assumptions(hang_rate_per_node_day=10.0)


# -- the reference figures -----------------------------------------------------------------------


def test_the_default_hang_detection_is_the_reference_detection_and_stop():
    f = figures()
    assert f["hang_detect"].value == 300 + 5 + 1 + 30  # the floor, rank 0's beat, the tick, the stack reports
    assert f["hang_stop"].value == 10 + 10 + 5  # SIGTERM, SIGKILL to the Slurm step, SIGKILL to srun
    assert f["hang_recovery"].value == pytest.approx(
        f["hang_detect"].value + f["hang_stop"].value + f["restart_spare"].value)
    default = simulate_defaults()["hang_detect_s"]
    assert Assumptions().hang_detect_s == default.value == f["hang_detect"].value + f["hang_stop"].value
    assert default.source.startswith("computed: ")


def test_the_hang_figures_follow_the_watchdog_constants():
    from resume.watchdog import BEAT_S, HANG_FACTOR, HANG_FLOOR_S, TICK_S
    f = figures()
    assert f["hang_detect"].value == HANG_FLOOR_S + BEAT_S + TICK_S + reference.COLLECT_S
    assert f"floor {HANG_FLOOR_S:g}" in f["hang_detect"].source
    assert f"{HANG_FACTOR:g} x the slowest iteration" in f["hang_detect"].source
    # The floor is the bound only while the reference run's iterations are shorter than floor / factor.
    assert "assumed: about 23 s" in f["hang_detect"].source and HANG_FLOOR_S / HANG_FACTOR > 23


def test_the_collection_window_and_the_stop_are_the_hooks():
    hangs = importlib.import_module("resume.cluster.hangs")
    assert reference.COLLECT_S == hangs.COLLECT_S
    assert reference.STOP_ESCALATION_S == sum(patience for _, patience in hangs.STOP_STAGES)


def test_the_reference_rows_print_with_their_sources():
    text = invoke("simulate", "--reference").output
    f = figures()
    for key, label in (("hang_detect", "hang detected"), ("hang_stop", "hung step stopped"),
                       ("hang_recovery", "hang: last progress to first iteration")):
        row = next(line for line in text.splitlines() if line.startswith(f"| {label}"))
        assert f"| {f[key].shown()} | {f[key].source} |" in row
    body = json.loads(invoke("simulate", "--reference", "--json").output)
    assert body["hang_recovery"] == f["hang_recovery"].to_dict()


# -- the command line ----------------------------------------------------------------------------


def test_simulate_prints_hangs_and_the_detection_time_lost():
    text = invoke("simulate", "--days", "10").output
    assert f"  hang_rate_per_node_day {HANG_RATE_SOURCE}" in text
    assert f"  hang_detect_s      {simulate_defaults()['hang_detect_s'].source}" in text
    assert " hangs on average):" in text
    assert "  hangs              " in text and "hang detection " in text and " h lost" in text


def test_simulate_takes_the_hang_options_and_reports_them_as_given():
    body = json.loads(invoke("simulate", "--days", "10", "--hang-rate-per-node-day", "0.01",
                             "--hang-detect-s", "120", "--json").output)
    assert body["assumptions"]["hang_rate_per_node_day"] == 0.01
    assert body["assumptions"]["hang_detect_s"] == 120
    assert body["sources"]["hang_rate_per_node_day"] == body["sources"]["hang_detect_s"] == "given"
    assert body["hangs"] > 0 and body["hang_detect_hours"] > 0
    assert body["interruption_mtbf_s"] < body["system_mtbf_s"]
    default = json.loads(invoke("simulate", "--days", "10", "--json").output)
    assert default["assumptions"]["hang_rate_per_node_day"] == ASSUMED_HANGS_PER_NODE_DAY
    assert default["assumptions"]["hang_detect_s"] == Assumptions().hang_detect_s
    assert default["sources"]["hang_rate_per_node_day"] == HANG_RATE_SOURCE


@pytest.mark.parametrize("args, field", [(["--hang-rate-per-node-day", "-1"], "hang_rate_per_node_day"),
                                         (["--hang-detect-s", "nan"], "hang_detect_s")])
def test_bad_hang_options_are_one_line_usage_errors(args, field):
    assert_one_line_error(resume("simulate", *args, timeout=60), 2, f"simulate: {field}: ")
