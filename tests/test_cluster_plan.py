"""The layout planner and the failure simulation (pure computation, no cluster)."""

from __future__ import annotations

import json

import pytest
from resume.cluster.layout import REFERENCE, Layout
from resume.cluster.simulate import Assumptions, best_interval, failure_times, report, simulate
from support.cli import resume

from resume import UsageError


def test_reference_layout_is_80_replicas_of_8_nodes_in_megatron_order():
    assert (REFERENCE.dp, REFERENCE.nodes_per_replica, REFERENCE.world_size) == (80, 8, 5120)
    # Megatron tp-cp-dp-pp: rank = tp + 8 * (dp + 80 * pp)
    c = REFERENCE.coords(8 * (3 + 80 * 5) + 6)
    assert (c.tp, c.dp, c.pp, c.node, c.local_rank) == (6, 3, 5, 403, 6)
    assert REFERENCE.replica_nodes(3) == [3 + 80 * p for p in range(8)]
    assert all(REFERENCE.replica_of_node(n) == 3 for n in REFERENCE.replica_nodes(3))
    covered = sorted(n for d in range(80) for n in REFERENCE.replica_nodes(d))
    assert covered == list(range(640))


def test_rank_mapping_round_trips_for_other_layouts():
    layout = Layout(nodes=12, gpus_per_node=4, tp=2, pp=3, cp=2, global_batch=24)
    assert layout.nodes_per_replica == 3 and layout.dp == 4
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        assert layout.rank_of(tp=c.tp, cp=c.cp, dp=c.dp, pp=c.pp) == rank


def test_valid_shrink_sizes_divide_the_global_batch():
    assert REFERENCE.valid_dp[:6] == [80, 64, 60, 48, 40, 32]
    assert REFERENCE.shrink_after(1) == 64  # one replica lost without spares
    assert {d: REFERENCE.micro_batches_per_rank(d) for d in (80, 64, 60)} == {80: 24, 64: 30, 60: 32}
    assert REFERENCE.global_batch_at_constant_micro_batches(64) == 64 * 24
    spared = Layout(nodes=648, spares=8)
    assert spared.dp == 80 and spared.shrink_after(8) == 80 and spared.shrink_after(9) == 64
    assert spared.spare_nodes == list(range(640, 648))


@pytest.mark.parametrize("kwargs, field", [
    ({"nodes": 4}, "nodes"),
    ({"tp": 16}, "tp"),
    ({"tp": 8, "pp": 3, "gpus_per_node": 16}, "tp x cp x pp"),
    ({"global_batch": 1921, "micro_batch": 2}, "global_batch"),
    ({"spares": 640}, "spares"),
    ({"nodes": 16, "tp": 4, "pp": 2, "global_batch": 16}, "tp x cp"),
])
def test_layouts_that_do_not_fit_are_usage_errors(kwargs, field):
    with pytest.raises(UsageError, match=f"layout: {field}"):
        Layout(**kwargs)


def test_simulated_best_interval_is_young_daly_for_exponential_failures():
    for seed in range(3):
        best, yd = best_interval(Assumptions(seed=seed, restart_spare_s=0, restart_requeue_s=0))
        assert abs(best.interval_s / yd - 1) <= 0.10


def test_failures_match_the_assumed_rate():
    a = Assumptions(days=900)
    n = sum(not e.hang for e in failure_times(a))  # hangs come on top (tests/test_simulate_hangs.py)
    expected = a.days * 86400 / a.system_mtbf_s
    assert abs(n / expected - 1) < 0.1


def test_more_checkpoint_stall_or_failures_costs_goodput():
    base = simulate(Assumptions(), 1500)
    assert simulate(Assumptions(stall_s=300), 1500).goodput < base.goodput
    assert simulate(Assumptions(node_mtbf_s=Assumptions().node_mtbf_s / 4), 1500).goodput < base.goodput
    assert 0 < base.goodput < 1


def test_spares_cut_requeues_and_a_recommendation_is_made():
    r = report(Assumptions())
    rows = {row["spares"]: row for row in r["spares_table"]}
    assert rows[16]["failures_without_spare"] < rows[0]["failures_without_spare"]
    assert 0 < r["recommended_spares"] < 32


def test_ninety_days_of_the_reference_print_one_json_object():
    proc = resume("simulate", "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout)
    assert body["simulated_days"] == 90
    assert {"goodput", "best_interval_s", "young_daly_interval_s", "recommended_spares", "hangs",
            "hang_detect_hours"} <= set(body)


def test_plan_json_has_the_fields_operators_script_against():
    proc = resume("plan", "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout)
    assert (body["nodes"], body["gpus_per_node"], body["tp"], body["pp"], body["cp"], body["dp"]) == \
        (640, 8, 8, 8, 1, 80)
    assert body["nodes_per_replica"] == 8 and body["spares"] == 0
    assert body["valid_dp"][:2] == [80, 64] and body["micro_batches_per_rank"]["64"] == 30


def test_plan_rejects_a_layout_that_does_not_fit_with_exit_2():
    proc = resume("plan", "--nodes", "4", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("resume: error: layout: nodes: expected at least 8")


def test_without_spares_a_shrunk_stretch_costs_speed_until_the_next_requeue():
    a = Assumptions(spares=0)
    shrink = simulate(a, 1500)
    full_speed = simulate(Assumptions(spares=0, shrink_factor=1.0), 1500)
    assert shrink.goodput < full_speed.goodput
    # A spare pool makes the policy irrelevant: with enough spares both agree.
    many = Assumptions(spares=64)
    assert simulate(many, 1500).goodput == simulate(Assumptions(spares=64, no_spare="requeue"), 1500).goodput


def test_weibull_nodes_start_in_steady_state():
    a = Assumptions(distribution="weibull", days=900)
    n = sum(not e.hang for e in failure_times(a))
    assert abs(n / (a.days * 86400 / a.system_mtbf_s) - 1) < 0.15


@pytest.mark.parametrize("args", [["--node-mtbf-hours", "inf"], ["--days", "nan"],
                                  ["--weibull-shape", "0.001", "--distribution", "weibull"],
                                  ["--node-mtbf-hours", "1"], ["--stall-s", "0"]])
def test_simulate_bad_input_is_a_usage_error(args):
    proc = resume("simulate", *args, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("resume: error: simulate: ")
