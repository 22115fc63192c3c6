"""Plain-JSON encoding of small framework state (scheduler and loader state dicts).

Tuples, bytes, non-finite floats and small tensors are tagged, so they come back
as they were. Decoding builds only plain values, bytes and tensors: it runs no code
(bytes come back as bytes, never unpickled).
"""

from __future__ import annotations

import base64
import math
from typing import Any

import torch

__all__ = ["decode", "encode"]

_DTYPES = {name: getattr(torch, name) for name in (
    "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "int64", "int32", "int16", "int8",
    "uint64", "uint32", "uint16", "uint8", "bool", "float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)}
"""The dtypes a tensor in JSON state may have (by name: a file's name is looked up here, never in
``torch``'s namespace), each of at least one byte per element."""


def encode(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            return {"__dict__": [[encode(k), encode(v)] for k, v in value.items()]}
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v) for v in value]}
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        if str(t.dtype).removeprefix("torch.") not in _DTYPES:
            raise TypeError(f"cannot store a tensor of {t.dtype} in JSON state")
        return {"__tensor__": base64.b64encode(t.reshape(-1).view(torch.uint8).numpy().tobytes()
                                              if t.numel() else b"").decode(),
                "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    raise TypeError(f"cannot store a {type(value).__name__} in JSON state")


def decode(value: Any) -> Any:
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__float__" in value:
        return float(value["__float__"])
    if "__tuple__" in value:
        return tuple(decode(v) for v in value["__tuple__"])
    if "__bytes__" in value:
        return base64.b64decode(value["__bytes__"], validate=True)
    if "__dict__" in value:
        return {decode(k): decode(v) for k, v in value["__dict__"]}
    if "__tensor__" in value:
        return _tensor(value)
    return {k: decode(v) for k, v in value.items()}


def _tensor(value: dict) -> torch.Tensor:
    """A tagged tensor, its shape checked against the bytes it carries before anything is
    allocated: a file that claims a tensor of 2**40 elements is refused, not allocated."""
    dtype = _DTYPES.get(value.get("dtype")) if isinstance(value.get("dtype"), str) else None
    if dtype is None:
        raise ValueError(f"tensor dtype: expected one of {sorted(_DTYPES)}, actual {str(value.get('dtype'))[:40]!r}")
    shape = value.get("shape")
    if not (isinstance(shape, list) and len(shape) <= 64
            and all(type(n) is int and 0 <= n < 2**63 for n in shape)):
        raise ValueError(f"tensor shape: expected a list of at most 64 sizes, actual {str(shape)[:80]}")
    text = value["__tensor__"]
    if not isinstance(text, str):
        raise TypeError(f"tensor data: expected base64 text, actual {type(text).__name__}")
    numel = math.prod(shape)
    size = torch.empty((), dtype=dtype).element_size()
    expected = numel * size
    carried = len(text) // 4 * 3 - len(text[-2:]) + len(text[-2:].rstrip("="))  # before decoding it
    if carried != expected:
        raise ValueError(f"tensor of shape {shape} ({dtype}): expected {expected} bytes of data, "
                         f"actual {max(carried, 0)}")
    raw = bytearray(base64.b64decode(text, validate=True))
    if len(raw) != expected:
        raise ValueError(f"tensor of shape {shape} ({dtype}): expected {expected} bytes of data, actual {len(raw)}")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=dtype).reshape(shape).clone()
