"""What a Megatron manifest records beyond the files: config, layout, next batch, LR ahead, RNG.

Shared by the recorder (at a save and at the restart check) and ``adopt``; every
value here is computed the same way on both sides of a restart.
"""

from __future__ import annotations

import copy
import types
from typing import Any

from resume.checksum import digest_parts
from resume.run import Run
from resume.storage import join

from .parallel import megatron_layout

__all__ = ["ADAPTER_NAME", "DATA_ARGS", "DEGREE_KEYS", "data_config", "data_parallel_rank", "group_overrides", "list_files",
           "loss_scale", "lr_ahead_megatron", "megatron_lr_numbering", "next_batch", "next_batch_ids", "rng_digest",
           "run_config", "same_degrees", "topology"]

ADAPTER_NAME = "megatron-core"
DATA_ARGS = ("data_path", "split", "dataloader_type", "tokenizer_type", "vocab_size", "seq_length", "seed")


def next_batch_ids(consumed: int, global_batch: int) -> list[int]:
    """Sample positions of the next global batch: ``consumed .. consumed + global_batch - 1``.

    Megatron's pretraining samplers read the stream in order (for ``single`` these are
    dataset indices; for ``cyclic`` positions in the epoch's permutation); a test checks
    this against ``MegatronPretrainingSampler`` itself.
    """
    return list(range(consumed, consumed + global_batch))


def next_batch(samples_read: int, global_batch: int, args: Any) -> dict:
    """The ``next_batch`` record: its ids and a digest over them and the data arguments."""
    ids = next_batch_ids(samples_read, global_batch)
    data = data_config(args)
    return {"ids": ids, "samples": len(ids),
            "digest": digest_parts([repr(sorted(data.items()))] + [str(i) for i in ids])}


def data_config(args: Any) -> dict:
    return {k: _jsonable(getattr(args, k, None)) for k in DATA_ARGS}


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


def run_config(args: Any) -> dict:
    """The manifest's ``config``: a restart with another one is refused."""
    return {"global_batch": args.global_batch_size, "seq_length": getattr(args, "seq_length", None),
            "data": data_config(args)}


def topology(args: Any, world_size: int) -> dict:
    """The manifest's ``topology``: the degrees (the keys manifests have always had) and the layout
    (``resume.layout``: with the format settings that decide which degrees a restart may change)."""
    layout = megatron_layout(args, world_size)
    return {"world_size": world_size, "tensor_parallel": layout.tensor, "pipeline_parallel": layout.pipeline,
            "context_parallel": layout.context, "data_parallel": layout.data_parallel, "layout": layout.to_dict()}


DEGREE_KEYS = ("world_size", "tensor_parallel", "pipeline_parallel", "context_parallel", "data_parallel")
"""The degrees of ``topology`` that decide where each rank's state goes (RNG per rank)."""


def same_degrees(recorded: dict, now: dict) -> bool:
    """Whether two topologies (``topology``) name the same degrees; the format settings recorded
    beside them do not move any rank's state."""
    return all(recorded.get(k) == now.get(k) for k in DEGREE_KEYS)


def megatron_lr_numbering(iteration: int, k: int) -> str:
    """Where Megatron's own log shows an LR of ``lr_ahead[+k]`` recorded at ``iteration``.

    Megatron logs, at iteration N, the LR the next update uses: ``lr_ahead[+0]`` is logged
    at the saved iteration, ``lr_ahead[+k]`` at ``iteration + k`` when no update is skipped."""
    return (f"Megatron logs at iteration {iteration + k} ('learning rate' of its log line; "
            f"{k} successful update{'s' if k != 1 else ''} after the saved iteration {iteration})")


def group_overrides(optimizer: Any) -> list[dict]:
    """Per param group, the fields the scheduler reads (max_lr/min_lr overrides); [{}] without groups."""
    groups = getattr(optimizer, "param_groups", None) if optimizer is not None else None
    if not groups:
        return [{}]
    return [{k: float(g[k]) for k in ("max_lr", "min_lr") if k in g} for g in groups]


def loss_scale(optimizer: Any) -> list[dict] | None:
    """Each (chained) optimizer's fp16 loss scaler as Megatron saves it in the optimizer's state
    (``grad_scaler``: scale, growth tracker, hysteresis tracker); None when none has a scaler
    (fp32, bf16 without one)."""
    parts = getattr(optimizer, "chained_optimizers", None) or ([optimizer] if optimizer is not None else [])
    out, any_scaler = [], False
    for part in parts:
        scaler = getattr(part, "grad_scaler", None)
        if scaler is None:
            out.append({})
            continue
        any_scaler = True
        state = dict(scaler.state_dict() or {})
        scale = state.pop("scale", None)
        scale = scaler.scale if scale is None else scale
        row = {"scale": float(scale.reshape(-1)[0]) if hasattr(scale, "reshape") else float(scale)}
        row.update({k: int(v) for k, v in sorted(state.items()) if isinstance(v, int)})
        out.append(row)
    return out if any_scaler else None


def lr_ahead_megatron(scheduler: Any, increment: int, k: int, groups: list[dict]) -> list[list[float]]:
    """LR of every group now and after each of the next k-1 updates, by Megatron's own scheduler.

    A shallow copy steps over copies of the groups (only the fields get_lr reads): the live
    scheduler and the optimizer's groups are untouched.
    """
    probe = copy.copy(scheduler)
    probe_groups = [dict(g) for g in groups]
    probe.optimizer = types.SimpleNamespace(param_groups=probe_groups)
    out = []
    for i in range(k):
        if i:
            probe.step(increment=increment)
        out.append([float(probe.get_lr(g)) for g in probe_groups])
    return out


def list_files(run: Run, d: str) -> list[str]:
    """Every file under ``d``, relative to it."""
    out = []
    for name in run.storage.listdir(d):
        path = join(d, name)
        if run.storage.isdir(path):
            out.extend(join(name, sub) for sub in list_files(run, path))
        else:
            out.append(name)
    return out


def rng_digest() -> str:
    """A digest of what Megatron saves and restores per rank: python, numpy, torch CPU, the
    current CUDA device and Megatron's CUDA RNG tracker states (not other devices')."""
    import random
    import sys

    import torch

    parts = [repr(random.getstate())]
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        parts.append(f"{name}:{digest_parts([keys.tobytes().hex()])}:{pos}:{has_gauss}:{cached!r}")
    parts.append(torch.get_rng_state().numpy().tobytes().hex())
    if torch.cuda.is_available():
        parts.append(torch.cuda.get_rng_state().numpy().tobytes().hex())
    tracker = sys.modules.get("megatron.core.tensor_parallel.random")
    if tracker is not None:
        try:
            states = tracker.get_cuda_rng_tracker().get_states()
        except Exception:  # noqa: BLE001 - a tracker never seeded has nothing to compare
            states = {}
        for name in sorted(states):
            parts.append(f"{name}:{states[name].cpu().numpy().tobytes().hex()}")
    return digest_parts(parts)


def data_parallel_rank() -> int:
    try:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank()
    except Exception:  # noqa: BLE001 - not initialised: treat as the one rank
        return 0
