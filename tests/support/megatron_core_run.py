"""A tiny real Megatron-Core run for the tests: GPTModel, OptimizerParamScheduler, dist_checkpointing.

What megatron.training's save_checkpoint/load_checkpoint do with the common
state is mirrored here with the real Megatron-Core pieces so that it runs on
several gloo ranks and at another tensor-parallel size (megatron.training
itself is exercised at world size 1 in test_megatron_training.py).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from support.megatron import cpu_patches, require_megatron, stub_optimizer

GBS = 16
SCHEDULE = {"lr": 8e-5, "min_lr": 8e-6, "lr_warmup_samples": 64, "lr_decay_samples": 1600}


def make_args(tp: int = 1, dp: int = 1, **overrides) -> argparse.Namespace:
    """Megatron's argument names, for what the recorder and the scheduler read."""
    args = argparse.Namespace(
        global_batch_size=GBS, micro_batch_size=1, seq_length=16, seed=1234,
        consumed_train_samples=0, skipped_train_samples=0, train_samples=1600, train_iters=None,
        lr_warmup_init=0.0, lr_warmup_fraction=None, lr_warmup_iters=0, lr_decay_iters=None,
        lr_decay_style="cosine", lr_wsd_decay_samples=None, lr_wsd_decay_iters=None,
        lr_wsd_decay_style="exponential", rampup_batch_size=None, data_path=["corpus_text_document"],
        split="99,1,0", dataloader_type="single", tokenizer_type="NullTokenizer", vocab_size=128,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, context_parallel_size=1,
        data_parallel_size=dp, ckpt_format="torch_dist", async_save=False, no_load_rng=False,
        finetune=False, params_dtype=torch.float32, **SCHEDULE)
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


def build_scheduler(args: argparse.Namespace, *, override: bool = False):
    """As megatron.training.get_optimizer_param_scheduler builds it for sample-based training."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        stub_optimizer(2), init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_samples, lr_decay_steps=args.lr_decay_samples,
        lr_decay_style=args.lr_decay_style, start_wd=0.1, end_wd=0.1, wd_incr_steps=args.train_samples,
        wd_incr_style="constant", use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=override)


def setup(tp: int, seed: int = 1234):
    """Model parallel state and a tiny GPTModel on this rank."""
    require_megatron()
    cpu_patches()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                               use_cpu_initialization=True, params_dtype=torch.float32)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128,
                    max_sequence_length=16)


def train(args, scheduler, recorder, iterations: int, skip_at: frozenset[int] = frozenset(),
          start: int = 0) -> int:
    """Megatron's counter updates per iteration (training.py): every iteration reads a global
    batch; the scheduler steps only when the update was applied."""
    for it in range(start + 1, start + iterations + 1):
        args.consumed_train_samples += args.global_batch_size
        applied = it not in skip_at
        if applied:
            scheduler.step(increment=args.global_batch_size)
        recorder.count_iteration(skipped=not applied)
    return start + iterations


def save(save_dir: str, iteration: int, model, args, scheduler) -> None:
    """Megatron's torch_dist save: common state + sharded model, then rank 0 moves the tracker."""
    from megatron.core import dist_checkpointing

    ckpt = os.path.join(save_dir, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(ckpt, exist_ok=True)
    dist.barrier()
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
             "opt_param_scheduler": scheduler.state_dict(), "num_floating_point_operations_so_far": 0,
             "model": model.sharded_state_dict()}
    dist_checkpointing.save(state, ckpt)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))


def load(save_dir: str, iteration: int, model, args, scheduler) -> int:
    """Megatron's load: model, then consumed samples and the scheduler from the common state."""
    from megatron.core import dist_checkpointing

    ckpt = os.path.join(save_dir, f"iter_{iteration:07d}")
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, ckpt)
    model.load_state_dict(loaded["model"], strict=True)
    saved_args = loaded["args"]
    args.consumed_train_samples = saved_args.consumed_train_samples
    scheduler.load_state_dict(loaded["opt_param_scheduler"])
    return int(loaded["iteration"])


def full_weights(model) -> dict[str, torch.Tensor]:
    """Every parameter gathered over tensor parallelism (for comparisons across TP sizes)."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = torch.cat(parts, dim=p.partition_dim)
        out[name] = t.clone()
    return out
