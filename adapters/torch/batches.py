"""What a batch holds: its sample ids and a digest of each row (``Adapter.describe_batch``)."""

from __future__ import annotations

from typing import Any

import torch
import xxhash

__all__ = ["batch_ids", "describe_batch"]


def describe_batch(batch: Any) -> list[tuple[int, str]]:
    """Sample ids from a dict's ``ids`` (``sample_ids``, ``index``) or a tuple's first item
    (an integer vector); the digest of each row over every other tensor of the batch. A
    batch without ids (torchtitan's ``(inputs, labels)``) gives each row by its position."""
    ids, fields = _ids_and_fields(batch)
    tensors = [f for f in fields if f.dim() > 0]
    rows = len(ids) if ids is not None else (len(tensors[0]) if tensors else 0)
    if ids is None and not rows:
        raise ValueError(f"describe_batch: expected a batch of tensors (a dict or tuple of them, "
                         f"nested), actual {type(batch).__name__} without any")
    out = []
    for row in range(rows):
        h = xxhash.xxh3_64()
        for f in tensors:
            if len(f) == rows:
                h.update(f[row].detach().cpu().contiguous().numpy().tobytes())
        out.append((int(ids[row]) if ids is not None else -1 - row, h.hexdigest()))
    return out


def batch_ids(batch: Any) -> Any:
    """The sample ids ``batch`` carries (as ``describe_batch`` finds them), as they are (a tensor
    or a list: read later, by the journal's writer), no content read; None if none."""
    if isinstance(batch, dict):
        key = next((k for k in _ID_KEYS if k in batch), None)
        return batch[key] if key is not None else None
    if (isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor)
            and batch[0].dim() == 1 and not batch[0].is_floating_point() and batch[0].dtype != torch.bool):
        return batch[0]
    return None


_ID_KEYS = ("ids", "sample_ids", "index")


def _ids_and_fields(batch: Any) -> tuple[list[int] | None, list[torch.Tensor]]:
    """(the sample ids or None, every other tensor of the batch, in a fixed order)."""
    if isinstance(batch, dict):
        key = next((k for k in _ID_KEYS if k in batch), None)
        if key is not None:
            rest = {k: v for k, v in batch.items() if k != key}
            return torch.as_tensor(batch[key]).reshape(-1).tolist(), _tensors_of(rest)
    elif (isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor)
          and batch[0].dim() == 1 and not batch[0].is_floating_point() and batch[0].dtype != torch.bool):
        return batch[0].tolist(), _tensors_of(list(batch[1:]))
    return None, _tensors_of(batch)


def _tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``: dicts by sorted key, sequences in order, nested."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for k in sorted(value, key=str) for t in _tensors_of(value[k])]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors_of(v)]
    return []
