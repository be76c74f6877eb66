"""Every deploy/*.yaml as the tools that read it would: cluster configs through Ray's own
`ray up` preparation and schema validation, their shell commands through `bash -n`, Serve
configs through Ray Serve's schema and kvmesh's typed config; the on-prem pool table and
the resources the pools require agree."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from kvmesh.cluster.config import ConfigFileError, load_config
from kvmesh.cluster.cli.node_role import NodeRoleError, node_resources, pools_of

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
YAMLS = sorted(DEPLOY.glob("*.yaml"))
CLUSTERS = [p for p in YAMLS if "provider" in yaml.safe_load(p.read_text())]
SERVES = [p for p in YAMLS if "applications" in yaml.safe_load(p.read_text())]
COMMAND_KEYS = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
                "head_start_ray_commands", "worker_start_ray_commands")
# Ray's fake multi-node provider cannot be prepared outside Ray's source tree (its defaults
# file is not in the wheel), so local-cluster.yaml spells out every key and is validated as is
UNPREPARED_PROVIDERS = {"fake_multinode"}


def test_every_deploy_yaml_is_a_cluster_or_a_serve_config():
    assert YAMLS and set(YAMLS) == set(CLUSTERS) | set(SERVES)


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.name)
def test_cluster_config_passes_ray_validation(path):
    from ray.autoscaler._private.util import prepare_config, validate_config
    config = yaml.safe_load(path.read_text())
    if config["provider"]["type"] not in UNPREPARED_PROVIDERS:
        config = prepare_config(config)          # what `ray up` does first (defaults, local provider)
    validate_config(config)


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.name)
def test_cluster_shell_commands_are_valid_bash(path):
    config = yaml.safe_load(path.read_text())
    commands = [c for key in COMMAND_KEYS for c in config.get(key) or []]
    for command in commands:
        out = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True)
        assert out.returncode == 0, f"{path.name}: `{command}`: {out.stderr}"


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.name)
def test_setup_commands_expand_home_paths(path):
    """A quoted `~` is never expanded by the shell (`pip install -e "~/kvmesh"` fails)."""
    config = yaml.safe_load(path.read_text())
    for key in COMMAND_KEYS:
        for command in config.get(key) or []:
            assert '"~' not in command and "'~" not in command, f"{path.name} {key}: `{command}`"


# the layouts docs/deploy.md walks through that this build plans but does not serve yet: refused at
# start-up with this message (drop the entry the day they are served)
NOT_SERVED_YET: dict[str, str] = {}


@pytest.mark.parametrize("path", SERVES, ids=lambda p: p.name)
def test_serve_config_passes_serve_and_kvmesh_validation(path):
    from ray.serve.schema import ServeDeploySchema
    ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    if path.name in NOT_SERVED_YET:
        with pytest.raises(ConfigFileError, match=NOT_SERVED_YET[path.name]):
            load_config(path)
    else:
        load_config(path)


def test_the_v4_pro_walk_through_is_the_plans_served_row_on_its_cluster():
    """serve-v4-pro.yaml asks for a layout `kvmesh plan` serves for V4-Pro on 8 x 80 GiB (DP 8 x TP 2
    over 2 nodes: TP inside the DP ranks), on exactly the two nodes of cluster-v4-pro.yaml that carry
    its resource; its KV budget fits the row's free memory per rank."""
    from kvmesh.workers.checkpoint.released import RELEASED_CONFIGS
    from kvmesh.workers.checkpoint.sizing import plan, split_from_config
    from kvmesh.workers.model.args import ModelArgs
    pool = yaml.safe_load((DEPLOY / "serve-v4-pro.yaml").read_text())["applications"][0]["args"]["colocated"]
    cluster = yaml.safe_load((DEPLOY / "cluster-v4-pro.yaml").read_text())
    gpu = cluster["available_node_types"]["v4pro_gpu"]
    nodes = pool["data_parallel_size"] // pool["data_parallel_size_local"]
    tp, dp = pool["tensor_parallel_size"], pool["data_parallel_size"]
    assert gpu["min_workers"] == gpu["max_workers"] == cluster["max_workers"] == nodes == 2
    assert (tp, dp) == (2, 8) and pool["enable_expert_parallel"]
    assert pool["data_parallel_size_local"] * tp == gpu["resources"]["GPU"] == gpu["resources"]["kvmesh_v4pro"]
    config = load_config(DEPLOY / "serve-v4-pro.yaml")
    opts = config.colocated.deployment_options("Colocated")
    assert len(opts["placement_group_bundles"]) == 2 and opts["placement_group_strategy"] == "STRICT_SPREAD"
    assert opts["placement_group_bundles"][0]["GPU"] == 8 and opts["ray_actor_options"]["num_gpus"] == tp
    args = ModelArgs.from_dict(RELEASED_CONFIGS["V4-Pro"])
    row = {(f.tp, f.dp, f.nodes): f for f in plan(args, split_from_config(args), 80, 8, kv_cache_dtype="fp8",
                                                  nodes=2).fits}[(tp, dp, 2)]
    assert row.fits
    assert config.engine.kv_cache_bytes <= row.free_per_rank      # the plan's KV free per rank holds it


RAY_UP = [p for p in CLUSTERS if yaml.safe_load(p.read_text()).get("head_start_ray_commands")]


@pytest.mark.parametrize("path", RAY_UP, ids=lambda p: p.name)
def test_every_ray_start_of_a_ray_up_config_hides_the_serve_proxys_route_list(path):
    """Serve's proxy serves /-/routes outside the API key unless its node's Ray was started with the
    proxy callback (cluster/openai/proxy_guard.py, docs/security.md)."""
    from kvmesh.cluster.openai.proxy_guard import RAY_ENV
    config = yaml.safe_load(path.read_text())
    starts = [c for key in ("head_start_ray_commands", "worker_start_ray_commands")
              for c in config.get(key, []) if "ray start" in c]
    assert len(starts) == 2, starts
    for command in starts:
        assert all(f"{name}={value} ray start" in command for name, value in RAY_ENV.items()), command

def onprem() -> dict:
    return yaml.safe_load((DEPLOY / "onprem.yaml").read_text())


def test_onprem_gives_every_worker_one_pool_and_the_pools_require_those_resources():
    config = onprem()
    pools = pools_of(config)
    assert set(pools) == set(config["provider"]["worker_ips"]) and set(pools.values()) == {"prefill", "decode"}
    serve = load_config(DEPLOY / "serve-onprem.yaml")
    for ip, pool in pools.items():
        carried = node_resources(config, [ip])
        required = getattr(serve, pool).resources
        assert set(required) <= set(carried), (ip, carried, required)
    head_start = " ".join(config["head_start_ray_commands"])
    assert all(key in head_start for key in serve.ingress.resources)


def test_onprem_worker_without_a_pool_is_named_at_start():
    config = onprem()
    config["provider"]["worker_ips"].append("10.0.0.9")
    with pytest.raises(NodeRoleError, match="10.0.0.9"):
        node_resources(config, ["10.0.0.2"])
    config = onprem()
    with pytest.raises(NodeRoleError, match=r"\(10.0.0.7, 127.0.0.1\) has no pool"):
        node_resources(config, ["127.0.0.1", "10.0.0.7"])


def test_onprem_unknown_pool_is_rejected():
    config = onprem()
    config["provider"]["kvmesh_pools"]["10.0.0.3"] = "decoder"
    with pytest.raises(NodeRoleError, match="unknown pool"):
        pools_of(config)


def test_node_role_finds_the_machine_by_its_interface_addresses():
    from kvmesh.cluster.cli.node_role import interface_addresses
    config = onprem()
    assert "127.0.0.1" in interface_addresses()
    config["provider"]["worker_ips"].append("127.0.0.1")
    config["provider"]["kvmesh_pools"]["127.0.0.1"] = "decode"
    assert node_resources(config, interface_addresses()) == {"kvmesh_decode": 1}
