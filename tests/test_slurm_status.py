"""``resume slurm status RUN``: the last hang in one line and where its stacks are, from the
hook's event log, which it reads as untrusted input (its tail only, line by line)."""

from __future__ import annotations

import json
import os

from resume.cluster import status as status_module
from support.cli import assert_one_line_error, invoke, resume

HANG = {"at": "2026-12-03T05:37:09.861+00:00", "event": "hang", "job": "6", "restart": 0, "phase": "iteration",
        "iteration": 12, "quiet_s": 9.1, "bound_s": 3.0, "suspects": [1], "suspect_nodes": ["n2"],
        "stacks": "/runs/r/cluster/hangs/launch-1", "reports": 2, "reason": "no progress"}


def write_events(run, *records, raw: bytes = b"") -> None:
    (run / "cluster").mkdir(parents=True, exist_ok=True)
    with open(run / "cluster" / "events.jsonl", "wb") as f:
        f.write(raw)
        f.writelines(json.dumps(r).encode() + b"\n" for r in records)


def test_the_last_hang_is_one_line_naming_the_suspect_its_node_and_the_stacks(tmp_path):
    run = tmp_path / "run"
    launch = {"at": "t0", "event": "launch", "launch": 2, "nodes": ["n1", "n3"], "committed_step": 10}
    excluded = {"at": "t1", "event": "hung_node_excluded", "nodes": ["n2"], "reason": "a spare is free"}
    write_events(run, dict(HANG, iteration=7, suspects=[0], suspect_nodes=["n1"]), HANG, excluded, launch)
    result = invoke("slurm", "status", str(run))
    assert result.exit_code == 0, result.output
    line = next(line for line in result.stdout.splitlines() if line.startswith("last hang"))
    assert "iteration 12" in line and "suspect rank 1 on n2" in line and "(2 in all)" in line
    assert "stacks /runs/r/cluster/hangs/launch-1" in line
    assert "left out     n2" in result.stdout and "#2" in result.stdout
    shown = json.loads(invoke("slurm", "status", str(run), "--json").stdout)
    assert shown["hangs"] == 2 and shown["last_hang"]["suspects"] == [1] and shown["left_out"] == ["n2"]


def test_a_run_without_a_hang_says_none(tmp_path):
    run = tmp_path / "run"
    write_events(run, {"at": "t0", "event": "start", "nodes": ["n1"]})
    result = invoke("slurm", "status", str(run))
    assert result.exit_code == 0 and "last hang    none" in result.stdout


def test_lines_that_are_not_events_are_skipped_and_only_the_tail_is_read(tmp_path, monkeypatch):
    run = tmp_path / "run"
    junk = b"not json\n[1,2]\n{\"event\": 5}\n" + b"\x00\xff" * 100 + b"\n" + b'{"a":' * 100_000 + b"\n"
    write_events(run, HANG, raw=junk)
    monkeypatch.setattr(status_module, "TAIL", 4096)
    result = invoke("slurm", "status", str(run))
    assert result.exit_code == 0, result.output
    assert "suspect rank 1 on n2" in result.stdout


def test_a_run_the_hook_never_ran_on_is_exit_3_and_a_missing_run_too(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    assert_one_line_error(resume("slurm", "status", str(run)), 3, "events.jsonl", "never ran")
    assert_one_line_error(resume("slurm", "status", os.path.join(str(tmp_path), "nothing")), 3)


def test_the_nodes_left_out_are_the_current_allocations_less_those_back_in_service():
    events = [
        {"event": "start", "nodes": ["n1", "n2", "n3"]},
        {"event": "hung_node_excluded", "nodes": ["n9"]},          # an earlier allocation's
        {"event": "start", "nodes": ["n1", "n2", "n3", "n4"]},
        {"event": "nodes_failed", "nodes": ["n2"]},
        {"event": "hung_node_excluded", "nodes": ["n3", "n3"]},
        {"event": "straggler_replaced", "nodes": ["n4"]},
        {"event": "nodes_back", "nodes": ["n2"]},
        {"event": "nodes_removed", "nodes": "n5"},                  # not a list: ignored
    ]
    assert status_module.status_of(events)["left_out"] == ["n3", "n4"]
