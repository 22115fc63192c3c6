"""Smoke test of benchmarks/export.py at a tiny size: it runs, its JSON line holds the figures it
promises, and the exports it timed are there, whole, and load with the safetensors library (no
timing assertions: CI machines vary)."""

import json
import math
import os
import subprocess
import sys

from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECONDS = ("read_s", "read_hash_s", "copy_s", "export_model_s", "export_all_s", "export_mem_s")


def test_export_benchmark_json(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "export.py"), "--gib", "0.03", "--runs", "1",
         "--pause", "0", "--drop", "fadvise", "--dir", str(tmp_path), "--mem-dir", str(tmp_path / "mem"), "--keep", "--json"],
        check=False, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])

    for key in (*SECONDS, "gib", "export_vs_read", "export_model_vs_read", "peak_vs_largest_tensor"):
        assert isinstance(result[key], float) and math.isfinite(result[key]) and result[key] > 0, key
    assert result["runs"] == 1 and len(result["per_run"]) == 1
    assert abs(result["gib"] - 0.03) < 0.003
    assert result["cache"] in ("dropped", "warm")
    assert result["export_vs_read"] == result["read_s"] / result["export_all_s"]
    assert result["export_mem_vs_read"] == result["read_s"] / result["export_mem_s"]
    assert result["mem_dir"] == str(tmp_path / "mem")
    assert sorted(result["cpu"]) == sorted(key[:-2] for key in SECONDS)
    assert all(c["user_s"] + c["sys_s"] >= 0 and c["minor_faults"] >= 0 for c in result["cpu"].values())

    # Every export reads each data file once, whole; part=all writes about what it read.
    checkpoint = result["checkpoint_bytes"]
    assert checkpoint >= result["state_bytes"] > result["model_bytes"] >= result["largest_tensor_bytes"] > 0
    model, everything = result["exports"]["model"], result["exports"]["all"]
    assert everything["bytes_read"] == model["bytes_read"] == checkpoint + result["index_bytes"]
    assert model["bytes_written"] >= result["model_bytes"] and everything["bytes_written"] >= result["state_bytes"]
    assert everything["bytes_written"] < checkpoint and not everything["rereads"]

    # Memory: a fresh process each, measured; about the largest tensor, not the model.
    peak, largest = result["peak_rss_bytes"], result["largest_tensor_bytes"]
    assert result["peak_rss_reset"] and 0 < peak < 20 * largest + (200 << 20), (peak, largest)
    assert peak == max(result["peak_rss_model_bytes"], result["peak_rss_all_bytes"])

    # The exports were verified by the benchmark and are still there (--keep): the files their
    # records list, of those sizes, loading with the safetensors library under the model's names.
    assert result["kept"] and os.path.isdir(os.path.join(result["kept"], "run"))
    for part, export in result["exports"].items():
        assert export["verified"] is True, part
        assert sorted(export["files"]) == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
        for name, info in export["files"].items():
            assert os.path.getsize(os.path.join(export["out"], name)) == info["size"], (part, name)
        assert os.path.isfile(os.path.join(export["out"], "resume-export.json"))
    tensors = load_file(os.path.join(model["out"], "model-00001-of-00001.safetensors"))
    width = result["width"]
    assert len(tensors) == model["tensors"] == 2 * result["layers"]
    assert all(tensors[name].shape == (width, width) for name in tensors if name.endswith(".weight"))
    assert sum(t.numel() * t.element_size() for t in tensors.values()) == result["model_bytes"]
    assert len(load_file(os.path.join(everything["out"], "model-00001-of-00001.safetensors"))) == everything["tensors"]
