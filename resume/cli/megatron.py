"""``resume megatron args | adopt``: Megatron-LM's arguments, and recording a save of its own.

The Megatron modules (``resume.adapters.megatron.args``, ``resume.adapters.megatron.adopt``)
are imported inside the commands, so ``resume --help`` never imports them.
"""

from __future__ import annotations

import json
import shlex

import click

from ..errors import EXIT_OK, CheckFailed, UsageError
from .common import command, emit_json, json_option

__all__ = ["megatron"]


@click.group()
def megatron() -> None:
    """Megatron-LM: the arguments the orchestrator needs. `verify`, `ls` and `inspect` take a
    Megatron save directory (--save) as RUN."""


@megatron.command(name="args")
@click.option("--save", "save_dir", default=None, help="Megatron's --save/--load directory.")
@click.option("--world-size", type=click.IntRange(min=1), default=None, help="GPUs (default 5120).")
@click.option("--tp", type=click.IntRange(min=1), default=None, help="Tensor-parallel size (default 8).")
@click.option("--pp", type=click.IntRange(min=1), default=None, help="Pipeline-parallel size (default 8).")
@click.option("--save-interval", type=click.IntRange(min=1), default=None,
              help="Iterations between scheduled saves (default 500).")
@click.option("--exit-signal", default=None, help="Signal for --exit-signal-handler (default SIGTERM).")
@click.option("--check", is_flag=True,
              help="Parse and validate them with Megatron's own parser (needs megatron-core).")
@json_option
@command
def megatron_args(save_dir: str | None, world_size: int | None, tp: int | None, pp: int | None,
                  save_interval: int | None, exit_signal: str | None, check: bool, as_json: bool) -> int:
    """Print Megatron-LM's arguments for the reference run (TP8 x PP8 x DP80, 1,920 x 8,192,
    AdamW, sample-based warm-up + cosine, bf16, distributed optimizer) with the checkpoint
    and exit flags `resume` relies on. Exits 0; 1 if --check finds a problem."""
    import dataclasses

    from ..adapters.megatron.args import REFERENCE, check_with_megatron_parser

    given = {"save_dir": save_dir, "world_size": world_size, "tensor_parallel": tp,
             "pipeline_parallel": pp, "save_interval": save_interval, "exit_signal": exit_signal}
    run_args = dataclasses.replace(REFERENCE, **{k: v for k, v in given.items() if v is not None})
    checked = None
    if check:
        try:
            parsed = check_with_megatron_parser(run_args)
        except UsageError as e:
            raise CheckFailed(str(e)) from e
        checked = {"data_parallel_size": parsed.data_parallel_size,
                   "num_micro_batches_per_rank": parsed.global_batch_size
                   // (parsed.micro_batch_size * parsed.data_parallel_size)}
    if as_json:
        emit_json({"argv": run_args.argv(), "environment": run_args.environment(), "checked": checked,
                    "groups": {what: flags for what, flags in run_args.groups()}})
        return EXIT_OK
    for name, value in run_args.environment().items():
        click.echo(f"export {name}={value}")
    # A bash array: comments are allowed inside it, and the launch line stays
    # `torchrun ... pretrain_gpt.py "${MEGATRON_ARGS[@]}"`.
    click.echo("MEGATRON_ARGS=(")
    for what, flags in run_args.groups():
        click.echo(f"  # {what}\n  {' '.join(shlex.quote(f) for f in flags)}")
    click.echo(")")
    if checked is not None:
        click.echo(f"# checked with Megatron's parser and validate_args: data-parallel size "
                   f"{checked['data_parallel_size']}, {checked['num_micro_batches_per_rank']} "
                   "micro-batches per rank", err=True)
    return EXIT_OK


@megatron.command(name="adopt")
@click.argument("save_dir", metavar="SAVE_DIR")
@click.option("--iteration", type=click.IntRange(min=0), default=None,
              help="The save to adopt (default: the newest up to Megatron's tracker that passes).")
@click.option("--lr-lookahead", type=click.IntRange(min=2), default=3, show_default=True,
              help="Updates whose LR the manifest records.")
@json_option
@command
def megatron_adopt(save_dir: str, iteration: int | None, lr_lookahead: int, as_json: bool) -> int:
    """Record a Megatron save that resume never recorded: after the deep check (every record
    read, CRC-32s compared), write its manifest (checksums taken now, the counters and the
    expectation from Megatron's own state), marked adopted. From the next restart with
    resume installed on, the continuity check covers the run.

    Exits 0 adopted (or already recorded), 1 refused (the reason names the file), 2 usage,
    3 nothing there.
    """
    from ..adapters.megatron.adopt import adopt, describe

    result = adopt(save_dir, iteration=iteration, lr_lookahead=lr_lookahead)
    if as_json:
        emit_json({"ok": True, "iteration": result.iteration, "already": result.already,
                    "passed_over": [{"iteration": s, "why": w} for s, w in result.passed_over],
                    "manifest": json.loads(result.manifest.to_json()) if result.manifest else None})
        return EXIT_OK
    for step, why in result.passed_over:
        click.echo(f"{step:>10}  passed over: {why}")
    click.echo(describe(result, save_dir))
    return EXIT_OK
