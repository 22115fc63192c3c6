"""One writer per Megatron save directory: the recorder holds the directory's lease."""

from __future__ import annotations

import json

import pytest
from resume.adapters.megatron import MegatronRecorder

from resume import RunBusyError
from resume.lease import LEASE_NAME


def test_a_second_job_on_a_megatron_save_directory_is_refused_naming_the_first(tmp_path, monkeypatch):
    save = tmp_path / "save"
    save.mkdir()
    monkeypatch.setenv("RESUME_JOB_ID", "1001")
    first = MegatronRecorder(str(save))
    first.before_save(10)  # the first save (or load) takes the lease
    holder = json.loads((save / LEASE_NAME).read_text())
    assert holder["job_id"] == "1001"

    monkeypatch.setenv("RESUME_JOB_ID", "2002")
    second = MegatronRecorder(str(save))
    with pytest.raises(RunBusyError, match=r"lease.json: expected no other job writing this run, actual "
                       r"job 1001 \(host .*\), heartbeat \d+ s ago, stale after 120 s"):
        second.before_save(10)

    monkeypatch.setenv("RESUME_JOB_ID", "1001")  # the same job, requeued, takes its lease over
    requeued = MegatronRecorder(str(save))
    requeued.before_save(10)
    assert json.loads((save / LEASE_NAME).read_text())["token"] != holder["token"]


def test_no_lease_when_asked_for_none(tmp_path):
    save = tmp_path / "save"
    save.mkdir()
    MegatronRecorder(str(save), lease_ttl_s=None).before_save(10)
    assert not (save / LEASE_NAME).exists()


def test_the_lease_names_the_slurm_job_and_its_requeued_copy_takes_it_over(tmp_path, monkeypatch):
    """The job's identity comes from the cluster layer (resume.cluster.environment), not the core."""
    save = tmp_path / "save"
    save.mkdir()
    monkeypatch.delenv("RESUME_JOB_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    MegatronRecorder(str(save)).before_save(10)
    first = json.loads((save / LEASE_NAME).read_text())
    assert first["job_id"] == "4242"
    MegatronRecorder(str(save)).before_save(10)  # the requeued copy: same job id, not refused
    assert json.loads((save / LEASE_NAME).read_text())["token"] != first["token"]
