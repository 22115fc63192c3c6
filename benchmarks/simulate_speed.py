"""How long `resume simulate` takes for 90 days of the reference run (goal: < 10 s).

Prints the time of the full report (interval search over 32 failure histories,
spares table) next to a baseline measured in the same run: one plain pass over
one 90-day failure history, so the ratio says what the search costs.

    python benchmarks/simulate_speed.py
"""

from __future__ import annotations

import time

from resume.cluster.simulate import Assumptions, failure_times, report, simulate


def timed(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    a = Assumptions()
    history = failure_times(a)
    baseline = timed(lambda: simulate(a, 1500.0, history))
    full = timed(lambda: report(a))
    print(f"one pass over 90 days ({len(history)} failures): {baseline * 1e3:8.2f} ms  (baseline)")
    print(f"full report (interval search + spares):      {full * 1e3:8.2f} ms  "
          f"= {full / baseline:6.0f} x baseline")
    print(f"goal: 90 simulated days < 10 s  -> {full / 10:.3f} of the budget")


if __name__ == "__main__":
    main()
