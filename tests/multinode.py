"""The multi-node test cluster; it lives in `psrec.bench.local_cluster`, which benchmarks use too."""

from psrec.bench.local_cluster import LocalRayCluster, Node, free_port

__all__ = ["LocalRayCluster", "Node", "free_port"]
