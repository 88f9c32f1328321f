"""A shard's side of a shared-memory pull and push: reading the trainer's segments in place and
gathering the rows straight into the reply segment, against copying the arrays out first and the
rows in after (what a logged shard, or a sync shard of several trainers, does).

One `ParameterShard` of 13 tables (dim 64, Adagrad), each call 4096 ids a table (the `psrec bench`
DLRM's share of one of two shards, drawn from 10x as many ids, so that after the warm-up steps most
rows exist); the two ways alternate call by call on the same shard, and the median time of each
over the timed steps is printed. Usage:

    python -m psrec.bench.shard_reads_bench [--steps 60] [--warmup 40] [--tables 13] [--batch 4096] [--dim 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from psrec.embedding import EmbeddingTable, InitializerSpec, SparseOptimizerSpec, TableSpec
from psrec.ps.shard import ParameterShard
from psrec.ps.shared_arrays import SegmentPool
from psrec.threads import set_thread_counts


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--tables", type=int, default=13)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args()
    set_thread_counts(1)
    specs = [
        TableSpec(
            f"t{i}", args.dim, SparseOptimizerSpec("adagrad", lr=0.01), InitializerSpec("uniform", 0.01)
        )
        for i in range(args.tables)
    ]
    shard = ParameterShard(
        0, {s.name: EmbeddingTable.from_spec(s) for s in specs}, num_trainers=1, mode="sync"
    )
    pool = SegmentPool()
    rng = np.random.default_rng(0)
    times: dict[str, list[float]] = {"pull": [], "pull copied": [], "push": [], "push copied": []}
    for step in range(args.warmup + args.steps):
        copied = step % 2 == 1
        ids = {s.name: np.sort(rng.choice(10 * args.batch, args.batch, replace=False)) for s in specs}
        sent = pool.write(ids)
        reply = pool.reserve(sum(v.size for v in ids.values()) * args.dim * 4)
        assert sent is not None and sent.arrays is not None and reply is not None and reply.reply is not None
        start = time.perf_counter()
        requests = sent.arrays.load(copy=copied)
        if copied:
            reply.reply.write(shard.pull(requests))
        else:
            placed = reply.reply.place(
                {n: ((v.size, args.dim), np.dtype(np.float32)) for n, v in requests.items()}
            )
            assert placed is not None
            shard.pull(requests, out=placed[1])
        if step >= args.warmup:
            times["pull copied" if copied else "pull"].append(time.perf_counter() - start)
        arrays = {}
        for name, values in ids.items():
            arrays[f"{name}/ids"] = values
            arrays[f"{name}/grads"] = rng.normal(size=(values.size, args.dim)).astype(np.float32)
        message = pool.write(arrays)
        assert message is not None and message.arrays is not None
        start = time.perf_counter()
        loaded = message.arrays.load(copy=copied)
        shard.push(0, step, step, {n: (loaded[f"{n}/ids"], loaded[f"{n}/grads"]) for n in ids})
        if step >= args.warmup:
            times["push copied" if copied else "push"].append(time.perf_counter() - start)
        for done in (sent, reply, message):
            pool.release(done)
    pool.close()
    for name, seconds in times.items():
        print(f"{name:12s} {statistics.median(seconds) * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
