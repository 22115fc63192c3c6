"""Smoke test of benchmarks/save_path.py at a tiny size: it runs and its JSON line holds the
figures it promises (no timing assertions: CI machines vary)."""

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_save_path_benchmark_json(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "save_path.py"), "--gib", "0.02", "--runs", "1",
         "--pause", "0", "--every", "50", "--drop", "fadvise", "--dir", str(tmp_path), "--json"],
        check=False, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])

    for key in ("save_vs_dcp", "async_stall_vs_dcp_async", "restore_vs_dcp_load", "update_us", "gib",
                "update_us_hang_on", "update_us_hang_off", "update_hang_on_vs_off", "update_us_hang_on_median",
                "update_us_hang_off_median"):
        assert isinstance(result[key], float) and math.isfinite(result[key]) and result[key] > 0, key
    assert result["runs"] == 1
    assert abs(result["gib"] - 0.02) < 0.002
    seconds = result["seconds"]
    for key in ("ours_save", "dcp_save", "ours_async_stall", "dcp_async_stall", "ours_restore", "dcp_load",
                "ours_first_save", "dcp_first_save", "ours_first_async_stall", "dcp_first_async_stall"):
        assert math.isfinite(seconds[key]) and seconds[key] > 0, key
    # A process's first save, each side in a fresh process: plain / ours, ours / DCP's.
    assert result["first_save_vs_dcp"] == seconds["dcp_first_save"] / seconds["ours_first_save"]
    assert result["first_async_stall_vs_dcp_async"] == seconds["ours_first_async_stall"] / seconds["dcp_first_async_stall"]
    assert [sorted(r) for r in result["first_per_run"]] == [["first_async_stall_vs_dcp_async", "first_save_vs_dcp",
                                                             "ours_first"]]
    assert 0 < result["update_calls"] < 50  # the not-due iterations before the save at 50
    # Hang detection on and off: a fresh Coordinator each, on, off, off, on, 49 not-due updates each.
    assert result["update_hang_calls"] == 2 * 49
    assert result["update_hang_on_vs_off"] == result["update_us_hang_on"] / result["update_us_hang_off"]
    assert result["machine"]["cores"] >= 1 and result["machine"]["torch"]
    assert set(result["goals_met"]) == {"save_vs_dcp", "async_stall_vs_dcp_async", "restore_vs_dcp_load",
                                        "update_us", "update_us_hang_on", "first_save_vs_dcp",
                                        "first_async_stall_vs_dcp_async"}
    table = proc.stdout[proc.stdout.index("hang detection on (default) | off | on / off | budget |"):]
    assert f"| mean | {result['update_us_hang_on']:.1f} µs | {result['update_us_hang_off']:.1f} µs | " in table
    assert "≤ 50 µs (" in table.splitlines()[2]
    assert [sorted(r) for r in result["per_run"]] == [["async_stall_vs_dcp_async", "ours_first", "restore_vs_dcp_load",
                                                       "save_vs_dcp"]]
    assert not any(tmp_path.iterdir()), "the benchmark left files behind"
