"""Where the shards and trainers run: in this process (`LocalRuntime`) or as Ray actors (`RayRuntime`).

Both expose the same driver-side calls, so the training loop in `psrec.train.loop` does not know
which one it drives. The Ray runtime starts an embedded single-machine cluster on loopback when no
address is given (never attaching to a cluster that happens to run on the host), or joins the
cluster at `ps.address`. `shutdown()` kills every actor it started, on success, error or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Protocol

import numpy as np

from psrec.config import ConfigError, RunConfig
from psrec.ps.shard import ParameterShard
from psrec.train import builders
from psrec.train.worker import ChunkResult, TrainerWorker

logger = logging.getLogger(__name__)


class Runtime(Protocol):
    def start_epoch(self, epoch: int) -> None: ...

    def train_steps(self, max_steps: int) -> list[ChunkResult]: ...

    def evaluate(self, split: str) -> tuple[np.ndarray, np.ndarray]: ...

    def scale_learning_rates(self, factor: float) -> None: ...

    def save_snapshot(self, tag: str) -> None: ...

    def restore_snapshot(self, tag: str) -> None: ...

    def table_stats(self) -> dict[str, dict[str, int]]: ...

    def table_rows(self) -> dict[str, tuple[np.ndarray, np.ndarray]]: ...

    def dense_states(self) -> list[dict[str, Any]]: ...

    def shutdown(self) -> None: ...


def _sum_stats(per_shard: list[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    total: dict[str, dict[str, int]] = {}
    for stats in per_shard:
        for table, values in stats.items():
            into = total.setdefault(table, {})
            for key, value in values.items():
                into[key] = into.get(key, 0) + int(value)
    return total


def _merge_rows(
    per_shard: list[dict[str, tuple[np.ndarray, np.ndarray]]],
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per-shard (ids, rows) -> one (ids, rows) per table, sorted by id."""
    merged = {}
    for table in per_shard[0]:
        ids = np.concatenate([rows[table][0] for rows in per_shard])
        values = np.concatenate([rows[table][1] for rows in per_shard])
        order = np.argsort(ids)
        merged[table] = (ids[order], values[order])
    return merged


class LocalRuntime:
    """Shards and one trainer in this process: no Ray (debugging, unit tests, the in-process bench)."""

    def __init__(self, config: RunConfig, *, base_dir: str, data_sources: dict[str, dict[str, Any]]) -> None:
        from psrec.ps.actors import set_thread_counts

        set_thread_counts(config.ps.trainer_resources.threads)
        self.config = config
        self.shards = [
            ParameterShard(i, builders.build_tables(config), num_trainers=1, mode=config.ps.mode)
            for i in range(config.ps.num_shards)
        ]
        self.trainer = TrainerWorker(
            config.model_dump(mode="json", by_alias=True),
            0,
            list(self.shards),
            base_dir=base_dir,
            data_sources=data_sources,
        )
        self._lr_factor = 1.0

    def start_epoch(self, epoch: int) -> None:
        self.trainer.start_epoch(epoch)

    def train_steps(self, max_steps: int) -> list[ChunkResult]:
        return [self.trainer.train_steps(max_steps)]

    def evaluate(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        return self.trainer.evaluate(split)

    def scale_learning_rates(self, factor: float) -> None:
        self._lr_factor *= factor
        self.trainer.set_dense_learning_rate(factor)
        for shard in self.shards:
            for name, table in shard.tables.items():
                table.set_learning_rate(_base_lr(self.config, name) * self._lr_factor)

    def save_snapshot(self, tag: str) -> None:
        self.trainer.save_snapshot(tag)
        for shard in self.shards:
            shard.save_snapshot(tag)

    def restore_snapshot(self, tag: str) -> None:
        self.trainer.restore_snapshot(tag)
        for shard in self.shards:
            shard.restore_snapshot(tag)

    def table_stats(self) -> dict[str, dict[str, int]]:
        return _sum_stats([shard.stats() for shard in self.shards])

    def table_rows(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        return _merge_rows([shard.table_rows() for shard in self.shards])

    def dense_states(self) -> list[dict[str, Any]]:
        return [self.trainer.dense_state()]

    def shutdown(self) -> None:
        self.trainer.shutdown()


def _base_lr(config: RunConfig, table: str) -> float:
    return builders.table_specs(config)[table].optimizer.lr


def start_ray(address: str | None, *, num_cpus: int | None = None) -> None:
    """Start an embedded loopback cluster (address None) or join `address`; clear error if unreachable."""
    import ray

    if ray.is_initialized():
        return
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True, "configure_logging": False}
    try:
        if address is None:
            ray.init(address="local", num_cpus=num_cpus, _node_ip_address="127.0.0.1", **kwargs)
        else:
            ray.init(address=address, **kwargs)
    except (ConnectionError, TimeoutError, RuntimeError, ValueError) as error:
        where = "an embedded local cluster" if address is None else f"the Ray cluster at {address!r}"
        raise ConfigError(
            f"ps.address: could not start or join {where}: {error}. Check the address (ray status on the "
            "head node prints it) or leave ps.address empty to run on this machine."
        ) from None


class RayRuntime:
    """Shards and trainers as Ray actors; dense allreduce through torch.distributed among the trainers."""

    def __init__(self, config: RunConfig, *, base_dir: str, data_sources: dict[str, dict[str, Any]]) -> None:
        import ray

        from psrec.ps.actors import ShardActor

        self.config = config
        self._owns_ray = not ray.is_initialized()
        start_ray(config.ps.address)
        ps = config.ps
        config_dict = config.model_dump(mode="json", by_alias=True)
        self._lr_factor = 1.0
        shard_class = ray.remote(ShardActor)
        trainer_class = ray.remote(TrainerWorker)
        self.shards = [
            shard_class.options(**_resources(ps.shard_resources), name=None).remote(
                i, config_dict, threads=ps.shard_resources.threads
            )
            for i in range(ps.num_shards)
        ]
        self.trainers = [
            trainer_class.options(**_resources(ps.trainer_resources)).remote(
                config_dict, i, self.shards, base_dir=base_dir, data_sources=data_sources
            )
            for i in range(ps.num_trainers)
        ]
        try:
            ray.get(
                [s.pid.remote() for s in self.shards] + [t.pid.remote() for t in self.trainers], timeout=300
            )
            if ps.num_trainers > 1:
                address = ray.get(self.trainers[0].node_address.remote())
                port = ray.get(self.trainers[0].free_port.remote())
                ray.get([t.init_process_group.remote(address, port) for t in self.trainers])
        except BaseException:
            self.shutdown()
            raise

    def _all(self, method: str, *args: Any) -> list[Any]:
        import ray

        return ray.get([getattr(t, method).remote(*args) for t in self.trainers])

    def start_epoch(self, epoch: int) -> None:
        self._all("start_epoch", epoch)

    def train_steps(self, max_steps: int) -> list[ChunkResult]:
        return self._all("train_steps", max_steps)

    def evaluate(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        parts = self._all("evaluate", split)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def scale_learning_rates(self, factor: float) -> None:
        import ray

        self._lr_factor *= factor
        self._all("set_dense_learning_rate", factor)
        calls = []
        for name in builders.table_specs(self.config):
            lr = _base_lr(self.config, name) * self._lr_factor
            calls += [s.call.remote("set_learning_rate", lr, [name]) for s in self.shards]
        ray.get(calls)

    def save_snapshot(self, tag: str) -> None:
        import ray

        ray.get(
            [t.save_snapshot.remote(tag) for t in self.trainers]
            + [s.call.remote("save_snapshot", tag) for s in self.shards]
        )

    def restore_snapshot(self, tag: str) -> None:
        import ray

        ray.get(
            [t.restore_snapshot.remote(tag) for t in self.trainers]
            + [s.call.remote("restore_snapshot", tag) for s in self.shards]
        )

    def table_stats(self) -> dict[str, dict[str, int]]:
        import ray

        return _sum_stats(ray.get([s.call.remote("stats") for s in self.shards]))

    def table_rows(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        import ray

        return _merge_rows(ray.get([s.call.remote("table_rows") for s in self.shards]))

    def dense_states(self) -> list[dict[str, Any]]:
        return self._all("dense_state")

    def shutdown(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        for trainer in getattr(self, "trainers", []):
            with contextlib.suppress(Exception):  # best effort: the actor is killed next
                ray.get(trainer.shutdown.remote(), timeout=10)
        for actor in [*getattr(self, "trainers", []), *getattr(self, "shards", [])]:
            ray.kill(actor)
        if self._owns_ray:
            ray.shutdown()


def _resources(resources: Any) -> dict[str, Any]:
    options: dict[str, Any] = {"num_cpus": resources.num_cpus, "num_gpus": resources.num_gpus}
    if resources.memory_gb is not None:
        options["memory"] = int(resources.memory_gb * 2**30)
    return options


def make_runtime(config: RunConfig, *, base_dir: str, data_sources: dict[str, dict[str, Any]]) -> Runtime:
    if config.ps.runtime == "local":
        return LocalRuntime(config, base_dir=base_dir, data_sources=data_sources)
    return RayRuntime(config, base_dir=base_dir, data_sources=data_sources)
