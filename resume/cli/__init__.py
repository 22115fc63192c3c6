"""The command line: ``resume save | verify | ls | inspect | journal | rewind | export | plan | simulate | slurm |
drill | megatron``.

One module per command group (``checkpoints``, ``history``, ``export``, ``planning``, ``slurm``, ``drill``,
``megatron``) over library functions that import no click (``resume.verify`` holds verify's
verdicts). Exit codes (every command; ``resume.errors``): 0 ok, 1 problems found or failed,
2 usage error, 3 nothing there (no run, no committed checkpoint), 4 timed out. Errors are
one line on stderr naming the file, the field, the expected and the actual value; with
``--json`` the same error is also printed on stdout as a JSON object of those fields.
"""

from __future__ import annotations

import click

# The adapters' run layouts register themselves at import (cheap: no framework is imported),
# so that every command here detects a framework's own save directory (Megatron-LM's --save).
from ..adapters.megatron import MEGATRON_LAYOUT  # noqa: F401
from .checkpoints import inspect, ls_command, save, verify
from .drill import drill
from .export import export
from .history import journal, rewind
from .megatron import megatron
from .planning import plan, simulate
from .slurm import slurm

__all__ = ["cli", "main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="resume")
def cli() -> None:
    """Committed, verifiable checkpoints, and a continuity check after every restart.

    Exit codes: 0 ok, 1 problems found / failed, 2 usage error, 3 nothing there
    (no run, no committed checkpoint), 4 timed out.
    """


for _command in (save, verify, ls_command, inspect, journal, rewind, export, plan, simulate, slurm, drill, megatron):
    cli.add_command(_command)


def main() -> None:
    cli(prog_name="resume")
