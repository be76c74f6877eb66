"""The pool a machine of an on-premises `ray up` cluster joins, as `ray start --resources`.

    ray start --address=$RAY_HEAD_IP:6379 \\
        --resources="$(python -m kvmesh.cluster.cli.node_role ~/kvmesh/.ray-cluster.json "$RAY_CLOUD_INSTANCE_ID")"

MACHINE is the machine's entry in `worker_ips` (Ray's autoscaler v2 exports it as
RAY_CLOUD_INSTANCE_ID); without it, any of the machine's IPv4 addresses is looked up.

The cluster config (deploy/onprem.yaml) names each worker's pool, one line per machine:

    provider:
      worker_ips: [10.0.0.2, 10.0.0.3]
      kvmesh_pools: {10.0.0.2: prefill, 10.0.0.3: decode}

A prefill machine carries the custom resource `kvmesh_prefill`, a decode machine
`kvmesh_decode`; the Serve pools require them (deploy/serve-onprem.yaml), so each pool
runs only on its own machines.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Iterable
import yaml

POOLS = ("prefill", "decode")
POOLS_KEY = "kvmesh_pools"
SLOTS_PER_NODE = 1   # replicas request a fraction of it, so CPU/GPU decide how many fit
SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


class NodeRoleError(ValueError):
    """The cluster config does not give this machine (or some machine) a valid pool."""


def pools_of(config: dict) -> dict[str, str]:
    """worker IP -> pool, checked against `provider.worker_ips`."""
    provider = config.get("provider") or {}
    pools = provider.get(POOLS_KEY) or {}
    workers = [str(ip) for ip in provider.get("worker_ips") or []]
    bad = {ip: pool for ip, pool in pools.items() if pool not in POOLS}
    if bad:
        raise NodeRoleError(f"provider.{POOLS_KEY}: unknown pool for {bad}; use one of {', '.join(POOLS)}")
    missing = [ip for ip in workers if ip not in pools]
    if missing:
        raise NodeRoleError(f"provider.{POOLS_KEY} has no pool for worker {', '.join(missing)}: "
                            f"add a line `<ip>: prefill` or `<ip>: decode`")
    extra = [ip for ip in pools if ip not in workers]
    if extra:
        raise NodeRoleError(f"provider.{POOLS_KEY} names {', '.join(extra)}, which is not in provider.worker_ips")
    return {str(ip): pool for ip, pool in pools.items()}


def interface_addresses() -> set[str]:
    """The IPv4 address of every network interface of this machine."""
    import fcntl
    import socket
    import struct
    found = set()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:      # an interface without an IPv4 address
                continue
            found.add(socket.inet_ntoa(packed[20:24]))
    return found


def node_resources(config: dict, machines: Iterable[str]) -> dict[str, int]:
    """The `--resources` of the machine known as any of `machines` (its worker_ips entry or addresses)."""
    pools = pools_of(config)
    mine = sorted({pools[m] for m in machines if m in pools})
    if len(mine) != 1:
        names = ", ".join(sorted(m for m in machines if m)) or "(no address)"
        raise NodeRoleError(f"this machine ({names}) has "
                            f"{'no pool' if not mine else 'several pools ' + str(mine)} in provider.{POOLS_KEY}")
    return {f"kvmesh_{mine[0]}": SLOTS_PER_NODE}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not 1 <= len(argv) <= 2:
        print("usage: python -m kvmesh.cluster.cli.node_role CLUSTER_CONFIG [MACHINE]", file=sys.stderr)
        return 2
    try:
        config = yaml.safe_load(Path(argv[0]).expanduser().read_text()) or {}
        given = [argv[1]] if len(argv) == 2 and argv[1] else []
        print(json.dumps(node_resources(config, given or interface_addresses())))
    except (OSError, yaml.YAMLError, NodeRoleError) as e:
        print(f"kvmesh node role: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
