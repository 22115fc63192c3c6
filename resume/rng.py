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
import random
import sys
from typing import Any

from .checksum import digest_parts

__all__ = ["RngRegistry"]


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
