"""torchtitan 0.3.0's own components under ``resume``: examples/torchtitan_train.py on 2 gloo ranks.

The example trains torchtitan's llama3 (fused QKV) with FSDP2, its OptimizersContainer,
LRSchedulersContainer and ParallelAwareDataloader. Covered: a run SIGKILLed between two
saves and restarted ends bitwise like an uninterrupted one (losses, LRs, batches,
parameters, AdamW moments); the 2-rank checkpoint is refused on 1 rank, since the loader's
state is one data-parallel rank's; the container is saved with its moments, and an
optimizer that hides its optimizers is refused. Needs ``pip install torchtitan==0.3.0
triton`` (triton: torchtitan imports it even on CPU); skipped without them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from support.ports import free_port

from resume import UsageError
from resume.run import Run

if os.environ.get("RESUME_REQUIRE_TORCHTITAN") == "1":  # CI: a missing torchtitan fails, never skips
    import torchtitan  # noqa: F401
    import triton  # noqa: F401
else:
    pytest.importorskip("torchtitan")
    pytest.importorskip("triton")

pytestmark = [pytest.mark.torchtitan, pytest.mark.multiprocess]

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                       "torchtitan_train.py")
STEPS, EVERY, KILL_AT = 8, 2, 5
LAUNCH_TIMEOUT_S = 180


def launch(nproc: int, run: str, assets: str, *, steps: int = STEPS, summary: str | None = None,
           env: dict | None = None) -> subprocess.CompletedProcess:
    """The example under torchrun (``python -m torch.distributed.run``) on ``nproc`` gloo ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", EXAMPLE,
           "--run-dir", run, "--assets", assets, "--steps", str(steps), "--every", str(EVERY)]
    if summary:
        cmd += ["--summary", summary]
    full_env = {k: v for k, v in os.environ.items() if k != "RESUME_EXAMPLE_KILL_AT"}
    full_env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})})
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S,
                          check=False)


def printed_steps(out: str) -> dict[int, tuple[float, float]]:
    """{step: (loss, lr)} from rank 0's ``step N loss L lr R`` lines (reprs: exact floats)."""
    return {int(m[1]): (float(m[2]), float(m[3]))
            for m in re.finditer(r"^step (\d+) loss (\S+) lr (\S+)$", out, re.MULTILINE)}


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """An uninterrupted run of STEPS steps, and one SIGKILLed right after step KILL_AT (its last
    save at KILL_AT - 1) then restarted to STEPS; both on 2 ranks, from the same assets."""
    root = tmp_path_factory.mktemp("titan")
    assets = str(root / "assets")
    out: dict = {"root": root, "assets": assets}
    whole = ok(launch(2, str(root / "whole"), assets, summary=str(root / "whole.json")))
    out["whole"] = json.loads((root / "whole.json").read_text())
    out["whole_printed"] = printed_steps(whole.stdout)
    out["killed"] = launch(2, str(root / "killed"), assets, env={"RESUME_EXAMPLE_KILL_AT": str(KILL_AT)})
    restarted = ok(launch(2, str(root / "killed"), assets, summary=str(root / "restarted.json")))
    out["restarted"] = json.loads((root / "restarted.json").read_text())
    out["restarted_stderr"] = restarted.stderr
    return out


def test_killed_and_restarted_run_ends_bitwise_like_an_uninterrupted_one(runs):
    whole, restarted = runs["whole"], runs["restarted"]
    killed = runs["killed"]
    assert killed.returncode != 0
    assert sorted(printed_steps(killed.stdout)) == list(range(1, KILL_AT + 1))
    # Before the kill: the same steps as the whole run, to the last bit.
    assert printed_steps(killed.stdout) == {s: runs["whole_printed"][s] for s in range(1, KILL_AT + 1)}

    last_save = KILL_AT - KILL_AT % EVERY
    assert whole["restored_from"] is None
    assert restarted["restored_from"] == last_save
    assert "continuity ok" in runs["restarted_stderr"]
    assert [s["step"] for s in restarted["steps"]] == list(range(last_save + 1, STEPS + 1))
    after = whole["steps"][last_save:]
    assert [s["loss"] for s in restarted["steps"]] == [s["loss"] for s in after]
    assert [s["lr"] for s in restarted["steps"]] == [s["lr"] for s in after]
    assert [s["batch"] for s in restarted["steps"]] == [s["batch"] for s in after]
    assert len(whole["params"]) == 17 and restarted["params"] == whole["params"]
    assert restarted["moments"] == whole["moments"]
    assert all({"exp_avg", "exp_avg_sq", "step"} <= set(m) for m in whole["moments"].values())
    # The LR moved over the run (warm-up, then decay): a frozen schedule would also compare equal.
    assert len({s["lr"] for s in whole["steps"]}) > 3


def test_two_rank_checkpoint_is_refused_on_one_rank_naming_the_loader_state(runs, tmp_path):
    run = str(tmp_path / "run")
    shutil.copytree(str(runs["root"] / "whole"), run)
    before = Run.open(run).committed_steps()
    proc = launch(1, run, runs["assets"], steps=STEPS + 2)
    assert proc.returncode != 0
    assert ("continuity check failed: data.dp_world_size: expected 2 (as saved), actual 1 "
            "(HuggingFaceTextDataLoader keeps one state per data-parallel rank") in proc.stderr
    assert "step " not in proc.stdout  # refused before any step
    assert Run.open(run).committed_steps() == before  # nothing called corrupt or moved aside


def test_optimizers_container_is_saved_with_its_moments(runs):
    from torch.distributed.checkpoint import FileSystemReader

    step_dir = str(runs["root"] / "whole" / f"step-{STEPS:09d}")
    keys = set(FileSystemReader(step_dir).read_metadata().state_dict_metadata)
    fused = "layers.0.attention.qkv_linear.wqkv.weight"
    assert {f"optim.state.{fused}.exp_avg", f"optim.state.{fused}.exp_avg_sq", f"optim.state.{fused}.step"} <= keys
    assert sum(1 for k in keys if k.startswith("optim.state.") and k.endswith(".exp_avg")) == 17
    # The model as its own state_dict() gives it: FusedQKVLinear's hooks split wqkv into wq, wk, wv.
    assert {"model.layers.0.attention.qkv_linear.wq.weight", "model.layers.0.attention.qkv_linear.wk.weight"} <= keys


class HiddenOptimizers(torch.optim.Optimizer):
    """A container that keeps its optimizers where the adapter does not look, and whose own
    param groups carry no settings (as torchtitan's container's do)."""

    def __init__(self, params) -> None:
        params = list(params)
        self.inner = [torch.optim.AdamW(params, lr=1e-3)]
        super().__init__(params, {})

    def step(self, closure=None):
        for opt in self.inner:
            opt.step()


def test_optimizer_hiding_its_optimizers_is_refused_at_construction():
    from resume.adapters.torch_native import NativeTorchAdapter

    model = torch.nn.Linear(4, 4)
    with pytest.raises(UsageError, match=r"optimizers\[0\] \(HiddenOptimizers\): expected param groups "
                                         r"with 'lr'"):
        NativeTorchAdapter(model, HiddenOptimizers(model.parameters()), None, None)
