"""The reference run's figures (cluster/reference.py): their arithmetic, their sources, and
that `resume simulate`, docs/performance.md and the Slurm runbook take them from there."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest
from resume.cluster.reference import (
    DEFAULT_INPUTS,
    LABELS,
    MEASURED,
    Inputs,
    figures,
    markdown_table,
    simulate_defaults,
)
from resume.cluster.simulate import Assumptions
from support.cli import assert_one_line_error, invoke, resume

ROOT = pathlib.Path(__file__).resolve().parents[1]
KINDS = ("measured: ", "computed: ", "assumed: ")


def test_the_checkpoint_is_14_bytes_per_parameter_of_500b():
    f = figures()
    assert f["checkpoint"].value == pytest.approx(500e9 * (2 + 4 + 4 + 4) / 1e12) == pytest.approx(7.0)
    assert f["checkpoint"].unit == "TB"
    # A rank stages its TP x PP share of the bf16 weights and its 1/5,120 of the optimizer state.
    assert f["staged_per_rank"].value == pytest.approx((500e9 * 2 / 64 + 500e9 * 12 / 5120) / 1e9)


def test_bulk_times_halve_when_the_bandwidth_doubles():
    at_100, at_200 = figures(Inputs(fs_bandwidth_gbs=100)), figures(Inputs(fs_bandwidth_gbs=200))
    assert at_100["bulk_write"].value == pytest.approx(70.0)  # 7 TB / 100 GB/s
    assert at_100["bulk_read"].value == pytest.approx(70.0)  # read once: the load checks the checksums
    for key in ("bulk_write", "bulk_read"):
        assert at_200[key].value == pytest.approx(at_100[key].value / 2)
    assert "7 TB / 200 GB/s" in at_200["bulk_write"].source
    # The control plane does not move with the bandwidth.
    assert at_200["save_control_plane"] == at_100["save_control_plane"]


def test_stalls_and_restarts_are_the_sums_of_their_parts():
    f, m = figures(), MEASURED
    finish = m.finish_s  # rank 0's end of a save, measured whole; every rank waits for it
    assert finish >= m.results_gather_s + m.metadata_write_s + m.index_write_s
    assert f["stall_sync"].value == pytest.approx(
        m.save_control_plane_s + m.dcp_plan_cached_s + f["bulk_write"].value + finish)
    assert f["stall_async"].value == pytest.approx(m.save_gather_s + f["staging"].value)
    assert f["async_background"].value == pytest.approx(
        m.dcp_plan_cached_s + f["bulk_write"].value + finish + m.save_control_plane_s)
    assert m.save_gather_s < m.save_control_plane_s
    assert f["staging"].value == pytest.approx(f["staged_per_rank"].value / DEFAULT_INPUTS.d2h_gbs)
    spare = (f["detect"].value + f["process_start"].value + f["dist_init"].value
             + m.restore_control_plane_s + m.index_rank0_s + m.index_other_rank_s + m.load_plan_s
             + f["bulk_read"].value)
    assert f["restart_spare"].value == pytest.approx(spare)
    assert f["dcp_load_plan"].value == m.load_plan_s
    assert f["restart_requeue"].value == pytest.approx(
        spare + f["requeue_hold"].value + f["scheduling"].value + DEFAULT_INPUTS.queue_wait_s)
    assert f["hang_recovery"].value == pytest.approx(f["hang_detect"].value + f["hang_stop"].value + spare)
    assert figures(Inputs(queue_wait_s=0))["restart_requeue"].value == pytest.approx(
        f["restart_requeue"].value - DEFAULT_INPUTS.queue_wait_s)


def test_a_restart_reads_the_index_not_the_metadata():
    f, m = figures(), MEASURED
    # The .metadata path (vetted, sent, unpickled) is for checkpoints written before the index:
    # shown, not on the way to the first iteration.
    assert f["metadata_legacy"].value == pytest.approx(
        m.metadata_restricted_s + m.metadata_pickle_s + m.metadata_unpickle_s)
    slower = dataclasses.replace(m, metadata_restricted_s=1e6, metadata_pickle_s=1e6, metadata_unpickle_s=1e6)
    assert figures(measured=slower)["restart_spare"] == f["restart_spare"]
    assert "index" in f["restart_spare"].source and ".metadata" not in f["restart_spare"].source
    # Issue 28's bounds at 5,120 ranks, at the default inputs.
    assert f["restart_spare"].value <= 350
    assert m.index_other_rank_s <= 0.5
    assert f["restore_received"].value <= 4 * 1024  # KiB
    assert f["save_received"].value <= 64 * 1024  # bytes
    assert m.load_plan_s < m.load_plan_full_metadata_s


def test_rank0_answers_the_index_within_issue_28s_bound():
    assert MEASURED.index_rank0_s <= 5


def test_the_synchronous_stalls_control_part_is_within_issue_28s_bound():
    f = figures()
    assert f["stall_sync"].value - f["bulk_write"].value <= 5
    # A save where an entry changed size lays .metadata and the index out anew: slower, shown.
    assert MEASURED.finish_changed_s > MEASURED.finish_s
    assert f"+ {MEASURED.finish_changed_s - MEASURED.finish_s:.3g} s (finish_changed_s)" in f["stall_sync"].source


def test_every_figure_says_where_it_came_from():
    f = figures()
    assert list(f) == list(LABELS)
    for key, fig in f.items():
        kind = next((k for k in KINDS if fig.source.startswith(k)), None)
        assert kind and len(fig.source) > len(kind) + 10, (key, fig.source)
    assert all(f[k].source.startswith("measured: ") for k in (
        "save_control_plane", "dcp_plan", "metadata", "index_rank0", "index_other_rank", "dcp_load_plan"))
    assert all(f[k].source.startswith("assumed: ") for k in ("fs_bandwidth", "d2h", "queue_wait"))
    assert all(f[k].source.startswith("computed: ") for k in ("hang_detect", "hang_stop", "hang_recovery"))
    # An input the user changed is not an assumption any more.
    assert figures(Inputs(fs_bandwidth_gbs=250))["fs_bandwidth"].source == "given: --fs-bandwidth-gbs"


def test_the_simulation_model_defaults_to_the_computed_figures():
    d, a = simulate_defaults(), Assumptions()
    assert (a.stall_s, a.restart_spare_s, a.restart_requeue_s, a.hang_detect_s) == (
        d["stall_s"].value, d["restart_spare_s"].value, d["restart_requeue_s"].value, d["hang_detect_s"].value)
    assert d["stall_s"] == figures()["stall_async"]
    assert simulate_defaults(Inputs(save="sync"))["stall_s"] == figures()["stall_sync"]


def test_simulate_takes_its_defaults_from_the_figures_and_names_their_sources():
    proc = resume("simulate", "--days", "5", "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout)
    for name, fig in simulate_defaults().items():
        assert body["assumptions"][name] == fig.value
        assert body["sources"][name] == fig.source and fig.source.startswith("computed: ")


def test_a_stall_passed_is_reported_as_given():
    proc = resume("simulate", "--days", "5", "--stall-s", "5", "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout)
    assert body["assumptions"]["stall_s"] == 5 and body["sources"]["stall_s"] == "given"
    assert body["sources"]["restart_spare_s"] == simulate_defaults()["restart_spare_s"].source
    text = invoke("simulate", "--days", "5", "--stall-s", "5").output
    assert "  stall_s            given" in text
    assert f"  restart_spare_s    {simulate_defaults()['restart_spare_s'].source}" in text


def test_the_bandwidth_and_save_options_feed_the_defaults():
    proc = resume("simulate", "--days", "5", "--fs-bandwidth-gbs", "200", "--save", "sync", "--json",
                  timeout=120)
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout)
    f = figures(Inputs(fs_bandwidth_gbs=200, save="sync"))
    assert body["assumptions"]["stall_s"] == f["stall_sync"].value
    assert body["assumptions"]["restart_spare_s"] == f["restart_spare"].value
    assert body["sources"]["stall_s"] == f["stall_sync"].source


def test_reference_prints_the_table_and_every_figure_as_json():
    assert invoke("simulate", "--reference").output.strip() == markdown_table(figures()).strip()
    body = json.loads(invoke("simulate", "--reference", "--json", "--d2h-gbs", "20").output)
    assert list(body) == list(LABELS)
    assert body["staging"]["value"] == pytest.approx(figures()["staging"].value / 2)
    assert set(body["checkpoint"]) == {"value", "unit", "source"}


@pytest.mark.parametrize("doc", ["docs/performance.md", "runbooks/slurm.md"])
def test_the_documented_table_is_the_one_the_module_computes(doc):
    # Regenerate with `resume simulate --reference` after changing cluster/reference.py.
    assert markdown_table(figures()) in (ROOT / doc).read_text()


@pytest.mark.parametrize("args, field", [(["--fs-bandwidth-gbs", "0"], "fs_bandwidth_gbs"),
                                         (["--d2h-gbs", "nan"], "d2h_gbs"),
                                         (["--queue-wait-s", "-1"], "queue_wait_s")])
def test_a_bad_input_is_a_usage_error(args, field):
    assert_one_line_error(resume("simulate", "--reference", *args, timeout=60), 2, f"simulate: {field}: ")
