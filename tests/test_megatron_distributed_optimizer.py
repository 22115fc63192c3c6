"""Checkpoints recorded on a GPU with Megatron-Core's distributed optimizer (which does not
build on CPU), read here: reading, verifying, vetting the pickles, the counters.

The fixtures are written by tests/fixtures/megatron/record_distributed_optimizer.py."""

from __future__ import annotations

import glob
import json
import os
import tarfile

import pytest
from support.cli import resume
from support.megatron import require_megatron

pytestmark = pytest.mark.megatron

FIXTURES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "fixtures", "megatron", "distopt-*.tar.gz")))


@pytest.mark.skipif(not FIXTURES, reason="no distributed-optimizer fixture recorded yet (needs a GPU: "
                    "tests/fixtures/megatron/record_distributed_optimizer.py)")
@pytest.mark.parametrize("fixture", FIXTURES)
def test_distributed_optimizer_checkpoint_reads_verifies_and_vets(fixture, tmp_path):
    require_megatron()  # registers Megatron's own safe globals (its enums in the rerun state)
    with tarfile.open(fixture) as tar:
        tar.extractall(tmp_path, filter="data")
    save = str(tmp_path / "save")
    proc = resume("verify", save, "--deep", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    body = json.loads(resume("ls", save, "--json").stdout)
    counters = {c["step"]: (c["train_state"]["updates_successful"], c["train_state"]["updates_skipped"])
                for c in body["checkpoints"]}
    assert counters == {4: (3, 1), 6: (5, 1)}

    from resume.adapters.megatron import vet_byte_entries

    from resume.storage import open_storage

    vet_byte_entries(open_storage(save), "iter_0000006")  # the sharded optimizer state is plain data
