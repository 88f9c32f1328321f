"""The sharding planner: which table (or which virtual buckets of it) lives on which device.

A pure function over plain data, no processes: `plan_sharding(tables, devices, strategy=...)` takes
the table sizes (rows seen or expected, dim, precision, optimizer) and the devices (count, memory),
and returns a `ShardingPlan` with the placement, the memory it expects on every device and the bytes
every device sends and receives per training step. A plan that does not fit raises `PlanDoesNotFit`,
naming the device or table and the shortfall. `psrec plan SPEC` (``psrec.parallel.cli``) prints it.

Strategies (``docs/parallelism.md`` says when to choose which):

- ``"ps"``: the devices are parameter-server shards. Every table is split row-wise over all shards by
  virtual bucket (``psrec.ps.routing.default_bucket_map``); every trainer pulls and pushes all of its
  ids over the network.
- ``"collective"``: the devices are the trainers themselves, exchanging ids and rows by all-to-all.
  ``sharding`` says how each table is split:

  - ``"table_wise"``: a whole table on one trainer; tables are packed largest first onto the trainer
    with the least memory used so far (greedy LPT);
  - ``"row_wise"``: every table split over all trainers by virtual bucket, like the PS;
  - ``"auto"``: row-wise for every table larger than an even share of all tables
    (``total / num_devices``), which alone would unbalance its trainer, or larger than one device;
    table-wise for the others, packed on top.

Memory model (``row_bytes``), worst case of the embedding engine's growth policy: row arrays (payload
at its precision, optimizer state, the int64 key and 8 bytes of metadata) grow 1.125x at a time, and
the hash index holds 5 bytes per slot at a load of at least 0.64, so

    bytes/row = 1.125 * (payload + optimizer state + 16) + 5 / 0.64

e.g. dim 128 fp32 with row-wise Adagrad: 1.125 * (512 + 4 + 16) + 7.8 = 606 bytes. Row-wise shares
assume ids spread evenly over buckets (the splitmix64 bucket hash makes them so).

Disk tier (``TableSize.memory_rows``, docs/disk_tier.md): a table keeps that many rows in memory
(all devices together) at the cost above; each other row costs ``DISK_INDEX_BYTES_PER_ROW`` (28) in
memory, for the disk tier's index; on the device's disk every row of the table takes up to
``DISK_SPACE_FACTOR`` (2.5) records (``disk_bytes_per_row``: payload, optimizer state, metadata, id
and checksum; the log-structured slab's garbage included), checked against ``Devices.disk_bytes``
when given.
`plan_disk_tier` chooses ``memory_rows`` for every table so that the tables fit the devices' memory
(for row-wise tables): the smallest tables whole, the same fraction of each larger one, as much as fits.

Communication model, per device and step, upper bound (ids are counted before deduplication and
travel as int64, rows and gradients as float32): a trainer with local batch ``b`` sends
``n = min(b * ids_per_sample, rows)`` ids of a table; a share of them is remote (all of them to the
PS; ``(W - 1) / W`` of them row-wise over ``W`` trainers; all or none table-wise). A remote id costs
8 bytes out and ``4 * dim`` back on the pull, ``8 + 4 * dim`` out on the push; its owner sees the
mirror image. Dense gradients add a ring allreduce, ``2 (W - 1) / W * 4 * dense_parameters`` each way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from psrec.embedding.optimizers import STATE_LAYOUT
from psrec.embedding.sizes import DISK_INDEX_BYTES_PER_ROW, DISK_SPACE_FACTOR, disk_bytes_per_row
from psrec.ps.routing import default_bucket_map

Strategy = Literal["ps", "collective"]
Sharding = Literal["table_wise", "row_wise", "auto"]
STRATEGIES: tuple[str, ...] = ("ps", "collective")
SHARDINGS: tuple[str, ...] = ("table_wise", "row_wise", "auto")

ROW_GROWTH = 1.125  # psrec.embedding.hash_index.ROW_GROWTH
INDEX_BYTES_PER_ROW = 5 / 0.64  # 5 bytes per slot; load between 0.64 and 0.8 (MAX_LOAD / INDEX_GROWTH)
KEY_AND_METADATA_BYTES = 16  # int64 key + (count, last step) uint32 metadata
ID_BYTES = 8
VALUE_BYTES = 4  # rows and gradients travel as float32
GB = 10**9


def payload_bytes(dim: int, precision: str) -> int:
    """Bytes of one stored row at `precision` (int8 keeps a float32 scale and offset per row)."""
    sizes = {"fp32": 4 * dim, "fp16": 2 * dim, "int8": dim + 8}
    if precision not in sizes:
        raise ValueError(f"precision must be one of {sorted(sizes)}, got {precision!r}")
    return sizes[precision]


def optimizer_state_bytes(dim: int, optimizer: str) -> int:
    """Bytes of sparse optimizer state per row (from the engine's `STATE_LAYOUT`)."""
    if optimizer not in STATE_LAYOUT:
        raise ValueError(f"optimizer must be one of {sorted(STATE_LAYOUT)}, got {optimizer!r}")
    return sum(
        (dim if kind == "element" else 1) * np.dtype(dtype).itemsize
        for _, kind, dtype in STATE_LAYOUT[optimizer]
    )


def row_bytes(dim: int, precision: str = "fp32", optimizer: str = "rowwise_adagrad") -> float:
    """Worst-case bytes one row costs in an `EmbeddingTable` (see the module docstring)."""
    arrays = payload_bytes(dim, precision) + optimizer_state_bytes(dim, optimizer) + KEY_AND_METADATA_BYTES
    return ROW_GROWTH * arrays + INDEX_BYTES_PER_ROW


@dataclass(frozen=True)
class TableSize:
    """What the planner needs to know about one table."""

    name: str
    rows: int  # rows seen or expected
    dim: int
    precision: str = "fp32"
    optimizer: str = "rowwise_adagrad"
    ids_per_sample: float = 1.0  # ids of this table in one sample (several for multi-valued features)
    memory_rows: int | None = None  # with a disk tier: rows kept in memory, all devices together

    def __post_init__(self) -> None:
        if self.rows < 0 or self.dim < 1 or self.ids_per_sample < 0:
            raise ValueError(f"table {self.name!r}: rows >= 0, dim >= 1 and ids_per_sample >= 0 required")
        if self.memory_rows is not None and self.memory_rows < 0:
            raise ValueError(f"table {self.name!r}: memory_rows >= 0 required")
        payload_bytes(self.dim, self.precision)
        optimizer_state_bytes(self.dim, self.optimizer)

    @property
    def hot_rows(self) -> int:
        return self.rows if self.memory_rows is None else min(self.memory_rows, self.rows)

    @property
    def bytes(self) -> float:
        """Memory: rows in memory at `row_bytes`, rows on disk at their index entry."""
        cold = self.rows - self.hot_rows
        return (
            self.hot_rows * row_bytes(self.dim, self.precision, self.optimizer)
            + cold * DISK_INDEX_BYTES_PER_ROW
        )

    @property
    def disk_bytes(self) -> float:
        """Disk: up to ``DISK_SPACE_FACTOR`` records for every row once any is on disk (promoted
        rows leave garbage behind until their segment is cleaned)."""
        record = disk_bytes_per_row(self.dim, precision=self.precision, optimizer=self.optimizer)
        return float(self.rows * record * DISK_SPACE_FACTOR) if self.hot_rows < self.rows else 0.0


@dataclass(frozen=True)
class Devices:
    """`count` identical devices (trainers or PS shards) with `memory_bytes` each.

    `headroom` is the fraction kept free for everything but the tables (dense model, activations,
    communication buffers, allocator slack).
    """

    count: int
    memory_bytes: int
    headroom: float = 0.1
    disk_bytes: int | None = None  # each device's disk for the disk tier (None: not checked)

    def __post_init__(self) -> None:
        if self.count < 1 or self.memory_bytes <= 0 or not 0 <= self.headroom < 1:
            raise ValueError("devices: count >= 1, memory_bytes > 0 and 0 <= headroom < 1 required")
        if self.disk_bytes is not None and self.disk_bytes < 0:
            raise ValueError("devices: disk_bytes >= 0 required")

    @property
    def usable_bytes(self) -> float:
        return self.memory_bytes * (1 - self.headroom)


@dataclass(frozen=True)
class Workload:
    """Per-step traffic inputs: each trainer's batch, and the dense parameters it allreduces."""

    batch_size: int = 4096  # per trainer and step
    num_trainers: int | None = None  # PS strategy only; collective: one trainer per device
    dense_parameters: int = 0


@dataclass(frozen=True)
class TablePlacement:
    table: str
    kind: Literal["table_wise", "row_wise"]
    owner: int | None  # the device holding the whole table (table-wise), else None
    bytes_per_device: tuple[float, ...]


@dataclass(frozen=True)
class Traffic:
    sent_bytes: float = 0.0
    received_bytes: float = 0.0


@dataclass(frozen=True)
class ShardingPlan:
    """A placement that fits, with its expected memory and per-step traffic per device."""

    strategy: str
    sharding: str
    num_devices: int
    num_buckets: int
    usable_bytes: float
    tables: tuple[TablePlacement, ...]
    memory_bytes: tuple[float, ...]  # per device: the tables' rows
    traffic: tuple[Traffic, ...]  # per device and step (PS: per shard)
    trainer_traffic: Traffic | None = None  # PS: per trainer and step
    notes: tuple[str, ...] = field(default=())
    disk_bytes: tuple[float, ...] = ()  # per device: the disk tiers' files

    def owners(self) -> dict[str, int | None]:
        """Table -> owning device (table-wise) or None (row-wise over all devices)."""
        return {t.table: t.owner for t in self.tables}

    def bucket_map(self) -> np.ndarray:
        """Bucket -> device of the row-wise tables, shape (num_buckets,)."""
        return default_bucket_map(self.num_buckets, self.num_devices)


class PlanDoesNotFit(ValueError):
    """The tables do not fit the devices; the message names the device or table and the shortfall."""

    def __init__(self, message: str, *, shortfall_bytes: float, minimum_devices: int | None) -> None:
        super().__init__(message)
        self.shortfall_bytes = shortfall_bytes
        self.minimum_devices = minimum_devices


def _gb(value: float) -> str:
    return f"{value / GB:.2f} GB"


def _row_wise_shares(num_buckets: int, num_devices: int) -> np.ndarray:
    """Fraction of the buckets (hence of the rows) each device holds under the default map."""
    counts = np.bincount(default_bucket_map(num_buckets, num_devices), minlength=num_devices)
    return counts / num_buckets


def _choose_kinds(tables: list[TableSize], devices: Devices, sharding: str) -> dict[str, str]:
    if sharding in ("table_wise", "row_wise"):
        return {t.name: sharding for t in tables}
    even_share = sum(t.bytes for t in tables) / devices.count
    limit = min(even_share, devices.usable_bytes)
    return {t.name: "row_wise" if t.bytes > limit else "table_wise" for t in tables}


def _minimum_devices(tables: list[TableSize], devices: Devices, kinds: dict[str, str]) -> int:
    total = sum(t.bytes for t in tables)
    needed = max(1, math.ceil(total / devices.usable_bytes))
    biggest_whole = max((t.bytes for t in tables if kinds[t.name] == "table_wise"), default=0.0)
    return needed if biggest_whole <= devices.usable_bytes else -1


def plan_sharding(
    tables: list[TableSize],
    devices: Devices,
    *,
    strategy: str = "collective",
    sharding: str = "auto",
    num_buckets: int = 1024,
    workload: Workload = Workload(),  # noqa: B008 - frozen dataclass
) -> ShardingPlan:
    """Place `tables` on `devices` (see the module docstring); raises `PlanDoesNotFit` if they do not fit."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
    if not tables:
        raise ValueError("no tables to place")
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"table names repeat: {sorted(n for n in set(names) if names.count(n) > 1)}")
    if devices.count > num_buckets:
        raise ValueError(f"{devices.count} devices need num_buckets >= {devices.count}, got {num_buckets}")
    if strategy == "ps":
        sharding = "row_wise"  # the PS splits every table over all shards
    kinds = _choose_kinds(tables, devices, sharding)
    shares = _row_wise_shares(num_buckets, devices.count)
    memory = np.zeros(devices.count)
    placements: dict[str, TablePlacement] = {}
    for table in tables:
        if kinds[table.name] == "row_wise":
            per_device = shares * table.bytes
            memory += per_device
            placements[table.name] = TablePlacement(table.name, "row_wise", None, tuple(per_device))
    overfull = int(np.argmax(memory - devices.usable_bytes))
    if memory[overfull] > devices.usable_bytes:
        short = memory[overfull] - devices.usable_bytes
        biggest = sorted((t for t in tables if kinds[t.name] == "row_wise"), key=lambda t: -t.bytes)[:3]
        minimum = _minimum_devices(tables, devices, kinds)
        raise PlanDoesNotFit(
            f"does not fit: device {overfull} would hold {_gb(memory[overfull])} of row-wise table shares "
            f"but has {_gb(devices.usable_bytes)} usable ({_gb(devices.memory_bytes)} less "
            f"{devices.headroom:.0%} headroom): short by {_gb(short)}. Largest tables: "
            + ", ".join(f"{t.name} {t.rows:,} rows x dim {t.dim} = {_gb(t.bytes)}" for t in biggest)
            + f". All tables need {_gb(sum(t.bytes for t in tables))}"
            + (f": at least {minimum} devices of this size." if minimum > 0 else "."),
            shortfall_bytes=float(short),
            minimum_devices=minimum if minimum > 0 else None,
        )
    # Table-wise: largest first onto the device with the least memory used so far.
    for table in sorted(
        (t for t in tables if kinds[t.name] == "table_wise"), key=lambda t: (-t.bytes, t.name)
    ):
        device = int(np.argmin(memory))
        if memory[device] + table.bytes > devices.usable_bytes:
            free = devices.usable_bytes - memory[device]
            short = table.bytes - free
            minimum = _minimum_devices(tables, devices, kinds)
            hint = (
                "shard it row-wise (sharding: row_wise or auto)"
                if table.bytes > devices.usable_bytes
                else f"use sharding row_wise or auto, or at least {minimum} devices"
            )
            raise PlanDoesNotFit(
                f"does not fit: table {table.name} ({table.rows:,} rows x dim {table.dim} = "
                f"{_gb(table.bytes)}) goes whole on one device, but the emptiest, device {device}, has "
                f"{_gb(free)} free of {_gb(devices.usable_bytes)} usable: short by {_gb(short)}; {hint}.",
                shortfall_bytes=float(short),
                minimum_devices=minimum if minimum > 0 else None,
            )
        per_device = np.zeros(devices.count)
        per_device[device] = table.bytes
        memory += per_device
        placements[table.name] = TablePlacement(table.name, "table_wise", device, tuple(per_device))
    ordered = tuple(placements[name] for name in names)
    disk = _disk_per_device(tables, ordered, shares, devices)
    if strategy == "ps":
        shard_traffic, trainer_traffic = _ps_traffic(tables, devices.count, shares, workload)
        traffic, trainer = shard_traffic, trainer_traffic
    else:
        traffic, trainer = _collective_traffic(tables, ordered, devices.count, workload), None
    notes = []
    if strategy == "ps" and workload.dense_parameters:
        notes.append("dense allreduce traffic is among the trainers and included in the trainer figure")
    return ShardingPlan(
        strategy=strategy,
        sharding=sharding,
        num_devices=devices.count,
        num_buckets=num_buckets,
        usable_bytes=devices.usable_bytes,
        tables=ordered,
        memory_bytes=tuple(float(m) for m in memory),
        traffic=traffic,
        trainer_traffic=trainer,
        notes=tuple(notes),
        disk_bytes=tuple(float(d) for d in disk),
    )


def _disk_per_device(
    tables: list[TableSize], placements: tuple[TablePlacement, ...], shares: np.ndarray, devices: Devices
) -> np.ndarray:
    disk = np.zeros(devices.count)
    for table, placement in zip(tables, placements, strict=True):
        if placement.owner is None:
            disk += shares * table.disk_bytes
        else:
            disk[placement.owner] += table.disk_bytes
    fullest = int(np.argmax(disk))
    if devices.disk_bytes is not None and disk[fullest] > devices.disk_bytes:
        raise PlanDoesNotFit(
            f"does not fit: device {fullest} would hold {_gb(disk[fullest])} of disk-tier rows but has "
            f"{_gb(devices.disk_bytes)} of disk: short by {_gb(disk[fullest] - devices.disk_bytes)}; keep more "
            "rows in memory or add devices.",
            shortfall_bytes=float(disk[fullest] - devices.disk_bytes),
            minimum_devices=None,
        )
    return disk


def _ids_per_step(table: TableSize, batch_size: int) -> float:
    return min(batch_size * table.ids_per_sample, float(table.rows))


def _allreduce_bytes(dense_parameters: int, world: int) -> float:
    return 2 * (world - 1) / world * VALUE_BYTES * dense_parameters if world > 1 else 0.0


def _collective_traffic(
    tables: list[TableSize], placements: tuple[TablePlacement, ...], world: int, workload: Workload
) -> tuple[Traffic, ...]:
    sent = np.zeros(world)
    received = np.zeros(world)
    for table, placement in zip(tables, placements, strict=True):
        n = _ids_per_step(table, workload.batch_size)
        request = ID_BYTES  # pull: id out
        reply = VALUE_BYTES * table.dim  # pull: row back
        gradient = ID_BYTES + VALUE_BYTES * table.dim  # push: id and gradient out
        if placement.owner is None:
            remote = n * (world - 1) / world  # of one trainer's ids, and of each owner's inbound
            sent += remote * (request + gradient) + remote * reply
            received += remote * reply + remote * (request + gradient)
        else:
            for rank in range(world):
                if rank == placement.owner:
                    inbound = n * (world - 1)
                    sent[rank] += inbound * reply
                    received[rank] += inbound * (request + gradient)
                else:
                    sent[rank] += n * (request + gradient)
                    received[rank] += n * reply
    dense = _allreduce_bytes(workload.dense_parameters, world)
    return tuple(Traffic(float(s + dense), float(r + dense)) for s, r in zip(sent, received, strict=True))


def _ps_traffic(
    tables: list[TableSize], num_shards: int, shares: np.ndarray, workload: Workload
) -> tuple[tuple[Traffic, ...], Traffic]:
    trainers = workload.num_trainers or 1
    out = sum(
        _ids_per_step(t, workload.batch_size) * (2 * ID_BYTES + VALUE_BYTES * t.dim) for t in tables
    )  # ids on pull and push, gradients
    back = sum(_ids_per_step(t, workload.batch_size) * VALUE_BYTES * t.dim for t in tables)
    dense = _allreduce_bytes(workload.dense_parameters, trainers)
    trainer = Traffic(float(out + dense), float(back + dense))
    shards = tuple(Traffic(float(back * trainers * s), float(out * trainers * s)) for s in shares)
    return shards, trainer


def plan_disk_tier(tables: list[TableSize], devices: Devices, *, num_buckets: int = 1024) -> list[TableSize]:
    """`tables` with ``memory_rows`` chosen so that, split row-wise over `devices`, they fit the devices'
    memory: the smallest tables whole in memory while they fit, then the same fraction of each of the
    others, the largest that fits the most loaded device (at least one row per device). Tables that
    all fit are returned unchanged. Raises `PlanDoesNotFit` when even the disk tier's index of every
    row does not fit."""
    share = float(_row_wise_shares(num_buckets, devices.count).max())
    budget = devices.usable_bytes / share  # bytes of whole tables the most loaded device can take

    def full(table: TableSize) -> float:
        return table.rows * row_bytes(table.dim, table.precision, table.optimizer)

    index = sum(t.rows for t in tables) * DISK_INDEX_BYTES_PER_ROW
    if index >= budget:
        raise PlanDoesNotFit(
            f"does not fit even with a disk tier: the disk index of every row needs {_gb(index * share)} on "
            f"the most loaded device, which has {_gb(devices.usable_bytes)} usable: add devices or memory.",
            shortfall_bytes=float((index - budget) * share),
            minimum_devices=None,
        )
    pending = sorted(tables, key=lambda t: (full(t), t.name))
    whole: set[str] = set()
    while pending:
        rest_index = sum(t.rows for t in pending[1:]) * DISK_INDEX_BYTES_PER_ROW
        if full(pending[0]) + rest_index > budget:
            break
        budget -= full(pending[0])
        whole.add(pending.pop(0).name)
    if not pending:
        return [replace(t, memory_rows=None) for t in tables]
    rest_index = sum(t.rows for t in pending) * DISK_INDEX_BYTES_PER_ROW
    fraction = (budget - rest_index) / (sum(full(t) for t in pending) - rest_index)
    return [
        replace(t, memory_rows=None)
        if t.name in whole
        else replace(t, memory_rows=max(int(fraction * t.rows), devices.count))
        for t in tables
    ]
