"""Megatron saves that resume never recorded (no manifest), written by megatron.training's own
save_checkpoint: checked from Megatron's .metadata, each kind of damage named by its file, the
counters that cannot be derived shown as unknown, one word and one exit code per state."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from support.checkpoints import flip_byte
from support.cli import assert_one_line_error, resume
from support.ranks import run_ranks

# Marked one by one: the tests that read our own code run without megatron-core too (.ci/run's
# fresh-machine step requires every marked test to skip there).

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "docs", "megatron.md")  # the README's Megatron-LM details
RUNBOOK = os.path.join(ROOT, "runbooks", "megatron.md")
DATA = "iter_0000003/__0_0.distcp"


def _plain(rank: int, world: int, save_dir: str, extra: list[str]) -> dict:
    from support.megatron_plain import plain_save

    return plain_save(save_dir, tuple(extra))


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    """Two saves of iteration 3 (2 applied updates, then an --iterations-to-skip iteration):
    with the optimizer (and so the scheduler), and with --no-save-optim."""
    from support.megatron import require_megatron

    require_megatron()
    root = tmp_path_factory.mktemp("megatron-unrecorded")
    out = {}
    for name, extra in (("full", []), ("no_optim", ["--no-save-optim"])):
        save_dir = str(root / name)
        result = run_ranks(_plain, 1, save_dir, extra)[0]
        assert (result["iteration"], result["consumed"], result["skipped_train_samples"]) == (3, 12, 4)
        out[name] = save_dir
    return out


@pytest.fixture
def full(saves, tmp_path):
    copy = str(tmp_path / "full")
    shutil.copytree(saves["full"], copy)
    return copy


def _path(save: str, rel: str = DATA) -> str:
    return os.path.join(save, *rel.split("/"))


def _truncate(size_of):
    def damage(save: str) -> None:
        path = _path(save)
        with open(path, "r+b") as f:
            f.truncate(size_of(os.path.getsize(path)))
    return damage


def _flip_tensor_byte(save: str) -> None:
    from support.megatron_records import tensor_data_offset

    flip_byte(_path(save), offset=tensor_data_offset(_path(save, "iter_0000003")))


def _append(save: str) -> None:
    with open(_path(save), "ab") as f:
        f.write(b"\0" * 100)


# (damage, needs --deep, the file named, words in the message)
DAMAGE = {
    "truncated_to_zero": (_truncate(lambda n: 0), False, DATA, "truncated"),
    "truncated_to_half": (_truncate(lambda n: n // 2), False, DATA, "truncated"),
    "one_byte_short": (_truncate(lambda n: n - 1), False, DATA, "truncated"),
    "bytes_appended": (_append, False, DATA, "bytes .metadata does not describe"),
    "flipped_byte_in_tensor_data": (_flip_tensor_byte, True, DATA, "CRC-32"),
    "data_file_deleted": (lambda save: os.remove(_path(save)), False, DATA, "actual missing"),
    "metadata_deleted": (lambda save: os.remove(_path(save, "iter_0000003/.metadata")), False,
                         "iter_0000003/.metadata", "actual missing"),
}


@pytest.mark.megatron
@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", DAMAGE)
def test_each_kind_of_damage_exits_1_naming_the_file(full, kind):
    damage, deep, named, words = DAMAGE[kind]
    damage(full)
    flags = ["--deep"] if deep else []
    proc = resume("verify", full, *flags)
    assert_one_line_error(proc, 1, named, words)
    # Printed under the iteration it is about, not under the tracker's heading.
    assert f"iter_0000003  PROBLEM: {_path(full, named)}" in proc.stdout, proc.stdout
    if deep:
        assert resume("verify", full).returncode == 0  # sizes and bounds alone cannot see it
        body = json.loads(resume("verify", full, "--deep", "--json").stdout)
        assert body["steps"][0]["status"] == "broken"
    else:
        # The same state is the same word and the same exit code everywhere.
        assert _status_everywhere(full) == {"ls": "broken", "verify": "broken"}
        assert_one_line_error(resume("inspect", full), 1, named)


@pytest.mark.megatron
@pytest.mark.multiprocess
def test_sound_save_is_unrecorded_everywhere_and_exits_0(full):
    proc = resume("verify", full, "--deep")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "iter_0000003  unrecorded (no resume manifest)" in proc.stdout
    assert "and the CRC-32 of every record" in proc.stdout and "no checksums" in proc.stdout
    assert _status_everywhere(full) == {"ls": "unrecorded", "verify": "unrecorded"}
    inspect = resume("inspect", full)
    assert inspect.returncode == 0 and "unrecorded: no resume manifest" in inspect.stdout


@pytest.mark.megatron
@pytest.mark.multiprocess
def test_a_save_megatron_did_not_finish_is_uncommitted_everywhere(full):
    # Megatron's tracker is its commit: an iteration newer than the tracker is ignored, by
    # Megatron's load and here.
    shutil.copytree(_path(full, "iter_0000003"), _path(full, "iter_0000005"))
    os.remove(_path(full, "iter_0000005/.metadata"))
    body = json.loads(resume("verify", full, "--json").stdout)
    assert {s["step"]: s["status"] for s in body["steps"]} == {3: "unrecorded", 5: "uncommitted"}
    assert resume("verify", full).returncode == 0
    ls = json.loads(resume("ls", full, "--json").stdout)
    assert {c["step"]: c["status"] for c in ls["checkpoints"]} == {3: "unrecorded", 5: "uncommitted"}
    assert "tracker names iter_0000003" in ls["checkpoints"][1]["reason"]


@pytest.mark.megatron
@pytest.mark.multiprocess
def test_common_state_that_cannot_be_read_is_broken_with_its_reason(full):
    from support.megatron_records import records

    _, rel, offset, length = next(r for r in records(_path(full, "iter_0000003")) if r[0].startswith("common_state"))
    flip_byte(_path(full, f"iter_0000003/{rel}"), offset=offset + length // 2)
    ls = json.loads(resume("ls", full, "--json").stdout)["checkpoints"][0]
    assert ls["status"] == "broken" and "__0_0.distcp" in ls["reason"], ls
    text = resume("ls", full).stdout
    assert "broken" in text and "__0_0.distcp" in text


@pytest.mark.megatron
@pytest.mark.multiprocess
def test_counters_megatron_can_give_and_its_own_sample_counters(full):
    ls = json.loads(resume("ls", full, "--json").stdout)["checkpoints"][0]
    assert ls["train_state"] == {"iteration": 3, "samples_read": 12, "updates_successful": 2,
                                 "updates_skipped": 1, "unknown": None}
    assert ls["counters_derived"] is True
    assert ls["framework_counters"] == {"consumed_train_samples": 12, "skipped_train_samples": 4}
    text = resume("ls", full).stdout
    assert "megatron: consumed_train_samples 12, skipped_train_samples 4" in text
    inspect = resume("inspect", full).stdout
    assert "updates 2 successful / 1 skipped" in inspect and "skipped_train_samples 4" in inspect


@pytest.mark.megatron
@pytest.mark.multiprocess
def test_counters_that_cannot_be_derived_are_unknown_not_guessed(saves):
    save = saves["no_optim"]
    ls = json.loads(resume("ls", save, "--json").stdout)["checkpoints"][0]
    assert ls["status"] == "unrecorded"
    state = ls["train_state"]
    assert (state["iteration"], state["samples_read"]) == (3, 12)
    assert state["updates_successful"] is None and state["updates_skipped"] is None
    assert "--no-save-optim" in state["unknown"]
    assert ls["framework_counters"] == {"consumed_train_samples": 12, "skipped_train_samples": 4}
    text = resume("ls", save).stdout
    row = next(line for line in text.splitlines() if line.strip().startswith("3 "))
    assert row.split()[:6] == ["3", "unrecorded", "3", "12", "?", "?"], row
    assert "updates unknown:" in text
    inspect = resume("inspect", save)
    assert inspect.returncode == 0 and "updates unknown" in inspect.stdout
    # And such a save is not adopted with made-up counters.
    adopt = resume("megatron", "adopt", save, "--iteration", "3")
    assert_one_line_error(adopt, 1, "cannot adopt", "--no-save-optim")


def test_the_readme_and_runbook_say_what_cannot_be_caught_and_name_each_state():
    from resume.adapters.megatron.check import UNCAUGHT

    with open(README) as f:
        readme = " ".join(f.read().split())
    assert "a record replaced whole by another valid archive" in readme and "CRC-32" in readme
    assert "a record replaced whole by another valid archive" in UNCAUGHT
    with open(RUNBOOK) as f:
        runbook = f.read()
    for word, code in (("committed", "0"), ("unrecorded", "0"), ("broken", "1"), ("uncommitted", "3")):
        assert f"| `{word}` |" in runbook and f"| {code} " in runbook, word


def _status_everywhere(save: str) -> dict[str, str]:
    ls = json.loads(resume("ls", save, "--json").stdout)["checkpoints"][0]["status"]
    verify = json.loads(resume("verify", save, "--json").stdout)["steps"][0]["status"]
    return {"ls": ls, "verify": verify}
