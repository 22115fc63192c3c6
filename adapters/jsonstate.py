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
        dtype = getattr(torch, value["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown tensor dtype {value['dtype']!r}")
        raw = bytearray(base64.b64decode(value["__tensor__"]))
        if not raw:
            return torch.empty(value["shape"], dtype=dtype)
        return torch.frombuffer(raw, dtype=dtype).reshape(value["shape"]).clone()
    return {k: decode(v) for k, v in value.items()}
