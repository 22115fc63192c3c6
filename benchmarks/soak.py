"""A longer soak than CI's: randomised save/kill/restore cycles, then the scenario table.

    python benchmarks/soak.py [--cycles 500] [--seed 0] [--s3] [--dir DIR]

Each job arms one fault at a random point of the commit protocol (resume/faults.py), on a
random rank, with a random action (SIGKILL mostly; an exception, ENOSPC or EIO), restores,
trains on and saves every 2 iterations on 2 gloo ranks. After every job the restore must have
loaded the newest checkpoint that passed the deep check before it, and no checkpoint may be
lost except by retention; each run goes on until a job reaches the end, whose state must equal
an uninterrupted run's. ``--s3`` puts every third run on a loopback S3-compatible server (nanio)
behind a proxy failing 5% of requests. Exit 0 when nothing was lost, torn or different.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from support.crash_jobs import soak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--s3", action="store_true", help="every third run on a faulty loopback S3")
    parser.add_argument("--dir", default=None, help="where the runs go (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="resume-soak-", dir=args.dir) as root:
        s3 = proxy = server = None
        if args.s3:
            from support.s3 import FaultProxy, S3Server, s3_env

            server = S3Server(os.path.join(root, "s3data"))
            server.start()
            server.make_bucket("soak")
            proxy = FaultProxy(server, rate=0.05, seed=args.seed).start()
            os.environ.update(s3_env(proxy.endpoint))
            s3 = ("s3://soak", s3_env(proxy.endpoint))
        try:
            report = soak(args.cycles, root=root, seed=args.seed, s3=s3,
                          log=lambda line: print(line, flush=True))
        finally:
            if proxy is not None:
                proxy.stop()
            if server is not None:
                server.stop()
        print(report.table())
        if proxy is not None:
            print(f"object-store faults injected by the proxy: {proxy.counts}")
    return 0 if report.lost == report.torn_loads == report.mismatched_finals == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
