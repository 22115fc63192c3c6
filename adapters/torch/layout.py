"""The parallel layout of a native PyTorch program, read from its objects (``resume.layout``).

What is read, in this order:

- data parallel: an FSDP2 module's mesh (its shard and, for HSDP, replicate dimension), or
  DDP's process group; else every rank the tensor, context and pipeline degrees leave is a
  data-parallel replica (plain tensors and a hand-written all-reduce count so);
- tensor, context and expert degrees: the device meshes of DTensor parameters, over the
  dimensions FSDP does not shard on, by their names (``tp``, ``cp``, ``ep``, as torchtitan
  names them); an unnamed one counts as tensor parallel;
- the pipeline stage: the set of parameter names this rank holds (``resume.layout.stage_digest``),
  the same on every layout for one stage; the degree is how many distinct sets the ranks hold;
- how each parameter is placed: ``S(0) over dp=2`` (torch's short form of ``Shard(0)``) or
  ``plain``, counted.

What cannot be read (a hand-written tensor-parallel split, a program's own shard scheme) is
stated: ``NativeTorchAdapter(..., parallel={"tensor": 2, "scheme": "flat-zero1"})``; a stated
degree wins over a read one. A tensor, context or expert degree stated where no DTensor shows it
is a split of the program's own: that degree is then fixed (``resume.layout``'s ``fixed``), and a
``scheme`` makes the checkpoint loadable on its own layout only.
"""

from __future__ import annotations

from typing import Any

import torch

from resume.layout import stage_digest

__all__ = ["PER_STAGE", "read_layout_part"]

_KINDS = {"tp": "tensor", "tensor": "tensor", "cp": "context", "context": "context", "ep": "expert",
          "expert": "expert", "pp": "pipeline", "pipeline": "pipeline"}


PER_STAGE = ("the optimizers' param groups and step counts and the schedulers are kept per pipeline stage, "
             "in each rank's state file, and cannot follow another split: restart with the saved pipeline "
             "degree at the same stage boundaries")
"""Why a checkpoint of this adapter loads on its own pipeline split only (``resume.layout``'s ``fixed``)."""


def _dim_kind(name: str | None, *, data_parallel: bool) -> str:
    """What a mesh dimension is: a degree of ``resume.layout.DEGREES`` or ``data``."""
    if data_parallel:
        return "data"
    if name is None:
        return "tensor"
    low = name.lower()
    if low in _KINDS:
        return _KINDS[low]
    if low.startswith(("dp", "fsdp", "hsdp", "ddp", "data", "replicate", "shard")):
        return "data"
    return "tensor"


def _fsdp_mesh(parts: list[torch.nn.Module]) -> tuple[int, int, Any] | None:
    """(replicate size, shard size, the data-parallel mesh) of the first FSDP2 module; None: none."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - every torch we support has it
        return None
    for part in parts:
        for module in part.modules():
            if not isinstance(module, FSDPModule):
                continue
            state = getattr(module, "_get_fsdp_state", None)  # private: read where torch has it
            group = getattr(state(), "_fsdp_param_group", None) if state is not None else None
            info = getattr(group, "mesh_info", None)
            if info is None:
                continue
            shard = int(getattr(info, "shard_mesh_size", 1) or 1)
            replicate = int(getattr(info, "replicate_mesh_size", 1) or 1)
            return replicate, shard, info.mesh
    return None


def _ddp_size(parts: list[torch.nn.Module]) -> int | None:
    from torch.nn.parallel import DistributedDataParallel

    for part in parts:
        if isinstance(part, DistributedDataParallel):
            return int(part.process_group.size())
    return None


def _mesh_text(mesh: Any, kinds: list[str]) -> str:
    names = mesh.mesh_dim_names or tuple(None for _ in range(mesh.ndim))
    return " x ".join(f"{name or ('dp' if kind == 'data' else kind)}={mesh.size(i)}"
                      for i, (name, kind) in enumerate(zip(names, kinds)))


def _param_kinds(param: Any, dp_dims: int) -> list[str]:
    """Per mesh dimension of a DTensor parameter: ``data`` or a degree (FSDP puts its
    data-parallel dimensions first)."""
    mesh = param.device_mesh
    names = mesh.mesh_dim_names or tuple(None for _ in range(mesh.ndim))
    return [_dim_kind(name, data_parallel=i < dp_dims) for i, name in enumerate(names)]


def read_layout_part(parts: list[torch.nn.Module], names: dict, stated: dict) -> dict:
    """This rank's share of the layout (``resume.layout.assemble_layout``): degrees read from the
    objects (``stated`` wins), how its parameters are placed, and its stage (``names``: parameter
    -> its checkpoint names)."""
    fsdp = _fsdp_mesh(parts)
    ddp = _ddp_size(parts)
    dp_dims = fsdp[2].ndim if fsdp is not None else 0
    degrees: dict[str, int] = {}
    placements: dict[str, int] = {}
    for part in parts:
        for param in part.parameters():
            mesh = getattr(param, "device_mesh", None)
            if mesh is None or not hasattr(param, "placements"):
                placements["plain"] = placements.get("plain", 0) + 1
                continue
            kinds = _param_kinds(param, dp_dims)
            for i, kind in enumerate(kinds):
                if kind != "data":
                    degrees[kind] = max(degrees.get(kind, 1), int(mesh.size(i)))
                elif fsdp is None:  # a named data-parallel dimension of a DTensor (no FSDP)
                    key = "dp_shard" if param.placements[i].is_shard() else "dp_replicate"
                    degrees[key] = max(degrees.get(key, 1), int(mesh.size(i)))
            text = f"{', '.join(str(p) for p in param.placements)} over {_mesh_text(mesh, kinds)}"
            placements[text] = placements.get(text, 0) + 1
    if fsdp is not None:
        degrees["dp_replicate"], degrees["dp_shard"] = fsdp[0], fsdp[1]
    elif ddp is not None:
        degrees["dp_replicate"] = ddp
    fixed = {"pipeline": PER_STAGE}
    for key, value in stated.items():
        if key in ("tensor", "context", "expert") and value > 1 and degrees.get(key, 1) == 1:
            fixed[key] = (f"the {key} degree {value} is stated by the program (parallel=...), not read from "
                          "DTensor parameters: a split of the program's own, which the checkpoint's shards "
                          f"do not describe; restart with the same {key} degree, or split with DTensor "
                          "(parallelize_module) so that the layout is read")
    degrees.update({k: v for k, v in stated.items() if k != "scheme"})
    held = sorted({fqn for fqns in names.values() for fqn in fqns})
    read = fsdp is not None or ddp is not None or set(placements) - {"plain"}
    how = "stated" if stated else "read" if read else "assumed"
    return {"degrees": degrees, "how": how, "scheme": stated.get("scheme"), "fixed": fixed,
            "placements": dict(sorted(placements.items())[:64]),
            "stage": {"digest": stage_digest(held), "names": len(held),
                      "first": held[0][:200] if held else "", "last": held[-1][:200] if held else ""}}
