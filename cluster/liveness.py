"""Which Serve replicas are alive now, so metrics can forget the ones that are gone."""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)
REPLICA_PREFIX = "SERVE_REPLICA::"     # Serve names each replica actor SERVE_REPLICA::app#Deployment#id


def live_replica_ids() -> set[str] | None:
    """Unique ids of the live Serve replicas (a worker's id), or None when Ray cannot say."""
    import ray
    try:
        actors = ray.util.list_named_actors(all_namespaces=True)
    except Exception as e:      # metrics must answer even when the GCS is slow
        log.debug("cannot list replicas: %s", e)
        return None
    return {a["name"].rsplit("#", 1)[-1] for a in actors if a["name"].startswith(REPLICA_PREFIX)}
