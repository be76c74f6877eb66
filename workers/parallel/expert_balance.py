"""EPLB on one data-parallel rank: count the load every step, re-place the experts every
`step_interval` steps, moving their weights between ranks in place.

    balancer = ExpertBalancer(model, comm, settings, num_nodes)
    engine step ... balancer.end_step()     # on every rank, after every step (between steps)

Every rank sees every rank's picks (the MoE exchange all-gathers them), so every rank's
`ExpertMap`s count the same load, its `end_step` sees the same steps, and its rebalance computes
the same placement (workers/parallel/eplb.py) from the same window: the ranks agree with no
message but the weights themselves. A step counts when any rank ran tokens through the MoE.

A rebalance, per MoE layer: each rank works out which experts its physical slots will hold;
one it holds already is copied locally, one it does not comes from a rank that held it (for a
destination d, holder number d mod holders: the sends spread over the replicas). The moves run
in one global order (by destination, then expert), each rank doing its sends and receives in
that order, so blocking point-to-point ops cannot deadlock. Then the layer's ExpertMap takes
the new placement. Weights are bytes moved unchanged: every replica stays exact.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from kvmesh.workers.engine_config import EngineConfig, EplbConfig
from kvmesh.workers.model.args import ModelArgs
from kvmesh.workers.model.expert_map import ExpertMap

from .eplb import imbalance, rebalance_experts, static_placement


class ExpertBalancer:
    """One rank's EPLB (module docstring). `comm`: the replica's process group (send_to / recv_from)."""

    def __init__(self, model: nn.Module, comm, settings: EplbConfig, num_nodes: int = 1):
        found = [(m.placement, m.experts) for m in model.modules() if getattr(m, "placement", None) is not None]
        self.maps: list[ExpertMap] = [p for p, _ in found]
        self.experts: list[nn.Module] = [e for _, e in found]
        self.comm, self.settings, self.num_nodes = comm, settings, num_nodes
        first = self.maps[0]
        self.ranks, self.logical, self.physical = first.num_ranks, first.num_logical, first.num_physical
        layers, w = len(self.maps), settings.window_size
        device = next(self.experts[0].parameters()).device
        self.counts = torch.zeros(layers, self.physical, dtype=torch.int64, device=device)   # this step's picks
        for m, row in zip(self.maps, self.counts):
            m.bind(row)
        self.phy2log = torch.stack([m.phy2log for m in self.maps])              # [layers, P], on the CPU
        # per step of the window (a ring), and the window's running sums (what counters and rebalances read)
        self.load = torch.zeros(w, layers, self.logical, dtype=torch.int32)      # picks per logical expert
        self.placed = torch.zeros(w, layers, self.ranks, dtype=torch.int32)     # ... per rank as placed
        self.static = torch.zeros(w, layers, self.ranks, dtype=torch.int32)     # ... per rank without EPLB
        self.sums = [torch.zeros(t.shape[1:], dtype=torch.int64) for t in (self.load, self.placed, self.static)]
        self.steps = self.rebalances = self.moved = 0
        self.rebalance_s = 0.0

    def end_step(self) -> None:
        """After every engine step on every rank: record the step's load; rebalance when due."""
        physical = self.counts.cpu().clone()           # one copy from the device a step
        if not int(physical.sum()):
            return
        self.counts.zero_()
        layers = len(self.maps)
        logical = torch.zeros(layers, self.logical, dtype=torch.int64).scatter_add_(1, self.phy2log, physical)
        placed = physical.view(layers, self.ranks, -1).sum(-1)
        static = logical.view(layers, self.ranks, -1).sum(-1)
        slot = self.steps % self.settings.window_size
        for ring, total, now in zip((self.load, self.placed, self.static), self.sums, (logical, placed, static)):
            total += now - ring[slot]
            ring[slot] = now
        self.steps += 1
        if self.steps % self.settings.step_interval == 0:
            self.rebalance()

    def rebalance(self) -> None:
        """Re-place every MoE layer's experts by the window's load, moving weights in place."""
        t0 = time.perf_counter()
        phy2log, _, _ = rebalance_experts(self.sums[0], self.physical, self.ranks, self.num_nodes, self.ranks)
        for m, experts, new in zip(self.maps, self.experts, phy2log):
            if not torch.equal(m.phy2log, new):
                self.moved += move_experts(experts, m.phy2log, new, self.comm, self.ranks)
                m.place(new)
        self.phy2log = torch.stack([m.phy2log for m in self.maps])
        self.rebalances += 1
        self.rebalance_s += time.perf_counter() - t0

    def counters(self) -> dict[str, int | float]:
        """engine/stats.py EplbCounters' fields: imbalance is max / mean tokens per rank averaged
        over the MoE layers, over the window, as placed and as the split without EPLB would place."""
        return dict(steps=self.steps, rebalances=self.rebalances, moved_experts=self.moved,
                    rebalance_s=self.rebalance_s, imbalance=imbalance(self.sums[1]),
                    imbalance_static=imbalance(self.sums[2]))


def start_placement(config: EngineConfig, model_dir: Path) -> torch.Tensor | None:
    """EPLB: the physical experts' logical ones at start-up (each rank's own block, its redundant
    slots copies of it, over all data_parallel_size x tensor_parallel_size ranks); None without EPLB."""
    if not config.enable_eplb:
        return None
    experts = ModelArgs.from_file(model_dir / "config.json").n_routed_experts
    return static_placement(experts, config.data_parallel_size * config.tensor_parallel_size,
                            config.eplb_config.num_redundant_experts)


def balancer(config: EngineConfig, model: nn.Module, experts) -> ExpertBalancer | None:
    """This rank's EPLB over the group the experts are split across (`experts`: the DP replica's,
    or its expert group under TP inside DP ranks; None without it); hierarchical (expert groups
    to nodes, then replicas to ranks) when the replica spans nodes (data_parallel_size_local)."""
    if experts is None or not config.enable_eplb:
        return None
    local = config.data_parallel_size_local or config.data_parallel_size
    return ExpertBalancer(model, experts, config.eplb_config, num_nodes=config.data_parallel_size // local)


def plan_moves(old: list[int], new: list[int], ranks: int) -> list[tuple[int, int, int, int]]:
    """The experts that must cross ranks for one layer: (destination, logical expert, source
    rank, source slot) in the one global order; a destination gets each missing expert once."""
    slots = len(old) // ranks
    held = [old[r * slots:(r + 1) * slots] for r in range(ranks)]
    moves = []
    for d in range(ranks):
        for e in sorted(set(new[d * slots:(d + 1) * slots]) - set(held[d])):
            holders = [r for r in range(ranks) if e in held[r]]
            src = holders[d % len(holders)]
            moves.append((d, e, src, held[src].index(e)))
    return moves


def move_experts(experts: nn.Module, old: torch.Tensor, new: torch.Tensor, comm, ranks: int) -> int:
    """One layer's experts from placement `old` to `new` [P] on this rank (`comm.rank`), in place;
    the number of experts this rank received."""
    me, params = comm.rank, [p.data for p in experts.parameters()]     # w1, w2, w3 (+ scales): [S, ...]
    old_l, new_l = old.tolist(), new.tolist()
    slots = len(old_l) // ranks
    mine = old_l[me * slots:(me + 1) * slots]
    before = [p.clone() for p in params]
    arrived: dict[int, list[torch.Tensor]] = {}
    for dst, e, src, slot in plan_moves(old_l, new_l, ranks):
        if src == me:
            comm.send_to(_pack([b[slot] for b in before]), dst, tag=e)
        if dst == me:
            buf = torch.empty(sum(_nbytes(b[0]) for b in before), dtype=torch.uint8, device=before[0].device)
            arrived[e] = _unpack(comm.recv_from(buf, src, tag=e), [b[0] for b in before])
    for j, e in enumerate(new_l[me * slots:(me + 1) * slots]):
        rows = arrived[e] if e in arrived else [b[mine.index(e)] for b in before]
        for p, row in zip(params, rows):
            p[j].copy_(row)
    return len(arrived)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _pack(rows: list[torch.Tensor]) -> torch.Tensor:
    """One expert's rows of every tensor as one byte buffer (any dtype, FP8/FP4 included)."""
    return torch.cat([r.contiguous().reshape(-1).view(torch.uint8) for r in rows])


def _unpack(buf: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, at = [], 0
    for t in like:
        n = _nbytes(t)
        out.append(buf[at:at + n].view(t.dtype).view(t.shape))
        at += n
    return out
