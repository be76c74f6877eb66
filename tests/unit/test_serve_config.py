"""The serving config and deploy files: one typed config, validated once (no Ray started)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvmesh.cluster.app import build_app
from kvmesh.cluster.cli import build_parser
from kvmesh.cluster.config import ConfigFileError, ServeConfig, load_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SERVE_FILES = ["serve.yaml", "serve-local-cluster.yaml", "serve-cluster.yaml"]


@pytest.mark.parametrize("name", SERVE_FILES)
def test_serve_files_are_valid_serve_configs_with_separately_scaled_pools(name, monkeypatch):
    from ray.serve.schema import ServeDeploySchema
    monkeypatch.setenv("KVMESH_REDIS_PASSWORD", "pw")     # the cluster recipe's Redis has a password
    raw = yaml.safe_load((DEPLOY / name).read_text())
    ServeDeploySchema.model_validate(raw)
    assert raw["applications"][0]["import_path"] == "kvmesh.cluster.app:build_app"
    config = load_config(DEPLOY / name)
    assert config.mode == "disaggregated"
    prefill, decode = (config.prefill.deployment_options("P"), config.decode.deployment_options("D"))
    assert "autoscaling_config" in prefill and "autoscaling_config" in decode
    build_app(config.with_head_ip("10.0.0.1"))


def test_cluster_files_pin_each_pool_to_its_node_type():
    cluster = yaml.safe_load((DEPLOY / "serve-cluster.yaml").read_text())["applications"][0]["args"]
    nodes = yaml.safe_load((DEPLOY / "cluster.yaml").read_text())["available_node_types"]
    for pool, resource in (("prefill", "kvmesh_prefill"), ("decode", "kvmesh_decode")):
        assert resource in cluster[pool]["resources"] and cluster[pool]["num_gpus"] >= 1
        carriers = [n for n, spec in nodes.items() if resource in spec.get("resources", {})]
        assert len(carriers) == 1 and nodes[carriers[0]]["resources"].get("GPU", 0) >= 1
    local = yaml.safe_load((DEPLOY / "local-cluster.yaml").read_text())["available_node_types"]
    assert {"kvmesh_prefill", "kvmesh_decode"} <= {r for spec in local.values() for r in spec["resources"]}


@pytest.mark.parametrize("name", ["cluster.yaml", "local-cluster.yaml"])
def test_cluster_configs_pass_the_autoscaler_schema(name):
    from ray.autoscaler._private.util import validate_config
    raw = yaml.safe_load((DEPLOY / name).read_text())
    validate_config(raw)            # as the monitor reads it: no defaults filled in
    assert "worker_setup_commands" in raw and raw["provider"]["type"] in ("aws", "fake_multinode")


def test_ray_up_cluster_starts_redis_and_mounts_the_store():
    raw = yaml.safe_load((DEPLOY / "cluster.yaml").read_text())
    assert any("redis-server" in c for c in raw["head_start_ray_commands"])
    assert any("/mnt/kvmesh" in c for c in raw["setup_commands"])


def test_defaults_validate_and_overrides_apply(tmp_path):
    config = load_config(None, {"engine.model": "/models/x", "mode": "colocated"})
    assert config.engine.model == "/models/x" and config.mode == "colocated"
    assert config.pool_engine(config.decode, "w1").worker_id == "w1"
    plain = tmp_path / "kvmesh.yaml"
    plain.write_text("mode: colocated\nengine: {kv_cache_bytes: 32MiB}\n")
    assert load_config(plain).engine.kv_cache_bytes == 32 << 20


@pytest.mark.parametrize("text", ["mode: sideways\n", "engine: {kv_cache_bytes: -1}\n", "prefill: {replicas: 2}\n",
                                  "decode: {autoscaling: {min_replicas: 5, max_replicas: 2}}\n", "- a list\n"])
def test_bad_config_files_name_the_problem(tmp_path, text):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigFileError, match="bad.yaml"):
        load_config(path)


def test_head_ip_placeholder_is_resolved():
    config = ServeConfig.model_validate({"engine": {"index": "redis://{head_ip}:6380/0"}})
    assert config.with_head_ip("10.1.2.3").engine.index == "redis://10.1.2.3:6380/0"


def test_redis_password_placeholder_comes_from_the_environment(monkeypatch):
    config = ServeConfig.model_validate({"engine": {"index": "redis://:{redis_password}@{head_ip}:6380/0"}})
    monkeypatch.delenv("KVMESH_REDIS_PASSWORD", raising=False)
    with pytest.raises(ConfigFileError, match="KVMESH_REDIS_PASSWORD"):
        config.with_head_ip("10.1.2.3")
    monkeypatch.setenv("KVMESH_REDIS_PASSWORD", "p@ss/word")
    assert config.with_head_ip("10.1.2.3").engine.index == "redis://:p%40ss%2Fword@10.1.2.3:6380/0"


def test_kvmesh_serve_parses_its_options():
    args = build_parser().parse_args(["serve", "--config", "deploy/serve.yaml", "--model", "/m", "--port", "9000"])
    assert args.port == 9000 and args.model == "/m" and callable(args.handler)
