"""A real multi-node Ray cluster on this machine, every node on loopback.

`ray.cluster_utils.Cluster` starts a head and two worker nodes (separate raylets, each with
its own resources) as processes of this machine. Ray would otherwise pick the machine's
interface address for every node and for `ray.init`, which tests must never use (and a
cluster mixing loopback and that address hangs), so every node gets
``node_ip_address="127.0.0.1"`` and Ray's "resolve localhost to the node address" step is
turned off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read by Ray on import and patched
again in case Ray was imported earlier).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'tensorrpc[ray]')")

ROOT = Path(__file__).resolve().parents[2]
#: A head and two workers, each with its own resources, on loopback, small and few workers.
NODE: dict[str, Any] = {
    "node_ip_address": "127.0.0.1",
    "object_store_memory": 78 * 1024 * 1024,
    "include_dashboard": False,
    "num_gpus": 0,
}


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[dict[str, str]]:
    """Start the cluster, connect this process as a driver; yields node name -> node id."""
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    patched = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    old_path = os.environ.get("PYTHONPATH")
    # the workers import tests.ray.services: put the repository on their path
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), old_path) if p)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**NODE, "num_cpus": 1, "resources": {"head": 1}},
    )
    try:
        a = cluster.add_node(**NODE, num_cpus=2, resources={"node_a": 2})
        b = cluster.add_node(**NODE, num_cpus=2, resources={"node_b": 2})
        cluster.wait_for_nodes(timeout=60)
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            yield {
                "head": cluster.head_node.node_id,  # type: ignore[attr-defined]
                "a": a.node_id,
                "b": b.node_id,
            }
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()  # type: ignore[no-untyped-call]
        ray_constants.ENABLE_RAY_CLUSTER = patched
        if old_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_path
