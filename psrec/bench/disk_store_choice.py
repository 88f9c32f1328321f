"""Which store holds a table's cold rows: LMDB, RocksDB or a memory-mapped slab file with its own index.

Each store holds ``--rows`` records (one row of dim 64 at fp32 plus its row-wise Adagrad accumulator
and metadata: 268 bytes, what a demoted row carries) keyed by int64 id, and is measured, in
interleaved rounds (lmdb, rocksdb, slab, lmdb, ...), on

1. **random reads**: ``--batch`` distinct ids drawn uniformly from the stored ones, read together
   into one (batch, 268) byte array (LMDB ``Cursor.getmulti``, RocksDB ``Rdict.get(list)`` =
   ``multi_get``, the slab: ``HashIndex.lookup`` then one fancy-indexed gather from the ``np.memmap``);
2. **demotion writes**: ``--batch`` records under new ids written together (LMDB ``putmulti`` in one
   write transaction, RocksDB one ``WriteBatch``, the slab: ``HashIndex.insert`` then one scatter into
   the memmap).

The files sit in ``--dir`` (default: a temporary directory on the working disk) and fit the page
cache, which is the regime of a hot/cold split (the OS caches what the tier reads most). Writes are
not fsynced by any store (LMDB ``sync=False``, RocksDB without WAL sync): the disk tier is rebuilt
from checkpoints after a crash, so its files need no durability of their own. Reported: rows/s
(median of rounds) and the CPU seconds per 100k rows. Results go to docs/benchmarks.md ("Disk tier").

    . .venv/bin/activate && pip install lmdb==3.0.0 rocksdict==0.3.29 && \
        python -m psrec.bench.disk_store_choice            # about 1 min on the shared 2-vCPU box
"""

from __future__ import annotations

import argparse
import functools
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from psrec.embedding import HashIndex

RECORD_BYTES = 64 * 4 + 4 + 8  # fp32 row (dim 64) + row-wise Adagrad accumulator + [count, last step]


def _keys(ids: np.ndarray) -> list[bytes]:
    raw = ids.astype(">i8").tobytes()
    return [raw[i : i + 8] for i in range(0, len(raw), 8)]


class LmdbStore:
    name = "lmdb"

    def __init__(self, path: Path, rows: int) -> None:
        import lmdb

        self.env = lmdb.open(
            str(path), map_size=rows * RECORD_BYTES * 4 + (64 << 20), sync=False, metasync=False,
            readahead=False, writemap=False, lock=True,
        )  # fmt: skip

    def write(self, ids: np.ndarray, records: np.ndarray) -> None:
        values = [record.tobytes() for record in records]
        with self.env.begin(write=True) as txn:
            txn.cursor().putmulti(list(zip(_keys(ids), values, strict=True)))

    def read(self, ids: np.ndarray) -> np.ndarray:
        with self.env.begin() as txn:
            found = txn.cursor().getmulti(_keys(ids))
        return np.frombuffer(b"".join(value for _, value in found), dtype=np.uint8).reshape(-1, RECORD_BYTES)

    def close(self) -> None:
        self.env.close()


class RocksStore:
    name = "rocksdb"

    def __init__(self, path: Path, rows: int) -> None:
        from rocksdict import Options, Rdict

        options = Options(raw_mode=True)
        options.create_if_missing(True)
        self.db = Rdict(str(path), options=options)

    def write(self, ids: np.ndarray, records: np.ndarray) -> None:
        from rocksdict import WriteBatch

        batch = WriteBatch(raw_mode=True)
        for key, record in zip(_keys(ids), records, strict=True):
            batch.put(key, record.tobytes())
        self.db.write(batch)

    def read(self, ids: np.ndarray) -> np.ndarray:
        values = self.db.get(_keys(ids))
        return np.frombuffer(b"".join(values), dtype=np.uint8).reshape(-1, RECORD_BYTES)

    def close(self) -> None:
        self.db.close()


class SlabStore:
    name = "slab"

    def __init__(self, path: Path, rows: int) -> None:
        self.path = path / "slab.bin"
        self.capacity = rows * 2
        with open(self.path, "wb") as file:
            file.truncate(self.capacity * RECORD_BYTES)
        self.slab = np.memmap(self.path, dtype=np.uint8, mode="r+", shape=(self.capacity, RECORD_BYTES))
        self.index = HashIndex(initial_rows=self.capacity)

    def write(self, ids: np.ndarray, records: np.ndarray) -> None:
        slots, _ = self.index.insert(ids)
        self.slab[slots] = records

    def read(self, ids: np.ndarray) -> np.ndarray:
        slots, missing = self.index.lookup(ids)
        assert missing == 0
        return self.slab[slots]

    def close(self) -> None:
        del self.slab


def _timed(call: Callable[[], object]) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    call()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000, help="records stored before timing")
    parser.add_argument("--batch", type=int, default=100_000, help="records per read / write batch")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where the store files go")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="psrec-store-", dir=args.dir))
    rng = np.random.default_rng(0)
    ids = rng.permutation(np.arange(args.rows, dtype=np.int64) * 7919 + 11)
    records = rng.integers(0, 256, size=(args.rows, RECORD_BYTES), dtype=np.uint8)
    stores = []
    try:
        for kind in (LmdbStore, RocksStore, SlabStore):
            (root / kind.name).mkdir()
            store = kind(root / kind.name, args.rows)
            for start in range(0, args.rows, args.batch):
                store.write(ids[start : start + args.batch], records[start : start + args.batch])
            probe = rng.choice(args.rows, size=1000, replace=False)
            assert np.array_equal(store.read(ids[probe]), records[probe]), kind.name
            stores.append(store)
        results: dict[str, dict[str, list[tuple[float, float]]]] = {
            store.name: {"read": [], "write": []} for store in stores
        }
        next_id = int(ids.max()) + 1
        for _ in range(args.rounds):
            sample = ids[rng.choice(args.rows, size=args.batch, replace=False)]
            fresh = np.arange(next_id, next_id + args.batch, dtype=np.int64)
            next_id += args.batch
            new_records = rng.integers(0, 256, size=(args.batch, RECORD_BYTES), dtype=np.uint8)
            for store in stores:
                results[store.name]["read"].append(_timed(functools.partial(store.read, sample)))
                results[store.name]["write"].append(
                    _timed(functools.partial(store.write, fresh, new_records))
                )
        print(
            f"{args.rows:,} records of {RECORD_BYTES} B stored; batches of {args.batch:,}; {args.rounds} rounds"
        )
        print(
            f"{'store':8s} {'read rows/s':>12s} {'read CPU s/100k':>16s} {'write rows/s':>13s} {'write CPU s/100k':>17s}"
        )
        for name, timings in results.items():
            read_rate = statistics.median(args.batch / wall for wall, _ in timings["read"])
            write_rate = statistics.median(args.batch / wall for wall, _ in timings["write"])
            read_cpu = statistics.median(cpu for _, cpu in timings["read"]) * 1e5 / args.batch
            write_cpu = statistics.median(cpu for _, cpu in timings["write"]) * 1e5 / args.batch
            print(f"{name:8s} {read_rate:12,.0f} {read_cpu:16.3f} {write_rate:13,.0f} {write_cpu:17.3f}")
    finally:
        for store in stores:
            store.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
