"""Smoke test of benchmarks/scale.py at 8 and 64 simulated ranks: it runs the library's save and
restore on a simulated Comm and prints the figures it promises (no timing assertions: CI
machines vary; only what must hold whatever the machine)."""

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REQUIRED = ("bytes_per_rank_per_save", "rank0_save_s", "manifest_parse_s", "metadata_bytes",
            "max_readers_per_file", "dcp_plan_s", "dcp_plan_cached_s", "manifest_bytes", "metadata_unpickle_s",
            "restore_bytes_read", "busiest_file_bytes")


def test_scale_benchmark_json(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "scale.py"), "--ranks", "8,64", "--dir", str(tmp_path),
         "--json"],
        check=False, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])

    assert sorted(result["ranks"]) == ["64", "8"]
    small, large = result["ranks"]["8"], result["ranks"]["64"]
    for n, figures in result["ranks"].items():
        for key in REQUIRED:
            value = figures[key]
            assert isinstance(value, int | float) and math.isfinite(value), (n, key, value)
            assert value > 0 or key in ("bytes_per_rank_per_save", "dcp_plan_cached_s"), (n, key, value)
        assert figures["metadata_unpickle"] == "measured"
        assert figures["manifest_files"] == 2 * int(n) + 1  # a state file and a shard per rank, .metadata
        assert figures["dcp_items_written"] > 0 and figures["restore_bytes_read"] >= figures["busiest_file_bytes"]
        assert figures["dcp_plan_bytes_per_rank_cached"] < figures["dcp_plan_bytes_per_rank"]
    # What must grow with the ranks: what rank 0 gathers, the manifest (a record per file), the
    # reference layout's .metadata (its items).
    for key in ("rank0_bytes_per_save", "manifest_bytes", "metadata_bytes", "dcp_items_written"):
        assert large[key] > small[key], key
    assert small["layout"] == "TP8 x PP1 x DP1" and large["layout"] == "TP8 x PP8 x DP1"
    # What must not grow: what each rank receives per save (a gather to rank 0, one small verdict
    # back; an all-gather made it grow with N), and how many ranks read one file at restore.
    assert large["bytes_per_rank_per_save"] <= 2 * small["bytes_per_rank_per_save"] + 64, (small, large)
    assert large["bytes_per_rank_per_save"] < 1024
    assert all(f["max_readers_per_file"] <= 8 for f in result["ranks"].values())
    growth = result["growth"]
    assert (growth["from"], growth["to"], growth["ranks"]) == (8, 64, 8)
    assert growth["ratio"]["metadata_bytes"] > 1
    assert not any(tmp_path.iterdir()), "the benchmark left files behind"
