"""EPLB inside one MoE layer: which replica of its expert each pick runs on, and the load counted.

Under data-parallel attention with EPLB the layer holds P = E + R physical experts, S = P / N
on each of the N ranks (rank r: physical [r*S, (r+1)*S)); `phy2log[p]` is the logical expert
physical expert p holds. Every rank routes the all-gathered picks (model/moe.py `exchanged`),
so every rank computes the same physical ids, and the same counts, with no message:

    pick (row t, logical e)  ->  replica t % logcnt[e] of e  ->  physical log2phy[e, replica]

Every replica of an expert holds the same weights, so where a pick runs never changes what it
computes: outputs equal those without EPLB. The picks per physical expert accumulate in
`physical_load` (workers/parallel/expert_balance.py binds every layer's to a row of one tensor and
reads and zeroes it once a step).
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
        self.phy2log = phy2log.to("cpu", torch.int64).clone()      # the balancer reads it on the CPU
        self.log2phy, self.logcnt = logical_to_physical(self.phy2log, num_logical, self.width)
        self.physical_load = torch.zeros(self.num_physical, dtype=torch.int64, device="cpu")

    @property
    def slots(self) -> int:
        """Physical experts per rank."""
        return self.num_physical // self.num_ranks

    def route(self, idx: torch.Tensor) -> torch.Tensor:
        """Logical expert ids [T, K] (every rank's rows, in rank order) -> physical ids [T, K],
        counted per physical expert (the logical counts follow from phy2log)."""
        if self.log2phy.device != idx.device:
            self._to(idx.device)
        rows = torch.arange(idx.shape[0], device=idx.device).unsqueeze(1)
        phys = self.log2phy.view(-1).take(idx * self.width + rows % self.logcnt.take(idx))
        flat = phys.view(-1)
        self.physical_load.scatter_add_(0, flat, torch.ones_like(flat))
        return phys

    def bind(self, counts: torch.Tensor) -> None:
        """Count into `counts` [P] (a row of the balancer's [layers, P], on the model's device) from now on."""
        self._to(counts.device)
        self.physical_load = counts

    def place(self, phy2log: torch.Tensor) -> None:
        """The new placement (its weights already moved), in place."""
        log2phy, logcnt = logical_to_physical(phy2log.to("cpu", torch.int64), self.num_logical, self.width)
        self.phy2log.copy_(phy2log)
        self.log2phy.copy_(log2phy)
        self.logcnt.copy_(logcnt)

    def _to(self, device: torch.device) -> None:
        self.log2phy, self.logcnt = self.log2phy.to(device), self.logcnt.to(device)
        self.physical_load = self.physical_load.to(device)
