"""``--json`` errors carry their fields (what, where, field, expected, actual, exit_code) beside
the message (``error``), for the errors a command raises and for the problems verify finds."""

from __future__ import annotations

import glob
import json
import os

from support.checkpoints import flip_byte
from support.cli import invoke

DETAILS = ("what", "where", "field", "expected", "actual")


def as_json(result) -> dict:
    return json.loads(result.stdout)


def test_inspect_of_a_missing_run_prints_the_fields_of_the_error(tmp_path):
    missing = str(tmp_path / "no-such-run")
    result = invoke("inspect", missing, "--json")
    assert result.exit_code == 3
    body = as_json(result)
    assert body["ok"] is False and body["exit_code"] == 3
    assert body["error"] == f"{missing}: run directory: expected an existing directory, actual missing"
    assert {k: body[k] for k in DETAILS} == {"what": "RunNotFoundError", "where": missing,
                                             "field": "run directory", "expected": "an existing directory",
                                             "actual": "missing"}


def test_verify_of_a_step_that_is_not_there_prints_the_fields_of_the_error(run_copy):
    result = invoke("verify", run_copy, "--step", "3", "--json")
    assert result.exit_code == 3
    body = as_json(result)
    where = os.path.join(run_copy, "step-000000003")
    assert body["error"] == f"{where}: expected a step directory, actual missing (steps: [2, 4])"
    assert {k: body[k] for k in DETAILS} == {"what": "CheckpointNotFoundError", "where": where, "field": None,
                                             "expected": "a step directory", "actual": "missing (steps: [2, 4])"}


def test_verify_of_a_damaged_run_prints_each_problem_with_its_fields(run_copy):
    shard = min(glob.glob(os.path.join(run_copy, "step-000000004", "*.distcp")))
    flip_byte(shard)
    with open(os.path.join(run_copy, "step-000000004", "manifest.json")) as f:
        manifest = json.load(f)
    recorded = manifest["files"][os.path.basename(shard)]["checksum"]
    result = invoke("verify", run_copy, "--deep", "--json")
    assert result.exit_code == 1
    body = as_json(result)
    assert body["ok"] is False and body["exit_code"] == 1
    assert [s["status"] for s in body["steps"]] == ["committed", "broken"]  # the verdict's keys kept
    [error] = body["errors"]
    assert error["error"] == body["steps"][1]["problems"][0]
    assert error["what"] == "broken" and error["step"] == 4
    assert error["where"] == shard and error["field"] == "checksum"
    assert error["expected"] == recorded and error["actual"].startswith("xxh3:") and error["actual"] != recorded
    assert error["error"] in result.stderr


def test_verify_of_a_sound_run_has_no_errors(run_copy):
    body = as_json(invoke("verify", run_copy, "--json"))
    assert body["ok"] is True and body["exit_code"] == 0 and body["errors"] == []


def test_inspect_of_a_torn_step_prints_the_problem_with_its_fields(run_copy):
    manifest = os.path.join(run_copy, "step-000000002", "manifest.json")
    os.unlink(manifest)
    result = invoke("inspect", run_copy, "--step", "2", "--json")
    assert result.exit_code == 1
    body = as_json(result)
    assert body["ok"] is False and body["exit_code"] == 1 and body["error"] == f"{manifest}: missing (uncommitted)"
    assert (body["what"], body["where"]) == ("uncommitted", manifest)
    assert body["errors"] == [{"error": body["error"], "what": "uncommitted", "step": 2, "where": manifest,
                               "field": None, "expected": None, "actual": None}]
