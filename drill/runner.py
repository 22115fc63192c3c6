"""The resume drill: an uninterrupted reference run against a run killed and resumed.

1. The reference trains straight through (no checkpoints at all).
2. The drilled run trains with checkpoints every ``every`` iterations; rank 0
   SIGKILLs itself at a random iteration after a checkpoint, the other ranks
   are SIGKILLed at once, and the run is started again from its run
   directory, ``kills`` times (each kill after a checkpoint that the previous
   resume committed: a resume of a resume), then runs to the end.
3. Final parameters, optimizer moments, the LR and loss traces and the
   counters are compared bitwise, and iterations run twice (before a kill and
   again after the resume) must have matched too.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from resume.errors import UsageError

__all__ = ["DrillConfig", "DrillResult", "plan_kills", "run_drill"]


@dataclass(kw_only=True)
class DrillConfig:
    run: str | None = None
    """Run directory of the drilled run; a new temporary directory when None."""
    ranks: int = 2
    iterations: int = 40
    every: int = 5
    kills: int = 2
    seed: int = 0
    timeout_s: float = 300.0
    """Per launch."""

    def __post_init__(self) -> None:
        if self.ranks < 1 or 8 % self.ranks:
            raise UsageError(f"--ranks: expected 1, 2, 4 or 8 (global batch 8), actual {self.ranks}")
        if self.every < 1:
            raise UsageError(f"every: expected >= 1, actual {self.every}")
        windows = max(0, self.iterations // self.every - 1)
        if self.kills < 0 or self.kills > windows:
            raise UsageError(f"--kills: expected 0..{max(windows, 0)} for {self.iterations} iterations "
                             f"with a checkpoint every {self.every}, actual {self.kills}")


@dataclass
class DrillResult:
    identical: bool
    rows: list[dict]
    kills: list[int]
    run: str
    seconds: float
    launches: int = 0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"identical": self.identical, "rows": self.rows, "kills": self.kills, "run": self.run,
                "seconds": round(self.seconds, 2), "launches": self.launches, "notes": self.notes}


def plan_kills(cfg: DrillConfig) -> list[int]:
    """Kill iterations: each strictly after a checkpoint the previous resume committed.

    A kill at iteration k stops the run before k executes. Windows are the
    checkpoint intervals (w*every, (w+1)*every); picking a later window for
    every kill means each resume commits a checkpoint before the next kill.
    """
    rng = random.Random(cfg.seed)
    windows = sorted(rng.sample(range(1, cfg.iterations // cfg.every), cfg.kills))
    return [w * cfg.every + rng.randint(1, cfg.every - 1) + 1 if cfg.every > 1 else w * cfg.every + 1
            for w in windows]


def skipped_iterations(cfg: DrillConfig) -> list[int]:
    return sorted({max(2, cfg.iterations // 5), cfg.iterations // 2 + 1})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(cfg: DrillConfig, *, run: str, every: int, trace: str, final: str, kill_at: int,
            logs: str, tag: str) -> int:
    """Start all ranks; return rank 0's exit code (the others are killed once rank 0 is gone)."""
    port = _free_port()
    procs = []
    for rank in range(cfg.ranks):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(cfg.ranks), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "resume.drill.worker", "--run", run, "--iterations",
               str(cfg.iterations), "--every", str(every), "--seed", str(cfg.seed),
               "--skip", ",".join(map(str, skipped_iterations(cfg))), "--kill-at", str(kill_at),
               "--trace", trace, "--final", final]
        with open(os.path.join(logs, f"{tag}-rank{rank}.log"), "w") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + cfg.timeout_s
    try:
        rc0 = procs[0].wait(timeout=max(1.0, deadline - time.monotonic()))
        if rc0 != 0:
            for p in procs[1:]:
                p.send_signal(signal.SIGKILL)
        for p in procs[1:]:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise RuntimeError(f"drill: {tag} did not finish within {cfg.timeout_s:.0f}s (logs in {logs})")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = [(r, p.returncode) for r, p in enumerate(procs[1:], 1) if rc0 == 0 and p.returncode != 0]
    if bad:
        raise RuntimeError(f"drill: {tag}: ranks {bad} failed (logs in {logs})")
    return rc0


def _read_trace(path: str) -> tuple[dict[int, dict], int, int]:
    """Last record per iteration, and how many replayed records disagreed with an earlier one."""
    records: dict[int, dict] = {}
    mismatched = 0
    replayed = 0
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            it = rec["iteration"]
            key = (rec["loss"], rec["lr"], rec["applied"])
            if it in records:
                replayed += 1
                old = records[it]
                if (old["loss"], old["lr"], old["applied"]) != key:
                    mismatched += 1
            records[it] = rec
    return records, replayed, mismatched


def _digest_of(mapping: dict) -> str:
    from resume.checksum import digest_parts

    return digest_parts(f"{k}={v}" for k, v in sorted(mapping.items()))


def run_drill(cfg: DrillConfig, *, say: Callable[[str], None] = lambda s: None) -> DrillResult:
    started = time.monotonic()
    work = tempfile.mkdtemp(prefix="resume-drill-")
    run = cfg.run or os.path.join(work, "run")
    _require_empty_run(run)
    logs = os.path.join(work, "logs")
    os.makedirs(logs)
    launches = 0

    say(f"drill: reference run, {cfg.iterations} iterations on {cfg.ranks} ranks")
    ref_trace, ref_final = os.path.join(work, "reference.trace"), os.path.join(work, "reference.json")
    launch_ranks(cfg, run=os.path.join(work, "reference-run"), every=0, trace=ref_trace, final=ref_final,
            kill_at=0, logs=logs, tag="reference")
    launches += 1

    kills = plan_kills(cfg)
    trace, final = os.path.join(work, "drilled.trace"), os.path.join(work, "drilled.json")
    for n, kill_at in enumerate(kills, 1):
        say(f"drill: run {n}: SIGKILL at iteration {kill_at}")
        rc = launch_ranks(cfg, run=run, every=cfg.every, trace=trace, final=final, kill_at=kill_at,
                     logs=logs, tag=f"segment{n}")
        launches += 1
        if rc != -signal.SIGKILL:
            raise RuntimeError(f"drill: segment {n}: expected rank 0 killed by SIGKILL, actual exit "
                               f"code {rc} (logs in {logs})")
    say(f"drill: run {len(kills) + 1}: resume and finish")
    rc = launch_ranks(cfg, run=run, every=cfg.every, trace=trace, final=final, kill_at=0, logs=logs,
                 tag="final")
    launches += 1
    if rc != 0:
        raise RuntimeError(f"drill: final segment: expected exit code 0, actual {rc} (logs in {logs})")

    rows = compare_runs(ref_trace, ref_final, trace, final, cfg.iterations)
    return DrillResult(identical=all(r["match"] for r in rows), rows=rows, kills=kills, run=run,
                       seconds=time.monotonic() - started, launches=launches,
                       notes=[f"logs: {logs}"])


def compare_runs(ref_trace: str, ref_final: str, trace: str, final: str, iterations: int) -> list[dict]:
    ref_records, _, _ = _read_trace(ref_trace)
    records, replayed, mismatched = _read_trace(trace)
    with open(ref_final) as f:
        ref = json.load(f)
    with open(final) as f:
        got = json.load(f)
    rows = []

    def row(item: str, a: str, b: str, match: bool) -> None:
        rows.append({"item": item, "reference": a, "resumed": b, "match": bool(match)})

    row("parameters", f"{_digest_of(ref['params'])} ({len(ref['params'])} tensors)",
        f"{_digest_of(got['params'])} ({len(got['params'])} tensors)", ref["params"] == got["params"])
    row("optimizer moments", f"{_digest_of(ref['moments'])} ({len(ref['moments'])} tensors)",
        f"{_digest_of(got['moments'])} ({len(got['moments'])} tensors)", ref["moments"] == got["moments"])
    for key, label in (("lr", "lr trace"), ("loss", "loss trace"), ("applied", "applied/skipped")):
        a = [ref_records.get(i, {}).get(key) for i in range(1, iterations + 1)]
        b = [records.get(i, {}).get(key) for i in range(1, iterations + 1)]
        row(label, f"{_digest_of(dict(enumerate(a)))} ({sum(x is not None for x in a)} its)",
            f"{_digest_of(dict(enumerate(b)))} ({sum(x is not None for x in b)} its)",
            a == b and None not in a)
    c_ref, c_got = ref["counters"], got["counters"]
    fmt = "it={iteration} samples={samples_read} ok={updates_successful} skipped={updates_skipped}"
    row("counters", fmt.format(**c_ref), fmt.format(**c_got), c_ref == c_got)
    row("final lr", repr(ref["lrs"]), repr(got["lrs"]), ref["lrs"] == got["lrs"])
    row("replayed iterations", "-", f"{replayed} replayed, {mismatched} differ", mismatched == 0)
    return rows


def _require_empty_run(run: str) -> None:
    if "://" in run and not run.startswith("file://"):
        from resume.storage import open_storage

        storage = open_storage(run)
        if storage.exists("") and storage.listdir(""):
            raise UsageError(f"{run}: --run: expected a new or empty run directory, actual not empty")
        return
    path = run.removeprefix("file://")
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise UsageError(f"{path}: --run: expected a new or empty run directory, actual not empty")


def format_table(result: DrillResult) -> str:
    width = [max(len(r[k]) for r in result.rows + [{"item": "item", "reference": "reference",
                                                     "resumed": "resumed"}])
             for k in ("item", "reference", "resumed")]
    lines = [f"{'item':<{width[0]}}  {'reference':<{width[1]}}  {'resumed':<{width[2]}}  match"]
    for r in result.rows:
        lines.append(f"{r['item']:<{width[0]}}  {r['reference']:<{width[1]}}  {r['resumed']:<{width[2]}}  "
                     f"{'identical' if r['match'] else 'DIFFERENT'}")
    verdict = "IDENTICAL" if result.identical else "NOT IDENTICAL"
    lines.append(f"kills at iterations {result.kills}; {result.launches} launches; "
                 f"{result.seconds:.1f}s; run: {result.run}")
    lines.append(f"drill: {verdict}")
    return "\n".join(lines)
