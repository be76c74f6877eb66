"""EPLB's parts without an engine: DeepSeek's placement algorithm (workers/parallel/eplb.py) on
hand-checked cases and its properties on random loads (every expert has a replica, every rank
the same number of physical experts, hierarchical groups on one node, the max rank load never
above the static split's), the per-layer routing and counting (model/expert_map.py), the move
plan, and a rebalance's weight moves between two real gloo ranks (threads of this process):
every physical slot ends with exactly its logical expert's bytes, FP8 / FP4-packed ones too.
The engine-level check (DP=2 + EP with EPLB rebalancing mid-generation = TP=1's greedy tokens)
is in test_data_parallel.py and test_speculative_parallel.py."""
from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from kvmesh.workers.engine_config import EngineConfig, EplbConfig
from kvmesh.workers.model.args import ConfigError
from kvmesh.workers.model.expert_map import ExpertMap, logical_to_physical
from kvmesh.workers.parallel.collectives import Collectives, init_method
from kvmesh.workers.parallel.eplb import (balanced_packing, imbalance, rebalance_experts, replicate_experts,
                                   static_placement)
from kvmesh.workers.model.shard import SingleRank
from kvmesh.workers.parallel.expert_balance import ExpertBalancer, move_experts, plan_moves


def rank_loads(load: torch.Tensor, phy2log: torch.Tensor, logcnt: torch.Tensor, ranks: int) -> torch.Tensor:
    """[L, ranks]: each rank's share of the load, an expert's load split evenly over its replicas."""
    per_phy = (load.double() / logcnt).gather(-1, phy2log)
    return per_phy.view(load.shape[0], ranks, -1).sum(-1)


# ---- the algorithm ----------------------------------------------------------------------------
def test_balanced_packing_puts_the_heaviest_item_into_the_lightest_pack_with_room():
    pack, rank = balanced_packing(torch.tensor([[5.0, 4.0, 3.0, 2.0]]), 2)
    assert pack.tolist() == [[0, 1, 1, 0]] and rank.tolist() == [[0, 0, 1, 1]]      # 5+2 | 4+3


def test_replicate_experts_gives_each_extra_replica_to_the_highest_load_per_replica():
    phy2log, rank, logcnt = replicate_experts(torch.tensor([[10.0, 1.0, 1.0, 4.0]]), 6)
    assert phy2log.tolist() == [[0, 1, 2, 3, 0, 0]]          # 10 > 4, then 10/2 = 5 > 4
    assert rank.tolist() == [[0, 0, 0, 0, 1, 2]] and logcnt.tolist() == [[3, 1, 1, 1]]


def test_a_hot_expert_gets_replicas_and_the_busiest_rank_drops_to_near_the_mean():
    load = torch.tensor([[10.0, 1.0, 1.0, 4.0]])        # static split: rank 0 has 11, rank 1 has 5
    phy2log, log2phy, logcnt = rebalance_experts(load, 6, 2, 1, 2)
    assert logcnt.tolist() == [[3, 1, 1, 1]]
    per_rank = rank_loads(load, phy2log, logcnt, 2)
    assert per_rank.max().item() == pytest.approx(25 / 3)     # 4 + 10/3 + 1 | 10/3 + 10/3 + 1
    assert imbalance(per_rank) == pytest.approx((25 / 3) / 8)
    assert imbalance(torch.tensor([[11, 5]])) == pytest.approx(11 / 8)


@pytest.mark.parametrize("experts, ranks, redundant, nodes", [(4, 2, 2, 1), (8, 4, 4, 2), (16, 4, 8, 2),
                                                              (12, 6, 6, 3), (8, 2, 0, 1)])
def test_placement_properties_on_random_loads(experts, ranks, redundant, nodes):
    g = torch.Generator().manual_seed(experts * 31 + ranks)
    load = (torch.rand(3, experts, generator=g) ** 4 * 1000).round()        # skewed
    physical = experts + redundant
    phy2log, log2phy, logcnt = rebalance_experts(load, physical, ranks, nodes, ranks)
    assert phy2log.shape == (3, physical) and int(phy2log.min()) >= 0 and int(phy2log.max()) < experts
    assert (logcnt >= 1).all() and (logcnt.sum(-1) == physical).all()       # every expert placed
    for layer in range(3):
        for e in range(experts):
            ids = log2phy[layer, e][log2phy[layer, e] >= 0].sort().values
            assert torch.equal(ids, (phy2log[layer] == e).nonzero().flatten())
        node_of = torch.arange(physical) // (physical // nodes)
        for group in range(ranks):              # kvmesh's groups: the static per-rank blocks
            members = torch.arange(group * experts // ranks, (group + 1) * experts // ranks)
            on = node_of[torch.isin(phy2log[layer], members)].unique()
            assert len(on) == 1, f"group {group} spans nodes {on.tolist()}"
    static = load.view(3, ranks, -1).sum(-1)
    assert (rank_loads(load, phy2log, logcnt, ranks).max(-1).values <= static.max(-1).values + 1e-6).all()


def test_sizes_the_algorithm_cannot_place_name_the_numbers():
    with pytest.raises(ValueError, match="physical experts 5 not a multiple of ranks 2"):
        rebalance_experts(torch.ones(1, 4), 5, 2, 1, 2)
    with pytest.raises(ValueError, match="ranks 2 not a multiple of nodes 3"):
        rebalance_experts(torch.ones(1, 6), 6, 3, 3, 2)


def test_static_placement_is_each_ranks_block_then_copies_of_it():
    assert static_placement(4, 2, 2).tolist() == [0, 1, 0, 2, 3, 2]
    assert static_placement(4, 2, 0).tolist() == [0, 1, 2, 3]


# ---- routing and counting ---------------------------------------------------------------------
def test_picks_go_round_robin_over_replicas_and_are_counted():
    m = ExpertMap(torch.tensor([0, 1, 0, 2, 3, 0]), 4, 2)       # expert 0: physical 0, 2, 5
    idx = torch.tensor([[0, 3], [0, 1], [0, 2], [0, 3]])
    assert m.route(idx).tolist() == [[0, 4], [2, 1], [5, 3], [0, 4]]
    assert m.physical_load.tolist() == [2, 1, 1, 1, 2, 1]
    m.place(torch.tensor([3, 3, 1, 0, 2, 3]))
    assert m.route(torch.tensor([[3, 0], [3, 2]])).tolist() == [[0, 3], [1, 4]]


def test_logical_to_physical_lists_replicas_in_physical_order():
    log2phy, cnt = logical_to_physical(torch.tensor([1, 0, 1, 1]), 2, 3)
    assert log2phy.tolist() == [[1, -1, -1], [0, 2, 3]] and cnt.tolist() == [1, 3]


# ---- weight moves -----------------------------------------------------------------------------
def test_a_destination_gets_each_missing_expert_once_from_a_holder():
    old, new = [0, 1, 0, 2, 3, 2], [0, 0, 3, 1, 2, 1]
    assert plan_moves(old, new, 2) == [(0, 3, 1, 1), (1, 1, 0, 1)]


class Stacked(nn.Module):
    """Experts as the model stacks them, one row per physical slot: a dense tensor, an FP8 one and an
    int8 (FP4-packed) one, each row filled with its logical expert's id."""

    def __init__(self, phy2log: list[int]):
        super().__init__()
        ids = torch.tensor(phy2log, dtype=torch.float32)
        self.w1 = nn.Parameter(ids.view(-1, 1, 1).expand(-1, 3, 4).clone(), requires_grad=False)
        self.w1_scale = nn.Parameter(ids.view(-1, 1, 1).expand(-1, 3, 2).to(torch.float8_e4m3fn), requires_grad=False)
        self.w2 = nn.Parameter(torch.tensor(phy2log, dtype=torch.int8).view(-1, 1, 1).expand(-1, 2, 2).clone(),
                               requires_grad=False)


def test_a_rebalance_moves_every_slot_to_exactly_its_new_experts_bytes_between_gloo_ranks():
    old, new = torch.tensor([0, 1, 0, 2, 3, 2]), torch.tensor([3, 0, 0, 1, 2, 3])
    store = Collectives.host_store("127.0.0.1", 2, 30)
    method, results = init_method("127.0.0.1", store), {}

    def rank(r: int) -> None:
        comm = Collectives(r, 2, method, "cpu", 30.0, store if r == 0 else None)
        experts = Stacked(old[r * 3:(r + 1) * 3].tolist())
        results[r] = (move_experts(experts, old, new, comm, 2), experts)
        comm.close()
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == [0, 1]
    for r, (received, experts) in results.items():
        want = new[r * 3:(r + 1) * 3].tolist()
        assert [int(experts.w1[j, 0, 0]) for j in range(3)] == want
        assert [int(experts.w1_scale[j, 0, 0].float()) for j in range(3)] == want
        assert [int(experts.w2[j, 0, 0]) for j in range(3)] == want
    assert results[0][0] == 1 and results[1][0] == 1     # rank 0 lacked 3, rank 1 lacked 1


class Layer(nn.Module):
    """What ExpertBalancer looks for in a model: a MoE's `placement` and its stacked `experts`."""

    def __init__(self, phy2log: list[int], experts: int, ranks: int):
        super().__init__()
        self.placement = ExpertMap(torch.tensor(phy2log), experts, ranks)
        self.experts = Stacked(phy2log)


def test_the_balancer_keeps_a_window_of_steps_and_rebalances_every_step_interval_steps():
    """One rank holding every expert (SingleRank: every move is a local copy): the window's sums are
    its last window_size counted steps, a step without picks does not count, and every step_interval
    steps the hot expert gets the redundant slots, its bytes copied into them."""
    model = nn.ModuleList([Layer([0, 1, 2, 3, 0, 1], 4, 1) for _ in range(2)])
    balancer = ExpertBalancer(model, SingleRank(), EplbConfig(2, window_size=2, step_interval=3))
    for step in range(3):
        for layer in model:
            layer.placement.route(torch.tensor([[3, 2]] * (step + 1)))    # expert 3 and 2 equally hot
        balancer.end_step()
        balancer.end_step()                                             # nothing routed: not a step
    assert balancer.steps == 3 and balancer.rebalances == 1
    assert balancer.sums[0][0].tolist() == [0, 0, 5, 5]                 # steps 2 and 3 of the window
    assert balancer.sums[1][0].tolist() == [10] and int(balancer.counts.sum()) == 0
    for layer in model:
        assert sorted(layer.placement.phy2log.tolist()) == [0, 1, 2, 2, 3, 3]
        assert [int(v) for v in layer.experts.w1[:, 0, 0]] == layer.placement.phy2log.tolist()
    assert balancer.counters()["imbalance"] == 1.0 and balancer.counters()["rebalances"] == 1


# ---- settings ---------------------------------------------------------------------------------
def test_eplb_settings_take_json_and_bad_ones_name_the_field(tmp_path):
    c = EngineConfig(data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
                     eplb_config='{"num_redundant_experts": 2, "window_size": 4, "step_interval": 2}')
    assert c.eplb_config == EplbConfig(2, 4, 2)
    assert EngineConfig().eplb_config == EplbConfig(0, 1000, 3000)
    bad = [({"eplb_config": '{"num_redundant_experts": 3}'}, "num_redundant_experts=3 is not a multiple"),
           ({"eplb_config": '{"window": 3}'}, "unknown key(s) window"),
           ({"eplb_config": '{"step_interval": 0}'}, "eplb_config.step_interval: must be an integer >= 1"),
           ({"eplb_config": "{nope"}, "eplb_config: not JSON")]
    for kw, message in bad:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            EngineConfig(data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True, **kw)
    with pytest.raises(ConfigError, match="enable_eplb: needs data_parallel_size > 1"):
        EngineConfig(enable_eplb=True)
