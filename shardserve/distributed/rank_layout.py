"""RankLayout: where every rank sits, the one place that computes ranks, groups and nodes.

Ranks are numbered over every replica: number = dp x W + rank, W = PP x PCP x TP the ranks of
one replica (its torch.distributed world). Within a replica, vLLM's order:

    all ranks = arange(DP x W).reshape(DP, PP, PCP, TP)

    TP=2, PCP=2, PP=2, DP=1:   pp 0: pcp 0 [0 1]   pp 1: pcp 0 [4 5]
                                     pcp 1 [2 3]         pcp 1 [6 7]
    TP groups  [0,1] [2,3] [4,5] [6,7]    (consecutive ranks: the last axis)
    PCP groups [0,2] [1,3] [4,6] [5,7]    (same TP rank, other context shard)
    PP groups  [0,4] [1,5] [2,6] [3,7]    (same place in every stage)
    DCP groups: decode context parallelism reuses the TP x PCP ranks of a stage, read TP-major
        (for each TP rank its PCP shards): DCP=2 of TP=2 x PCP=2 is [0,2] [1,3]; DCP=4 is
        [0,2,1,3]; without PCP, DCP splits each TP group into consecutive runs.
    DP groups: the same rank of every replica.

Nodes (multi-node): numbers are spread evenly, node-major: node n holds numbers n x L ..
(n+1) x L - 1, L = DP x W / nnodes; a rank's local rank (its device) is its index there.
The output rank of a replica (whose sampled tokens are returned): the first TP rank of the first
context shard of the last stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

AXES = ("dp", "pp", "pcp", "tp")


@dataclass(frozen=True)
class RankCoords:
    dp: int
    pp: int
    pcp: int
    tp: int


@dataclass(frozen=True)
class RankLayout:
    tp: int = 1
    pp: int = 1
    pcp: int = 1
    dp: int = 1
    dcp: int = 1
    """Decode context parallelism: divides TP x PCP (it reuses those ranks)."""
    nnodes: int = 1

    def __post_init__(self) -> None:
        for name in (*AXES, "dcp", "nnodes"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if (self.tp * self.pcp) % self.dcp:
            raise ValueError(f"decode context parallel size {self.dcp} must divide tensor x "
                             f"prefill context parallel size {self.tp} x {self.pcp}")
        if self.total % self.nnodes:
            raise ValueError(f"nnodes={self.nnodes} must divide the {self.total} ranks of every "
                             f"replica (DP x PP x PCP x TP): ranks are spread evenly")

    # ---- sizes ----
    @property
    def world_size(self) -> int:
        """Ranks of one replica (one torch.distributed world)."""
        return self.pp * self.pcp * self.tp

    @property
    def total(self) -> int:
        return self.dp * self.world_size

    @property
    def ranks_per_node(self) -> int:
        return self.total // self.nnodes

    @cached_property
    def _grid(self) -> np.ndarray:
        return np.arange(self.total).reshape(self.dp, self.pp, self.pcp, self.tp)

    # ---- rank <-> coordinates ----
    def rank_of(self, dp: int = 0, pp: int = 0, pcp: int = 0, tp: int = 0) -> int:
        """The number of the rank at these coordinates (over every replica; = rank for dp 0)."""
        return int(self._grid[dp, pp, pcp, tp])

    def coords(self, number: int) -> RankCoords:
        dp, pp, pcp, tp = np.unravel_index(number, self._grid.shape)
        return RankCoords(int(dp), int(pp), int(pcp), int(tp))

    def stage_of(self, rank: int) -> int:
        return self.coords(rank).pp

    @property
    def output_rank(self) -> int:
        """Within a replica: first TP rank of the first context shard of the last stage."""
        return self.rank_of(pp=self.pp - 1)

    def describe(self, rank: int, where: str) -> str:
        """'rank 3 (pid 7)' or, with stages, 'rank 3 (stage 1, TP rank 1, pid 7)'."""
        c = self.coords(rank)
        parts = [f"stage {c.pp}"] if self.pp > 1 else []
        parts += [f"context shard {c.pcp}"] if self.pcp > 1 else []
        parts += [f"TP rank {c.tp}"] if parts else []
        return f"rank {rank} ({', '.join([*parts, where])})"

    # ---- groups (lists of rank numbers; over every replica) ----
    def tp_groups(self) -> list[list[int]]:
        return _rows(self._grid, self.tp)

    def pcp_groups(self) -> list[list[int]]:
        return _rows(self._grid.transpose(0, 1, 3, 2), self.pcp)

    def pp_groups(self) -> list[list[int]]:
        return _rows(self._grid.transpose(0, 2, 3, 1), self.pp)

    def dp_groups(self) -> list[list[int]]:
        return _rows(self._grid.transpose(1, 2, 3, 0), self.dp)

    def dcp_groups(self) -> list[list[int]]:
        return _rows(self._grid.transpose(0, 1, 3, 2), self.dcp)

    def replica(self) -> RankLayout:
        """One replica's layout (its ranks numbered 0..world_size-1): its torch world's."""
        return RankLayout(self.tp, self.pp, self.pcp, 1, self.dcp)

    def replica_groups(self, kind: str) -> list[list[int]]:
        """One replica's groups of `kind` (tp, pcp, pp, dcp), in its own rank numbers: what
        its torch.distributed world builds."""
        return getattr(self.replica(), f"{kind}_groups")()

    def group_of(self, kind: str, number: int) -> list[int]:
        return next(g for g in getattr(self, f"{kind}_groups")() if number in g)

    # ---- nodes ----
    def number(self, rank: int, replica: int = 0) -> int:
        return replica * self.world_size + rank

    def node_of(self, rank: int, replica: int = 0) -> int:
        return self.number(rank, replica) // self.ranks_per_node

    def local_rank_of(self, rank: int, replica: int = 0) -> int:
        """Index among every replica's ranks on its node (its device there)."""
        return self.number(rank, replica) % self.ranks_per_node

    def ranks_on_node(self, node: int, replica: int = 0) -> tuple[int, ...]:
        """Replica `replica`'s ranks on `node` (consecutive; node 0's are a prefix)."""
        return tuple(r for r in range(self.world_size) if self.node_of(r, replica) == node)

    def nodes_of_replica(self, replica: int = 0) -> list[int]:
        """The node of each of the replica's ranks, in rank order."""
        return [self.node_of(r, replica) for r in range(self.world_size)]


def _rows(grid: np.ndarray, size: int) -> list[list[int]]:
    return [[int(x) for x in row] for row in grid.reshape(-1, size)]
