"""Expert-parallel load balancing: where each routed expert's replicas go (DeepSeek's EPLB).

    phy2log, log2phy, logcnt = rebalance_experts(load, num_replicas, num_groups, num_nodes, num_ranks)

Pure torch on the CPU, no process groups: every rank of a replica computes the same placement
from the same counted load (model/moe.py ExpertMap counts the all-gathered picks, which every
rank sees), so placements agree without a message. The algorithm is DeepSeek's
(github.com/deepseek-ai/EPLB `eplb.py`, MIT), kept step for step:

1. `balanced_packing` packs expert groups to nodes (each node the same number of groups, the
   heaviest group first into the lightest node that has room);
2. `replicate_experts` adds the redundant replicas inside each node, each to the expert whose
   load per replica is highest;
3. `balanced_packing` again packs the node's physical experts to its ranks.

Hierarchical (1-3 over `num_nodes`) when the groups divide over the nodes, else global (one
node, one group). V4 has no expert groups (no group-limited routing): kvmesh's groups are the
static per-rank blocks of experts (`num_groups` = ranks), which always divide over the nodes.

Shapes: L = MoE layers, E = logical experts, P = physical experts (E + redundant), X = most
replicas of one expert. Physical expert p lives on rank p // (P / num_ranks).
"""
from __future__ import annotations

import torch


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Items weight [L, n] into `num_packs` packs of n / num_packs items each, the packs' weights
    as even as greedy gets them: (pack index [L, n], rank of the item in its pack [L, n])."""
    num_layers, num_items = weight.shape
    assert num_items % num_packs == 0, (num_items, num_packs)
    per_pack = num_items // num_packs
    if per_pack == 1:
        pack_index = torch.arange(num_items, dtype=torch.int64).expand(weight.shape).clone()
        return pack_index, torch.zeros_like(pack_index)
    order = weight.float().sort(dim=-1, descending=True, stable=True).indices
    pack_index = torch.full(weight.shape, -1, dtype=torch.int64)
    rank_in_pack = torch.full_like(pack_index, -1)
    for i in range(num_layers):
        loads, items = [0.0] * num_packs, [0] * num_packs
        for item in order[i].tolist():
            pack = min((p for p in range(num_packs) if items[p] < per_pack), key=loads.__getitem__)
            pack_index[i, item], rank_in_pack[i, item] = pack, items[pack]
            loads[pack] += float(weight[i, item])
            items[pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: torch.Tensor, num_phy: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`num_log` experts (weight [L, num_log]) to `num_phy` replicas, each extra one to the expert
    with the highest load per replica: (phy2log [L, num_phy], replica rank [L, num_phy],
    replicas per expert [L, num_log])."""
    n, num_log = weight.shape
    assert num_phy >= num_log, (num_phy, num_log)
    phy2log = torch.arange(num_phy, dtype=torch.int64).repeat(n, 1)
    rank = torch.zeros(n, num_phy, dtype=torch.int64)
    logcnt = torch.ones(n, num_log, dtype=torch.int64)
    rows = torch.arange(n)
    for i in range(num_log, num_phy):
        hottest = (weight / logcnt).max(dim=-1).indices
        phy2log[:, i] = hottest
        rank[:, i] = logcnt[rows, hottest]
        logcnt[rows, hottest] += 1
    return phy2log, rank, logcnt


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    return inv.scatter_(1, perm, torch.arange(perm.size(1), dtype=torch.int64).expand(perm.shape))


def rebalance_experts_hierarchical(weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int,
                                   num_ranks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups to nodes, replicas inside nodes, physical experts to ranks (module docstring):
    (phy2log [L, P], replica rank [L, P], replicas per expert [L, E])."""
    num_layers, num_logical = weight.shape
    group_size, groups_per_node = num_logical // num_groups, num_groups // num_nodes
    per_rank = num_physical // num_ranks
    # 1: groups to nodes; mlog = the experts renumbered node by node
    group_pack, group_rank = balanced_packing(weight.unflatten(-1, (num_groups, group_size)).sum(-1), num_nodes)
    log2mlog = (((group_pack * groups_per_node + group_rank) * group_size).unsqueeze(-1)
                + torch.arange(group_size)).flatten(-2)
    mlog2log = _inverse(log2mlog)
    # 2: redundant replicas inside each node  [L * nodes, E / nodes]
    per_mlog = weight.gather(-1, mlog2log).view(-1, num_logical // num_nodes)
    phy2mlog, phyrank, mlogcnt = replicate_experts(per_mlog, num_physical // num_nodes)
    # 3: a node's physical experts to its ranks
    per_phy = (per_mlog / mlogcnt).gather(-1, phy2mlog)
    pack, rank_in_pack = balanced_packing(per_phy, num_ranks // num_nodes)
    pphy2phy = _inverse(pack * per_rank + rank_in_pack)
    pphy2mlog = phy2mlog.gather(-1, pphy2phy)
    pphy2mlog = (pphy2mlog.view(num_layers, num_nodes, -1)
                 + torch.arange(0, num_logical, num_logical // num_nodes).view(1, -1, 1)).flatten(-2)
    pphy2log = mlog2log.gather(-1, pphy2mlog)
    pphyrank = phyrank.gather(-1, pphy2phy).view(num_layers, -1)
    logcnt = mlogcnt.view(num_layers, -1).gather(-1, log2mlog)
    return pphy2log, pphyrank, logcnt


def check_sizes(num_logical: int, num_physical: int, num_groups: int, num_nodes: int, num_ranks: int) -> None:
    """ValueError naming the numbers unless the algorithm can place these sizes."""
    problems = [(num_physical >= num_logical, f"physical experts {num_physical} < logical {num_logical}"),
                (num_physical % num_ranks == 0, f"physical experts {num_physical} not a multiple of ranks {num_ranks}"),
                (num_ranks % num_nodes == 0, f"ranks {num_ranks} not a multiple of nodes {num_nodes}"),
                (num_logical % num_groups == 0, f"logical experts {num_logical} not a multiple of groups {num_groups}")]
    bad = [why for ok, why in problems if not ok]
    if bad:
        raise ValueError("; ".join(bad))


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_ranks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The placement for load `weight` [L, E] (tokens per logical expert): (phy2log [L, P],
    log2phy [L, E, X] (-1 past an expert's replicas), logcnt [L, E]); P = `num_replicas`."""
    check_sizes(weight.shape[1], num_replicas, num_groups, num_nodes, num_ranks)
    weight = weight.float().cpu()
    num_layers, num_logical = weight.shape
    if num_groups % num_nodes == 0:
        phy2log, phyrank, logcnt = rebalance_experts_hierarchical(weight, num_replicas, num_groups, num_nodes,
                                                                  num_ranks)
    else:
        phy2log, phyrank, logcnt = rebalance_experts_hierarchical(weight, num_replicas, 1, 1, num_ranks)
    width = int(logcnt.max())
    log2phy = torch.full((num_layers, num_logical, width), -1, dtype=torch.int64)
    log2phy.view(num_layers, -1).scatter_(-1, phy2log * width + phyrank,
                                          torch.arange(num_replicas, dtype=torch.int64).expand(num_layers, -1))
    return phy2log, log2phy, logcnt


def static_placement(num_logical: int, num_ranks: int, num_redundant: int) -> torch.Tensor:
    """phy2log [P] before any load is counted: rank r holds its block of E / ranks experts (the
    split without EPLB) and fills its R / ranks redundant slots with copies of that block's
    first experts, so a rank loads only its own block from the checkpoint."""
    block, extra = num_logical // num_ranks, num_redundant // num_ranks
    return torch.tensor([r * block + (j if j < block else (j - block) % block)
                         for r in range(num_ranks) for j in range(block + extra)], dtype=torch.int64)


def imbalance(rank_tokens: torch.Tensor) -> float:
    """max / mean tokens per rank, averaged over the MoE layers that saw tokens; rank_tokens [L, ranks]
    (1.0: perfectly even; 0.0: no tokens yet)."""
    t = rank_tokens.double()
    seen = t.sum(-1) > 0
    if not bool(seen.any()):
        return 0.0
    t = t[seen]
    return float((t.max(-1).values / t.mean(-1)).mean())
