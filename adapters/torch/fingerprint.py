"""Fingerprints of optimizer moments: bit sums per state key, the same for any sharding."""

from __future__ import annotations

from typing import Any

import torch

from resume.layout import name_weight

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
    """A DTensor replicated over some mesh dimension is counted by its first replica only, and one
    whose mesh is part of a larger one (FSDP's data-parallel mesh inside data x tensor parallel)
    by the first copy of that mesh only: the other copies hold the same shards."""
    placements = getattr(value, "placements", None)
    mesh = getattr(value, "device_mesh", None)
    if placements is None or mesh is None:
        return True
    for dim, placement in enumerate(placements):
        if placement.is_replicate() and mesh.get_local_rank(dim) != 0:
            return False
    return _in_first_copy(mesh)


_FIRST_COPY: dict[int, tuple[Any, bool]] = {}  # id(mesh) -> (the mesh, whether this rank counts)


def _in_first_copy(mesh: Any) -> bool:
    """Whether this rank's copy of ``mesh`` is the first within its root mesh: along each root
    dimension the mesh does not span, this rank's coordinate is 0."""
    known = _FIRST_COPY.get(id(mesh))
    if known is not None and known[0] is mesh:
        return known[1]
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    counts = True
    if root is not mesh and root.get_coordinate() is not None:
        ranks = root.mesh
        members = torch.isin(ranks, mesh.mesh.flatten())
        where = members.nonzero()  # the root coordinates of the mesh's ranks
        mine = root.get_coordinate()
        counts = all(mine[d] == 0 for d in range(ranks.ndim) if bool((where[:, d] == where[0, d]).all())
                     and ranks.shape[d] > 1)
    if len(_FIRST_COPY) > 1024:
        _FIRST_COPY.clear()
    _FIRST_COPY[id(mesh)] = (mesh, counts)
    return counts


def moment_fingerprint(opt: torch.optim.Optimizer, names: dict | None = None) -> dict:
    """``names``: parameter -> its checkpoint names (the first, sorted, weighs its moments)."""
    params = [p for group in opt.param_groups for p in group["params"]]
    return fingerprint_states([opt.state.get(p, {}) for p in params],
                              [min(names[p]) if names and names.get(p) else None for p in params])


def fingerprint_states(states: list[dict], names: list[str | None] | None = None) -> dict:
    """Bit sums per state key of the given per-parameter optimizer states (resume.continuity).

    ``names``: each state's parameter name; given for every state, each kind also records
    ``named``, the sums weighted by their names (``resume.layout.name_weight``): a moment loaded
    under another name changes it where the plain sums stay equal."""
    sums: dict[str, list[tuple[str, str | None, torch.Tensor]]] = {"replicated": [], "sharded": []}
    numel = {"replicated": 0, "sharded": 0}
    weighed = names is not None and len(names) == len(states) and all(n is not None for n in names)
    for index, state in enumerate(states):
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
            sums[kind].append((str(key), names[index] if weighed else None, bits.sum(dtype=acc).to(torch.int64)))
            numel[kind] += local.numel()
    every = [t for kind in ("replicated", "sharded") for _, _, t in sums[kind]]
    # One transfer for every tensor's sum: the partial sums stay on their device until here.
    values = iter(torch.stack([t.to(every[0].device) for t in every]).cpu().tolist() if every else [])
    out = {}
    for kind in ("replicated", "sharded"):
        bits: dict[str, int] = {}
        named: dict[str, int] = {}
        for key, name, _ in sums[kind]:
            value = next(values) & 0xFFFFFFFF
            bits[key] = (bits.get(key, 0) + value) & 0xFFFFFFFF
            if name is not None:
                named[key] = (named.get(key, 0) + value * name_weight(name)) & 0xFFFFFFFF
        out[kind] = {"bits": dict(sorted(bits.items())), "numel": numel[kind]}
        if weighed:
            out[kind]["named"] = dict(sorted(named.items()))
    return out
