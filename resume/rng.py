"""Capture and restore every random number generator a training step may use.

Python's ``random``, numpy's global generator, torch's CPU generator, every
CUDA device's generator when CUDA is present, and generators the user
registers (``torch.Generator``, ``numpy.random.Generator``, ``random.Random``).
The state is plain JSON (byte states base64-encoded): loading it runs no code.
numpy and torch are used only when the training process already imported them.
"""

from __future__ import annotations

import base64
import json
import math
import random
import sys
from typing import Any

from .checksum import digest_parts
from .errors import CorruptCheckpointError
from .text import short

__all__ = ["RngRegistry", "check_state"]

_WORD = 2**32
_B64_STATE_CAP = 1 << 20
"""A torch generator's state as base64 (the CPU one is 6,744 characters)."""
_ARRAY_DTYPES = {"uint8", "uint16", "uint32", "uint64", "int32", "int64"}
_ARRAY_CAP = 1 << 16
_DEPTH_CAP = 8


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode(), validate=True)


def _to_json(value: Any) -> Any:
    """numpy bit-generator states hold arrays for some generators (MT19937, Philox, SFC64)."""
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    if hasattr(value, "tolist") and hasattr(value, "dtype"):
        return {"__array__": value.tolist(), "dtype": str(value.dtype)}
    if hasattr(value, "item") and hasattr(value, "dtype"):  # numpy scalar
        return value.item()
    return value


def _from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if "__array__" in value:
            np = sys.modules["numpy"]
            return np.array(value["__array__"], dtype=value["dtype"])
        return {k: _from_json(v) for k, v in value.items()}
    return value


def _capture_one(gen: Any) -> dict:
    if isinstance(gen, random.SystemRandom):
        raise TypeError("cannot capture the state of a SystemRandom generator (it has none)")
    if isinstance(gen, random.Random):
        version, internal, gauss = gen.getstate()
        return {"kind": "python", "version": version, "state": list(internal), "gauss": gauss}
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(gen, torch.Generator):
        return {"kind": "torch", "state": _b64(bytes(gen.get_state().numpy().tobytes()))}
    np = sys.modules.get("numpy")
    if np is not None and isinstance(gen, np.random.Generator):
        return {"kind": "numpy.Generator", "state": _to_json(gen.bit_generator.state)}
    raise TypeError(f"cannot capture the state of a {type(gen).__name__} generator")


def _restore_one(gen: Any, state: dict) -> None:
    kind = state["kind"]
    if kind == "python":
        gen.setstate((state["version"], tuple(state["state"]), state["gauss"]))
    elif kind == "torch":
        torch = sys.modules["torch"]
        gen.set_state(torch.frombuffer(bytearray(_unb64(state["state"])), dtype=torch.uint8))
    elif kind == "numpy.Generator":
        gen.bit_generator.state = _from_json(state["state"])
    else:
        raise ValueError(f"unknown generator kind {kind!r}")


def check_state(state: Any, *, source: str) -> None:
    """The saved generators' states in shape and bounds, before any is restored: the
    CorruptCheckpointError names ``source`` and the field (``rng.numpy.keys``)."""
    _require(isinstance(state, dict), source, "rng", "an object", state)
    _check_python(state.get("python"), source, "rng.python")
    if "numpy" in state:
        s = state["numpy"]
        _require(isinstance(s, dict) and s.get("name") == "MT19937", source, "rng.numpy",
                 "an MT19937 state", s)
        _check_words(s.get("keys"), 624, source, "rng.numpy.keys")
        _require(_is_int(s.get("pos"), 0, 625), source, "rng.numpy.pos", "an integer in [0, 624]", s.get("pos"))
        _require(s.get("has_gauss") in (0, 1), source, "rng.numpy.has_gauss", "0 or 1", s.get("has_gauss"))
        _require(_is_float(s.get("cached_gaussian")), source, "rng.numpy.cached_gaussian", "a finite number",
                 s.get("cached_gaussian"))
    if "torch" in state:
        _check_b64(state["torch"], source, "rng.torch")
    if "cuda" in state:
        _require(isinstance(state["cuda"], list) and len(state["cuda"]) <= 4096, source, "rng.cuda",
                 "a list of states", state["cuda"])
        for i, s in enumerate(state["cuda"]):
            _check_b64(s, source, f"rng.cuda[{i}]")
    user = state.get("user", {})
    _require(isinstance(user, dict), source, "rng.user", "an object", user)
    for name, s in user.items():
        _check_user(s, source, f"rng.user[{short(name)}]")


def _require(ok: bool, source: str, field: str, expected: str, actual: Any) -> None:
    if not ok:
        raise CorruptCheckpointError(f"{source}: {field}: expected {expected}, actual {short(actual)}")


def _is_int(value: Any, low: int, high: int) -> bool:
    return type(value) is int and low <= value < high


def _is_float(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def _check_words(words: Any, count: int, source: str, field: str) -> None:
    ok = isinstance(words, list) and len(words) == count and all(_is_int(w, 0, _WORD) for w in words)
    _require(ok, source, field, f"{count} integers in [0, 2**32)", words)


def _check_b64(text: Any, source: str, field: str) -> None:
    ok = isinstance(text, str) and len(text) <= _B64_STATE_CAP
    if ok:
        try:
            _unb64(text)
        except ValueError:
            ok = False
    _require(ok, source, field, f"a base64 generator state of at most {_B64_STATE_CAP} characters",
             text if isinstance(text, str) and len(text) < 200 else type(text).__name__)


def _check_python(s: Any, source: str, field: str) -> None:
    _require(isinstance(s, dict) and s.get("kind") == "python", source, field, "a python generator state", s)
    _require(_is_int(s.get("version"), 1, 4), source, f"{field}.version", "1, 2 or 3", s.get("version"))
    words = s.get("state")
    ok = (isinstance(words, list) and len(words) == 625 and all(_is_int(w, 0, _WORD) for w in words[:624])
          and _is_int(words[624], 0, 625))
    _require(ok, source, f"{field}.state", "624 integers in [0, 2**32) and a position", words)
    _require(s.get("gauss") is None or _is_float(s.get("gauss")), source, f"{field}.gauss",
             "null or a finite number", s.get("gauss"))


def _check_user(s: Any, source: str, field: str) -> None:
    _require(isinstance(s, dict) and s.get("kind") in ("python", "torch", "numpy.Generator"), source, field,
             "a python, torch or numpy.Generator state", s)
    if s["kind"] == "python":
        _check_python(s, source, field)
    elif s["kind"] == "torch":
        _check_b64(s.get("state"), source, f"{field}.state")
    else:
        _check_numpy_tree(s.get("state"), source, f"{field}.state")


def _check_numpy_tree(value: Any, source: str, field: str) -> None:
    """A numpy bit generator's state: names, bounded ints and flat arrays of known dtypes,
    a few levels deep (walked without recursion)."""
    pending = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        _require(depth <= _DEPTH_CAP, source, field, f"at most {_DEPTH_CAP} levels", "deeper")
        if isinstance(item, dict) and "__array__" in item:
            array, dtype = item["__array__"], item.get("dtype")
            ok = (isinstance(dtype, str) and dtype in _ARRAY_DTYPES and isinstance(array, list) and len(array) <= _ARRAY_CAP
                  and all(_is_int(v, -(2**63), 2**64) for v in array))
            _require(ok, source, field, f"a flat array of at most {_ARRAY_CAP} integers of "
                     f"{sorted(_ARRAY_DTYPES)}", item)
        elif isinstance(item, dict):
            pending.extend((v, depth + 1) for v in item.values())
        else:
            ok = (isinstance(item, str) and len(item) <= 64) or _is_int(item, -(2**128), 2**128) \
                or _is_float(item) or item is None
            _require(ok, source, field, "names and integers below 2**128", item)


class RngRegistry:
    """The process's generators, plus the ones the user registers by name."""

    def __init__(self) -> None:
        self._user: dict[str, Any] = {}

    def register(self, name: str, generator: Any) -> None:
        _capture_one(generator)  # rejects unsupported kinds now, not at the first save
        self._user[name] = generator

    def capture(self) -> dict:
        state: dict[str, Any] = {"python": _capture_one(random._inst)}  # type: ignore[attr-defined]
        np = sys.modules.get("numpy")
        if np is not None:
            name, keys, pos, has_gauss, cached = np.random.get_state()
            state["numpy"] = {"name": name, "keys": [int(k) for k in keys], "pos": int(pos),
                              "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
        torch = sys.modules.get("torch")
        if torch is not None:
            state["torch"] = _b64(bytes(torch.get_rng_state().numpy().tobytes()))
            if torch.cuda.is_available():
                state["cuda"] = [_b64(bytes(s.numpy().tobytes())) for s in torch.cuda.get_rng_state_all()]
        state["user"] = {name: _capture_one(gen) for name, gen in sorted(self._user.items())}
        return state

    def restore(self, state: dict) -> None:
        _restore_one(random._inst, state["python"])  # type: ignore[attr-defined]
        np = sys.modules.get("numpy")
        if np is not None and "numpy" in state:
            s = state["numpy"]
            np.random.set_state((s["name"], np.array(s["keys"], dtype=np.uint32), s["pos"],
                                 s["has_gauss"], s["cached_gaussian"]))
        torch = sys.modules.get("torch")
        if torch is not None and "torch" in state:
            torch.set_rng_state(torch.frombuffer(bytearray(_unb64(state["torch"])), dtype=torch.uint8))
            if "cuda" in state and torch.cuda.is_available():
                states = [torch.frombuffer(bytearray(_unb64(s)), dtype=torch.uint8) for s in state["cuda"]]
                torch.cuda.set_rng_state_all(states[: torch.cuda.device_count()])
        saved_user = state.get("user", {})
        missing = sorted(set(self._user) - set(saved_user))
        if missing:
            raise KeyError(f"rng: registered generators {missing} have no saved state")
        for name, gen in self._user.items():
            _restore_one(gen, saved_user[name])

    @staticmethod
    def digest(state: dict) -> str:
        return digest_parts([json.dumps(state, sort_keys=True)])
