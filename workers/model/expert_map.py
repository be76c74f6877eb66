"""EPLB inside one MoE layer: which replica of its expert each pick runs on, and the load counted.

Under data-parallel attention with EPLB the layer holds P = E + R physical experts, S = P / N
on each of the N ranks (rank r: physical [r*S, (r+1)*S)); `phy2log[p]` is the logical expert
physical expert p holds. Every rank routes the all-gathered picks (model/moe.py `exchanged`),
so every rank computes the same physical ids, and the same counts, with no message:

    pick (row t, logical e)  ->  replica t % logcnt[e] of e  ->  physical log2phy[e, replica]

Every replica of an expert holds the same weights, so where a pick runs never changes what it
computes: outputs equal those without EPLB. The counts (picks per logical expert, per physical
expert) accumulate until `take()` (workers/parallel/expert_balance.py reads them once a step).
"""
from __future__ import annotations

import torch


def logical_to_physical(phy2log: torch.Tensor, num_logical: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log2phy [E, width], -1 past an expert's replicas; logcnt [E]) of phy2log [P], replicas in
    physical order."""
    log2phy = torch.full((num_logical, width), -1, dtype=torch.int64, device=phy2log.device)
    logcnt = torch.zeros(num_logical, dtype=torch.int64, device=phy2log.device)
    for p, e in enumerate(phy2log.tolist()):
        log2phy[e, logcnt[e]] = p
        logcnt[e] += 1
    return log2phy, logcnt


class ExpertMap:
    """One MoE layer's placement (phy2log [P]) and its counted load. Not a Module: the model is
    built on the meta device; these tensors follow the picks to their device on first use."""

    def __init__(self, phy2log: torch.Tensor, num_logical: int, num_ranks: int):
        self.num_logical, self.num_ranks = num_logical, num_ranks
        self.num_physical = phy2log.numel()
        self.width = self.num_physical - num_logical + 1          # the most replicas one expert can have
        self.phy2log = phy2log.to("cpu", torch.int64).clone()
        self.log2phy, self.logcnt = logical_to_physical(self.phy2log, num_logical, self.width)
        self.logical_load = torch.zeros(num_logical, dtype=torch.int64, device="cpu")
        self.physical_load = torch.zeros(self.num_physical, dtype=torch.int64, device="cpu")

    @property
    def slots(self) -> int:
        """Physical experts per rank."""
        return self.num_physical // self.num_ranks

    def route(self, idx: torch.Tensor) -> torch.Tensor:
        """Logical expert ids [T, K] (every rank's rows, in rank order) -> physical ids [T, K];
        counts them."""
        if self.log2phy.device != idx.device:
            self._to(idx.device)
        rows = torch.arange(idx.shape[0], device=idx.device).unsqueeze(1)
        phys = self.log2phy[idx, rows % self.logcnt[idx]]
        flat, ones = idx.flatten(), torch.ones(idx.numel(), dtype=torch.int64, device=idx.device)
        self.logical_load.scatter_add_(0, flat, ones)
        self.physical_load.scatter_add_(0, phys.flatten(), ones)
        return phys

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(picks per logical expert [E], picks per rank [N]) since the last take, on the picks'
        device (the caller stacks every layer's and copies once)."""
        logical, physical = self.logical_load.clone(), self.physical_load.view(self.num_ranks, self.slots).sum(1)
        self.logical_load.zero_()
        self.physical_load.zero_()
        return logical, physical

    def place(self, phy2log: torch.Tensor) -> None:
        """The new placement (its weights already moved), in place."""
        log2phy, logcnt = logical_to_physical(phy2log.to("cpu", torch.int64), self.num_logical, self.width)
        self.phy2log.copy_(phy2log)
        self.log2phy.copy_(log2phy)
        self.logcnt.copy_(logcnt)

    def _to(self, device: torch.device) -> None:
        self.log2phy, self.logcnt = self.log2phy.to(device), self.logcnt.to(device)
        self.logical_load, self.physical_load = self.logical_load.to(device), self.physical_load.to(device)
