"""The psrec systems of `psrec bench`: (c) in-process and (d) on Ray, both through `train()`.

The run config is built in code (`bench_config`) from the `Workload`: DLRM 13-512-256-D / 512-256-1,
row-wise Adagrad tables, Adam for the MLPs, batch 4096, checkpoints off. Steps run in chunks of
`warmup_steps` (the driver's `log_every_steps`); the bench stamps the clock when the driver reports
progress after each chunk, and the timed window runs from the report of the first (warm-up) chunk to
the last report (with `training.compile`, the first, untimed chunk holds the compile; every timed
batch is full, so none recompiles). The window holds everything psrec does between those steps, the
driver's work between chunks included (absorbing results, metrics, the report itself); only the
bench's own bookkeeping in the progress callback is taken out of it. `timed_train_steps_seconds`
keeps the driver's own training time of the window (its `runtime.train_steps` calls alone).
psrec reads and hashes its batches inside that time (the reader's prefetch thread), which the
PyTorch-only systems do not: they load their batches before timing. The `*-cached` systems compare
like for like: `training.cache_data` with two epochs, the first untimed, so the timed steps train
from rows already in memory (decoded and hashed), as the baselines do; batching and routing still
run in the timed steps.

Ray runs start their own embedded cluster (4 logical CPUs, so a 2x2 layout fits on 2 cores) and
measure peak RSS as the driver's plus every trainer and shard actor's peak (VmHWM, polled). A layout
with `nodes` > 1 starts a local cluster of that many Ray nodes instead (`psrec.testing.local_cluster`,
2 logical CPUs each), joins it as `psrec train` joins `ps.address`, and spreads the trainers and the
shards evenly over the nodes: every node offers ceil(N / nodes) units of `TRAINER_RESOURCE` and
ceil(M / nodes) of `SHARD_RESOURCE`, which `ps.placement` pins each kind of actor to. The result's
`placement` is the run's placement report (which node each actor ran on).
`seconds_to_first_step` is the run's time from the `train()` call to the end of its first step
(`summary.json`'s ``startup``): for Ray runs, the actors' start without the cluster's own.

With `Workload.device` "cuda" the trainers train on the GPU (``training.device: cuda``; Ray trainers
ask for one GPU each), except Ray layouts with more trainers than the machine has GPUs (NCCL needs a
GPU per trainer), which stay on the CPU; the result's ``device`` says which (`psrec_device`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any

from psrec.bench.workload import (
    BOTTOM_HIDDEN_SIZES,
    TOP_HIDDEN_SIZES,
    Workload,
    bench_schema,
    peak_rss_bytes,
    process_cpu_seconds,
    process_peak_rss,
    set_threads,
    synthetic_config,
)
from psrec.data.synth import CRITEO_SPARSE

logger = logging.getLogger(__name__)

ACTOR_NAMES = ("ray::ShardActor", "ray::TrainerWorker")
# Ray's own processes (executable names): objects move between nodes through the raylets.
RAY_DAEMONS = ("raylet", "gcs_server")
# Custom resources every node of a multi-node bench cluster offers; `ps.placement` pins actors to them.
TRAINER_RESOURCE = "psrec_trainer"
SHARD_RESOURCE = "psrec_shard"
CPUS_PER_NODE = 2
SPREAD_OVER_NODES = {
    "shards": "spread",
    "trainers": "spread",
    "shard_node_resource": SHARD_RESOURCE,
    "trainer_node_resource": TRAINER_RESOURCE,
}


@dataclass(frozen=True)
class PsrecLayout:
    """Where a psrec bench system runs: the runtime ("local" or "ray"), its processes and threads."""

    runtime: str = "local"
    _: KW_ONLY
    num_trainers: int = 1
    num_shards: int = 2
    trainer_threads: int | None = None  # None: the workload's thread count
    shard_threads: int = 1
    omp_passive: bool = False  # Ray runs only: the actors get OMP_WAIT_POLICY=PASSIVE
    shared_memory: bool = True  # Ray runs only: ps.shared_memory (False: arrays via the object store)
    nodes: int = 1  # Ray runs only: > 1 runs on a local cluster of that many nodes, actors spread

    def node_resources(self) -> dict[str, float]:
        """The custom resources each node of a multi-node layout offers (trainers and shards evenly)."""
        return {
            TRAINER_RESOURCE: float(math.ceil(self.num_trainers / self.nodes)),
            SHARD_RESOURCE: float(math.ceil(self.num_shards / self.nodes)),
        }


@dataclass(frozen=True, kw_only=True)
class PsrecOptions:
    """What a psrec bench system trains with: precisions, compile, table reservation, data reading.

    With `cache_data`, a first (untimed) epoch reads the data into `training.cache_data`'s cache and
    the warm-up + timed steps follow in the second epoch. With `prepared`, psrec reads the data as
    `psrec data convert --prepared` writes it (ids hashed, dense values transformed; written untimed).
    Without `reserve`, the tables get no `expected_rows` and grow as rows arrive; `populate` backs
    the reserved rows up front.
    """

    dense_precision: str = "fp32"
    compile_model: bool = False
    wire_precision: str = "fp32"
    row_precision: str = "fp32"
    reserve: bool = True
    populate: bool = True
    cache_data: bool = False
    prepared: bool = False


def bench_config(
    workload: Workload,
    run_dir: str,
    layout: PsrecLayout,
    options: PsrecOptions | None = None,
    *,
    sources: dict[str, Any] | None = None,
    address: str | None = None,
) -> dict[str, Any]:
    """The psrec run config (a plain dict for `parse_config`) of this workload (see `PsrecOptions`).

    The Criteo-shaped workload reads `data.synthetic` (as `psrec train` generates it); a multi-hot
    one reads `sources` (`prepare_sources`) with the schema of `bench_schema`. `address`: the Ray
    cluster to join (`ps.address`); a layout on several nodes also gets the `ps.placement` that
    spreads trainers and shards over them.
    """
    options = options or PsrecOptions()
    if workload.multi_hot_features:
        if sources is None:
            raise ValueError(
                "a multi-hot workload needs its data sources (psrec.bench.workload.prepare_sources)"
            )
        if options.prepared:
            raise ValueError("the -prepared psrec systems run the Criteo-shaped workload only, not multi-hot")
        data: dict[str, Any] = {
            "schema": bench_schema(workload).model_dump(mode="json"),
            **{split: source for split, source in sources.items() if split in ("train", "validation")},
        }
    else:
        data = {"synthetic": {**synthetic_config(workload), "prepared": options.prepared}}
    chunk = max(1, workload.warmup_steps)
    timed_chunks = -(-workload.steps // chunk)
    steps = chunk * (1 + timed_chunks) if workload.warmup_steps else workload.steps
    first_epoch = epoch_steps(workload) if options.cache_data else 0
    trainer_threads = layout.trainer_threads or workload.threads
    device = psrec_device(workload, layout)
    gpus = {"num_gpus": 1} if device == "cuda" and layout.runtime == "ray" else {}
    table = {
        "dim": workload.dim,
        "optimizer": {"name": "rowwise_adagrad", "lr": workload.sparse_lr},
        "initializer": {"kind": "uniform", "scale": workload.init_scale},
        "precision": options.row_precision,
        "populate": options.populate,
    }
    # The fixed-size systems allocate exactly these rows up front; psrec gets the same sizes as a
    # hint (`expected_rows`: shards reserve their share), its tables still grow past them if needed.
    tables = (
        {
            name: {**table, "expected_rows": rows}
            for name, rows in zip(
                [*CRITEO_SPARSE, *workload.multi_hot_names], workload.table_sizes(), strict=True
            )
        }
        if options.reserve
        else {}
    )
    return {
        "run_dir": run_dir,
        "data": data,
        "model": {
            "name": "dlrm",
            "bottom_hidden_sizes": list(BOTTOM_HIDDEN_SIZES),
            "top_hidden_sizes": list(TOP_HIDDEN_SIZES),
        },
        "embedding": {"default": table, "tables": tables},
        "training": {
            "batch_size": workload.batch_size,
            "max_steps": first_epoch + steps,
            "epochs": 2 if options.cache_data else 1,
            "cache_data": options.cache_data,
            "log_every_steps": chunk,
            "dense_optimizer": {"name": "adam", "lr": workload.dense_lr},
            "dense_precision": options.dense_precision,
            "compile": options.compile_model,
            "seed": workload.seed,
            "device": device,
        },
        "ps": {
            "runtime": layout.runtime,
            "num_trainers": layout.num_trainers,
            "num_shards": layout.num_shards,
            "mode": "sync",
            "wire_precision": options.wire_precision,
            "shared_memory": layout.shared_memory,
            "trainer_resources": {"num_cpus": 1, "threads": trainer_threads, **gpus},
            "shard_resources": {"num_cpus": 0.5, "threads": layout.shard_threads},
            "address": address,
            **({"placement": SPREAD_OVER_NODES} if layout.nodes > 1 else {}),
        },
        "checkpoint": {"enabled": False},
    }


def psrec_device(workload: Workload, layout: PsrecLayout) -> str:
    """Where a psrec system's trainers train: the workload's device, but a Ray layout with more
    trainers than GPUs stays on the CPU (see the module docstring)."""
    if workload.device != "cuda":
        return "cpu"
    import torch

    if layout.runtime == "ray" and layout.num_trainers > torch.cuda.device_count():
        return "cpu"
    return "cuda"


def epoch_steps(workload: Workload) -> int:
    return -(-workload.train_rows // workload.batch_size)


class ProgressClock:
    """The bench's progress callback: stamps each driver report with the wall clock and CPU seconds.

    `clock` and `cpu` are taken when the report arrives, less the time and CPU this callback spent on
    earlier reports (reading the actors' CPU time scans /proc), so that the bench's bookkeeping is
    not charged to psrec while all of the driver's own work is. `cpu` adds the psrec actors' CPU
    seconds when `actors` is set (Ray runs); `ray_daemons_cpu` is then the CPU seconds of Ray's own
    processes under this one (raylets and GCS: not in `cpu`, as Ray's share of the machine).
    `peak_rss_bytes` is this process's peak RSS at the latest report: the driver reports after each
    chunk of steps and evaluates after it, so in process it is the peak of training alone.
    """

    def __init__(self, *, actors: bool = False) -> None:
        self.actors = actors
        self.reports: list[dict[str, Any]] = []
        self.peak_rss_bytes = 0
        self._own_seconds = 0.0
        self._own_cpu = 0.0

    def __call__(self, report: dict[str, Any]) -> None:
        arrived, cpu = time.perf_counter(), time.process_time()
        actors = sum(process_cpu_seconds(pid) for pid in _actor_pids()) if self.actors else 0.0
        stamps = {"clock": arrived - self._own_seconds, "cpu": cpu + actors - self._own_cpu}
        if self.actors:
            stamps["ray_daemons_cpu"] = sum(process_cpu_seconds(pid) for pid in _ray_daemon_pids())
        self.reports.append({**report, **stamps})
        self.peak_rss_bytes = peak_rss_bytes()
        self._own_seconds += time.perf_counter() - arrived
        self._own_cpu += time.process_time() - cpu


def _timed_rate(reports: list[dict[str, Any]], has_warmup: bool, from_epoch: int = 0) -> dict[str, Any]:
    """Rate of the chunks after the first (warm-up) one, from cumulative progress reports.

    Each report carries the driver's cumulative samples, steps, phase seconds and samples/s (hence
    its training seconds: `runtime.train_steps` alone) and, added by the bench (`ProgressClock`),
    the wall clock (`clock`) and the CPU seconds used so far by this process and the psrec actors
    (`cpu`) when it arrived. The timed seconds are wall-clock seconds between two reports, so they
    include the driver's work between chunks. Reports of epochs before `from_epoch` are left out.
    Without a warm-up the first kept chunk is timed too: its start is estimated from its training
    seconds, and its CPU seconds are known only from an earlier report.
    """
    kept = next((i for i, report in enumerate(reports) if report.get("epoch", 0) >= from_epoch), 0)

    def trained(report: dict[str, Any]) -> float:
        return (
            float(report["samples"]) / max(report["samples_per_second"], 1e-12) if report["samples"] else 0.0
        )

    timed = reports[kept:]
    if has_warmup and len(timed) > 1:
        start = timed[0]
    else:
        start = reports[kept - 1] if kept else {"samples": 0, "step": 0, "samples_per_second": 1.0}
        start = {**start, "clock": timed[0]["clock"] - (trained(timed[0]) - trained(start))}
        start.setdefault("cpu", None)
    if start["cpu"] is None and len(timed) > 1:  # no report before the first chunk: CPU after it
        cpu_samples, cpu = timed[-1]["samples"] - timed[0]["samples"], timed[-1]["cpu"] - timed[0]["cpu"]
    elif start["cpu"] is None:  # one chunk in all: CPU since the process started
        cpu_samples, cpu = timed[0]["samples"], timed[0]["cpu"]
    else:
        cpu_samples, cpu = timed[-1]["samples"] - start["samples"], timed[-1]["cpu"] - start["cpu"]
    samples, seconds = timed[-1]["samples"] - start["samples"], timed[-1]["clock"] - start["clock"]
    daemons: dict[str, float] = {}
    if start.get("ray_daemons_cpu") is not None and "ray_daemons_cpu" in timed[-1]:
        daemon_seconds = timed[-1]["ray_daemons_cpu"] - start["ray_daemons_cpu"]
        daemons["ray_daemons_cpu_seconds_per_sample"] = daemon_seconds / max(samples, 1)
    phases: dict[str, float] = timed[-1].get("phase_seconds", {})
    before: dict[str, float] = start.get("phase_seconds", {})
    window = [start, *(timed[1:] if start is timed[0] else timed)]
    chunk_rates = [
        (b["samples"] - a["samples"]) / max(b["clock"] - a["clock"], 1e-12)
        for a, b in zip(window, window[1:], strict=False)
    ]
    return {
        "samples_per_second": samples / max(seconds, 1e-12),
        "samples_per_cpu_second": cpu_samples / max(cpu, 1e-9),
        "best_step_samples_per_second": max(chunk_rates),
        "timed_seconds": seconds,
        "timed_train_steps_seconds": trained(timed[-1]) - trained(start),
        "timed_samples": samples,
        "timed_steps": timed[-1]["step"] - start["step"],
        "timed_phase_seconds": {phase: value - before.get(phase, 0.0) for phase, value in phases.items()},
        **daemons,
    }


def _actor_pids() -> list[int]:
    """psrec actor processes started under this process (other jobs' Ray clusters are not counted)."""
    return _processes_under_me(lambda title: title.startswith(ACTOR_NAMES))


def _ray_daemon_pids() -> list[int]:
    """The raylets and GCS of the Ray cluster this process started (embedded or local multi-node)."""
    return _processes_under_me(lambda title: Path(title).name in RAY_DAEMONS)


def _processes_under_me(wanted: Callable[[str], bool]) -> list[int]:
    """Descendants of this process whose command's first word passes `wanted`."""
    parents: dict[int, int] = {}
    titles: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            titles[int(entry.name)] = (
                (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            )
        except OSError:
            continue
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    me = os.getpid()

    def mine(pid: int) -> bool:
        for _ in range(16):
            pid = parents.get(pid, 0)
            if pid == me:
                return True
            if pid <= 1:
                return False
        return False

    return [pid for pid, title in titles.items() if wanted(title) and mine(pid)]


class _ActorRssPoller:
    """Polls the peak RSS (VmHWM) of this machine's psrec Ray actors while a run goes on."""

    def __init__(self, interval: float = 0.25) -> None:
        self.interval = interval
        self.peaks: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="bench-rss")

    def __enter__(self) -> _ActorRssPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def poll(self) -> None:
        for pid in _actor_pids():
            self.peaks[pid] = max(self.peaks.get(pid, 0), process_peak_rss(pid))


def run_psrec(
    workload: Workload,
    sources: dict[str, Any],
    *,
    layout: PsrecLayout | None = None,
    options: PsrecOptions | None = None,
) -> dict[str, Any]:
    """Train the workload with psrec's `train()`; returns the bench result plus psrec's profile.

    Defaults: the in-process runtime with 2 shards (`PsrecLayout()`), fp32 throughout (`PsrecOptions()`).
    """
    from psrec.config import parse_config
    from psrec.train.loop import train

    layout = layout or PsrecLayout()
    options = options or PsrecOptions()
    runtime = layout.runtime
    set_threads(layout.trainer_threads or workload.threads)
    progress = ProgressClock(actors=runtime == "ray")

    with tempfile.TemporaryDirectory(prefix="psrec-bench-") as tmp:
        run_dir = str(Path(tmp) / "run")
        if runtime == "ray":
            with _ray_cluster(layout, Path(tmp) / "cluster") as address:
                config = parse_config(
                    bench_config(workload, run_dir, layout, options, sources=sources, address=address),
                    source="<bench>",
                )
                started = time.perf_counter()
                with _ActorRssPoller() as poller:
                    summary = train(config, progress=progress, resume=False)
                    poller.poll()
            actors_rss = sum(poller.peaks.values())
            logger.debug("ray run took %.1f s", time.perf_counter() - started)
        else:
            config = parse_config(
                bench_config(workload, run_dir, layout, options, sources=sources), source="<bench>"
            )
            summary = train(config, progress=progress, resume=False)
            actors_rss = 0
    result: dict[str, Any] = _timed_rate(
        progress.reports, workload.warmup_steps > 0, from_epoch=int(options.cache_data)
    )
    result.update(
        auc=summary.get("validation", {}).get("auc"),
        peak_rss_bytes=peak_rss_bytes() + actors_rss,
        steps=summary["steps"],
        samples=summary["samples"],
        train_seconds=summary["train_seconds"],
        phase_seconds=summary["phase_seconds"],
        bytes_pulled_per_sample=summary["bytes_pulled_per_sample"],
        bytes_pushed_per_sample=summary["bytes_pushed_per_sample"],
        num_trainers=layout.num_trainers,
        num_shards=layout.num_shards,
        device=config.training.device,
        # from the train() call; a Ray system's cluster is up before it (started above)
        seconds_to_first_step=summary["startup"]["seconds_from_train_call"],
    )
    if runtime == "local":  # a Ray run trains in its actors: their peaks are polled, not split by phase
        result["training_peak_rss_bytes"] = progress.peak_rss_bytes
    if summary.get("placement"):
        result["placement"] = summary["placement"]
    return result


@contextlib.contextmanager
def _ray_cluster(layout: PsrecLayout, root: Path) -> Iterator[str | None]:
    """Ray for a run of `layout`; yields the address to join (None: this process is connected already).

    One node: the embedded cluster as `psrec train` starts it (loopback only, token auth), unless
    this process is connected to a cluster already (tests bring their own). Several nodes: a
    `LocalRayCluster` under `root`, joined as `psrec train` joins `ps.address`, stopped afterwards.
    """
    import ray

    from psrec.cluster.start import start_ray, stop_ray

    if layout.nodes == 1:
        owns_ray = not ray.is_initialized()
        if owns_ray:
            start_ray(
                None,
                num_cpus=4,
                log_to_driver=False,
                omp_passive=layout.omp_passive,
                actors=layout.num_trainers + layout.num_shards,
            )
        try:
            yield None
        finally:
            if owns_ray:
                stop_ray()
        return
    if ray.is_initialized():
        raise RuntimeError(
            f"a layout on {layout.nodes} nodes starts its own cluster: call ray.shutdown() first"
        )
    from psrec.cluster.start import token_path, write_private_token
    from psrec.testing.local_cluster import LocalRayCluster

    token = token_path() or root / "auth_token"  # the token this process authenticates with
    write_private_token(token)
    cluster = LocalRayCluster(
        root, nodes_wanted=layout.nodes, cpus=CPUS_PER_NODE, resources=layout.node_resources(), token=token
    )
    saved = {name: os.environ.get(name) for name in cluster.client_environment()}
    try:
        cluster.start()
        os.environ.update(cluster.client_environment())
        start_ray(cluster.address, log_to_driver=False, omp_passive=layout.omp_passive)
        yield cluster.address
    finally:
        ray.shutdown()
        cluster.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
