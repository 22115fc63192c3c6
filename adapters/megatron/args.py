"""Megatron-LM arguments: the reference run's, checked against Megatron's own parser, and the
settings ``resume`` cannot record (``check_supported``).

``resume megatron args`` prints the reference run's. Everything the orchestrator relies on is
here: the parallel layout, the constant global batch, the sample-based warm-up
and cosine schedule (so the scheduler's position is in samples and the LR the
sidecar records is Megatron's), the distributed optimizer, ``torch_dist``
checkpoints, and the exit signal the Slurm hook sends.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from resume.errors import UsageError

__all__ = ["REFERENCE", "MegatronRunArgs", "check_supported", "check_with_megatron_parser"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronRunArgs:
    """The reference run's training configuration, as Megatron-LM flags."""

    save_dir: str = "/lustre/ckpt/run42"
    """Megatron's --save and --load: the same directory, so a restart continues from it."""
    tensor_parallel: int = 8
    pipeline_parallel: int = 8
    world_size: int = 5120
    """GPUs; the data-parallel size is world / (TP x PP) = 80."""
    global_batch: int = 1920
    micro_batch: int = 1
    seq_length: int = 8192
    lr: float = 8e-5
    min_lr: float = 8e-6
    warmup_samples: int = 2_442_240
    decay_samples: int = 1_220_701_440
    train_samples: int = 1_220_701_440
    """~10T tokens at 8,192 tokens per sample."""
    save_interval: int = 500
    """Iterations between scheduled checkpoints (``resume plan`` computes the best one)."""
    exit_signal: str = "SIGTERM"
    """The signal Megatron's --exit-signal-handler listens for; the Slurm hook sends it."""
    # A 500B-class dense shape; replace with the model's own.
    num_layers: int = 96
    hidden_size: int = 20480
    num_attention_heads: int = 160
    ffn_hidden_size: int = 81920

    def __post_init__(self) -> None:
        model_parallel = self.tensor_parallel * self.pipeline_parallel
        if self.world_size % model_parallel:
            raise UsageError(f"world_size: expected a multiple of TP x PP = {model_parallel}, "
                             f"actual {self.world_size}")
        dp = self.world_size // model_parallel
        if self.global_batch % (dp * self.micro_batch):
            raise UsageError(f"global_batch: expected a multiple of DP x micro batch = "
                             f"{dp * self.micro_batch}, actual {self.global_batch}")

    @property
    def data_parallel(self) -> int:
        return self.world_size // (self.tensor_parallel * self.pipeline_parallel)

    def groups(self) -> Iterator[tuple[str, list[str]]]:
        """(what, flags) in the order they are printed."""
        yield "parallelism", [
            "--tensor-model-parallel-size", str(self.tensor_parallel),
            "--pipeline-model-parallel-size", str(self.pipeline_parallel),
            "--sequence-parallel",
        ]
        yield "model (a 500B-class dense shape; use your own)", [
            "--num-layers", str(self.num_layers), "--hidden-size", str(self.hidden_size),
            "--num-attention-heads", str(self.num_attention_heads),
            "--ffn-hidden-size", str(self.ffn_hidden_size),
            "--seq-length", str(self.seq_length), "--max-position-embeddings", str(self.seq_length),
        ]
        yield "batch (constant: the counters' invariants assume it)", [
            "--micro-batch-size", str(self.micro_batch), "--global-batch-size", str(self.global_batch),
        ]
        yield "AdamW", [
            "--optimizer", "adam", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--adam-eps", "1e-8",
            "--weight-decay", "0.1", "--clip-grad", "1.0",
        ]
        yield "schedule (sample-based: the scheduler counts samples)", [
            "--train-samples", str(self.train_samples),
            "--lr", repr(self.lr), "--min-lr", repr(self.min_lr), "--lr-warmup-init", "0.0",
            "--lr-warmup-samples", str(self.warmup_samples),
            "--lr-decay-samples", str(self.decay_samples), "--lr-decay-style", "cosine",
        ]
        yield "precision and optimizer sharding", [
            "--bf16", "--use-distributed-optimizer",
        ]
        yield "checkpointing (resume writes its manifest beside each save)", [
            "--save", self.save_dir, "--load", self.save_dir, "--ckpt-format", "torch_dist",
            "--save-interval", str(self.save_interval),
        ]
        yield "exit on the Slurm hook's signal (saves, then exits)", [
            "--exit-signal-handler", "--exit-signal", self.exit_signal,
        ]

    def environment(self) -> dict[str, str]:
        """Environment Megatron requires for this layout (TP with sequence parallel before Blackwell)."""
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if self.tensor_parallel > 1 else {}

    def argv(self) -> list[str]:
        return [flag for _, flags in self.groups() for flag in flags]


REFERENCE = MegatronRunArgs()


def check_with_megatron_parser(run_args: MegatronRunArgs) -> argparse.Namespace:
    """Parse and validate the flags with Megatron-LM's own parser and ``validate_args``.

    Raises ``UsageError`` naming the flag Megatron rejects or the value that
    came out differently. Needs megatron-core (with ``megatron.training``).
    """
    argv = run_args.argv() + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "131072"]
    arguments = import_megatron_arguments()
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    arguments.add_megatron_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except (argparse.ArgumentError, SystemExit) as e:
        raise UsageError(f"megatron arguments: Megatron's parser rejects them ({e})") from e
    args._is_global_batch_size_explicitly_specified = True
    args.rank, args.world_size = 0, run_args.world_size
    env = {"RANK": "0", "WORLD_SIZE": str(run_args.world_size), **run_args.environment()}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    arch = arguments.get_device_arch_version
    if not _has_cuda():
        # validate_args asks the GPU for its architecture; answer for the
        # reference machines (Hopper, 9) where there is none to ask.
        arguments.get_device_arch_version = lambda: 9
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints every argument
            arguments.validate_args(args, {})
    except (AssertionError, ValueError, RuntimeError) as e:
        raise UsageError(f"megatron arguments: Megatron's validate_args rejects them ({e})") from e
    finally:
        arguments.get_device_arch_version = arch
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    _expect(args, "data_parallel_size", run_args.data_parallel)
    _expect(args, "lr_warmup_samples", run_args.warmup_samples)
    _expect(args, "lr_decay_samples", run_args.decay_samples)
    _expect(args, "ckpt_format", "torch_dist")
    _expect(args, "use_distributed_optimizer", True)
    _expect(args, "exit_signal_handler", True)
    return args


def _expect(args: argparse.Namespace, name: str, value: Any) -> None:
    actual = getattr(args, name, None)
    if actual != value:
        raise UsageError(f"megatron arguments: {name}: expected {value!r}, actual {actual!r} "
                         "after Megatron's validate_args")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def import_megatron_arguments() -> Any:
    """``megatron.training.arguments``, with a clear message when megatron-core is missing."""
    import typing

    if not hasattr(typing, "override"):  # Python 3.11: megatron.training imports typing.override
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]
    try:
        from megatron.training import arguments
    except ImportError as e:
        raise UsageError("megatron: expected megatron-core 0.19 with megatron.training installed, actual "
                         f"{type(e).__name__}: {e} (see README: Megatron-Core)") from e
    return arguments


def check_supported(args: Any) -> None:
    """Settings whose saves resume cannot record yet: refused before training, not at a save."""
    problems = []
    if getattr(args, "rampup_batch_size", None):
        problems.append("--rampup-batch-size (the counters assume a constant global batch)")
    if getattr(args, "decrease_batch_size_if_needed", False):
        problems.append("--decrease-batch-size-if-needed (the counters assume a constant global batch)")
    if getattr(args, "save_retain_interval", None):
        problems.append("--save-retain-interval (Megatron deletes the previous checkpoint before the "
                        "new one is committed)")
    if problems:
        raise UsageError("megatron arguments: expected none of " + ", ".join(problems) + " with "
                         "resume.adapters.megatron installed, actual set")
