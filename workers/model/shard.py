"""How one rank holds its part of the model (`Shard`), and `SingleRank`: the collectives
interface at TP=1, where every collective is the identity, so the model has one code path.
`kvmesh.workers.parallel.collectives.Collectives` is the same interface over real process groups."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


class SingleRank:
    """TP=1: rank 0 of 1; collectives are the identity."""
    rank, size = 0, 1

    def __init__(self) -> None:
        self.stats = {"collectives": 0, "collective_s": 0.0, "collective_bytes": 0,   # the model's
                      "counts_s": 0.0,              # of which in all_counts (a DP step's first wait)
                      "messages": 0, "message_s": 0.0, "message_bytes": 0}            # rank 0's step messages

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather_rows(self, x: torch.Tensor, counts: list[int] | None = None) -> torch.Tensor:
        """Every rank's rows of x concatenated (rank order); `counts`: each rank's row count."""
        return x

    def all_counts(self, n: int) -> list[int]:
        """Every rank's `n`, in rank order."""
        return [n]


@dataclass
class Shard:
    """This rank's part of a tensor-parallel model, as DeepSeek's reference splits it: query
    heads, output groups, sinks (wq_b column-, wo_a group-, wo_b row-parallel), the vocabulary
    (embedding and head), and the routed experts (whole experts with `expert_parallel`, else
    each expert's intermediate dim) are split in `size` parts; the shared expert is split like
    the experts' intermediate dim when `split_shared`, else replicated and counted on rank 0
    only; everything else (wq_a, wkv, compressor, indexer, router, mHC, norms) is replicated.
    Each sublayer's partial output is summed by one all-reduce (`comm`).

    Data-parallel attention (`dp_size` > 1, with `size` 1): every rank holds the whole model
    but the routed experts, of which it owns n_routed_experts/dp_size whole experts; each MoE
    layer exchanges its tokens with the other `dp_size` - 1 ranks over `exchange` (moe.py).
    Tensor parallelism inside data-parallel ranks (`size` > 1 and `dp_size` > 1, `grouped`):
    `rank`/`size`/`comm` are the rank's attention group (one DP rank: heads, output groups,
    vocabulary and the shared expert split as above), `dp_rank`/`dp_size`/`exchange` its place
    among every rank of every group (D x T), over which the routed experts are split whole; each
    MoE layer splits the group's tokens over its ranks before the exchange and sums the outputs
    back in the group after it (moe.py `MoE.grouped`).
    With EPLB, `placement` (phy2log [P], P = n_routed_experts + redundant) says which logical
    expert each physical one holds at start-up; the rank holds physical experts [r*P/N, (r+1)*P/N)
    (model/expert_map.py), loaded from its own block of logical ones (`owned_experts`)."""
    rank: int = 0
    size: int = 1
    expert_parallel: bool = False
    split_shared: bool = True
    comm: SingleRank = field(default_factory=SingleRank, compare=False, repr=False)
    dp_rank: int = 0
    dp_size: int = 1
    exchange: SingleRank = field(default_factory=SingleRank, compare=False, repr=False)
    placement: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def part(self, n: int) -> int:
        return n // self.size

    @property
    def grouped(self) -> bool:
        """Tensor parallelism inside a data-parallel rank (see the class docstring)."""
        return self.size > 1 and self.dp_size > 1

    def owned_experts(self, n: int) -> tuple[int, int] | None:
        """(first, count) of the `n` routed experts this rank holds whole; None: all of them
        (or, under TP without expert parallelism, a slice of each)."""
        if self.dp_size > 1:
            return self.dp_rank * (n // self.dp_size), n // self.dp_size
        if self.size > 1 and self.expert_parallel:
            return self.rank * self.part(n), self.part(n)
        return None

    def physical_experts(self) -> tuple[int, int] | None:
        """EPLB: (first, count) of the physical experts this rank holds; None without EPLB."""
        if self.placement is None:
            return None
        count = self.placement.numel() // self.dp_size
        return self.dp_rank * count, count

    def local_placement(self, n: int) -> torch.Tensor | None:
        """EPLB: the logical expert in each of this rank's physical slots at start-up, as an index
        into its own block of the `n` logical experts (`owned_experts`); None without EPLB."""
        if self.placement is None:
            return None
        first, count = self.physical_experts()
        return self.placement[first:first + count] - self.owned_experts(n)[0]


SINGLE = Shard()
