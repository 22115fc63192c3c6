"""torch.distributed glue: ``resume.comm.Comm`` over a process group, and a DDP comm hook."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from resume.comm import Comm, LocalComm

__all__ = ["TorchDistComm", "allreduce_each_gradient", "comm_for"]


class TorchDistComm:
    """``resume.comm.Comm`` over torch.distributed (any backend; gloo on CPU)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        # dst is a rank of this group; torch wants the global rank.
        dist.gather_object(obj, out, dst=dist.get_global_rank(self.group, dst) if self.group else dst,
                           group=self.group)
        return out

    def scatter_object(self, objs: list[Any] | None, src: int = 0) -> Any:
        out: list[Any] = [None]
        dist.scatter_object_list(out, objs if self.rank == src else None,
                                 src=dist.get_global_rank(self.group, src) if self.group else src, group=self.group)
        return out[0]

    def fork(self) -> TorchDistComm:
        # gloo whatever training uses: the background save moves CPU objects only.
        # For a subgroup only its members take part (the rest of the world never calls this).
        ranks = None if self.group is None else dist.get_process_group_ranks(self.group)
        return TorchDistComm(dist.new_group(ranks=ranks, backend="gloo",
                                            use_local_synchronization=ranks is not None))

    def max_flags(self, flags: list[int]) -> list[int]:
        # On the device NCCL needs; gloo and others take CPU tensors.
        device = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
        t = torch.tensor([int(f) for f in flags], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [int(x) for x in t.tolist()]


def allreduce_each_gradient(state, bucket):
    """Average gradients parameter by parameter, not per DDP bucket.

    With more than 2 ranks the sum's order depends on where an element falls in
    the buffer being reduced, and DDP lays its buckets out differently in the
    first iteration after it is constructed (a restarted job) than later. One
    reduction per parameter makes the order depend on the parameter alone, so
    a resumed run can be bitwise identical at any data-parallel size.

    Use: ``ddp.register_comm_hook(state=None, hook=allreduce_each_gradient)``.
    It costs one collective per parameter instead of one per bucket: for
    reproducibility checks and small models, not for a 500B run.
    """
    world = dist.get_world_size()
    for grad in bucket.gradients():
        grad.div_(world)
        dist.all_reduce(grad)
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def comm_for(group: Any = None) -> Comm:
    if dist.is_available() and dist.is_initialized():
        return TorchDistComm(group)
    return LocalComm()
