"""Disk tier benchmark: demotion policies' hit rates, and a table larger than its memory budget.

Two parts (results in docs/benchmarks.md, "Disk tier", and docs/disk_tier.md):

``policies``: one TieredTable (dim 16, row-wise Adagrad) per demotion policy (LFU, LRU, LFU with
aging) is trained on the same batches of Zipf(``--exponent``) ids over ``--universe`` ids, deduped
per batch as the PS client sends them, with ``--memory-fraction`` of the universe in memory. Reported:
the hit rate (pulled ids found in memory) over the second half of the steps, next to the best any
policy can do on this traffic (the probability mass of the most frequent ids that fit), on stationary
traffic and on traffic whose popular ids change halfway ("drift": the rank -> id map is redrawn).

``scale``: a table of ``--rows`` rows of dim ``--dim`` (row-wise Adagrad, fp32) is filled (every
row inserted and updated once), then trained for ``--rounds`` rounds of ``--steps`` steps of
``--batch`` Zipf ids (after ``--warmup-rounds`` untimed ones, in which the memory tier fills with
the popular rows), each system in a fresh process: ``memory`` (an EmbeddingTable), ``tiered`` (a
TieredTable with the rows that fit ``--memory-gb``, disk index included, in memory; the rest under
``--disk-dir``) and ``prefetch`` (the same, told each next batch's ids after each pull:
``TieredTable.prefetch``, so its cold rows are read on a background thread during the push).
With ``--model dlrm`` every step is a training step of psrec's DLRM (bottom 13-512-256-D, dot
interaction, top 512-256-1, Adam 1e-3; the model of `psrec bench`) whose ``--features`` sparse
features all look up this one table: ``--batch-samples`` samples a step draw samples x features Zipf ids,
the step pulls the distinct ones, gathers them into the (B, F, D) input, runs forward, backward and
the dense optimizer on ``--threads`` torch threads (under bf16 autocast with ``--dense-precision
bf16``, psrec's `training.dense_precision`), and pushes the rows' summed gradients (what
psrec's in-process trainer does with its tables); the rate is then samples/s.
The systems run interleaved, ``--repeats`` times each (memory, tiered, prefetch, memory, ...).
Reported per system: ids/s of pull + push and ids per CPU-second (all threads), each the median over
repeats of a process's median round; the ratios to ``memory`` per repeat; peak RSS (VmHWM) and its
anonymous and file-backed parts at the end; the hit rate, disk traffic per step, and where the
tiered steps' time goes (promotion reads, demotion writes and victim choice); the load average
before each process.

    . .venv/bin/activate && python -m psrec.bench.disk_tier_bench policies
    python -m psrec.bench.disk_tier_bench scale --rows 20000000 --memory-gb 1     # the issue's target
    python -m psrec.bench.disk_tier_bench scale --rows 4000000 --memory-gb 0.2    # scaled down 5x
    python -m psrec.bench.disk_tier_bench scale --rows 20000000 --memory-gb 1 --model dlrm   # trained
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from psrec.embedding import EmbeddingTable, SparseOptimizerSpec, TieredTable
from psrec.embedding.sizes import memory_rows_for_budget

OPTIMIZER = SparseOptimizerSpec("rowwise_adagrad", lr=0.05)


class ZipfIds:
    """Batches of ids whose ranks follow a bounded Zipf law; rank -> id is a random permutation."""

    def __init__(self, universe: int, exponent: float, seed: int) -> None:
        weights = np.arange(1, universe + 1, dtype=np.float64) ** -exponent
        self.probabilities = weights / weights.sum()
        self.cumulative = np.cumsum(self.probabilities)
        self.rng = np.random.default_rng(seed)
        self.universe = universe
        self.redraw()

    def redraw(self) -> None:
        self.ids = self.rng.permutation(self.universe).astype(np.int64) * 2654435761 % (2**61)

    def draws(self, size: int) -> np.ndarray:
        """`size` ids drawn independently (repeats kept, in draw order)."""
        ranks = np.searchsorted(self.cumulative, self.rng.random(size), side="right")
        return self.ids[np.minimum(ranks, self.universe - 1)]

    def batch(self, size: int) -> np.ndarray:
        return np.unique(self.draws(size))  # deduped, as the client sends

    def best_hit_rate(self, rows: int, batch: int) -> float:
        """Share of a deduped batch's ids among the `rows` most probable: the best a policy can keep."""
        seen = 1 - (1 - self.probabilities) ** batch  # P(id in a batch of `batch` draws)
        return float(seen[:rows].sum() / seen.sum())


def run_policies(args: argparse.Namespace) -> None:
    memory_rows = int(args.universe * args.memory_fraction)
    print(
        f"Zipf({args.exponent}) over {args.universe:,} ids, batches of {args.batch:,} draws (deduped), "
        f"{args.steps} steps, {memory_rows:,} rows in memory ({args.memory_fraction:.0%})"
    )
    print(
        f"{'traffic':10s} {'policy':10s} {'hit rate':>9s} {'best':>7s} {'promoted/step':>14s} "
        f"{'demote ms/step':>12s}"
    )
    for traffic in ("stationary", "drift"):
        results = {}
        variants = [("lfu", 1.0, 0)] + [("lfu", 1.0, k) for k in args.samples] + [("lru", 1.0, 0)]
        variants += [("lfu_aging", h, 0) for h in args.half_lives]
        for policy, half_life, sample in variants:
            ids = ZipfIds(args.universe, args.exponent, seed=1)
            best = ids.best_hit_rate(memory_rows, args.batch)
            with tempfile.TemporaryDirectory(dir=args.disk_dir) as directory:
                table = TieredTable(
                    "t",
                    16,
                    memory_rows=memory_rows,
                    disk_dir=directory,
                    policy=policy,
                    half_life_steps=half_life,
                    victim_sample=sample,
                    optimizer=OPTIMIZER,
                )
                hits = misses = promotions = 0
                choosing = 0.0
                stopwatch = _Stopwatch(table._enforce_budget)
                table._enforce_budget = stopwatch  # type: ignore[method-assign]
                rng = np.random.default_rng(2)
                for step in range(1, args.steps + 1):
                    if traffic == "drift" and step == args.steps // 2:
                        ids.redraw()
                    batch = ids.batch(args.batch)
                    before = (table.hits, table.misses, table.promotions)
                    table.pull(batch)
                    table.push(batch, rng.standard_normal((batch.shape[0], 16), dtype=np.float32), step=step)
                    if step > args.steps // 2:
                        hits += table.hits - before[0]
                        misses += table.misses - before[1]
                        promotions += table.promotions - before[2]
                table.close()
                choosing = stopwatch.seconds
            label = policy if policy != "lfu_aging" else f"aging/{half_life:g}"
            label += f"~{sample}" if sample else ""
            results[label] = hits / (hits + misses)
            print(
                f"{traffic:10s} {label:10s} {results[label]:9.3f} {best:7.3f} "
                f"{promotions / (args.steps - args.steps // 2):14,.0f} {choosing * 1e3 / args.steps:12.2f}"
            )


class _Stopwatch:
    """`function`, adding the wall seconds of each call to ``seconds``."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        self.seconds = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self.function(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started


# ------------------------------------------------------------------------------------------ scale
def _rss() -> dict[str, int]:
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
            values[key] = int(rest.split()[0]) * 1024
    return values


def _timed(timings: dict[str, float], name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            timings[name] += time.perf_counter() - started

    return wrapper


# A DLRM batch: (distinct ids, each draw's position among them, dense features, labels).
DlrmBatch = tuple[np.ndarray, np.ndarray, Any, Any]


class _DlrmSteps:
    """Training steps of psrec's DLRM whose sparse features all look up one table (see the docstring).

    A step is what the in-process trainer does with a table: pull the batch's distinct ids, gather
    the (B, F, D) input from them, forward, backward, the dense optimizer, and push each distinct
    id's summed gradient.
    """

    def __init__(self, args: argparse.Namespace, zipf: ZipfIds) -> None:
        import torch

        from psrec.models.dlrm import DLRM
        from psrec.threads import set_thread_counts

        set_thread_counts(args.threads)
        torch.manual_seed(0)
        self.torch = torch
        self.zipf = zipf
        self.samples, self.features, self.dim = args.batch_samples, args.features, args.dim
        self.unique_ids: list[int] = []
        self.model = DLRM(
            13, args.features, args.dim, bottom_hidden_sizes=(512, 256), top_hidden_sizes=(512, 256)
        )
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.rng = np.random.default_rng(5)
        self.bf16 = args.dense_precision == "bf16"

    def batch(self) -> DlrmBatch:
        """(distinct ids, each draw's position among them, dense features, labels) of one batch."""
        draws = self.zipf.draws(self.samples * self.features)
        ids, inverse = np.unique(draws, return_inverse=True)
        self.unique_ids.append(ids.shape[0])
        dense = self.torch.from_numpy(self.rng.standard_normal((self.samples, 13), dtype=np.float32))
        labels = self.torch.from_numpy((self.rng.random(self.samples) < 0.25).astype(np.float32))
        return ids, inverse.astype(np.int64), dense, labels

    def step(
        self,
        table: EmbeddingTable,
        batch: DlrmBatch,
        *,
        step: int,
        pulled: Callable[[], Any] | None = None,
    ) -> None:
        """One training step; `pulled` runs once the rows are pulled (the trainer's prefetch point)."""
        from psrec.models.base import ModelInput
        from psrec.trainer.pooling import gather_rows

        ids, inverse, dense, labels = batch
        rows = self.torch.from_numpy(table.pull(ids)).requires_grad_()  # (U, D)
        if pulled is not None:
            pulled()
        dtype = self.torch.bfloat16 if self.bf16 else self.torch.float32
        pooled = gather_rows(rows, inverse, self.features, dtype)  # (B, F, D)
        with self.torch.autocast("cpu", dtype=self.torch.bfloat16, enabled=self.bf16):
            loss, _ = self.model.loss(ModelInput(dense, pooled), labels)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        assert rows.grad is not None
        table.push(ids, rows.grad.numpy(), step=step)


def _ids(batch: np.ndarray | DlrmBatch) -> np.ndarray:
    """A batch's distinct ids (a DLRM batch carries them first)."""
    return batch[0] if isinstance(batch, tuple) else batch


def run_system(args: argparse.Namespace) -> dict[str, Any]:
    """One system's run, in this (fresh) process."""
    rows, dim = args.rows, args.dim
    timings: dict[str, float] = defaultdict(float)
    zipf = ZipfIds(rows, args.exponent, seed=3)
    baseline = _rss()["VmRSS"]  # interpreter, numba and NumPy, the id generator: before any row
    if args.system == "memory":
        table: EmbeddingTable = EmbeddingTable("t", dim, optimizer=OPTIMIZER, initial_rows=rows)
        memory_rows = rows
    else:
        memory_rows = memory_rows_for_budget(
            args.memory_gb * 2**30, dim=dim, precision="fp32", optimizer=OPTIMIZER.name, expected_rows=rows
        )
        tiered = TieredTable(
            "t",
            dim,
            memory_rows=memory_rows,
            disk_dir=args.disk_dir,
            optimizer=OPTIMIZER,
            initial_rows=memory_rows,
            **({} if args.victim_sample is None else {"victim_sample": args.victim_sample}),
        )
        cold = tiered._cold
        cold.read = _timed(timings, "disk read (promotion)", cold.read)  # type: ignore[method-assign]
        cold.write = _timed(timings, "disk write (demotion)", cold.write)  # type: ignore[method-assign]
        tiered._enforce_budget = _timed(timings, "demotion (victims + write)", tiered._enforce_budget)  # type: ignore[method-assign]
        tiered._promote = _timed(timings, "promotion (read + insert)", tiered._promote)  # type: ignore[method-assign]
        tiered.prefetch = _timed(timings, "prefetch (issuing it)", tiered.prefetch)  # type: ignore[method-assign]
        table = tiered
    started = time.perf_counter()
    chunk = min(200_000, max(memory_rows // 4, 1))
    for start in range(0, rows, chunk):  # every row inserted and updated once
        ids = zipf.ids[start : start + chunk]
        table.pull(ids)
        table.push(ids, np.full((ids.shape[0], dim), 0.01, dtype=np.float32), step=1)
    fill_seconds = time.perf_counter() - started
    peak_after_fill = _rss()["VmHWM"]
    rng = np.random.default_rng(4)
    grad = rng.standard_normal((args.batch, dim), dtype=np.float32)
    step = 1

    prefetch = args.system == "prefetch"
    trainer = _DlrmSteps(args, zipf) if args.model == "dlrm" else None

    def round_of_steps() -> int:
        """One timed round; returns the ids (pull + push alone) or samples (DLRM) it processed."""
        nonlocal step
        batches: list[np.ndarray | DlrmBatch] = [  # drawn before timing
            trainer.batch() if trainer is not None else zipf.batch(args.batch) for _ in range(args.steps + 1)
        ]
        wall, cpu = time.perf_counter(), time.process_time()
        for index in range(args.steps):
            step += 1
            # the next batch's ids are known once this step's rows are pulled (the planner has routed it)
            pulled = partial(tiered.prefetch, _ids(batches[index + 1])) if prefetch else None
            batch = batches[index]
            if isinstance(batch, tuple):
                assert trainer is not None
                trainer.step(table, batch, step=step, pulled=pulled)
            else:
                table.pull(batch)
                if pulled is not None:
                    pulled()
                table.push(batch, grad[: batch.shape[0]], step=step)
        rounds.append((time.perf_counter() - wall, time.process_time() - cpu))
        if trainer is not None:
            return args.batch_samples * args.steps
        return sum(_ids(batch).shape[0] for batch in batches[: args.steps])

    rounds: list[tuple[float, float]] = []
    for _ in range(args.warmup_rounds):  # the memory tier fills with the popular rows
        round_of_steps()
    rounds.clear()
    disk_before = dict(getattr(table, "tier_stats", dict)())
    timings.clear()
    ids_per_round = statistics.median(round_of_steps() for _ in range(args.rounds))
    result: dict[str, Any] = {
        "system": args.system,
        "rows": table.num_rows,
        "memory_rows": memory_rows,
        "fill_seconds": fill_seconds,
        "ids_per_second": statistics.median(ids_per_round / wall for wall, _ in rounds),
        "ids_per_cpu_second": statistics.median(ids_per_round / cpu for _, cpu in rounds),
        "round_seconds": [wall for wall, _ in rounds],
        "unique_ids_per_step": (
            ids_per_round / args.steps if trainer is None else statistics.median(trainer.unique_ids)
        ),
        "model": args.model,
        "table_bytes": table.memory_bytes()["total"],
        "baseline_rss": baseline,
        "peak_after_fill": peak_after_fill,
        **_rss(),
    }
    if isinstance(table, TieredTable):
        after = table.tier_stats()
        steps = args.rounds * args.steps
        pulled = (after["pull_hits"] - disk_before["pull_hits"]) + (
            after["pull_misses"] - disk_before["pull_misses"]
        )
        result.update(
            hit_rate=(after["pull_hits"] - disk_before["pull_hits"]) / pulled,
            disk_read_per_step=(after["disk_bytes_read"] - disk_before["disk_bytes_read"]) / steps,
            disk_written_per_step=(after["disk_bytes_written"] - disk_before["disk_bytes_written"]) / steps,
            promotions_per_step=(after["promotions"] - disk_before["promotions"]) / steps,
            demotions_per_step=(after["demotions"] - disk_before["demotions"]) / steps,
            disk_rows=after["disk_rows"],
            disk_bytes=after["disk_bytes"],
            relocations_per_step=(after["relocations"] - disk_before["relocations"]) / steps,
            prefetch_hits_per_step=(after["prefetch_hits"] - disk_before["prefetch_hits"]) / steps,
            seconds_per_step={name: value / steps for name, value in timings.items()},
            step_seconds=sum(wall for wall, _ in rounds) / steps,
        )
    return result


SYSTEMS = ("memory", "tiered", "prefetch")


def _system_command(args: argparse.Namespace, system: str) -> list[str]:
    command = [sys.executable, "-m", "psrec.bench.disk_tier_bench", "system", "--system", system]
    for name in (
        "model",
        "batch_samples",
        "features",
        "dense_precision",
        "threads",
        "rows",
        "dim",
        "batch",
        "steps",
        "rounds",
        "warmup_rounds",
        "exponent",
        "memory_gb",
        "disk_dir",
        "victim_sample",
    ):
        value = getattr(args, name)
        if value is not None:
            command += [f"--{name.replace('_', '-')}", str(value)]
    return command


def run_scale(args: argparse.Namespace) -> None:
    runs: dict[str, list[dict[str, Any]]] = {system: [] for system in args.systems}
    for _ in range(args.repeats):
        for system in args.systems:
            load = os.getloadavg()[0]
            output = subprocess.run(
                _system_command(args, system), check=True, capture_output=True, text=True
            ).stdout
            result = json.loads(output.strip().splitlines()[-1])
            result["load"] = load
            runs[system].append(result)
    gib = 2**30
    first = runs[args.systems[0]][0]
    tiered_runs = [run for system in args.systems if system != "memory" for run in runs[system]]
    memory_rows = tiered_runs[0]["memory_rows"] if tiered_runs else first["memory_rows"]
    loads = [run["load"] for system in args.systems for run in runs[system]]
    unit = "samples" if args.model == "dlrm" else "ids"
    if args.model == "dlrm":
        print(
            f"DLRM training steps: {args.batch_samples:,} samples x {args.features} features a step, "
            f"{args.threads} torch threads, dense {args.dense_precision}; rates are samples/s"
        )
    print(
        f"{args.rows:,} rows x dim {args.dim} (row-wise Adagrad, fp32), budget {args.memory_gb} GiB "
        f"({memory_rows:,} rows in memory), Zipf({args.exponent}), {first['unique_ids_per_step']:,.0f} "
        f"unique ids/step, {args.rounds} rounds x {args.steps} steps per process, {args.repeats} "
        f"interleaved processes per system; load average {min(loads):.1f}-{max(loads):.1f}"
    )
    print(
        f"{'system':8s} {unit + '/s':>10s} {unit[:3] + '/CPU-s':>10s} {'peak RSS':>9s} {'-base':>7s} {'anon':>7s} "
        f"{'file':>7s} {'tables':>7s} {'fill s':>7s}"
    )
    for system in args.systems:
        results = runs[system]
        last = results[-1]
        print(
            f"{system:8s} {statistics.median(r['ids_per_second'] for r in results):10,.0f} "
            f"{statistics.median(r['ids_per_cpu_second'] for r in results):10,.0f} "
            f"{max(r['VmHWM'] for r in results) / gib:8.2f}G "
            f"{max(r['VmHWM'] - r['baseline_rss'] for r in results) / gib:6.2f}G "
            f"{last['RssAnon'] / gib:6.2f}G {last['RssFile'] / gib:6.2f}G {last['table_bytes'] / gib:6.2f}G "
            f"{statistics.median(r['fill_seconds'] for r in results):7.1f}"
        )
    for system in args.systems:
        results = runs[system]
        print(
            f"{system}: {unit}/s per process "
            + " ".join(f"{r['ids_per_second']:,.0f}" for r in results)
            + f"; {unit}/CPU-s "
            + " ".join(f"{r['ids_per_cpu_second']:,.0f}" for r in results)
            + "; load before "
            + " ".join(f"{r['load']:.1f}" for r in results)
            + f"; peak RSS filled {max(r['peak_after_fill'] for r in results) / gib:.2f}G, "
            f"base {max(r['baseline_rss'] for r in results) / gib:.2f}G"
        )
    if "memory" not in runs:
        return
    for system in args.systems:
        if system == "memory":
            continue
        pairs = list(zip(runs["memory"], runs[system], strict=True))
        wall = [run["ids_per_second"] / memory["ids_per_second"] for memory, run in pairs]
        cpu = [run["ids_per_cpu_second"] / memory["ids_per_cpu_second"] for memory, run in pairs]
        print(
            f"{system} / memory: {statistics.median(wall):.2f}x {unit}/s (per repeat "
            + " ".join(f"{value:.2f}" for value in wall)
            + f"), {statistics.median(cpu):.2f}x {unit} per CPU-second (per repeat "
            + " ".join(f"{value:.2f}" for value in cpu)
            + ")"
        )
        results = runs[system]
        middle = results[len(results) // 2]

        def median(name: str, results: list[dict[str, Any]] = results) -> float:
            return statistics.median(r[name] for r in results)

        print(
            f"{system}: hit rate {median('hit_rate'):.3f}; per step: {median('promotions_per_step'):,.0f} "
            f"promotions ({median('prefetch_hits_per_step'):,.0f} from the prefetch), "
            f"{median('demotions_per_step'):,.0f} demotions, {median('relocations_per_step'):,.0f} "
            f"records moved by cleaning, {median('disk_read_per_step') / 2**20:.1f} MiB read, "
            f"{median('disk_written_per_step') / 2**20:.1f} MiB written; file {middle['disk_bytes'] / gib:.2f} "
            f"GiB for {middle['disk_rows']:,} rows on disk"
        )
        parts = ", ".join(
            f"{name} {seconds * 1e3:.1f} ms" for name, seconds in middle["seconds_per_step"].items()
        )
        print(f"{system} step {middle['step_seconds'] * 1e3:.1f} ms (a middle process): {parts}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("part", choices=["policies", "scale", "system"])
    parser.add_argument("--exponent", type=float, default=1.1)
    parser.add_argument(
        "--disk-dir", default=None, help="where the disk tier's files go (default: a temp dir)"
    )
    parser.add_argument("--universe", type=int, default=1_000_000, help="policies: distinct ids")
    parser.add_argument("--memory-fraction", type=float, default=0.1, help="policies: share of ids in memory")
    parser.add_argument("--batch", type=int, default=None, help="draws per batch (deduped)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--rows", type=int, default=4_000_000, help="scale: rows in the table")
    parser.add_argument(
        "--model", choices=["none", "dlrm"], default="none", help="scale: pull + push alone, or DLRM steps"
    )
    parser.add_argument("--batch-samples", type=int, default=4096, help="scale --model dlrm: samples a step")
    parser.add_argument(
        "--dense-precision", choices=["fp32", "bf16"], default="fp32", help="scale --model dlrm"
    )
    parser.add_argument("--features", type=int, default=26, help="scale --model dlrm: sparse features")
    parser.add_argument("--threads", type=int, default=2, help="scale --model dlrm: torch threads")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--memory-gb", type=float, default=0.2, help="scale: the tiered table's budget")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup-rounds", type=int, default=1, help="scale: untimed rounds first")
    parser.add_argument("--system", choices=SYSTEMS)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="scale: systems")
    parser.add_argument("--repeats", type=int, default=3, help="scale: interleaved processes per system")
    parser.add_argument(
        "--samples",
        type=int,
        nargs="*",
        default=[4, 8, 16],
        help="policies: sampled LFU, candidates per row demoted (besides the exact ranking)",
    )
    parser.add_argument(
        "--victim-sample", type=int, default=None, help="scale: the tiered table's victim_sample"
    )
    parser.add_argument(
        "--half-lives",
        type=float,
        nargs="+",
        default=[10, 50, 1000],
        help="policies: lfu_aging half-lives (steps)",
    )
    args = parser.parse_args()
    if args.part == "policies":
        args.batch = args.batch or 16_384
        args.steps = args.steps or 200
        run_policies(args)
        return
    args.batch = args.batch or 65_536
    args.steps = args.steps or 20
    if args.part == "scale":
        run_scale(args)
        return
    with tempfile.TemporaryDirectory(dir=args.disk_dir) as directory:
        args.disk_dir = directory
        print(json.dumps(run_system(args), default=float))


if __name__ == "__main__":
    main()
