"""State a trainer keeps beyond the model, the optimizers and the schedulers: any object with
``state_dict()`` / ``load_state_dict()`` (a loss scaler, an EMA of the weights, a counter of the
program's own), registered by name (``Coordinator.register``).

Each object's ``state_dict()`` is split in two at a save: its tensors go through DCP with the
model's (under ``state.<name>.<path>``; a DTensor stays sharded), the rest is JSON in the rank's
state file (``resume.adapters.jsonstate``: plain values, never pickled code), where each tensor
is a placeholder naming its path. A restore joins them again and calls ``load_state_dict``
with the result; the tensors are read into memory of their own first, so an object is written
only once every rank's read went through. Every object's state is digested at the save and
again after the load (``digests``), and compared like the moments: a name saved and not
registered now, or registered now and not saved, is a ``ContinuityError`` naming it.
"""

from __future__ import annotations

import gc
import json
import re
from typing import Any

import torch

from resume.checksum import digest_parts
from resume.errors import ContinuityError, CorruptCheckpointError, UsageError
from resume.text import short

from .. import jsonstate
from .fingerprint import bits_view

__all__ = ["NAME", "Registered", "unregistered_state"]

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_PLACEHOLDER = "__shard__"
_SHOWN_CAP = 8


class Registered:
    """The registered objects of one adapter, by name, in the order they were registered."""

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}
        self._loaded: dict[str, dict[str, Any]] = {}  # name -> path -> tensor, read by the last load

    def add(self, name: str, obj: Any) -> None:
        if not isinstance(name, str) or not NAME.match(name):
            raise UsageError(f"register: name: expected letters, digits and '_' (not first a digit, at most "
                             f"64), actual {short(name)}")
        if name in self.objects:
            raise UsageError(f"register: name: expected a name not registered yet, actual {name!r} (already "
                             f"{type(self.objects[name]).__name__})")
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise UsageError(f"register({name!r}): expected an object with state_dict() and load_state_dict(), "
                             f"actual {type(obj).__name__}")
        self.objects[name] = obj
        split(obj.state_dict(), name)  # what cannot be saved is refused now, not at the first save

    def __bool__(self) -> bool:
        return bool(self.objects)

    # -- save ------------------------------------------------------------------------------------

    def tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """For DCP: each object's tensors by path (objects without any left out)."""
        out = {}
        for name, obj in self.objects.items():
            found = split(obj.state_dict(), name)[1]
            if found:
                out[name] = found
        return out

    def state(self) -> dict[str, dict]:
        """For the rank's state file: each object's kind and its state without the tensors."""
        return {name: {"kind": _kind(obj), "data": split(obj.state_dict(), name)[0]}
                for name, obj in self.objects.items()}

    def digests(self) -> dict[str, str]:
        """Each object's state in a digest: the JSON part and every tensor's bit sum (the rank's own
        shard of a DTensor), for the continuity check."""
        out = {}
        for name, obj in self.objects.items():
            data, found = split(obj.state_dict(), name)
            parts = [json.dumps(data, sort_keys=True)]
            parts += [f"{path}:{t.dtype}:{tuple(t.shape)}:{_bits(t)}" for path, t in sorted(found.items())]
            out[name] = digest_parts(parts)
        return out

    def shown(self) -> dict[str, dict]:
        """Each object's kind and a few of its values, for ``resume inspect`` and for naming what
        differs: a GradScaler's scale and growth tracker, an AveragedModel's ``n_averaged``, else
        the first scalar values of its state."""
        return {name: {"kind": _kind(obj), "values": _values(obj)} for name, obj in self.objects.items()}

    # -- restore ---------------------------------------------------------------------------------

    def kept(self, loaded: dict[str, dict[str, Any]]) -> None:
        """The tensors the load read (into memory of their own), for ``load`` to hand over."""
        self._loaded = loaded

    def load(self, saved: Any, *, source: str) -> None:
        """Every object's state from the rank state file's ``saved`` and the tensors the load read.
        Names must match both ways; a ``ContinuityError`` names the first that does not."""
        saved = {} if saved is None else saved
        loaded, self._loaded = self._loaded, {}
        missing = [n for n in self.objects if n not in saved]
        if missing:
            raise ContinuityError(f"state.{missing[0]}", "in the checkpoint (registered now)",
                                  "not saved", "registered after this checkpoint was written, or saved by a "
                                  "program that did not register it: restoring would start it afresh")
        extra = [n for n in saved if n not in self.objects]
        if extra:
            raise ContinuityError(f"state.{extra[0]}", f"registered ({saved[extra[0]].get('kind')}, saved in "
                                  "the checkpoint)", "not registered", f"add coord.register({extra[0]!r}, ...) "
                                  "before coord.restore(), or its state is lost")
        for name, obj in self.objects.items():
            data = jsonstate.decode(saved[name]["data"])
            obj.load_state_dict(_joined(data, loaded.get(name, {}), name, source))

    def check(self, saved: Any, *, source: str) -> None:
        """The rank state file's part in shape (before anything is loaded)."""
        if not isinstance(saved, dict):
            raise CorruptCheckpointError(f"{source}: adapter.registered: expected an object, actual {short(saved)}")
        for name, entry in saved.items():
            if not (NAME.match(name) and isinstance(entry, dict) and isinstance(entry.get("kind"), str)
                    and "data" in entry):
                raise CorruptCheckpointError(f"{source}: adapter.registered.{short(name, 40)}: expected an object "
                                             f"with kind and data, actual {short(entry)}")


def split(tree: Any, name: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """(the state as JSON, each tensor a placeholder naming its path; the tensors by path)."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            if path in tensors:
                raise UsageError(f"register({name!r}): state_dict(): expected one tensor per path, actual two "
                                 f"at {path!r}")
            tensors[path] = value
            return {_PLACEHOLDER: path}
        if isinstance(value, dict):
            if _PLACEHOLDER in value:
                raise UsageError(f"register({name!r}): state_dict(): a key {_PLACEHOLDER!r} is reserved")
            return {k: walk(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [walk(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return value
    if not isinstance(tree, dict):
        raise UsageError(f"register({name!r}): state_dict(): expected a dict, actual {type(tree).__name__}")
    try:
        return jsonstate.encode(walk(tree, "")), tensors
    except TypeError as e:
        raise UsageError(f"register({name!r}): state_dict(): expected tensors and plain values (numbers, "
                         f"strings, lists, dicts), actual: {e}") from e


def _joined(data: Any, tensors: dict[str, Any], name: str, source: str) -> Any:
    """``data`` with each placeholder replaced by the tensor the load read for its path."""
    def walk(value: Any) -> Any:
        if isinstance(value, dict) and set(value) == {_PLACEHOLDER}:
            path = value[_PLACEHOLDER]
            if path not in tensors:
                raise ContinuityError(f"state.{name}.{short(path, 60)}", "a tensor (the saved state names it)",
                                      "not in the checkpoint's shards", f"{source}: saved and read do not agree")
            return tensors[path]
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [walk(v) for v in value]
            return items if isinstance(value, list) else tuple(items)
        return value
    return walk(data)


def _kind(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}" if cls.__module__.startswith("torch.") else cls.__qualname__


def _bits(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    if local.numel() == 0:
        return 0
    bits, acc = bits_view(local.detach().contiguous())
    return int(bits.sum(dtype=acc)) & 0xFFFFFFFF


def _values(obj: Any) -> dict:
    if isinstance(obj, torch.amp.GradScaler):
        state = obj.state_dict()
        return {"scale": state.get("scale"), "growth_tracker": state.get("_growth_tracker")} if state else \
            {"enabled": False}
    out: dict[str, Any] = {}
    for key, value in obj.state_dict().items():
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not hasattr(value, "to_local"):
            value = value.item()
        if isinstance(value, (bool, int, float, str)) and len(out) < _SHOWN_CAP:
            out[str(key)] = value if not isinstance(value, str) else value[:40]
    return out


def unregistered_state(registered: Registered, model_parts: list[torch.nn.Module]) -> list[str]:
    """The stateful objects this process holds that are in use and not in the checkpoint, each
    with the line that registers it: a ``GradScaler`` that scaled a loss, an ``AveragedModel``
    (an EMA or SWA of the weights) that is not a model part. Looked for once, at the first save."""
    from torch.optim.swa_utils import AveragedModel

    kept = {id(o) for o in registered.objects.values()} | {id(m) for part in model_parts for m in part.modules()}
    kept |= {id(m) for o in registered.objects.values() if isinstance(o, torch.nn.Module) for m in o.modules()}
    found = []
    for obj in gc.get_objects():
        if id(obj) in kept:
            continue
        cls = type(obj)  # not isinstance: that asks obj.__class__, which some objects warn about
        if issubclass(cls, torch.amp.GradScaler) and obj.is_enabled() and getattr(obj, "_scale", None) is not None:
            found.append(("GradScaler", "scaler", obj.get_scale()))
        elif issubclass(cls, AveragedModel):
            found.append(("AveragedModel", "ema", int(obj.n_averaged)))
    return [f"a {kind} in use ({'scale' if kind == 'GradScaler' else 'n_averaged'} {value}) is not in the "
            f"checkpoint: a restart would start it afresh; add coord.register({label!r}, <it>) before "
            "coord.restore()" for kind, label, value in found]
