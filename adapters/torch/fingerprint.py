"""Fingerprints of optimizer moments: bit sums per state key, the same for any sharding."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["bits_view", "fingerprint_states", "moment_fingerprint"]


def bits_view(t: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
    """The tensor's bit patterns as integers of its element size, and the accumulation dtype."""
    if t.is_complex():
        t = torch.view_as_real(t)
    size = t.element_size()
    if size == 8:
        return t.view(torch.int64), torch.int64
    if size == 4:
        return t.view(torch.int32), torch.int32  # wraps mod 2**32: order-free, fast
    if size == 2:
        return t.view(torch.int16), torch.int32
    return t.view(torch.int8) if t.dtype != torch.bool else t.to(torch.int8), torch.int32


def _counts_here(value: Any) -> bool:
    """A DTensor replicated over some mesh dimension is counted by its first replica only."""
    placements = getattr(value, "placements", None)
    mesh = getattr(value, "device_mesh", None)
    if placements is None or mesh is None:
        return True
    for dim, placement in enumerate(placements):
        if placement.is_replicate() and mesh.get_local_rank(dim) != 0:
            return False
    return True


def moment_fingerprint(opt: torch.optim.Optimizer) -> dict:
    return fingerprint_states([opt.state.get(p, {}) for group in opt.param_groups for p in group["params"]])


def fingerprint_states(states: list[dict]) -> dict:
    """Bit sums per state key of the given per-parameter optimizer states (resume.continuity)."""
    partial: dict[str, dict[str, list[torch.Tensor]]] = {"replicated": {}, "sharded": {}}
    numel = {"replicated": 0, "sharded": 0}
    for state in states:
        for key, value in state.items():
            if key == "step" or not isinstance(value, torch.Tensor):
                continue
            kind = "sharded" if hasattr(value, "to_local") else "replicated"
            if kind == "sharded" and not _counts_here(value):
                continue
            local = value.to_local() if kind == "sharded" else value
            if local.numel() == 0:
                continue
            bits, acc = bits_view(local.detach())
            partial[kind].setdefault(str(key), []).append(bits.sum(dtype=acc).to(torch.int64))
            numel[kind] += local.numel()
    out = {}
    for kind in ("replicated", "sharded"):
        keys = sorted(partial[kind])
        if not keys:
            out[kind] = {"bits": {}, "numel": numel[kind]}
            continue
        # One transfer per optimizer and kind: the partial sums stay on their device until here.
        totals = torch.stack([torch.stack([t.to(partial[kind][keys[0]][0].device) for t in partial[kind][k]]
                                          ).sum() for k in keys]).cpu().tolist()
        out[kind] = {"bits": {k: int(v) & 0xFFFFFFFF for k, v in zip(keys, totals)}, "numel": numel[kind]}
    return out
