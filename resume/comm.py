"""The collectives the coordinator needs, behind a small protocol.

The core never imports a framework: adapters hand it a ``Comm`` built on their
process group (``resume.adapters.torch.comm.TorchDistComm``), single-process
runs use ``LocalComm``.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Comm", "LocalComm"]


class Comm(Protocol):
    rank: int
    world_size: int

    def barrier(self) -> None: ...
    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...
    def all_gather_object(self, obj: Any) -> list[Any]: ...
    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` on ``dst`` (a list in rank order); None on the others. What
        each rank sends is its own object only: O(1) per rank, not O(ranks) as an all-gather."""
        ...
    def scatter_object(self, objs: list[Any] | None, src: int = 0) -> Any:
        """``objs[r]`` from ``src`` to each rank ``r`` (``objs`` is read on ``src`` only): each
        rank receives its own object, not the whole list as from a broadcast."""
        ...
    def max_flags(self, flags: list[int]) -> list[int]:
        """Element-wise maximum of small integer flags over all ranks (one small all-reduce)."""
        ...
    def fork(self) -> Comm:
        """Collective: a Comm over the same ranks on a group of its own, for a background
        thread (an asynchronous save) whose collectives must not interleave with training's."""
        ...


class LocalComm:
    rank = 0
    world_size = 1

    def barrier(self) -> None:
        pass

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        return [obj]

    def scatter_object(self, objs: list[Any] | None, src: int = 0) -> Any:
        assert objs is not None
        return objs[0]

    def max_flags(self, flags: list[int]) -> list[int]:
        return [int(f) for f in flags]

    def fork(self) -> LocalComm:
        return self
