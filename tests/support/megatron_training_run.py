"""megatron.training at world size 1 on CPU: Megatron's own arguments, model, optimizer,
scheduler, save_checkpoint and load_checkpoint, with resume installed.

Test-only CUDA stand-ins (only when CUDA is absent), beyond support.megatron.cpu_patches:
- megatron/training/checkpointing.py read_metadata all-reduces the tracker's
  iteration in a tensor built with device='cuda';
- megatron/core/optimizer/optimizer.py FP32Optimizer.__init__ builds its loss
  scale with device='cuda';
- a real optimizer step: clip_grads.py builds its norm tensors with device='cuda'.
Each is run with ``torch.tensor``/``torch.zeros`` mapping device='cuda' to CPU.
The micro-batch loop below is the body of megatron.training's train_step
without the CUDA streams of DDP's gradient sync (at DP=1 there is nothing to
reduce); the counter updates are train()'s.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys

import torch

from support.megatron import cpu_patches, require_megatron

GBS, MBS, SEQ, VOCAB = 4, 2, 16, 128


@contextlib.contextmanager
def cuda_factories_on_cpu(names=("tensor", "zeros")):
    saved = {n: getattr(torch, n) for n in names}

    def on_cpu(factory):
        def make(*a, **k):
            if str(k.get("device", "")).startswith("cuda"):
                k["device"] = "cpu"
            return factory(*a, **k)
        return make

    for n, f in saved.items():
        setattr(torch, n, on_cpu(f))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch, n, f)


@contextlib.contextmanager
def cuda_tensors_on_cpu():
    """For --fp16: Float16OptimizerWithFloat16Params accepts only parameters whose ``type()`` is
    'torch.cuda.HalfTensor' or 'torch.cuda.FloatTensor', and DynamicGradScaler.load_state_dict moves
    the saved scale with ``.cuda()``. Here a CPU tensor's type() reads as the CUDA one and
    ``.cuda()`` keeps it where it is."""
    saved_type, saved_cuda = torch.Tensor.type, torch.Tensor.cuda

    def type_(self, *a, **k):
        name = saved_type(self, *a, **k)
        return name.replace("torch.", "torch.cuda.", 1) if not (a or k or self.is_cuda) else name

    torch.Tensor.type = type_
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        with cuda_factories_on_cpu():
            yield
    finally:
        torch.Tensor.type, torch.Tensor.cuda = saved_type, saved_cuda


def _wrap_on_cpu(owner, name, patch=cuda_factories_on_cpu):
    original = getattr(owner, name)
    if getattr(original, "_on_cpu", False):
        return

    def wrapped(*a, **k):
        with patch():
            return original(*a, **k)
    wrapped._on_cpu = True
    setattr(owner, name, wrapped)


def argv(save_dir: str, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        "pretrain_gpt.py",
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--transformer-impl", "local",
        "--use-cpu-initialization", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
        "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
        "--no-rope-fusion", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
        "--micro-batch-size", str(MBS), "--global-batch-size", str(GBS), "--train-samples", "400",
        "--lr", "1e-3", "--min-lr", "1e-5", "--lr-decay-style", "cosine", "--lr-warmup-samples", "8",
        "--lr-decay-samples", "320", "--weight-decay", "0.1",
        "--clip-grad", "0.0",  # clip_grads.py asserts CUDA tensors when clipping
        "--save", save_dir, "--load", save_dir, "--ckpt-format", "torch_dist", "--save-interval", "1000",
        "--seed", "1234", *extra,
    ]


def fresh(save_dir: str, extra: tuple[str, ...] = ()):
    """A fresh process's view: args parsed by Megatron, a new model, optimizer and scheduler."""
    require_megatron()
    cpu_patches()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import get_megatron_optimizer, grad_scaler
    from megatron.core.optimizer import optimizer as optimizer_module
    from megatron.core.transformer.module import Float16Module
    from megatron.training import checkpointing, global_vars
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args
    from megatron.training.training import (
        get_megatron_ddp_config,
        get_megatron_optimizer_config,
        get_optimizer_param_scheduler,
    )
    from megatron.training.vocab_utils import calculate_padded_vocab_size

    saved_argv, sys.argv = sys.argv, argv(save_dir, extra)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            args = parse_args()
            validate_args(args, {})
            global_vars.unset_global_variables()
            global_vars.set_global_variables(args, build_tokenizer=False)
    finally:
        sys.argv = saved_argv
    if not parallel_state.model_parallel_is_initialized():
        _init_runtime(args)
        parallel_state.initialize_model_parallel(1, 1)
    _wrap_on_cpu(checkpointing, "read_metadata")
    _wrap_on_cpu(optimizer_module.FP32Optimizer, "__init__")
    _wrap_on_cpu(optimizer_module.Float16OptimizerWithFloat16Params, "__init__", cuda_tensors_on_cpu)
    for scaler in (grad_scaler.MegatronGradScaler, grad_scaler.DynamicGradScaler):
        _wrap_on_cpu(scaler, "__init__")
    _wrap_on_cpu(grad_scaler.DynamicGradScaler, "load_state_dict", cuda_tensors_on_cpu)
    import random

    import numpy as np

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    args.padded_vocab_size = calculate_padded_vocab_size(
        args.vocab_size, args.make_vocab_size_divisible_by, 1, logging_enabled=False)
    args.model_type = ModelType.encoder_or_decoder  # what get_model sets (it needs CUDA itself)
    config = core_transformer_config_from_args(args)
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                   vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings)
    if args.fp16:
        gpt = Float16Module(config, gpt)  # what get_model does with --fp16
    with contextlib.redirect_stdout(io.StringIO()):
        model = [DistributedDataParallel(config=config, ddp_config=get_megatron_ddp_config(args), module=gpt)]
        opt_config, overrides = get_megatron_optimizer_config(args)
        optimizer = get_megatron_optimizer(opt_config, model, config_overrides=overrides)
        scheduler = get_optimizer_param_scheduler(optimizer)
    return args, model, optimizer, scheduler


def _init_runtime(args) -> None:
    """As megatron/training/initialize.py does, on gloo at world size 1."""
    import tempfile

    from megatron.core import tensor_parallel
    from megatron.core.rerun_state_machine import (
        RerunDiagnostic,
        RerunErrorInjector,
        RerunMode,
        initialize_rerun_state_machine,
    )

    initialize_rerun_state_machine(
        state_save_func=lambda: {"rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()},
        state_restore_func=lambda sd: sd["rng_tracker_states"]
        and tensor_parallel.get_cuda_rng_tracker().set_states(sd["rng_tracker_states"]),
        mode=RerunMode(args.rerun_mode),
        error_injector=RerunErrorInjector(error_injection_rate=args.error_injection_rate,
                                          error_injection_type=RerunDiagnostic(args.error_injection_type)),
        result_rejected_tracker_filename=args.result_rejected_tracker_filename)
    if not torch.distributed.is_initialized():
        store = os.path.join(tempfile.mkdtemp(prefix="resume-mega-"), "store")
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


def real_step(model, optimizer, *, force_skip: bool) -> bool:
    """Forward, backward and the optimizer step on random tokens; update_successful."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), 1)  # the default one is on CUDA
    position = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
    for _ in range(get_num_microbatches()):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ))
        labels = torch.randint(0, VOCAB, (MBS, SEQ))
        loss = model[0](tokens, position, mask, labels=labels).float().mean()
        optimizer.scale_loss(loss).backward()  # backward_step's grad_scale_func; 1.0 without --fp16
    if force_skip:  # what a loss-scale overflow or a NaN gradient does: no update at all
        return False
    with cuda_factories_on_cpu():
        update_successful, _, _ = optimizer.step()
    return bool(update_successful)


def train(args, model, optimizer, scheduler, recorder, *, until: int, start: int,
          overflow_at: frozenset[int] = frozenset(), trace: list | None = None) -> int:
    """train()'s counters: each iteration reads a global batch; the scheduler steps on success.
    ``trace`` gets, per iteration, whether it updated and each fp16 scaler's state after it."""
    from resume.adapters.megatron.record import loss_scale

    iteration = start
    while iteration < until:
        skipped = not real_step(model, optimizer, force_skip=(iteration + 1) in overflow_at)
        if trace is not None:
            trace.append([not skipped, loss_scale(optimizer)])
        if not skipped:
            scheduler.step(increment=GBS)
        recorder.count_iteration(skipped=skipped)  # what the installed train_step wrapper does
        iteration += 1
        args.consumed_train_samples += GBS
    return iteration


def save(iteration, model, optimizer, scheduler) -> None:
    """As save_checkpoint_and_time calls it, through the name train() uses."""
    from megatron.training import training

    with contextlib.redirect_stdout(io.StringIO()):
        training.save_checkpoint(iteration, model, optimizer, scheduler, 0.0, checkpointing_context={},
                                 preprocess_common_state_dict_fn=training.preprocess_common_state_dict)


def load(args, model, optimizer, scheduler) -> int:
    """As setup_model_and_optimizer calls it, through the name training.py uses."""
    from megatron.training import training

    args.consumed_train_samples = 0
    args.skipped_train_samples = 0
    with contextlib.redirect_stdout(io.StringIO()):
        iteration, _ = training.load_checkpoint(model, optimizer, scheduler, checkpointing_context={})
    return iteration


OVERFLOW_AT = frozenset({3})  # a skipped update: optimizer and scheduler do not step


def train_and_save(rank: int, world: int, save_dir: str) -> dict:
    """A fresh run with resume installed: saves at iteration 4 (one overflow skip before it) and
    6 (one --iterations-to-skip iteration before it)."""
    from resume.adapters.megatron import install

    args, model, optimizer, scheduler = fresh(save_dir)
    recorder = install()
    load(args, model, optimizer, scheduler)  # fresh start: nothing to load
    it = train(args, model, optimizer, scheduler, recorder, until=4, start=0, overflow_at=OVERFLOW_AT)
    save(it, model, optimizer, scheduler)
    # --iterations-to-skip (training.py): the batch is read and booked as skipped, no train_step.
    it += 1
    args.consumed_train_samples += GBS
    args.skipped_train_samples += GBS
    it = train(args, model, optimizer, scheduler, recorder, until=6, start=it)
    save(it, model, optimizer, scheduler)
    return {"iteration": it, "lr_now": scheduler.get_lr(optimizer.param_groups[0]),
            "num_steps": scheduler.num_steps, "recorder_url": recorder.run.url}
