"""``resume drill``: train a tiny GPT with and without SIGKILLs and resumes; compare bitwise."""

from __future__ import annotations

import click

from ..errors import EXIT_OK, EXIT_PROBLEM, DrillFailed, UsageError
from .common import command, emit_json, json_option

__all__ = ["drill"]


@click.command()
@click.option("--run", "run_url", default=None,
              help="Run directory (local path or fsspec URL) of the drilled run; default a new "
                   "temporary directory. Its checkpoints stay there for verify/ls/inspect.")
@click.option("--ranks", type=int, default=2, show_default=True, help="Processes (gloo, CPU).")
@click.option("--iterations", type=click.IntRange(min=2), default=40, show_default=True)
@click.option("--every", type=click.IntRange(min=1), default=5, show_default=True,
              help="Checkpoint interval in iterations.")
@click.option("--kills", type=click.IntRange(min=0), default=2, show_default=True,
              help="SIGKILLs at random iterations after a checkpoint.")
@click.option("--seed", type=int, default=0, show_default=True)
@json_option
@command
def drill(run_url: str | None, ranks: int, iterations: int, every: int, kills: int, seed: int,
          as_json: bool) -> int:
    """The resume drill: train a tiny GPT straight through, then again with SIGKILLs and
    resumes, and compare parameters, moments, LR and loss traces and counters bitwise.

    Exits 0 only if everything is identical.
    """
    try:
        from ..drill.runner import DrillConfig, format_table, run_drill
    except ImportError as e:
        raise UsageError(f"resume drill needs torch: expected it installed, actual {e} "
                         "(pip install torch==2.13.0)") from e
    cfg = DrillConfig(run=run_url, ranks=ranks, iterations=iterations, every=every, kills=kills,
                      seed=seed)
    say = (lambda s: None) if as_json else (lambda s: click.echo(s, err=True))
    try:
        result = run_drill(cfg, say=say)
    except RuntimeError as e:
        raise DrillFailed(str(e)) from e
    if as_json:
        emit_json(result.to_dict())
    else:
        click.echo(format_table(result))
    return EXIT_OK if result.identical else EXIT_PROBLEM
