"""Per-pool tensor_parallel_size / enable_expert_parallel in the serve config: validated,
turned into the replica's placement group (one bundle per rank, packed on one node), and
handed to each pool's engine config."""
from __future__ import annotations

import pytest

from cluster.config import ConfigFileError, PoolConfig, load_config


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
