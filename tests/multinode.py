"""The multi-node test cluster; it lives in `psrec.testing.local_cluster`, which benchmarks use too."""

from psrec.testing.local_cluster import LocalRayCluster, Node, free_port

__all__ = ["LocalRayCluster", "Node", "free_port"]
