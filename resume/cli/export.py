"""``resume export RUN OUT``: a committed checkpoint's tensors as consolidated sharded safetensors
(or torch files) with their index, for evaluation and serving (``resume.adapters.export``)."""

from __future__ import annotations

import re
import sys

import click

from ..errors import UsageError
from .common import command, emit_json, is_terminal, json_option
from .show import human_bytes

__all__ = ["export", "parse_size"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """``5GB`` (10^9), ``500MiB`` (2^20), ``1048576`` (bytes)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS or float(m.group(1)) * _UNITS[unit] < 1:
        raise UsageError(f"--max-shard-size: expected a size such as 5GB, 500MiB or a number of bytes, "
                         f"actual {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])


@click.command()
@click.argument("run_url", metavar="RUN")
@click.argument("out", metavar="OUT")
@click.option("--step", type=click.IntRange(min=0), default=None, help="The step (default: the newest committed).")
@click.option("--format", "fmt", type=click.Choice(["safetensors", "torch"]), default="safetensors", show_default=True,
              help="Sharded safetensors + model.safetensors.index.json, or sharded torch.save files + "
                   "pytorch_model.bin.index.json.")
@click.option("--dtype", type=click.Choice(["keep", "bf16", "fp16", "fp32"]), default="keep", show_default=True,
              help="Floating-point tensors cast to this dtype (others kept).")
@click.option("--what", "part", type=click.Choice(["model", "optimizer", "all"]), default="model", show_default=True,
              help="The model's weights (native: under their own names, without 'model.'), the optimizer's "
                   "state, or every tensor.")
@click.option("--include", multiple=True, metavar="PREFIX", help="Only names starting with PREFIX (repeatable).")
@click.option("--exclude", multiple=True, metavar="PREFIX", help="Leave out names starting with PREFIX (repeatable).")
@click.option("--strip-prefix", default="", metavar="PREFIX", help="Remove PREFIX from the names that start with it.")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Bytes of tensor data per shard file.")
@json_option
@command
def export(run_url: str, out: str, step: int | None, fmt: str, dtype: str, part: str, include: tuple[str, ...],
           exclude: tuple[str, ...], strip_prefix: str, max_shard_size: str, as_json: bool) -> int:
    """Export a committed checkpoint's tensors to OUT (a new or empty local directory).

    Each file of the checkpoint is read once and verified against the manifest's checksum
    while it is read; OUT appears only when every file verified and every output file is
    written (it holds resume-export.json: source run, step, manifest checksum, selection,
    dtype, each output file's size and checksum). Works on our runs and on Megatron save
    directories with our manifests (torch_dist: the model's tensors as global tensors).

    Exits 0 exported, 1 the checkpoint is damaged (the file named; nothing written),
    2 usage error (OUT not empty, nothing selected, two tensors given one name),
    3 no run or no committed checkpoint.
    """
    from ..adapters.export import Selection, export_checkpoint

    selection = Selection(part=part, include=include, exclude=exclude, strip_prefix=strip_prefix)
    size = parse_size(max_shard_size)
    if as_json or not is_terminal():
        result = export_checkpoint(run_url, out, step=step, fmt=fmt, dtype=dtype, selection=selection,
                                   max_shard_size=size)
    else:
        with click.progressbar(length=1, label="exporting", file=sys.stderr) as bar:
            def progress(done: int, total: int) -> None:
                bar.length = max(total, 1)
                bar.update(done - bar.pos)
            result = export_checkpoint(run_url, out, step=step, fmt=fmt, dtype=dtype, selection=selection,
                                       max_shard_size=size, progress=progress)
    if as_json:
        emit_json({"ok": True, **result.to_dict()})
        return 0
    rate = result.bytes_read / max(result.seconds, 1e-9)
    click.echo(f"exported step {result.step}: {result.tensors} tensors, {human_bytes(result.bytes_written)} in "
               f"{len(result.record['files'])} files to {result.out} ({result.seconds:.1f}s, "
               f"{human_bytes(rate)}/s read and verified)")
    for name, entry in sorted(result.record["files"].items()):
        click.echo(f"  {name:<40} {entry['size']:>14}  {entry['checksum']}")
    return 0
