"""The trainer's side of a shared-memory push and pull: writing a message's arrays into a segment
of its `SegmentPool` (`psrec.ps.shared_arrays`), the work a Ray trainer does per shard and step
before the actor call.

A push carries two arrays per table (the unique ids and their float32 row gradients), a pull one
(the ids); the default shape is the quickstart's share of one of two shards (26 tables, dim 16,
batch 2048, 50-800 unique ids a table). Each message is written and released `--calls` times,
and the median of `--rounds` rounds is printed, in microseconds per message. Usage:

    python -m psrec.bench.shared_write_bench [--tables 26] [--dim 16] [--calls 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from psrec.ps.shared_arrays import SegmentPool


def _time_writes(pool: SegmentPool, arrays: dict[str, np.ndarray], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        message = pool.write(arrays)
        assert message is not None
        pool.release(message)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    push: dict[str, np.ndarray] = {}
    pull: dict[str, np.ndarray] = {}
    for table in range(args.tables):
        unique = int(rng.integers(50, 800))
        ids = rng.integers(0, 1 << 40, unique).astype(np.int64)
        push[f"{table}/ids"] = ids
        push[f"{table}/grads"] = rng.random((unique, args.dim), dtype=np.float32)
        pull[str(table)] = ids
    pool = SegmentPool()
    try:
        for name, arrays in (("push", push), ("pull", pull)):
            _time_writes(pool, arrays, max(1, args.calls // 10))  # the segment exists and is warm
            times = [_time_writes(pool, arrays, args.calls) for _ in range(args.rounds)]
            print(
                f"{name}: {len(arrays)} arrays, {sum(a.nbytes for a in arrays.values()) / 1e6:.2f} MB: "
                f"{statistics.median(times):.1f} us per message (rounds {min(times):.1f}-{max(times):.1f})"
            )
    finally:
        pool.close()


if __name__ == "__main__":
    main()
