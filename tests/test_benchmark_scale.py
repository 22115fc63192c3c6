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
            "restore_bytes_read", "busiest_file_bytes", "index_bytes", "index_write_s", "metadata_write_s",
            "index_rank0_s", "index_read_s", "index_parse_s", "index_select_s", "index_rank0_comm_s",
            "index_other_rank_s", "index_bytes_per_rank", "index_requests_bytes_rank0", "load_plan_s",
            "load_plan_full_metadata_s", "restore_bytes_received_per_rank", "dcp_final_broadcast_bytes",
            "dcp_bytes_per_rank_per_save", "dcp_bytes_per_rank_per_save_cached", "rank0_restore_s",
            "finish_s", "finish_first_s", "finish_changed_s")
MAY_BE_ZERO = ("bytes_per_rank_per_save", "dcp_plan_cached_s", "index_read_s", "index_rank0_comm_s")


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
            assert value > 0 or key in MAY_BE_ZERO, (n, key, value)
        assert figures["metadata_unpickle"] == "measured"
        # A state file and a shard per rank, .metadata and the index.
        assert figures["manifest_files"] == 2 * int(n) + 2
        assert figures["dcp_items_written"] > 0 and figures["restore_bytes_read"] >= figures["busiest_file_bytes"]
        assert figures["dcp_plan_bytes_per_rank_cached"] < figures["dcp_plan_bytes_per_rank"]
        # DCP's end-of-save broadcast carries a summary of the Metadata, not the Metadata.
        assert figures["dcp_final_broadcast_bytes"] < 1024
        # A restore sends no rank .metadata: the index is scattered, each rank its own entries.
        assert figures["restore_broadcasts_of_metadata"] == 0
        assert figures["index_bytes_per_rank"] < figures["index_bytes"]
        assert figures["restore_bytes_received_per_rank"] >= figures["index_bytes_per_rank"]
        assert figures["index_rank0_s"] >= figures["index_select_s"]
    # What must grow with the ranks: what rank 0 gathers, the manifest (a record per file), the
    # reference layout's .metadata and index (their items), the requests rank 0 answers.
    for key in ("rank0_bytes_per_save", "manifest_bytes", "metadata_bytes", "dcp_items_written", "index_bytes",
                "index_requests_bytes_rank0"):
        assert large[key] > small[key], key
    assert small["layout"] == "TP8 x PP1 x DP1" and large["layout"] == "TP8 x PP8 x DP1"
    # What must not grow: what each rank receives per save (a gather to rank 0, one small verdict
    # back; DCP's empty cached plan and its summary), its index answer and what it receives at a
    # restore, and how many ranks read one file at restore.
    per_save = {n: f["bytes_per_rank_per_save"] + f["dcp_bytes_per_rank_per_save_cached"]
                for n, f in result["ranks"].items()}
    assert per_save["64"] <= per_save["8"] + 64 and per_save["64"] < 1024, per_save
    assert large["bytes_per_rank_per_save"] <= 2 * small["bytes_per_rank_per_save"] + 64, (small, large)
    assert large["index_bytes_per_rank"] <= small["index_bytes_per_rank"] + 1024
    assert large["restore_bytes_received_per_rank"] <= small["restore_bytes_received_per_rank"] + 64 * 1024
    assert large["restore_bytes_received_per_rank"] < 4 << 20
    assert all(f["max_readers_per_file"] <= 8 for f in result["ranks"].values())
    growth = result["growth"]
    assert (growth["from"], growth["to"], growth["ranks"]) == (8, 64, 8)
    assert growth["ratio"]["metadata_bytes"] > 1 and growth["ratio"]["index_bytes"] > 1
    assert not any(tmp_path.iterdir()), "the benchmark left files behind"


def test_synthetic_index_requests_are_what_requests_for_makes():
    # The benchmark builds every rank's index requests with numpy; they must be what the adapter's
    # requests_for makes of a state holding exactly the chunks the rank wrote, on every rank.
    code = ("import scale; layout = scale.Layout.of(128); plans = scale.local_plans(layout, 40); "
            "print(scale.requests_agree(scale.Holdings(layout, 40), plans, list(range(layout.ranks))))")
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120,
                          cwd=os.path.join(ROOT, "benchmarks"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
