"""torchtitan's llama3, trained with ``resume``: checkpoint, kill, restart, continue exactly.

    torchrun --nproc_per_node 2 examples/torchtitan_train.py --run-dir /tmp/run --steps 8

Everything but the ``resume`` lines is torchtitan 0.3.0's own: the llama3 model from its
registry (a tiny flavor, fused QKV as every llama3 flavor has it), FSDP2 through
``parallelize_llama``, its ``OptimizersContainer`` (AdamW), its ``LRSchedulersContainer``
(warm-up, linear decay), its cross-entropy loss (sum over the global count of valid tokens,
as its trainer does), and its ``HuggingFaceTextDataLoader`` (a ``ParallelAwareDataloader``)
over a local data set
(``torchtitan_assets.py`` makes one offline). ``resume`` is the few lines in ``main`` from
``NativeTorchAdapter`` to ``coord.close()``.

It runs on CPU with gloo (``pip install torchtitan==0.3.0 triton``: torchtitan imports triton
even where no kernel of it runs); what that takes is in ``run_on_cpu``. Rank 0 prints
``step N loss L lr R`` per step; ``--summary FILE`` writes what a comparison of two runs
needs (losses, LRs, digests of the batches, the parameters and the optimizer moments).
``RESUME_EXAMPLE_KILL_AT=K`` SIGKILLs every rank right after step K, for the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the data set and tokenizer are local files
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import torch.distributed as dist
from resume.adapters.torch_native import NativeTorchAdapter
from resume.drill.worker import tensor_digest

from resume import Coordinator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torchtitan_assets import data_dir, make_assets, tokenizer_dir

KILL_AT_ENV = "RESUME_EXAMPLE_KILL_AT"


def tiny_llama3(attn_backend: str, tp_gemm_backend: str = "default"):
    """A llama3 flavor of 164k parameters, built as torchtitan builds ``debugmodel`` (with the
    module's private helpers, as of torchtitan 0.3.0)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
    )

    dim, n_heads, vocab = 64, 4, 512
    layers = _build_llama3_layers(
        n_layers=2, dim=dim, n_heads=n_heads, n_kv_heads=2, fuse_qkv=True,
        hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=32), attn_backend=attn_backend,
        tp_gemm_backend=tp_gemm_backend,
        rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=256, theta=500000, scaling="llama"))
    return Llama3Model.Config(
        dim=dim, vocab_size=vocab, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)))


def run_on_cpu(spec, parallelism, training):
    """What torchtitan 0.3.0 needs to train on CPU with gloo; returns the parallelize function.

    None of this concerns ``resume``; on GPUs with NCCL, drop this function."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed import parallel_dims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.tools import utils as tt_utils

    # The mesh: torchtitan takes device_type "cuda" where no accelerator is found.
    for module in (tt_utils, parallel_dims, dist_utils):
        module.device_type, module.device_module = "cpu", torch.cpu
    # build_mesh gives degree-1 axes the "fake" backend, which importing DCP registers.
    import torch.distributed.checkpoint as _  # noqa: F401
    # The default "spmd_types" backend needs the Trainer's SPMD context; this is plain FSDP2.
    parallelism.spmd_backend = "partial_dtensor"
    dist_utils.set_spmd_backend("partial_dtensor")
    # FlexAttention has no backward on CPU (and "sdpa" is refused by name): swap it in after.
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    # bfloat16 parameters (the default) for compute would only be slower on CPU.
    training.mixed_precision_param = "float32"

    def parallelize_on_gloo(model, **kwargs):
        model = spec.parallelize_fn(model, **kwargs)
        # torchtitan divides the loss itself, so FSDP reduces with PREMUL_SUM(1.0): gloo has none.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        return model

    return parallelize_on_gloo


def build(args):
    """torchtitan's components, as its Trainer builds them (trainer.py), on this rank."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models import llama3

    world = dist.get_world_size()
    llama3.llama3_configs["tiny"] = tiny_llama3  # a flavor of our own, beside debugmodel
    spec = llama3.model_registry("tiny")
    parallelism = ParallelismConfig(data_parallel_shard_degree=-1)
    training = TrainingConfig(local_batch_size=args.global_batch // world, seq_len=args.seq_len,
                              steps=args.schedule_steps)
    parallelize = run_on_cpu(spec, parallelism, training)

    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    batch_mesh = dims.get_mesh("batch") if dims.dp_enabled else None
    torch.manual_seed(args.seed)
    with torch.device("meta"):
        model = spec.model.build()
    model = parallelize(model, parallel_dims=dims, training=training, parallelism=parallelism,
                        compile_config=CompileConfig(enable=False), ac_config=None, dump_folder=args.run)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()

    optimizers = default_adamw(lr=1e-3).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_type="linear").build(
        optimizers=optimizers, training_steps=args.schedule_steps)
    loss_fn = CrossEntropyLoss.Config().build(compile_config=None)
    tokenizer = HuggingFaceTokenizer(tokenizer_path=tokenizer_dir(args.assets))
    dataloader = HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=data_dir(args.assets)).build(
        dp_world_size=batch_mesh.size() if batch_mesh else 1,
        dp_rank=batch_mesh.get_local_rank() if batch_mesh else 0,
        tokenizer=tokenizer, seq_len=args.seq_len, local_batch_size=training.local_batch_size)
    return model, optimizers, schedulers, dataloader, loss_fn, batch_mesh


def train_step(model, optimizers, schedulers, loss_fn, batch_mesh, batch) -> tuple[float, float]:
    """One update as torchtitan's Trainer.train_step makes it; (global loss, LR it applied)."""
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.distributed import utils as dist_utils

    inputs, labels = batch
    global_valid = dist_utils.dist_sum_tensor((labels != IGNORE_INDEX).sum(), batch_mesh)
    # SDPA (run_on_cpu) takes no document masks; positions still feed RoPE.
    pred = model(inputs["input"], positions=inputs["positions"], attention_masks=None)
    loss, _ = loss_fn(pred, labels, global_valid)
    loss.backward()
    dist_utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
    lr = optimizers.optimizers[0].param_groups[0]["lr"]
    optimizers.step()
    schedulers.step()
    optimizers.zero_grad()
    return dist_utils.dist_sum(loss.detach(), batch_mesh), lr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Not "--run": torchrun reads it as its own --run-path.
    parser.add_argument("--run-dir", dest="run", required=True, help="the run's home: a directory, or an fsspec URL")
    parser.add_argument("--assets", default=None, help="tokenizer and data set (made there if missing; "
                                                       "default: assets beside the run directory)")
    parser.add_argument("--steps", type=int, default=8, help="stop after step N")
    parser.add_argument("--schedule-steps", type=int, default=12, help="length of the LR schedule")
    parser.add_argument("--every", type=int, default=2, help="save every N steps")
    parser.add_argument("--global-batch", type=int, default=4, help="sequences per step over all ranks")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--summary", default=None, help="write losses, LRs and digests here (JSON)")
    args = parser.parse_args()
    args.assets = args.assets or os.path.join(os.path.dirname(os.path.abspath(args.run)), "assets")
    kill_at = int(os.environ.get(KILL_AT_ENV, "0"))

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        make_assets(args.assets)
    dist.barrier()
    model, optimizers, schedulers, dataloader, loss_fn, batch_mesh = build(args)

    # resume: an adapter over torchtitan's objects as built, a coordinator, restore, the loop.
    adapter = NativeTorchAdapter([model], optimizers, schedulers, dataloader)
    coord = Coordinator(args.run, adapter, global_batch=args.global_batch, seq_len=args.seq_len,
                        every=args.every, config={"seed": args.seed})
    coord.restore()  # the newest committed checkpoint, or a fresh start; checks continuity
    trace = []
    for batch in coord.batches():  # through resume, which knows the next batch at every save
        step = coord.iteration + 1
        loss, lr = train_step(model, optimizers, schedulers, loss_fn, batch_mesh, batch)
        coord.update()  # counts the step; saves every --every steps
        trace.append({"step": step, "loss": loss, "lr": lr, "batch": batch_digests(batch)})
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss!r} lr {lr!r}", flush=True)
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if step >= args.steps:
            break
    coord.close()

    summary = {"restored_from": coord.restored_from, "steps": trace,
               "params": param_digests(model), "moments": moment_digests(optimizers)}
    if args.summary and dist.get_rank() == 0:
        with open(args.summary, "w") as f:
            json.dump(summary, f, indent=1)
    dist.destroy_process_group()


# -- the summary a comparison of two runs needs (collective: every rank calls these) -----------

def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def batch_digests(batch) -> list[str]:
    """Every rank's batch (inputs, positions, labels), by digest, in rank order."""
    inputs, labels = batch
    mine = [tensor_digest(inputs["input"]), tensor_digest(inputs["positions"]), tensor_digest(labels)]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, "/".join(mine))
    return out


def param_digests(model: torch.nn.Module) -> dict[str, str]:
    return {name: tensor_digest(full(p)) for name, p in model.named_parameters()}


def moment_digests(optimizers) -> dict[str, dict[str, str]]:
    """Per parameter name, the digest of each tensor of its optimizer state (AdamW: exp_avg,
    exp_avg_sq, step)."""
    out = {}
    for opt in optimizers.optimizers:
        for group in opt.param_groups:
            for name, p in zip(group["param_names"], group["params"]):
                out[name] = {k: tensor_digest(full(v)) for k, v in sorted(opt.state.get(p, {}).items())}
    return out


if __name__ == "__main__":
    main()
