"""The run's exactly-once accounting at a checkpoint: the ranges of the row ids its steps consumed
(`psrec.train.accounting.id_ranges`), against the same ranges from `np.unique` (NumPy's hash-based
unique, which the function used before), on the distinct, shuffled row ids of a run's epoch.

Both ways run alternately, the ranges are checked equal, and the median of `--rounds` is printed.
Usage:

    python -m psrec.bench.accounting_bench [--rows 400000 2000000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from psrec.train.accounting import id_ranges


def ranges_with_np_unique(ids: np.ndarray) -> np.ndarray:
    unique = np.unique(ids)
    breaks = np.flatnonzero(np.diff(unique) != 1) + 1
    starts = unique[np.concatenate([[0], breaks])]
    stops = unique[np.concatenate([breaks - 1, [unique.size - 1]])] + 1
    return np.stack([starts, stops], axis=1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[400_000, 2_000_000])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    for rows in args.rows:
        ids = rng.permutation(rows).astype(np.int64)  # an epoch's rows, shuffled
        ids[: rows // 100] = ids[rows // 100 : 2 * (rows // 100)]  # and a few read twice
        times: dict[str, list[float]] = {"id_ranges": [], "np.unique": []}
        for _ in range(args.rounds):
            for name, function in (("id_ranges", id_ranges), ("np.unique", ranges_with_np_unique)):
                start = time.perf_counter()
                ranges = function(ids)
                times[name].append((time.perf_counter() - start) * 1e3)
                np.testing.assert_array_equal(ranges, id_ranges(ids))
        print(
            f"{rows:>10,} ids: "
            + ", ".join(f"{name} {statistics.median(ms):.1f} ms" for name, ms in times.items())
        )


if __name__ == "__main__":
    main()
