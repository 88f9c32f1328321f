"""A trainer: its share of the data, its replica of the dense model, and a client to the shards.

`TrainerWorker` is a plain class: the in-process runtime calls it directly with in-process shards,
and the Ray runtime runs it as an actor (`ray.remote(TrainerWorker)`) with shard actor handles. The
driver calls `train_steps(n)` on every trainer together; in between it evaluates, checkpoints and
reports progress, so those happen at step boundaries. The dense model lives on ``training.device``
(`psrec.trainer.device`); the state a trainer hands out (checkpoints, snapshots, replicas) is in host
memory whatever that device. torch is imported when a trainer is built, not with this module: the
driver of a Ray run imports it to start the trainers' actors, and runs without torch.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from psrec.allocator import release_free_memory
from psrec.checkpoint.files import torch_state_bytes
from psrec.config import RunConfig
from psrec.data.background import InputGate
from psrec.data.reader import PreparedCache, StreamWindow, open_reader
from psrec.data.schema import DataSource
from psrec.machine import describe_machine
from psrec.parallel import rendezvous
from psrec.ps.actors import RayConnection, actor_location, maintenance_name
from psrec.ps.client import EmbeddingClient, LocalConnection, ShardConnection
from psrec.ps.shard import ParameterShard
from psrec.ps.shard_checkpoint import restore_shard, write_shard_checkpoint
from psrec.threads import compute_settings, set_thread_counts
from psrec.trainer import builders, readers
from psrec.trainer.chunks import ChunkResult, ChunkSoFar
from psrec.trainer.startup import paused_gc

if TYPE_CHECKING:
    import torch

    from psrec.trainer.runner import Runner

logger = logging.getLogger(__name__)


def _leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _host_copy(value: Any) -> Any:
    from psrec.trainer.device import host_copy

    return host_copy(value)


class TrainerWorker:
    """One trainer (see the module docstring)."""

    def __init__(
        self,
        config: RunConfig,
        trainer_index: int,
        shards: list[Any],
        *,
        base_dir: str = ".",
        data_sources: dict[str, dict[str, Any]] | None = None,
        bucket_map: np.ndarray | None = None,
        routing_version: int = 0,
    ) -> None:
        self.config = config  # validated once by the driver; Ray pickles it to the actor
        import torch  # here, not at the module's import: the driver of a Ray run imports this module

        # after torch's import: torch reads its counts when it loads, and the step's GEMMs must run
        # with the configured count (psrec.threads: on some CPUs the bits depend on it)
        set_thread_counts(self.config.ps.trainer_resources.threads)

        torch.manual_seed(self.config.training.seed)  # identical dense init on every trainer
        self.trainer_index = trainer_index
        self.world_size = self.config.ps.num_trainers
        # ps.pipeline: trainers per replica; the replica's first stage reads its data and pushes
        self.num_stages = self.config.ps.pipeline.stages if self.config.ps.pipeline else 1
        self.base_dir = Path(base_dir)
        self.sources = readers.parse_sources(data_sources or {})
        self.device = builders.training_device(self.config)  # cpu unless training.device says otherwise
        # training.dense_precision, resolved on this trainer's machine (auto: bf16 where it is native)
        self.dense_precision = builders.dense_precision(self.config, self.device)
        if self.dense_precision.warning is not None:
            logger.warning("trainer %d: %s", trainer_index, self.dense_precision.warning)
        with paused_gc():  # the model and its optimizer (see paused_gc)
            model = builders.build_model_for(self.config).to(self.device)  # initialised on the CPU
            self.model = builders.maybe_compile(model, self.config)
            self.optimizer = builders.build_dense_optimizer(self.config, self.model)
        # strategy "collective": this trainer holds its own partition of every table; the client
        # over it needs the process group, so it is built in `init_process_group`.
        self.collective = self.config.ps.strategy == "collective"
        self.local_shard: ParameterShard | None = None
        self._collective_connection: Any = None
        self._input_gate: InputGate | None = None
        # training.cache_data: prepared training rows kept from the first epoch's read for the next ones
        self._data_cache = PreparedCache() if self.config.training.cache_data else None
        train_source = self.sources.get("train")
        if (
            self._data_cache is not None
            and train_source is not None
            and train_source.format == "interactions"
        ):
            logger.warning(
                "training.cache_data has no effect on interactions data (negatives change each epoch)"
            )
        if self.collective:
            self.local_shard = ParameterShard(
                trainer_index,
                builders.build_tables(self.config, partitions=self.world_size),
                num_trainers=self.world_size,
                mode="sync",
            )
            if self.world_size == 1:
                self._build_collective_client()
        else:
            connections = self._connections(shards)
            local = all(isinstance(s, ParameterShard) for s in shards)  # nothing is serialised
            if local:  # pulls and pushes run on the training thread: input threads hold back then
                self._input_gate = InputGate()
            specs = builders.table_specs(self.config)
            client = EmbeddingClient(
                connections,
                builders.bucket_map(self.config) if bucket_map is None else bucket_map,
                table_dims={name: spec.dim for name, spec in specs.items()},
                wire_precision=self.config.ps.wire_precision if not local else "fp32",
                linear_terms=self._linear_terms(),
                trainer_index=trainer_index // self.num_stages,
                routing_version=routing_version,
                prefetch_tables=[name for name, spec in specs.items() if spec.storage is not None],
            )
            self._build_runner(client)
        self.step = 0
        self.epoch = -1
        self._reader: Any = None
        self._batches: Any = None
        self._opened_at: Any = None  # the position the reader was opened at
        self._chunk = self._new_chunk()
        self._snapshots: dict[str, dict[str, Any]] = {}
        self._input_reported = readers.InputReport()
        self._interactions: Any = None
        self._store_listener: socket.socket | None = None  # trainer 0's, until the group forms

    def _linear_terms(self) -> bool:
        return bool(getattr(self.model, "uses_linear_terms", False))

    def _build_runner(self, client: EmbeddingClient) -> None:
        from psrec.trainer.lookup import BatchLookup

        lookup = self.client = BatchLookup(
            client,
            feature_tables=builders.feature_tables(self.config),
            sequence_tables=builders.sequence_tables(self.config),
            device=None if self.device.type == "cpu" else self.device,  # None: the CPU's numba path
        )
        self.runner: Runner = builders.build_runner(
            self.config,
            self.model,
            self.optimizer,
            lookup,
            rank=self.trainer_index,
            world_size=self.world_size,
            bf16=self.dense_precision.resolved == "bf16",
            input_gate=self._input_gate,
        )

    def _build_collective_client(self) -> None:
        from psrec.parallel.collective import CollectiveConnection, collective_client

        assert self.local_shard is not None
        specs = builders.table_specs(self.config)
        num_buckets = self.config.ps.num_buckets
        placement = builders.collective_placement(self.config, self.world_size)
        self._collective_connection = CollectiveConnection(
            self.local_shard, placement, table_dims={name: spec.dim for name, spec in specs.items()}
        )
        self._build_runner(
            collective_client(
                self._collective_connection, linear_terms=self._linear_terms(), num_buckets=num_buckets
            )
        )

    def set_routing(self, shards: list[Any], bucket_map: np.ndarray, version: int) -> int:
        """Route through `shards` with `bucket_map` from the next step on (the shard count changes
        while training, `psrec.elastic.resharding`); returns the version now in use."""
        self.client.client.set_routing(self._connections(shards), bucket_map, version=version)
        return self.client.client.routing_version

    def _connections(self, shards: list[Any]) -> list[ShardConnection]:
        """A connection to each shard. A trainer's training pulls are numbered by step under its own
        name, so that a shard answers its replacement's repeated pull with the first rows."""
        return [
            LocalConnection(s)
            if isinstance(s, ParameterShard)
            else RayConnection(
                s, caller=f"trainer-{self.trainer_index}", shared_memory=self.config.ps.shared_memory
            )
            for s in shards
        ]

    # -- the local shard of strategy "collective" ------------------------------------------------
    def shard_call(self, method: Callable[..., Any], *args: Any) -> Any:
        """Run `method`, one of ParameterShard's maintenance methods, on this trainer's partition
        (strategy "collective"), as `ShardActor.call` does on a shard."""
        assert self.local_shard is not None, "shard_call needs strategy 'collective'"
        maintenance_name(method)  # refuses any other method
        return method(self.local_shard, *args)

    def shard_write_checkpoint(self, pending: Any, kind: str) -> Any:
        assert self.local_shard is not None
        return write_shard_checkpoint(self.local_shard, pending, kind)

    def shard_restore(self, chain: list[Any], step: int) -> None:
        assert self.local_shard is not None
        restore_shard(self.local_shard, chain, step)

    # -- process group -----------------------------------------------------------------------
    def _node_address(self) -> str:
        """This trainer's node address: 127.0.0.1 in the embedded cluster (`psrec.cluster.start`)."""
        import ray

        return str(ray.util.get_node_ip_address())

    def listen_for_group(self) -> tuple[str, int]:
        """Trainer 0: open the group's store socket on this node's address; where the others connect."""
        self._store_listener = rendezvous.listen(self._node_address())
        return self._node_address(), int(self._store_listener.getsockname()[1])

    def init_process_group(
        self,
        master_address: str,
        master_port: int,
        timeout_s: float | None = None,
        join_timeout_s: float | None = None,
    ) -> None:
        """Join the trainers' gloo group (dense allreduce); NCCL for GPU tensors when the model is on a
        GPU (`rendezvous.backend_for`). Trainer 0 serves the store on the socket `listen_for_group`
        opened. `timeout_s` bounds every collective (torch's default otherwise) and the wait for the
        others to join, unless `join_timeout_s` bounds that."""
        listener, self._store_listener = self._store_listener, None
        rendezvous.init_process_group(
            rendezvous.backend_for(self.device.type),
            master_address=master_address,
            master_port=master_port,
            rank=self.trainer_index,
            world_size=self.world_size,
            local_address=self._node_address(),
            listen_fd=listener.detach() if listener is not None else None,
            timeout=None if timeout_s is None else datetime.timedelta(seconds=timeout_s),
            join_timeout=None if join_timeout_s is None else datetime.timedelta(seconds=join_timeout_s),
        )
        if self.collective:
            self._build_collective_client()

    def shutdown(self) -> None:
        self._close_runner()
        client = getattr(getattr(self, "client", None), "client", None)
        for connection in getattr(client, "connections", ()):
            if isinstance(connection, RayConnection):
                connection.close()  # its shared-memory segments
        if self._reader is not None:
            self._reader.close()
        _leave_process_group()

    # -- training ------------------------------------------------------------------------------
    def _close_runner(self) -> None:
        """Stop the runner's read-ahead of the current reader (before the reader goes away)."""
        self.runner.close()

    def start_epoch(self, epoch: int, position: dict[str, Any] | None = None) -> None:
        self._close_runner()
        if self._reader is not None:
            self._reader.close()
        training = self.config.training
        self.epoch = epoch
        self._reader = readers.open_training_reader(
            self.config,
            self.sources["train"],
            epoch=epoch,
            shard=self.trainer_index // self.num_stages,  # a pipeline replica's stages share one
            num_shards=self.world_size // self.num_stages,
            position=position,
            base_dir=self.base_dir,
            gate=self._input_gate,
            cache=self._data_cache,
        )
        if training.mode == "continuous":  # a chunk ends when the stream brought nothing for a while
            self._batches = StreamWindow(self._reader, wait_seconds=training.stream.wait_seconds)
        else:
            self._batches = iter(self._reader)
        self._opened_at = position
        self._input_reported = readers.InputReport()

    def epoch_steps(self) -> int | None:
        """Steps this trainer's share of the epoch takes, when the format knows its rows (Parquet)."""
        rows = self._reader.stats().get("shard_rows") if self._reader is not None else None
        if rows is None:
            return None
        return -(-int(rows) // self.config.training.batch_size)

    def train_steps(self, max_steps: int) -> ChunkResult:
        if self._batches is None:
            raise RuntimeError("train_steps before start_epoch")
        chunk = self._chunk
        steps = 0
        # A runner that reads ahead across chunks records the position of what it trained on.
        run = self.runner.run(
            self._batches, first_step=self.step, max_steps=max_steps, position=self._reader.position
        )
        for result in run:
            steps += 1
            self.step = result.step + 1
            chunk.record(result)
        if isinstance(self._batches, StreamWindow):  # a quiet stream ends a chunk, not the stream
            return self._take_chunk(exhausted=steps < max_steps and self._reader.ended)
        return self._take_chunk(exhausted=steps < max_steps)

    def _new_chunk(self) -> ChunkSoFar:
        runner = getattr(self, "runner", None)
        if runner is None:  # strategy "collective" builds its runner with the process group
            return ChunkSoFar()
        return ChunkSoFar(
            phases=dict(runner.timer.seconds),
            pulled=self.client.bytes_pulled,
            pushed=self.client.bytes_pushed,
        )

    def _take_chunk(self, *, exhausted: bool) -> ChunkResult:
        """The steps done since the last chunk was taken, as one result; starts the next chunk."""
        chunk = self._chunk
        input_counts, failed_units = self._input_report()
        result = ChunkResult(
            steps=chunk.steps,
            samples=chunk.samples,
            loss_sum=chunk.loss_sum,
            scores=np.concatenate(chunk.scores) if chunk.scores else np.zeros(0, np.float32),
            labels=np.concatenate(chunk.labels) if chunk.labels else np.zeros(0, np.float32),
            row_ids=np.concatenate(chunk.row_ids) if chunk.row_ids else np.zeros(0, np.int64),
            exhausted=exhausted,
            phase_seconds={k: v - chunk.phases.get(k, 0.0) for k, v in self.runner.timer.seconds.items()},
            bytes_pulled=self.client.bytes_pulled - chunk.pulled,
            bytes_pushed=self.client.bytes_pushed - chunk.pushed,
            input_counts=input_counts,
            failed_units=failed_units,
            first_step_at=chunk.first_step_at,
            state=self.checkpoint_state(),
            stream=self._stream_report(),
        )
        self._chunk = self._new_chunk()
        return result

    def _stream_report(self) -> dict[str, Any] | None:
        """A stream's lag after the chunk: messages behind the partitions' ends (for growing files,
        the files not read yet) and the newest event trained (for files: the newest file's time)."""
        if self.config.training.mode != "continuous" or self._reader is None:
            return None
        return readers.stream_lag(self._reader.stats(), self.checkpoint_state()["position"] or {})

    # -- trainer failover (psrec.elastic.trainer_failover) -------------------------------------------
    def abort_chunk(self) -> dict[str, Any]:
        """After a chunk a dead trainer cut short: leave the broken group, hand over the steps that
        completed (`partial`) and where they left this trainer (`state`), and reopen the reader
        there (the read-ahead is dropped). Called again, it hands over nothing more."""
        _leave_process_group()
        partial = self._take_chunk(exhausted=False)
        position = self.runner.trained_position
        if position is None:
            position = self._opened_at
        state = {**self.checkpoint_state(), "position": position}
        self.start_epoch(self.epoch, position=position)
        self._mark_input_reported()
        return {"state": state, "partial": partial}

    def replica_state(self) -> dict[str, Any]:
        """This trainer's dense replica: the model, its optimizer and its snapshots."""
        return {
            "model": self.dense_state(),
            "optimizer": _host_copy(self.optimizer.state_dict()),
            "snapshots": self._snapshots,
        }

    def take_over(
        self, replica: dict[str, Any], *, step: int, epoch: int, position: Any, skip: int
    ) -> ChunkResult:
        """Become the trainer that died: the survivors' dense `replica`, at `step`. The dead trainer's
        reader stood at `position` `skip` steps before `step`: those batches were trained on, so they
        are read past (not trained); the result reports them (their rows, without scores)."""
        self.model.load_state_dict(replica["model"])
        self.optimizer.load_state_dict(replica["optimizer"])
        self._snapshots = dict(replica["snapshots"])
        self.start_epoch(epoch, position=position)
        self._mark_input_reported()
        self._chunk = self._new_chunk()
        chunk = self._chunk
        for _ in range(skip):
            batch = next(self._batches, None)
            if batch is None:  # out of data: the dead trainer ran empty steps
                break
            chunk.samples += batch.labels.shape[0]
            if batch.row_ids is not None:
                chunk.row_ids.append(batch.row_ids)
        chunk.steps = skip
        self._opened_at = self._reader.position()
        self.step = step
        return self._take_chunk(exhausted=False)

    def rescale(self, config: RunConfig) -> None:
        """Train as one of `config.ps.num_trainers` trainers from the next step on (trainers added or
        removed between steps, `psrec.elastic.trainer_scaling`): leave the process group (it is formed
        again with the new world size); `take_over` then opens this trainer's new share of the data."""
        from psrec.trainer.step import StepRunner

        _leave_process_group()
        self.config = config
        self.world_size = config.ps.num_trainers
        assert isinstance(self.runner, StepRunner), (
            "strategy 'ps' without a pipeline changes its trainer count"
        )
        self.runner.world_size = self.world_size

    def _mark_input_reported(self) -> None:
        """Count the reader's bad input from here on (what it counted before was reported)."""
        self._input_report()

    def _input_report(self) -> tuple[dict[str, int], list[dict[str, Any]]]:
        """The reader's bad-input counters and failed units since the last report (this epoch's reader)."""
        return self._input_reported.since_last(self._reader.stats())

    def evaluate(self, split: str) -> dict[str, np.ndarray]:
        """This trainer's share of `split`, evaluated without changing or growing any table.

        CTR models: {"scores", "labels"}. Ranking models (SASRec): {"ranks"} of each held-out item
        among its 100 sampled negatives (held out of the training interactions file as its
        ``holdout`` says), and with ``training.full_ranking`` {"full_ranks"} among all items, the
        user's input items excluded (`psrec.data.sequences.full_ranking_batches`).
        """
        self.runner.flush()
        release_free_memory()  # training's freed blocks do not fit evaluation's (psrec.allocator)
        if self.config.model.ranks_items:
            return self._evaluate_ranking(split)
        reader = open_reader(
            self._file_source(split),
            self.config.feature_schema(),
            batch_size=self.config.training.eval_batch_size,
            base_dir=self.base_dir,
            shard=self.trainer_index,
            num_shards=self.world_size,
        )
        batches: Any = reader
        if self._collective_connection is not None:
            from psrec.parallel.collective import lockstep_batches

            batches = lockstep_batches(reader, self._collective_connection)
        try:
            return readers.score_batches(batches, self.runner.predict)
        finally:
            reader.close()

    def _file_source(self, split: str) -> DataSource:
        source = self.sources[split]
        if not isinstance(source, DataSource):
            raise TypeError(f"data.{split} is a {source.format} stream, not files")
        return source

    def _evaluate_ranking(self, split: str) -> dict[str, np.ndarray]:
        if self._interactions is None:
            self._interactions = readers.load_training_interactions(self._file_source("train"), self.base_dir)
        return readers.rank_held_out(
            self._interactions,
            self.runner.predict,
            config=self.config,
            split=split,
            shard=self.trainer_index,
            num_shards=self.world_size,
            holdout=self._file_source("train").holdout,
        )

    def set_dense_learning_rate(self, factor: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] *= factor

    def save_snapshot(self, tag: str) -> None:
        self._snapshots[tag] = {
            "model": _host_copy(dict(self.model.state_dict())),
            "optimizer": _host_copy(self.optimizer.state_dict()),
        }

    def restore_snapshot(self, tag: str) -> None:
        self.model.load_state_dict(self._snapshots[tag]["model"])
        self.optimizer.load_state_dict(self._snapshots[tag]["optimizer"])

    # -- checkpoints -----------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        """JSON-able: where this trainer is (step, epoch, reader position after its last batch)."""
        position = None
        if self.runner.trained_position is not None:
            position = self.runner.trained_position  # the reader itself may be read ahead
        elif self._reader is not None:
            position = self._reader.position()
        return {"trainer": self.trainer_index, "step": self.step, "epoch": self.epoch, "position": position}

    def dense_checkpoint(self) -> bytes:
        """The dense model and optimizer state (identical on every trainer after the allreduce),
        serialised here: the driver writes it into the checkpoint without importing torch."""
        return torch_state_bytes(
            {"model": self.dense_state(), "optimizer": _host_copy(self.optimizer.state_dict())}
        )

    def restore(self, dense: dict[str, Any] | None, state: dict[str, Any] | None) -> None:
        """Resume from a checkpoint: dense state, step, and this trainer's epoch and reader position."""
        if dense:
            self.model.load_state_dict(dense["model"])
            self.optimizer.load_state_dict(dense["optimizer"])
        self._chunk = self._new_chunk()
        if state is None:
            self.step, self.epoch = 0, -1
            return
        self.step = int(state["step"])
        self.start_epoch(int(state["epoch"]), position=state["position"])

    def compute_settings(self) -> dict[str, int | str]:
        """The thread counts and CPU dispatch this trainer's steps run with (`psrec.threads`)."""
        return compute_settings()

    def machine_report(self) -> dict[str, Any]:
        """The machine this trainer computes on (`psrec.machine.describe_machine`, with its GPU when the
        model is on one) and the dense precision resolved there, as ``summary.json`` records them."""
        import torch

        machine = describe_machine()
        if self.device.type == "cuda":
            machine["gpu"] = torch.cuda.get_device_name(self.device)
        return {"machine": machine, "dense_precision": self.dense_precision.to_dict()}

    def pid(self) -> int:
        return os.getpid()

    def location(self) -> dict[str, Any]:
        return actor_location()

    def dense_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
