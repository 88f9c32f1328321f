"""Where the shards and trainers run: in this process (`LocalRuntime`) or as Ray actors (`RayRuntime`).

Both expose the same driver-side calls, so the training loop in `psrec.train.loop` does not know
which one it drives. The Ray runtime starts an embedded single-machine cluster on loopback when no
address is given (never attaching to a cluster that happens to run on the host), or joins the
cluster at `ps.address`. `shutdown()` kills every actor it started, on success, error or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Protocol

import numpy as np

from psrec.allocator import malloc_environment
from psrec.config import ConfigError, RunConfig
from psrec.ps.shard import ParameterShard
from psrec.train import builders, checkpoint
from psrec.train.worker import ChunkResult, TrainerWorker

logger = logging.getLogger(__name__)


class Runtime(Protocol):
    def start_epoch(self, epoch: int) -> None: ...

    def train_steps(self, max_steps: int) -> list[ChunkResult]: ...

    def epoch_steps(self) -> int | None: ...

    def evaluate(self, split: str) -> dict[str, np.ndarray]: ...

    def scale_learning_rates(self, factor: float, *, dense: bool = True) -> None: ...

    def save_snapshot(self, tag: str) -> None: ...

    def restore_snapshot(self, tag: str) -> None: ...

    def table_stats(self) -> dict[str, dict[str, int]]: ...

    def table_rows(self) -> dict[str, tuple[np.ndarray, np.ndarray]]: ...

    def dense_states(self) -> list[dict[str, Any]]: ...

    def save_checkpoint(self, run_dir: str, *, kind: str, parent: Any, extra: dict[str, Any]) -> Any: ...

    def restore(self, chain: list[Any]) -> dict[str, Any]: ...

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
            ParameterShard(
                i,
                builders.build_tables(config, partitions=config.ps.num_shards),
                num_trainers=1,
                mode=config.ps.mode,
            )
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

    def epoch_steps(self) -> int | None:
        return self.trainer.epoch_steps()

    def evaluate(self, split: str) -> dict[str, np.ndarray]:
        return self.trainer.evaluate(split)

    def scale_learning_rates(self, factor: float, *, dense: bool = True) -> None:
        self._lr_factor *= factor
        if dense:
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

    def save_checkpoint(self, run_dir: str, *, kind: str, parent: Any, extra: dict[str, Any]) -> Any:
        from psrec.ps.actors import write_shard_checkpoint

        pending = checkpoint.begin_checkpoint(run_dir, step=self.trainer.step, kind=kind)  # type: ignore[arg-type]
        try:
            files = {s.shard_index: write_shard_checkpoint(s, pending, kind) for s in self.shards}
            ref = _commit(
                self.config,
                pending,
                files,
                self.trainer.dense_checkpoint(),
                [self.trainer.checkpoint_state()],
                extra,
                parent,
            )
        except BaseException:
            checkpoint.abort_checkpoint(pending)
            raise
        for shard in self.shards:
            shard.confirm_checkpoint()
        return ref

    def restore(self, chain: list[Any]) -> dict[str, Any]:
        from psrec.ps.actors import restore_shard

        data = checkpoint.load_checkpoint(chain[-1], shards=[])
        for shard in self.shards:
            restore_shard(shard, chain, data.step)
        self.trainer.restore(data.dense, data.trainers[0])
        self._lr_factor = 1.0
        self.scale_learning_rates(float(data.extra.get("lr_factor", 1.0)), dense=False)
        return {"step": data.step, **data.trainers[0], "extra": data.extra}

    def shutdown(self) -> None:
        self.trainer.shutdown()


def _commit(
    config: RunConfig,
    pending: Any,
    files: dict[int, Any],
    dense: dict[str, Any],
    trainers: list[dict[str, Any]],
    extra: dict[str, Any],
    parent: Any,
) -> Any:
    return checkpoint.commit_checkpoint(
        pending,
        shard_files=files,
        dense=dense,
        trainers=trainers,
        extra=extra,
        config=config.fingerprint_dict(),
        bucket_map=builders.bucket_map(config).tolist(),
        parent=parent,
    )


def _base_lr(config: RunConfig, table: str) -> float:
    return builders.table_specs(config)[table].optimizer.lr


def required_cpus(config: RunConfig) -> float:
    ps = config.ps
    shards = 0 if ps.strategy == "collective" else ps.num_shards
    return ps.num_trainers * ps.trainer_resources.num_cpus + shards * ps.shard_resources.num_cpus


def start_ray(address: str | None, *, num_cpus: int | None = None) -> None:
    """Start an embedded loopback cluster (address None) or join `address`; clear error if unreachable."""
    import ray

    if ray.is_initialized():
        return
    if address is not None:
        check_reachable(address)
    kwargs: dict[str, Any] = {
        "include_dashboard": False,
        "log_to_driver": True,
        "configure_logging": False,
        # Actors share cores: OpenMP waiters must sleep, not spin (see psrec.cli.main).
        "runtime_env": {
            "env_vars": {
                "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
                **malloc_environment(),
            }
        },
    }
    try:
        if address is None:
            # Ray starts workers at nice 15; on a shared machine the trainer then starves.
            os.environ.setdefault("RAY_worker_niceness", "0")
            ray.init(address="local", num_cpus=num_cpus, _node_ip_address="127.0.0.1", **kwargs)
        else:
            ray.init(address=address, **kwargs)
    except (ConnectionError, TimeoutError, RuntimeError, ValueError) as error:
        where = "an embedded local cluster" if address is None else f"the Ray cluster at {address!r}"
        raise ConfigError(
            f"ps.address: could not start or join {where}: {error}. Check the address (ray status on the "
            "head node prints it) or leave ps.address empty to run on this machine."
        ) from None


def check_reachable(address: str, *, timeout: float = 5.0) -> None:
    """Fail fast on a Ray address that does not answer (ray.init itself retries for minutes)."""
    import socket

    if address in ("auto", "local") or "://" in address:
        return  # "auto" reads the local cluster file; client addresses are checked by ray.init
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(
            f"ps.address {address!r}: expected HOST:PORT of the Ray head node (e.g. 10.0.0.5:6379)"
        )
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as error:
        raise ConfigError(
            f"ps.address {address!r} does not answer ({error}). Is the Ray head running there "
            "(`ray start --head` prints its address)? Leave ps.address empty to run on this machine."
        ) from None


class RayRuntime:
    """Shards and trainers as Ray actors; dense allreduce through torch.distributed among the trainers.

    Failure handling (`recover`): trainers are all replaced (a survivor may be blocked in an allreduce
    with the dead one), dead shards are re-created, and every shard and trainer is restored from the
    given checkpoint chain, so the whole job continues from the last committed checkpoint.
    """

    def __init__(self, config: RunConfig, *, base_dir: str, data_sources: dict[str, dict[str, Any]]) -> None:
        import ray

        from psrec.ps.actors import ShardActor

        self.config = config
        if config.ps.strategy == "collective":
            from psrec.train.builders import collective_placement

            collective_placement(config, config.ps.num_trainers)  # a plan that does not fit fails here
        self._owns_ray = not ray.is_initialized()
        import math
        import os

        # The embedded cluster offers at least the CPUs the config asks for: logical CPUs are only
        # scheduling tokens, and every process's thread count is set explicitly.
        start_ray(config.ps.address, num_cpus=max(os.cpu_count() or 1, math.ceil(required_cpus(config))))
        available = ray.cluster_resources().get("CPU", 0.0)
        if required_cpus(config) > available:
            raise ConfigError(
                f"ps: {config.ps.num_trainers} trainers x {config.ps.trainer_resources.num_cpus} CPU + "
                f"{config.ps.num_shards} shards x {config.ps.shard_resources.num_cpus} CPU = {required_cpus(config)} "
                f"CPUs, but the Ray cluster has {available}: lower ps.*_resources.num_cpus or add nodes"
            )
        self._config_dict = config.model_dump(mode="json", by_alias=True)
        self._base_dir = base_dir
        self._data_sources = data_sources
        self._lr_factor = 1.0
        self._shard_class = ray.remote(ShardActor)
        self._trainer_class = ray.remote(TrainerWorker)
        self.shards: list[Any] = []
        self.trainers: list[Any] = []
        # strategy "collective": no shard actors, every trainer holds a partition of the tables.
        self.collective = config.ps.strategy == "collective"
        try:
            if not self.collective:
                self.shards = [self._start_shard(i) for i in range(config.ps.num_shards)]
            self._start_trainers()
        except BaseException:
            self.shutdown()
            raise

    def _start_shard(self, index: int) -> Any:
        resources = self.config.ps.shard_resources
        return self._shard_class.options(**_resources(resources)).remote(
            index, self._config_dict, threads=resources.threads
        )

    def _start_trainers(self) -> None:
        import ray

        ps = self.config.ps
        self.trainers = [
            self._trainer_class.options(**_resources(ps.trainer_resources)).remote(
                self._config_dict, i, self.shards, base_dir=self._base_dir, data_sources=self._data_sources
            )
            for i in range(ps.num_trainers)
        ]
        _get([s.pid.remote() for s in self.shards] + [t.pid.remote() for t in self.trainers], timeout=300)
        if ps.num_trainers > 1:
            address = ray.get(self.trainers[0].node_address.remote())
            port = ray.get(self.trainers[0].free_port.remote())
            _get([t.init_process_group.remote(address, port) for t in self.trainers])

    def _all(self, method: str, *args: Any) -> list[Any]:
        return _get([getattr(t, method).remote(*args) for t in self.trainers])

    def _shard_refs(self, method: str, *args: Any) -> list[Any]:
        """Call a ParameterShard method on every table partition (shard actors or trainers)."""
        if self.collective:
            return [t.shard_call.remote(method, *args) for t in self.trainers]
        return [s.call.remote(method, *args) for s in self.shards]

    def start_epoch(self, epoch: int) -> None:
        self._all("start_epoch", epoch)

    def train_steps(self, max_steps: int) -> list[ChunkResult]:
        return self._all("train_steps", max_steps)

    def epoch_steps(self) -> int | None:
        steps = self._all("epoch_steps")
        return None if None in steps else max(steps)  # sync trainers step together

    def evaluate(self, split: str) -> dict[str, np.ndarray]:
        parts = self._all("evaluate", split)
        return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}

    def scale_learning_rates(self, factor: float, *, dense: bool = True) -> None:
        self._lr_factor *= factor
        if dense:
            self._all("set_dense_learning_rate", factor)
        calls = []
        for name in builders.table_specs(self.config):
            lr = _base_lr(self.config, name) * self._lr_factor
            calls += self._shard_refs("set_learning_rate", lr, [name])
        _get(calls)

    def save_snapshot(self, tag: str) -> None:
        _get([t.save_snapshot.remote(tag) for t in self.trainers] + self._shard_refs("save_snapshot", tag))

    def restore_snapshot(self, tag: str) -> None:
        _get(
            [t.restore_snapshot.remote(tag) for t in self.trainers]
            + self._shard_refs("restore_snapshot", tag)
        )

    def table_stats(self) -> dict[str, dict[str, int]]:
        return _sum_stats(_get(self._shard_refs("stats")))

    def table_rows(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        return _merge_rows(_get(self._shard_refs("table_rows")))

    def dense_states(self) -> list[dict[str, Any]]:
        return self._all("dense_state")

    def save_checkpoint(self, run_dir: str, *, kind: str, parent: Any, extra: dict[str, Any]) -> Any:
        states = self._all("checkpoint_state")
        pending = checkpoint.begin_checkpoint(run_dir, step=int(states[0]["step"]), kind=kind)  # type: ignore[arg-type]
        try:
            if self.collective:
                records = _get([t.shard_write_checkpoint.remote(pending, kind) for t in self.trainers])
            else:
                records = _get([s.write_checkpoint.remote(pending, kind) for s in self.shards])
            dense = _get([self.trainers[0].dense_checkpoint.remote()])[0]
            ref = _commit(self.config, pending, dict(enumerate(records)), dense, states, extra, parent)
        except BaseException:
            checkpoint.abort_checkpoint(pending)
            raise
        _get(self._shard_refs("confirm_checkpoint"))
        return ref

    def restore(self, chain: list[Any]) -> dict[str, Any]:
        data = checkpoint.load_checkpoint(chain[-1], shards=[])
        if self.collective:
            _get([t.shard_restore.remote(chain, data.step) for t in self.trainers])
        else:
            _get([s.restore.remote(chain, data.step) for s in self.shards])
        _get([t.restore.remote(data.dense, data.trainers[i]) for i, t in enumerate(self.trainers)])
        self._lr_factor = 1.0
        self.scale_learning_rates(float(data.extra.get("lr_factor", 1.0)), dense=False)
        return {"step": data.step, **data.trainers[0], "extra": data.extra}

    def dead_actors(self) -> list[str]:
        """Names of the actors that no longer answer (a failed call may be a symptom of one of them)."""
        named = [(f"trainer {i}", a) for i, a in enumerate(self.trainers)]
        named += [(f"shard {i}", a) for i, a in enumerate(self.shards)]
        return [name for name, actor in named if not _answers(actor, timeout=5.0)]

    def recover(self, chain: list[Any]) -> dict[str, Any] | None:
        """Replace dead actors and roll every shard and trainer back to `chain` (or to a fresh start)."""
        import ray

        for trainer in self.trainers:
            ray.kill(trainer)
        dead = [i for i, shard in enumerate(self.shards) if not _answers(shard)]
        logger.warning("recovering: re-creating trainers and shards %s", dead)
        if not chain:  # nothing committed yet: start over with fresh tables everywhere
            dead = list(range(len(self.shards)))
        for index in dead:
            ray.kill(self.shards[index])
            self.shards[index] = self._start_shard(index)
        self._start_trainers()
        if not chain:
            self._lr_factor = 1.0
            return None
        return self.restore(chain)

    def shutdown(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        for trainer in self.trainers:
            with contextlib.suppress(Exception):  # best effort: the actor is killed next
                ray.get(trainer.shutdown.remote(), timeout=10)
        for actor in [*self.trainers, *self.shards]:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        if self._owns_ray:
            ray.shutdown()


def _get(refs: list[Any], timeout: float | None = None) -> list[Any]:
    """ray.get that raises as soon as any call fails (ray.get(list) may first wait on a blocked one)."""
    import ray

    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not ready:
            raise TimeoutError(f"{len(pending)} actor calls did not answer within {timeout} s")
        ray.get(ready)  # raises the call's error, if any
    return ray.get(list(refs))


def _answers(actor: Any, timeout: float = 10.0) -> bool:
    import ray

    try:
        ray.get(actor.pid.remote(), timeout=timeout)
    except Exception:  # noqa: BLE001 - any failure means the actor must be replaced
        return False
    return True


def _resources(resources: Any) -> dict[str, Any]:
    options: dict[str, Any] = {"num_cpus": resources.num_cpus, "num_gpus": resources.num_gpus}
    if resources.memory_gb is not None:
        options["memory"] = int(resources.memory_gb * 2**30)
    return options


def make_runtime(config: RunConfig, *, base_dir: str, data_sources: dict[str, dict[str, Any]]) -> Runtime:
    if config.ps.runtime == "local":
        return LocalRuntime(config, base_dir=base_dir, data_sources=data_sources)
    return RayRuntime(config, base_dir=base_dir, data_sources=data_sources)
