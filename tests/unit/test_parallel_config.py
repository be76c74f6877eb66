"""Per-pool tensor_parallel_size / data_parallel_size / enable_expert_parallel in the serve config: validated,
turned into the replica's placement group (one bundle per rank packed on one node, or one
bundle per node for a data-parallel replica over several), and handed to each pool's engine config."""
from __future__ import annotations

import pytest

from kvmesh.cluster.config import ConfigFileError, PoolConfig, check_parallel_sizes, load_config


class Worker:
    pass


def test_a_tp1_pool_asks_for_no_placement_group():
    opts = PoolConfig().deployment_options("Decode")
    assert "placement_group_bundles" not in opts and "placement_group_strategy" not in opts


def test_a_tp_pool_is_one_bundle_per_rank_packed_on_one_node():
    pool = PoolConfig(tensor_parallel_size=4, num_cpus=2, num_gpus=1, resources={"decode_node": 0.01})
    opts = pool.deployment_options("Decode")
    assert opts["placement_group_bundles"] == [{"CPU": 2, "GPU": 1, "decode_node": 0.01}] * 4
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    assert opts["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 1, "resources": {"decode_node": 0.01}}
    cpu = PoolConfig(tensor_parallel_size=2, num_cpus=0.25).deployment_options("Prefill")
    assert cpu["placement_group_bundles"] == [{"CPU": 0.25}, {"CPU": 0.25}]    # no GPU key on a CPU pool


def test_serve_accepts_the_placement_options():
    """Ray Serve's own validation: the replica (bundle 0) must fit its bundle."""
    from ray import serve
    for pool in (PoolConfig(tensor_parallel_size=2, num_cpus=0.25),
                 PoolConfig(tensor_parallel_size=8, num_cpus=4, num_gpus=1, autoscaling={"max_replicas": 2})):
        replica = serve.deployment(Worker).options(**pool.deployment_options("P"))._replica_config
        assert len(replica.placement_group_bundles) == pool.tensor_parallel_size
        assert replica.placement_group_strategy == "STRICT_PACK"


def test_prefill_and_decode_sizes_differ_and_are_validated(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("prefill: {tensor_parallel_size: 2, num_cpus: 1}\n"
                    "decode: {tensor_parallel_size: 1, enable_expert_parallel: true}\n")
    config = load_config(path)
    assert (config.prefill.tensor_parallel_size, config.decode.tensor_parallel_size) == (2, 1)
    assert (config.prefill.enable_expert_parallel, config.decode.enable_expert_parallel) == (False, True)
    with pytest.raises(ConfigFileError, match="tensor_parallel_size"):
        load_config(None, {"prefill.tensor_parallel_size": 0})
    with pytest.raises(ConfigFileError, match="num_cpus, num_gpus or resources > 0"):
        load_config(None, {"decode.tensor_parallel_size": 2, "decode.num_cpus": 0})
    with pytest.raises(ConfigFileError, match="extra"):
        load_config(None, {"decode.tensor_parallel": 2})


def test_each_pool_engine_gets_its_own_parallel_sizes():
    config = load_config(None, {"prefill.tensor_parallel_size": 2, "prefill.num_cpus": 1,
                                "decode.enable_expert_parallel": True})
    prefill, decode = config.pool_engine(config.prefill), config.pool_engine(config.decode)
    assert (prefill.tensor_parallel_size, prefill.enable_expert_parallel) == (2, False)
    assert (decode.tensor_parallel_size, decode.enable_expert_parallel) == (1, True)
    assert config.pool_engine(config.colocated).tensor_parallel_size == 1


def test_a_dp_pool_is_one_bundle_per_rank_and_its_engine_gets_the_sizes():
    config = load_config(None, {"mode": "colocated", "colocated.data_parallel_size": 2,
                                "colocated.enable_expert_parallel": True, "colocated.num_cpus": 0.5})
    opts = config.colocated.deployment_options("Colocated")
    assert opts["placement_group_bundles"] == [{"CPU": 0.5}] * 2 and opts["placement_group_strategy"] == "STRICT_PACK"
    engine = config.pool_engine(config.colocated)
    assert (engine.data_parallel_size, engine.tensor_parallel_size, engine.enable_expert_parallel) == (2, 1, True)
    assert config.pool_engine(config.prefill).data_parallel_size == 1


def test_prefill_and_decode_pools_may_each_be_data_parallel_with_their_own_sizes():
    config = load_config(None, {"prefill.data_parallel_size": 2, "prefill.enable_expert_parallel": True,
                                "decode.tensor_parallel_size": 2})
    prefill, decode = config.pool_engine(config.prefill), config.pool_engine(config.decode)
    assert (prefill.data_parallel_size, prefill.tensor_parallel_size) == (2, 1)
    assert (decode.data_parallel_size, decode.tensor_parallel_size) == (1, 2)


@pytest.mark.parametrize("overrides, words", [
    ({"mode": "colocated", "colocated.data_parallel_size": 2},
     ["colocated: EngineConfig.data_parallel_size=2 needs enable_expert_parallel=true"]),
    ({"decode.data_parallel_size": 4}, ["decode: EngineConfig.data_parallel_size=4 needs enable_expert_parallel=true"]),
    ({"mode": "colocated", "colocated.data_parallel_size": 2, "colocated.enable_expert_parallel": True,
      "colocated.num_cpus": 0}, ["data_parallel_size 2 places one rank per bundle"]),
    ({"colocated.data_parallel_size": 0}, ["data_parallel_size", "greater than or equal to 1"]),
])
def test_a_dp_size_or_combination_not_built_is_refused_naming_the_keys(overrides, words):
    with pytest.raises(ConfigFileError) as e:
        load_config(None, overrides)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_tp_inside_dp_ranks_places_one_actor_per_dp_rank_holding_its_groups_resources():
    """DP 2 x TP 2: two actors (the replica and one rank actor), each leading a TP group of two
    processes, so each bundle (and the replica itself) reserves two ranks' resources; over two
    nodes (data_parallel_size_local 1) a bundle per node holds one DP rank's group."""
    keys = {"mode": "colocated", "colocated.data_parallel_size": 2, "colocated.tensor_parallel_size": 2,
            "colocated.enable_expert_parallel": True, "colocated.num_cpus": 0.5,
            "colocated.resources": {"kvmesh_wide": 0.25}}
    pool = load_config(None, keys).colocated
    assert (pool.ranks, pool.actors, pool.group) == (4, 2, 2)
    assert pool.placement() == ([{"CPU": 1.0, "kvmesh_wide": 0.5}] * 2, "STRICT_PACK")
    opts = pool.deployment_options("Colocated")["ray_actor_options"]
    assert (opts["num_cpus"], opts["resources"]) == (1.0, {"kvmesh_wide": 0.5})
    engine = load_config(None, keys).pool_engine(pool)
    assert (engine.data_parallel_size, engine.tensor_parallel_size) == (2, 2)
    spread = load_config(None, {**keys, "colocated.data_parallel_size_local": 1}).colocated
    assert spread.placement() == ([{"CPU": 1.0, "kvmesh_wide": 0.5}] * 2, "STRICT_SPREAD")
    wrong = load_config(None, {**keys, "colocated.tensor_parallel_size": 4})
    with pytest.raises(ConfigFileError, match=r"colocated\.data_parallel_size: data_parallel_size x "
                                              r"tensor_parallel_size = 2 x 4 = 8 does not divide n_routed_experts=4"):
        check_parallel_sizes(wrong)


def test_a_dp_size_that_does_not_divide_the_experts_fails_before_deploying():
    config = load_config(None, {"mode": "colocated", "colocated.data_parallel_size": 3,
                                "colocated.enable_expert_parallel": True})
    with pytest.raises(ConfigFileError, match=r"colocated\.data_parallel_size: data_parallel_size=3 does not divide "
                                              r"n_routed_experts=4"):
        check_parallel_sizes(config)
    check_parallel_sizes(load_config(None, {"prefill.data_parallel_size": 1}))   # nothing to check: no error


def test_a_dp_replica_over_nodes_is_one_bundle_per_node_on_distinct_nodes():
    pool = PoolConfig(data_parallel_size=8, data_parallel_size_local=4, enable_expert_parallel=True,
                      num_cpus=2, num_gpus=1, resources={"decode_node": 0.01})
    assert (pool.nodes, pool.ranks, pool.ranks_per_bundle) == (2, 8, 4)
    opts = pool.deployment_options("Decode")
    assert opts["placement_group_bundles"] == [{"CPU": 8, "GPU": 4, "decode_node": 0.04}] * 2
    assert opts["placement_group_strategy"] == "STRICT_SPREAD"
    assert opts["ray_actor_options"]["num_gpus"] == 1          # the replica is rank 0, in bundle 0
    from ray import serve
    replica = serve.deployment(Worker).options(**opts)._replica_config    # Serve's own check: rank 0 fits bundle 0
    assert len(replica.placement_group_bundles) == 2
    one_node = PoolConfig(data_parallel_size=4, data_parallel_size_local=4, enable_expert_parallel=True, num_cpus=1)
    assert one_node.deployment_options("D")["placement_group_bundles"] == [{"CPU": 1}] * 4
    assert one_node.ranks_per_bundle == 1
    config = load_config(None, {"mode": "colocated", "colocated.data_parallel_size": 4,
                                "colocated.data_parallel_size_local": 2, "colocated.enable_expert_parallel": True,
                                "colocated.num_cpus": 0.5})
    assert config.pool_engine(config.colocated).data_parallel_size_local == 2
    with pytest.raises(ConfigFileError, match="data_parallel_size_local 3 does not divide data_parallel_size 4"):
        load_config(None, {"decode.data_parallel_size": 4, "decode.data_parallel_size_local": 3,
                           "decode.enable_expert_parallel": True})
