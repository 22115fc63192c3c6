"""The parallel layout: global rank <-> node <-> (tp, cp, dp, pp), replicas, spares, elastic sizes.

Megatron's default rank order (``tp-cp-ep-dp-pp``, EP = 1)::

    rank = tp + TP * (cp + CP * (dp + DP * pp))

With TP = GPUs per node, one failed node takes its whole model replica out. The valid
data-parallel sizes are those that divide ``global_batch / micro_batch``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from resume.errors import UsageError

__all__ = ["REFERENCE", "Layout", "RankCoords", "valid_dp_sizes"]


def valid_dp_sizes(*, global_batch: int, micro_batch: int, max_dp: int) -> list[int]:
    """Data-parallel sizes up to ``max_dp`` that split the global batch into equal
    micro-batches on every rank, largest first: the sizes a job may shrink to."""
    micro_batches = global_batch // micro_batch
    return [d for d in range(max_dp, 0, -1) if micro_batches % d == 0]


@dataclass(frozen=True, slots=True)
class RankCoords:
    rank: int
    node: int
    local_rank: int
    tp: int
    cp: int
    dp: int
    pp: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """A job's parallel layout on its nodes."""

    nodes: int = 640
    """Nodes of the allocation, spares included."""
    gpus_per_node: int = 8
    tp: int = 8
    """Tensor-parallel size (inside a node)."""
    pp: int = 8
    """Pipeline-parallel size (across the nodes of one replica)."""
    cp: int = 1
    """Context-parallel size."""
    spares: int = 0
    """Hot-spare nodes held idle inside the allocation to replace a failed one."""
    global_batch: int = 1920
    """Sequences per optimizer step."""
    micro_batch: int = 1
    """Sequences per micro-batch on one data-parallel rank."""

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "tp", "pp", "cp", "global_batch", "micro_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UsageError(f"layout: {name}: expected a positive integer, actual {value!r}")
        if self.spares < 0 or self.spares >= self.nodes:
            raise UsageError(f"layout: spares: expected 0..{self.nodes - 1}, actual {self.spares}")
        per_replica = self.tp * self.cp * self.pp
        if per_replica % self.gpus_per_node:
            raise UsageError(f"layout: tp x cp x pp: expected a multiple of gpus_per_node "
                             f"{self.gpus_per_node} (whole nodes per replica), actual {per_replica}")
        if self.tp > self.gpus_per_node or self.gpus_per_node % self.tp:
            raise UsageError(f"layout: tp: expected a divisor of gpus_per_node {self.gpus_per_node} "
                             f"(tensor parallelism stays inside a node), actual {self.tp}")
        if (self.tp * self.cp) % self.gpus_per_node:
            # Megatron's order puts consecutive dp ranks on one node otherwise, so one
            # failed node would take several replicas out; not modelled here.
            raise UsageError(f"layout: tp x cp: expected a multiple of gpus_per_node "
                             f"{self.gpus_per_node} (one replica slice per node), actual {self.tp * self.cp}")
        if self.global_batch % self.micro_batch:
            raise UsageError(f"layout: global_batch: expected a multiple of micro_batch "
                             f"{self.micro_batch}, actual {self.global_batch}")
        if self.dp < 1:
            raise UsageError(f"layout: nodes: expected at least {self.nodes_per_replica + self.spares} "
                             f"({self.nodes_per_replica} per replica + {self.spares} spares), "
                             f"actual {self.nodes}")
        if not self.valid_dp:
            raise UsageError(f"layout: global_batch: expected a multiple of micro_batch x dp for some "
                             f"dp <= {self.max_dp}, actual {self.global_batch}")

    # -- sizes ---------------------------------------------------------------------------

    @property
    def nodes_per_replica(self) -> int:
        return self.tp * self.cp * self.pp // self.gpus_per_node

    @property
    def max_dp(self) -> int:
        """Replicas the non-spare nodes can hold."""
        return (self.nodes - self.spares) // self.nodes_per_replica

    @property
    def micro_batches(self) -> int:
        return self.global_batch // self.micro_batch

    @property
    def valid_dp(self) -> list[int]:
        """Data-parallel sizes that fit and split the global batch evenly, largest first."""
        return valid_dp_sizes(global_batch=self.global_batch, micro_batch=self.micro_batch,
                              max_dp=self.max_dp)

    @property
    def dp(self) -> int:
        """The data-parallel size used: the largest valid one (0 if none fits)."""
        valid = self.valid_dp
        return valid[0] if valid else 0

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def idle_nodes(self) -> int:
        """Non-spare nodes left over because the largest valid dp does not use them all."""
        return self.nodes - self.spares - self.dp * self.nodes_per_replica

    def micro_batches_per_rank(self, dp: int) -> int:
        if self.micro_batches % dp:
            raise UsageError(f"dp: expected a divisor of {self.micro_batches} micro-batches, actual {dp}")
        return self.micro_batches // dp

    def shrink_after(self, lost_nodes: int) -> int:
        """The data-parallel size once ``lost_nodes`` nodes are gone (spares used first):
        replicas are re-formed from the healthy nodes, and the size must stay valid."""
        fits = (self.nodes - lost_nodes) // self.nodes_per_replica
        return next((d for d in self.valid_dp if d <= fits), 0)

    def global_batch_at_constant_micro_batches(self, dp: int) -> int:
        """The other way to shrink: keep micro-batches per rank, let the global batch change
        (the LR schedule must then be sample-based, and continuity compared in samples)."""
        return self.micro_batch * self.micro_batches_per_rank(self.dp) * dp

    # -- mapping ---------------------------------------------------------------------------

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise UsageError(f"rank: expected 0..{self.world_size - 1}, actual {rank}")
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        return RankCoords(rank=rank, node=rank // self.gpus_per_node,
                          local_rank=rank % self.gpus_per_node, tp=tp, cp=cp, dp=dp, pp=pp)

    def rank_of(self, *, tp: int, cp: int = 0, dp: int, pp: int) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def replica_nodes(self, dp: int) -> list[int]:
        """The nodes that hold data-parallel replica ``dp`` (one per pipeline stage and cp rank)."""
        nodes = {self.rank_of(tp=t, cp=c, dp=dp, pp=p) // self.gpus_per_node
                 for p in range(self.pp) for c in range(self.cp) for t in range(self.tp)}
        return sorted(nodes)

    def replica_of_node(self, node: int) -> int:
        return self.coords(node * self.gpus_per_node).dp

    @property
    def spare_nodes(self) -> list[int]:
        first = self.dp * self.nodes_per_replica
        return list(range(first + self.idle_nodes, self.nodes))

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "dp": self.dp,
            "world_size": self.world_size,
            "nodes_per_replica": self.nodes_per_replica,
            "replicas": self.dp,
            "idle_nodes": self.idle_nodes,
            "valid_dp": self.valid_dp,
            "micro_batches_per_rank": {str(d): self.micro_batches_per_rank(d) for d in self.valid_dp},
            "global_batch_at_constant_micro_batches": {
                str(d): self.global_batch_at_constant_micro_batches(d) for d in self.valid_dp},
            "after_one_node_lost": self.shrink_after(1),
        }


REFERENCE = Layout()
