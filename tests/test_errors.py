"""Errors in one module (resume/errors.py): their structured fields, read off the message or
given at the raise, survive the trip between ranks; the exit codes are defined there once."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest

from resume import errors
from resume.collective import Failure, rebuild
from resume.errors import (
    ContinuityError,
    CorruptCheckpointError,
    ResumeError,
    RunNotFoundError,
    SlurmMissingError,
    StorageError,
    error_details,
    message_fields,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("message, where, field, expected, actual", [
    ("/runs/a: run directory: expected an existing directory, actual missing",
     "/runs/a", "run directory", "an existing directory", "missing"),
    ("s3://b/run/step-000000004/__0_0.distcp: checksum: expected xxh3:1f, actual xxh3:2e",
     "s3://b/run/step-000000004/__0_0.distcp", "checksum", "xxh3:1f", "xxh3:2e"),
    ("/r/step-000000004: expected a step directory, actual missing (steps: [2, 3])",
     "/r/step-000000004", None, "a step directory", "missing (steps: [2, 3])"),
    ("--nodes: expected at least 3 (2 per replica + 1 spares), actual 2",
     None, "--nodes", "at least 3 (2 per replica + 1 spares)", "2"),
    ("run.json: schema: expected one of [1, 2], actual 9", "run.json", "schema", "one of [1, 2]", "9"),
    ("/r/LATEST: names step-000000004: expected a committed checkpoint, actual no such directory",
     "/r/LATEST", "names step-000000004", "a committed checkpoint", "no such directory"),
    ("/r: storage operation ls failed after retries: OSError: EIO", "/r", None, None, None),
    ("injected fault at save.after_shards", None, None, None, None),
])
def test_message_fields_reads_the_conventional_shape(message, where, field, expected, actual):
    assert message_fields(message) == {"where": where, "field": field, "expected": expected, "actual": actual}


def test_details_are_the_given_fields_over_those_of_the_message():
    error = CorruptCheckpointError("/r/step-000000002/a.bin: size: expected 10 bytes, actual 9",
                                   expected=10, actual=9)
    assert error.details() == {"what": "CorruptCheckpointError", "where": "/r/step-000000002/a.bin",
                               "field": "size", "expected": 10, "actual": 9, "exit_code": 1}
    assert list(error.details()) == list(errors.DETAILS)
    assert str(error) == "/r/step-000000002/a.bin: size: expected 10 bytes, actual 9"  # the message kept


def test_details_of_an_error_that_is_not_ours():
    missing = FileNotFoundError(2, "No such file or directory", "/r/x")
    assert error_details(missing) == {"what": "FileNotFoundError", "where": "/r/x", "field": None,
                                      "expected": None, "actual": None, "exit_code": 1}
    assert error_details(RunNotFoundError("/r: run directory: expected an existing directory, "
                                          "actual missing"))["exit_code"] == 3


@pytest.mark.parametrize("error", [
    StorageError("/r/step-000000004/__0_0.distcp: write: expected 4096 bytes, actual 0 (ENOSPC)",
                 where="/r/step-000000004/__0_0.distcp", field="write", expected=4096, actual=0),
    CorruptCheckpointError("/r/step-000000004/manifest.json: files: expected a mapping, actual a list"),
    ContinuityError("lr_ahead[+0]", [1e-3, 1e-3], [1e-3, 5e-4], "a changed schedule"),
    ContinuityError("config.seed", None, 7),
    SlurmMissingError("scontrol: expected on PATH, actual missing"),
])
def test_the_fields_survive_the_trip_between_ranks(error):
    failure = pickle.loads(pickle.dumps(Failure.of(error, 3)))  # as broadcast_object sends it
    again = rebuild(failure)
    assert type(again) is type(error) and str(again) == str(error)
    assert again.details() == error.details() and again.exit_code == error.exit_code
    assert failure.describe() == f"rank 3: {type(error).__name__}: {error}"


def test_an_error_of_ours_the_receiver_does_not_know_keeps_its_fields():
    class AdapterError(ResumeError, RuntimeError):
        pass

    error = AdapterError("/r/iter_0000004: tracker: expected 4, actual 5", expected=4, actual=5)
    again = rebuild(Failure.of(error, 1))
    assert type(again) is ResumeError and again.details() == {**error.details(), "what": "ResumeError"}


def test_the_old_homes_of_the_errors_and_exit_codes_still_name_them():
    from resume.cluster import hook, slurm

    from resume import control, faults

    assert (slurm.EXIT_NO_SLURM, slurm.EXIT_NOT_IN_ALLOCATION, hook.EXIT_CRASH_LOOP, hook.EXIT_UNRECOVERABLE) \
        == (6, 7, 5, 1)
    assert slurm.SlurmError is errors.SlurmError and slurm.SlurmMissingError is errors.SlurmMissingError
    assert slurm.NotInAllocationError is errors.NotInAllocationError
    assert faults.InjectedFault is errors.InjectedFault and control.BadControlFile is errors.BadControlFile
    assert issubclass(errors.InjectedFault, RuntimeError) and not issubclass(errors.InjectedFault, ResumeError)
    assert issubclass(errors.BadControlFile, ValueError) and not issubclass(errors.BadControlFile, ResumeError)
    assert errors.SlurmMissingError("x").exit_code == 6 and errors.NotInAllocationError("x").exit_code == 7


def test_exit_codes_are_defined_in_resume_errors_only():
    defined = []
    for folder in ("resume", "adapters", "cluster", "drill"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, ast.AnnAssign) else []
                defined += [f"{path.relative_to(ROOT)}:{node.lineno}: {t.id}" for t in targets
                            if isinstance(t, ast.Name) and t.id.startswith("EXIT_")]
    elsewhere = [d for d in defined if not d.startswith("resume/errors.py:")]
    assert len(defined) > len(elsewhere) and not elsewhere, elsewhere
