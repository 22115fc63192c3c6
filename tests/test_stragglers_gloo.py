"""A straggler on real gloo ranks: the drill's trainer on 4 processes, the ranks of one "node"
slow after the gradients' all-reduce; each save's gather brings every rank's own iteration time
to rank 0, which names the slowest rank, its node and its factor in the manifest; ``resume
inspect`` shows it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support.cli import resume
from support.ports import free_port

pytestmark = pytest.mark.multiprocess

RANKS, ITERATIONS, EVERY = 4, 10, 5


def test_a_slow_rank_is_named_with_its_node_and_factor_in_the_manifest_and_inspect(tmp_path):
    run, port = str(tmp_path / "run"), free_port()
    procs = []
    for rank in range(RANKS):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(RANKS), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   RESUME_NODE=f"node{rank}")
        cmd = [sys.executable, "-m", "resume.drill.worker", "--run", run, "--iterations", str(ITERATIONS),
               "--every", str(EVERY), "--trace", str(tmp_path / "trace.jsonl"),
               "--final", str(tmp_path / "final.json"), "--slow-node", "node1", "--slow-s", "0.15"]
        with open(tmp_path / f"rank{rank}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0] * RANKS, [(tmp_path / f"rank{r}.log").read_text()[-2000:] for r in range(RANKS)]
    with open(os.path.join(run, f"step-{EVERY:09d}", "manifest.json")) as f:
        found = json.load(f)["stragglers"]
    slowest = found["slowest"][0]
    assert (slowest["rank"], slowest["node"], found["nodes"][0]["node"]) == (1, "node1", "node1"), found
    assert slowest["factor"] > 1.5 and found["ranks"] == RANKS, found  # 0.15 s more than the others
    assert all(s["factor"] < 1.5 for s in found["slowest"][1:])
    shown = resume("inspect", run, "--step", str(EVERY))
    assert shown.returncode == 0, shown.stderr
    line = next(line for line in shown.stdout.splitlines() if "stragglers" in line)
    assert "slowest rank 1 (node node1)" in line and f"x{slowest['factor']:.2f}" in line, line
