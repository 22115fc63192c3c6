"""Simulation of a long run on many nodes: failures, hangs, checkpoint stalls, restarts, spares.

Every node fails independently (exponential or Weibull times between failures, renewed when a
node is replaced); a failure loses the work since the last committed checkpoint and costs a
restart: on a hot spare when one is free, else (as the hook does) on fewer replicas until the next
requeue, or with ``no_spare='requeue'`` a requeue. Repaired nodes refill the spare pool.

Every node also hangs independently (exponential, from its own random stream: a zero hang rate
leaves the failures and the results exactly as without hangs). A hang loses the work since the
last checkpoint, then ``hang_detect_s`` with nothing trained (the watchdog's bound, the stack
reports, the stop), then a restart on a spare (the hung node goes to repair) or, none free, on the
same nodes: ``restart_spare_s`` either way, no shrink.

Training alternates ``interval`` seconds of work with a checkpoint stall; stall, restart and hang
detection times default to the reference figures (``reference.simulate_defaults``). Goodput =
useful training time / wall time; the best interval is searched on a grid over the same
interruptions for every candidate and set beside Young/Daly's ``sqrt(2 * stall * MTBF)``, the
MTBF counting failures and hangs alike.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import asdict, dataclass, field, replace
from typing import NamedTuple

from resume.errors import UsageError

from .reference import simulate_defaults

__all__ = ["Assumptions", "Interruption", "SimResult", "best_interval", "failure_times", "plan_spares",
           "simulate", "young_daly"]

DAY = 86400.0

# Llama 3 (Meta, 2024): 419 unexpected interruptions in 54 days on 16,384 GPUs.
LLAMA3_FAILURES_PER_GPU_SECOND = 419 / (54 * DAY * 16384)

HANG_SHARE = 0.1
"""Assumed, neither measured nor published: hangs per node are a tenth of Llama 3's interruption
rate per node (8 GPUs), on top of the failures. Pass a cluster's own rate where it is known."""
ASSUMED_HANGS_PER_NODE_DAY = HANG_SHARE * LLAMA3_FAILURES_PER_GPU_SECOND * 8 * DAY
HANG_RATE_SOURCE = (f"assumed: {HANG_SHARE:g} x Llama 3's interruption rate per node (419 in 54 days "
                    f"on 16,384 GPUs, 8 GPUs per node); no published hang rate; set --hang-rate-per-node-day")

# The reference run's stall and restart times (cluster/reference.py: measured control plane,
# assumed file system bandwidth and start-up, computed sums), not guessed constants.
REFERENCE_TIMES = {name: figure.value for name, figure in simulate_defaults().items()}


@dataclass(frozen=True, kw_only=True)
class Assumptions:
    """What the simulation assumes; printed with every result."""

    nodes: int = 640
    """Nodes that train (one failure stops the job)."""
    gpus_per_node: int = 8
    spares: int = 0
    """Hot-spare nodes inside the allocation."""
    node_mtbf_s: float = 1 / (8 * LLAMA3_FAILURES_PER_GPU_SECOND)
    """Mean time between failures of one node (default: Llama 3's rate, 8 GPUs per node)."""
    distribution: str = "exponential"
    """'exponential' or 'weibull' times between failures of a node."""
    weibull_shape: float = 0.7
    """Weibull shape k (< 1: infant mortality, failures cluster after a replacement)."""
    stall_s: float = REFERENCE_TIMES["stall_s"]
    """Training time lost to each checkpoint (the blocking part of a save); default: the
    reference run's asynchronous save (cluster/reference.py)."""
    restart_spare_s: float = REFERENCE_TIMES["restart_spare_s"]
    """Detect, relaunch on a spare inside the allocation, load the checkpoint; default: the
    reference run's (cluster/reference.py)."""
    restart_requeue_s: float = REFERENCE_TIMES["restart_requeue_s"]
    """No spare free: requeue excluding the bad node, wait in the queue, load; default: the
    reference run's (cluster/reference.py)."""
    hang_rate_per_node_day: float = ASSUMED_HANGS_PER_NODE_DAY
    """Hangs per node per day (a rank stops making progress without dying), independent of the
    failures; default ASSUMED (``HANG_SHARE``: a tenth of Llama 3's interruption rate)."""
    hang_detect_s: float = REFERENCE_TIMES["hang_detect_s"]
    """Nothing trains from a hang until its step is gone (the watchdog's bound, the stack reports,
    the stop); the restart follows. Default: the reference run's (cluster/reference.py)."""
    repair_s: float = 3 * DAY
    """Until a failed node is back (it then joins the spare pool)."""
    no_spare: str = "shrink"
    """No spare free: 'shrink' (what the hook does: fewer replicas until the next requeue)
    or 'requeue' (queue wait and restart at full size)."""
    shrink_factor: float = 64 / 80
    """Speed after a shrink relative to full size (reference: DP 80 -> 64)."""
    requeue_every_s: float = DAY
    """The job's time limit: each requeue starts at full size again."""
    days: float = 90.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.no_spare not in ("shrink", "requeue"):
            raise UsageError(f"simulate: no_spare: expected 'shrink' or 'requeue', actual {self.no_spare!r}")
        if not 0 < self.shrink_factor <= 1 or not self.requeue_every_s > 0:
            raise UsageError("simulate: shrink_factor: expected 0 < f <= 1 and requeue_every_s > 0, "
                             f"actual {self.shrink_factor}, {self.requeue_every_s}")
        if self.distribution not in ("exponential", "weibull"):
            raise UsageError(f"distribution: expected 'exponential' or 'weibull', actual {self.distribution!r}")
        for name in ("nodes", "node_mtbf_s", "days", "weibull_shape", "stall_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise UsageError(f"simulate: {name}: expected a finite number > 0, actual {value}")
        for name in ("spares", "restart_spare_s", "restart_requeue_s", "repair_s", "hang_rate_per_node_day",
                     "hang_detect_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise UsageError(f"simulate: {name}: expected a finite number >= 0, actual {value}")
        if not 0.1 <= self.weibull_shape <= 10:
            raise UsageError(f"simulate: weibull_shape: expected 0.1..10, actual {self.weibull_shape}")
        expected = self.days * DAY / self.system_mtbf_s
        if expected > 50_000:
            raise UsageError(f"simulate: node_mtbf_s: expected at most 50,000 job failures in "
                             f"{self.days:g} days, actual about {expected:,.0f} (MTBF too short)")
        hangs = self.days * self.nodes * self.hang_rate_per_node_day
        if hangs > 50_000:
            raise UsageError(f"simulate: hang_rate_per_node_day: expected at most 50,000 job hangs in "
                             f"{self.days:g} days, actual about {hangs:,.0f}")

    @property
    def system_mtbf_s(self) -> float:
        """Mean time between failures of the whole job (any of its nodes)."""
        return self.node_mtbf_s / self.nodes

    @property
    def interruption_mtbf_s(self) -> float:
        """Mean time between the job's failures and hangs: each loses the work since the last
        checkpoint (Young/Daly's MTBF). Exactly ``system_mtbf_s`` at a zero hang rate."""
        return self.system_mtbf_s / (1 + self.node_mtbf_s * self.hang_rate_per_node_day / DAY)


@dataclass
class SimResult:
    interval_s: float
    goodput: float
    failures: int
    failures_without_spare: int
    work_lost_s: float
    restart_s: float
    stall_total_s: float
    wall_s: float
    hangs: int
    hang_detect_total_s: float
    """Time nothing trained between hangs and the end of their steps (``hang_detect_s`` each)."""
    extra: dict = field(default_factory=dict)


class Interruption(NamedTuple):
    """One failure or hang of the job: when, and whether a spare was free for it."""

    t: float
    has_spare: bool
    hang: bool = False


def young_daly(stall_s: float, mtbf_s: float) -> float:
    return math.sqrt(2 * stall_s * mtbf_s)


def _draw(rng: random.Random, a: Assumptions) -> float:
    if a.distribution == "exponential":
        return rng.expovariate(1 / a.node_mtbf_s)
    scale = a.node_mtbf_s / math.gamma(1 + 1 / a.weibull_shape)  # same mean
    return rng.weibullvariate(scale, a.weibull_shape)


def _failure_clocks(rng: random.Random, a: Assumptions) -> list[tuple[float, int, bool]]:
    """Every node's first failure, as ``(time, node, False)``."""
    clocks = [(_draw(rng, a), n, False) for n in range(a.nodes)]
    if a.distribution != "weibull":
        return clocks
    # Nodes have been in service a while when the run starts: roll each
    # node's renewal process forward from far in the past, so the run sees
    # the steady failure rate 1/MTBF, not the burst of brand-new nodes. (The draws above are
    # discarded, not skipped: every seed keeps the history it has always had.)
    warmup = 5 * a.node_mtbf_s
    clocks = []
    for n in range(a.nodes):
        t = -warmup + _draw(rng, a)
        while t < 0:
            t += _draw(rng, a)
        clocks.append((t, n, False))
    return clocks


def _draw_hang(rng: random.Random, a: Assumptions) -> float:
    return rng.expovariate(a.hang_rate_per_node_day / DAY)


def failure_times(a: Assumptions) -> list[Interruption]:
    """Wall-clock failures and hangs of the job and whether a spare was free for each.

    Independent of the checkpoint interval (failures and hangs happen to nodes, whatever the job
    is doing), so every candidate interval sees the same ones. Hangs draw from a random stream
    of their own: the failures are the same at any hang rate. A hung node that a spare replaces
    keeps its slot's failure clock (exact for exponential failures).
    """
    rng, hang_rng = random.Random(a.seed), random.Random(f"hangs/{a.seed}")
    horizon = a.days * DAY
    clocks = _failure_clocks(rng, a)
    if a.hang_rate_per_node_day > 0:
        clocks += [(_draw_hang(hang_rng, a), n, True) for n in range(a.nodes)]
    heapq.heapify(clocks)
    spares_free = a.spares
    repairs: list[float] = []
    out = []
    while clocks and clocks[0][0] < horizon:
        t, slot, hang = heapq.heappop(clocks)
        while repairs and repairs[0] <= t:
            heapq.heappop(repairs)
            spares_free += 1
        has_spare = spares_free > 0
        if has_spare:
            # The spare swaps in; the failed (or hung) node is repaired and rejoins the pool.
            # Without one, the requeued job gets another node from the cluster and the failed
            # one leaves the allocation for good; a hang relaunches on the same nodes.
            spares_free -= 1
            heapq.heappush(repairs, t + a.repair_s)
        out.append(Interruption(t, has_spare, hang))
        renewed = _draw_hang(hang_rng, a) if hang else _draw(rng, a)
        heapq.heappush(clocks, (t + renewed, slot, hang))  # the slot gets a fresh node
    return out


def simulate(a: Assumptions, interval_s: float, failures: list[Interruption] | None = None) -> SimResult:
    """Goodput of one checkpoint interval over the assumed run (``failures``: ``failure_times(a)``)."""
    if interval_s <= 0:
        raise UsageError(f"interval: expected > 0 seconds, actual {interval_s}")
    events = failure_times(a) if failures is None else failures
    horizon = a.days * DAY
    run = _Timeline(a, interval_s)
    for e in events:
        if e.hang:
            run.hang(e.t)
        else:
            run.fail(e.t, e.has_spare)
    run.finish(horizon)
    wall = max(horizon, run.t)
    hangs = sum(e.hang for e in events)
    return SimResult(interval_s=interval_s, goodput=run.useful / wall, failures=len(events) - hangs,
                     failures_without_spare=sum(not (e.has_spare or e.hang) for e in events),
                     work_lost_s=run.lost, restart_s=run.restarts, stall_total_s=run.stalls, wall_s=wall,
                     hangs=hangs, hang_detect_total_s=run.detecting)


@dataclass
class _Timeline:
    """One simulated run, interruption after interruption: its clock, and what the time went to."""

    a: Assumptions
    interval_s: float
    t: float = 0.0
    """When the training (re)started last, or will once the restart in progress is done."""
    slow_until: float = 0.0
    """Shrunk (fewer replicas) until the next requeue gives full size back."""
    useful: float = 0.0
    lost: float = 0.0
    restarts: float = 0.0
    stalls: float = 0.0
    detecting: float = 0.0
    hung_until: float = 0.0
    """The end of the last hang's detection (its step stopped; the restart follows)."""

    def fail(self, when: float, has_spare: bool) -> None:
        if when < self.t:  # failed while restarting: the restart starts over
            if when < self.hung_until:  # a crash ends the hung step at once: detection stops here
                self.detecting -= self.hung_until - when
                self.restarts += self.hung_until - when
                self.hung_until = when
            restart = self._restart_after(when, has_spare)
            self.restarts += (when + restart) - self.t
            self.t = when + restart
            return
        committed, uncommitted, stalled = self._work_until(when)
        self.useful += committed
        self.lost += uncommitted
        self.stalls += stalled
        restart = self._restart_after(when, has_spare)
        self.restarts += restart
        self.t = when + restart

    def hang(self, when: float) -> None:
        """Nothing trains for ``hang_detect_s``, then the step restarts on a spare or the same
        nodes; a hang while hung is found by the same detection."""
        a = self.a
        if when < self.hung_until:
            return
        if when < self.t:  # the restart hung: what it had left is not spent, it starts over
            self.restarts -= self.t - when
        else:
            committed, uncommitted, stalled = self._work_until(when)
            self.useful += committed
            self.lost += uncommitted
            self.stalls += stalled
        self.detecting += a.hang_detect_s
        self.hung_until = when + a.hang_detect_s
        self.restarts += a.restart_spare_s
        self.t = self.hung_until + a.restart_spare_s

    def finish(self, horizon: float) -> None:
        if self.t < horizon:
            committed, uncommitted, stalled = self._work_until(horizon)
            self.useful += committed + uncommitted  # the run's end is not a failure
            self.stalls += stalled

    def _work_until(self, end: float) -> tuple[float, float, float]:
        """Committed work, uncommitted work and stall time from t (fresh start) to end,
        work counted at full-size speed (a shrunk stretch at ``shrink_factor``)."""
        a, cycle = self.a, self.interval_s + self.a.stall_s
        span = max(0.0, end - self.t)
        full = math.floor(span / cycle)
        rest = span - full * cycle
        slow = max(0.0, min(end, self.slow_until) - self.t)
        speed = 1.0 if span == 0 else (slow * a.shrink_factor + (span - slow)) / span
        return (full * self.interval_s * speed, min(rest, self.interval_s) * speed,
                full * a.stall_s + max(0.0, rest - self.interval_s))

    def _restart_after(self, when: float, has_spare: bool) -> float:
        a = self.a
        if has_spare:
            return a.restart_spare_s
        if a.no_spare == "shrink":
            # Relaunch inside the allocation on fewer replicas until the job's
            # next requeue (its time limit) brings a full-size allocation back.
            self.slow_until = max(self.slow_until,
                                  (math.floor(when / a.requeue_every_s) + 1) * a.requeue_every_s)
            return a.restart_spare_s
        return a.restart_requeue_s


def best_interval(a: Assumptions, *, points: int = 41, replications: int = 32) -> tuple[SimResult, float]:
    """The interval with the best mean goodput on a log grid around Young/Daly, and Young/Daly's.

    Each candidate sees the same ``replications`` independent failure histories
    (seeds ``seed .. seed+replications-1``): the goodput curve is flat near its
    top, and one history alone would pick its maximum by chance.
    """
    yd = young_daly(a.stall_s, a.interruption_mtbf_s)
    histories = [failure_times(replace(a, seed=a.seed + i)) for i in range(replications)]
    grid = [yd * 4 ** ((i - points // 2) / (points // 2)) for i in range(points)]  # yd/4 .. yd*4
    best: SimResult | None = None
    best_mean = -1.0
    for t in grid:
        runs = [simulate(a, t, h) for h in histories]
        mean = sum(r.goodput for r in runs) / len(runs)
        if mean > best_mean:
            best_mean = mean
            best = _mean_result(t, runs)
    assert best is not None
    return best, yd


def _mean_result(interval_s: float, runs: list[SimResult]) -> SimResult:
    """The mean of ``runs`` (counts rounded), all of one interval."""
    def mean(name: str) -> float:
        return sum(getattr(r, name) for r in runs) / len(runs)

    return SimResult(interval_s=interval_s, goodput=mean("goodput"), failures=round(mean("failures")),
                     failures_without_spare=round(mean("failures_without_spare")),
                     work_lost_s=mean("work_lost_s"), restart_s=mean("restart_s"),
                     stall_total_s=mean("stall_total_s"), wall_s=mean("wall_s"), hangs=round(mean("hangs")),
                     hang_detect_total_s=mean("hang_detect_total_s"))


def plan_spares(a: Assumptions, interval_s: float, *, max_spares: int = 32) -> tuple[int, list[dict]]:
    """Spares that maximise goodput per node of the allocation (idle spares cost nodes too)."""
    rows = []
    for s in range(max_spares + 1):
        r = simulate(replace(a, spares=s), interval_s)
        per_node = r.goodput * a.nodes / (a.nodes + s)
        rows.append({"spares": s, "goodput": r.goodput, "goodput_per_node": per_node,
                     "failures_without_spare": r.failures_without_spare})
    best = max(rows, key=lambda row: row["goodput_per_node"])
    return best["spares"], rows


def report(a: Assumptions) -> dict:
    best, yd = best_interval(a)
    spares, rows = plan_spares(a, best.interval_s)
    at_spares = simulate(replace(a, spares=a.spares), best.interval_s)
    return {
        "assumptions": asdict(a),
        "system_mtbf_s": a.system_mtbf_s,
        "simulated_days": a.days,
        "failures": best.failures,
        "goodput": best.goodput,
        "best_interval_s": best.interval_s,
        "young_daly_interval_s": yd,
        "interval_ratio": best.interval_s / yd,
        "work_lost_hours": best.work_lost_s / 3600,
        "restart_hours": best.restart_s / 3600,
        "stall_hours": best.stall_total_s / 3600,
        "hangs": best.hangs,
        "hang_detect_hours": best.hang_detect_total_s / 3600,
        "interruption_mtbf_s": a.interruption_mtbf_s,
        "failures_without_spare": at_spares.failures_without_spare,
        "recommended_spares": spares,
        "spares_table": rows,
    }
