"""A free TCP port on loopback, for servers and process groups the tests start.

The port is free when returned and bound later by another process, so it must not be handed out
in between: it comes from a block of this pytest-xdist worker's own (gw0, gw1, ...; one block
without xdist), below the kernel's ephemeral range (32768 and up), where no bind(0) or outgoing
connection of another test lands. The blocks (10000-15999) miss Slurm's fixed ports
(tests/support/slurm_cluster.sh: 6817, 17001-17004) and the hook's MASTER_PORT (20000 and up).
"""

from __future__ import annotations

import itertools
import os
import random
import socket

BASE, BLOCK, BLOCKS = 10000, 500, 12


def _block_start() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    return BASE + (index % BLOCKS) * BLOCK


# A random start: a spawned child of a test process picks on from elsewhere in the block.
_next = itertools.count(random.randrange(BLOCK))


def free_port() -> int:
    start = _block_start()
    for _ in range(BLOCK):
        port = start + next(_next) % BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {start}-{start + BLOCK - 1}")
