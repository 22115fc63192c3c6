"""Save and restore through a real S3-compatible server on loopback, behind a proxy that fails
10% of requests (503 SlowDown, connection resets) and restarts the server in the middle of a save."""

from __future__ import annotations

import json
import os

import pytest
from support.cli import resume
from support.ranks import run_ranks
from support.s3 import FaultProxy, S3Server, s3_env

pytestmark = pytest.mark.multiprocess

RUN = "s3://ckpt/run"


def _train_and_save(rank: int, world: int) -> dict:
    from support.workloads import Setup, build, moment_digests, param_digests, train

    coord, parts = build(rank, world, RUN, Setup(every=3))
    coord.restore()
    train(coord, parts, until=6, skip={2})  # saves at 3 and 6
    coord.close()
    return {"params": param_digests(parts["model"]), "moments": moment_digests(parts["opt"]),
            "committed": coord.last_committed_step}


def _restore(rank: int, world: int) -> dict:
    from support.workloads import Setup, build, moment_digests, param_digests

    coord, parts = build(rank, world, RUN, Setup(every=3))
    coord.restore()  # the continuity check runs here
    coord.close()
    return {"restored": coord.restored_from, "params": param_digests(parts["model"]),
            "moments": moment_digests(parts["opt"])}


@pytest.fixture
def s3(tmp_path, monkeypatch):
    server = S3Server(str(tmp_path / "s3data"))
    server.start()
    server.make_bucket("ckpt")
    proxy = FaultProxy(server, rate=0.10, seed=7).start()
    for k, v in s3_env(proxy.endpoint).items():
        monkeypatch.setenv(k, v)
    yield server, proxy
    proxy.stop()
    server.stop()


def test_save_and_restore_survive_faults_and_a_server_restart(s3):
    server, proxy = s3
    # The restart hits while the second checkpoint's shards are being uploaded.
    proxy.restart_when(lambda method, path: method == "PUT" and "step-000000006" in path
                       and "distcp" in path)
    saved = run_ranks(_train_and_save, 2)
    assert [s["committed"] for s in saved] == [6, 6]
    assert server.restarts == 1
    restored = run_ranks(_restore, 2)
    assert [r["restored"] for r in restored] == [6, 6]
    for before, after in zip(saved, restored):
        assert after["params"] == before["params"]
        assert after["moments"] == before["moments"]
    # Every byte as written: a deep verify through the faulty proxy, checksums against the manifest.
    proc = resume("verify", RUN, "--deep", "--json", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [s["status"] for s in json.loads(proc.stdout)["steps"]] == ["committed", "committed"]
    assert proxy.counts["slowdown"] > 0 and proxy.counts["reset"] > 0, proxy.counts


def test_missing_bucket_is_one_line_exit_3(s3):
    proc = resume("ls", "s3://no-such-bucket/run", timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and "no-such-bucket" in proc.stderr


def test_wrong_or_missing_credentials_are_one_line_exit_3_without_retrying(s3, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    started = __import__("time").monotonic()
    proc = resume("ls", RUN, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and RUN in proc.stderr and "access" in proc.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    env.update(AWS_SHARED_CREDENTIALS_FILE="/nonexistent", AWS_CONFIG_FILE="/nonexistent")
    proc = resume("save", RUN, "--timeout", "5", timeout=120, env=env)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "credentials: expected valid ones" in proc.stderr and proc.stderr.count("\n") == 1
    assert __import__("time").monotonic() - started < 60  # permanent: not retried with back-off


def test_unknown_url_scheme_names_the_package_to_install(tmp_path):
    proc = resume("ls", "gs://bucket/run", timeout=120)
    assert proc.returncode == 2 and "pip install gcsfs" in proc.stderr, proc.stderr


def test_journal_and_rewind_on_an_object_store(s3):
    """The journal's open records go up at each seal and at close (an object cannot be appended
    to); the rewind's moves are copies and deletes there; all through the faulty proxy."""
    import s3fs
    from support.workloads import Setup, build, train

    # In this process, not a spawned one: fsspec would hand back a file system made by an earlier
    # test of the module for another server's endpoint.
    s3fs.S3FileSystem.clear_instance_cache()
    coord, parts = build(0, 1, RUN, Setup(every=3))
    coord.restore()
    train(coord, parts, until=7, skip={2})  # saves at 3 and 6; 7 is not sealed
    coord.close()
    out = json.loads(resume("journal", RUN, "--json", timeout=300).stdout)
    branches = {b["name"]: [r["it"] for r in b["records"]] for b in out["branches"]}
    assert branches == {"main": [1, 2, 3, 4, 5, 6], "unsealed": [7]}
    assert [r["ok"] for r in out["branches"][0]["records"]] == [True, False, True, True, True, True]
    proc = resume("rewind", RUN, "--to", "3", "--reason", "on s3", "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr
    coord, parts = build(0, 1, RUN, Setup(every=3))
    coord.restore()
    assert coord.restored_from == 3 and coord.rewinds[0]["n"] == 1
    coord.close()
    listing = json.loads(resume("ls", RUN, "--json", timeout=300).stdout)
    assert [c["step"] for c in listing["checkpoints"]] == [3] and listing["abandoned"][0]["steps"] == [6]


def test_export_and_warm_start_from_an_object_store(s3, tmp_path):
    """``resume export`` reads a run on S3 (each object once, hashed) and a new local run
    warm-starts from it, through the faulty proxy."""
    import s3fs
    import torch
    from safetensors.torch import load_file
    from support.workloads import Setup, build, param_digests, train

    s3fs.S3FileSystem.clear_instance_cache()
    coord, parts = build(0, 1, RUN, Setup(every=3))
    coord.restore()
    train(coord, parts, until=6)
    coord.close()
    weights = {k: v.clone() for k, v in parts["model"].state_dict().items()}
    out = str(tmp_path / "out")
    proc = resume("export", RUN, out, "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["step"] == 6
    exported = load_file(os.path.join(out, "model-00001-of-00001.safetensors"))
    assert exported.keys() == weights.keys() and all(torch.equal(exported[k], weights[k]) for k in weights)

    coord, parts = build(0, 1, str(tmp_path / "B"), Setup(every=3, seed=5, warm_start=RUN))
    coord.restore()
    coord.close()
    assert param_digests(parts["model"]) == param_digests(_module(weights))
    assert coord.origin["source"] == RUN and coord.origin["step"] == 6


def _module(state: dict):
    """A module whose state_dict is ``state`` (for its digests)."""
    from resume.drill.model import TinyGPT
    from support.workloads import CFG

    model = TinyGPT(CFG)
    model.load_state_dict(state)
    return model
