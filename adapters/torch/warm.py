"""``NativeTorchAdapter``'s warm start (``resume.adapter.WarmStartIO``): the model's weights from
another run's committed checkpoint (DCP reads only each rank's own shards, resharded to this
run's layout) or from an export's safetensors files (each rank takes its own part of each whole
tensor). Nothing but the model is touched: the optimizers, schedulers and data stay fresh."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from resume.errors import WarmStartError
from resume.run import Run
from resume.storage import open_storage

from ..dcp.filesystem import make_reader
from ..dcp.reader import SafeLoadPlanner
from .failures import load_failure
from .metadata import recorded_for_shards
from .objects import merge_into
from .shards import quiet_single_process

__all__ = ["WarmStartMixin"]


class WarmStartMixin:
    """Expects ``model_parts``, ``model_state``, ``process_group`` and ``_part_model_state``."""

    model_parts: list[torch.nn.Module]
    model_state: str
    process_group: Any

    def _model_state(self) -> dict:
        state: dict = {}
        for index, part in enumerate(self.model_parts):
            merge_into(state, self._part_model_state(part), f"model part {index}")  # type: ignore[attr-defined]
        return state

    def weight_shapes(self) -> dict[str, list[int]]:
        return {k: list(v.shape) for k, v in self._model_state().items() if isinstance(v, torch.Tensor)}

    def source_shapes(self, origin: dict) -> dict[str, list[int]]:
        if origin["kind"] == "export":
            return {name: list(t.shape) for name, (_, t) in _export_tensors(origin).items()}
        from ..export import read_entries

        src = read_entries(origin["source"], origin["step"])
        return {e.key[len("model."):]: list(e.shape) for e in src.entries if e.key.startswith("model.")}

    def load_weights(self, origin: dict) -> None:
        state = self._model_state()
        if origin["kind"] == "export":
            _copy_from_export(origin, state)
        else:
            self._load_checkpoint(origin, state)
        for part in self.model_parts:
            keys = self._part_model_state(part).keys()  # type: ignore[attr-defined]
            sub = {k: state[k] for k in keys}
            if self.model_state == "module":
                part.load_state_dict(sub)
            else:
                set_model_state_dict(part, sub)

    def _load_checkpoint(self, origin: dict, state: dict) -> None:
        run = Run.open(origin["source"])
        manifest = run.read_manifest(origin["step"])
        reader = make_reader(run.storage, origin["step_dir"])
        reader.compressed = recorded_for_shards(manifest)["compression"] == "zstd"
        try:
            with quiet_single_process():
                dcp.load({"model": state}, storage_reader=reader, planner=SafeLoadPlanner(),
                         process_group=self.process_group, no_dist=not dist.is_initialized())
        except CheckpointException as e:
            raise WarmStartError(f"warm start from {origin['source']}: {load_failure(e, run.storage, origin['step_dir'])}"
                                 " (the model may be partly loaded: start the run again)") from e


def _export_tensors(origin: dict) -> dict[str, tuple[str, Any]]:
    """Every tensor of the export's safetensors files: name -> (file, stored)."""
    from ..export.safetensors_files import read_header

    storage = open_storage(origin["source"])
    found: dict[str, tuple[str, Any]] = {}
    for name in origin["files"]:
        with storage.open_read(name) as f:
            for key, stored in read_header(f, storage.size(name), storage.url(name)).items():
                found[key] = (name, stored)
    return found


def _copy_from_export(origin: dict, state: dict) -> None:
    """Each live tensor filled from its whole tensor in the export (a DTensor: its own part)."""
    from ..export.safetensors_files import read_tensor

    storage = open_storage(origin["source"])
    tensors = _export_tensors(origin)
    by_file: dict[str, list[str]] = {}
    for key in state:
        by_file.setdefault(tensors[key][0], []).append(key)
    for name, keys in sorted(by_file.items()):
        with storage.open_read(name) as f:
            for key in sorted(keys, key=lambda k: tensors[k][1].start):
                full = read_tensor(f, tensors[key][1], storage.url(name))
                target = state[key]
                with torch.no_grad():
                    if isinstance(target, DTensor):
                        part = distribute_tensor(full.to(target.dtype), target.device_mesh, target.placements,
                                                 src_data_rank=None)
                        target.to_local().copy_(part.to_local())
                    else:
                        target.copy_(full)
