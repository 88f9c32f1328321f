"""Moving virtual buckets between live shards: the move plan (pure) and the shard-side copy.

Changing the shard count while training moves whole virtual buckets (`psrec.ps.routing`): the
bucket map goes from N shards to M, in rounds of at most a few buckets, each round applied at a
step boundary:

1. **copy**: the source shard exports every row of the round's buckets with its optimizer state,
   access count and last step, and its table clock (`bucket_rows`); the destination adds them to its
   tables (`add_bucket_rows`): nothing else of its tables changes;
2. **switch**: every trainer routes with the new bucket map (a version number names it);
3. **drop**: the source removes the moved rows (`drop_buckets`).

Moves run at a step boundary, between the driver's calls to the trainers: no pull or push is in
flight then (a trainer returns from a chunk of steps only once its pushes are acknowledged), so
the copy holds every update of every step so far and none arrives until the switch: nothing to
catch up, no update lost or applied twice. A shard actor runs one call at a time, so a copy made
while training went on would hold that shard's pulls and pushes just as long; moving a few buckets
per boundary bounds each pause instead.

What moves with the rows: the admission state of a `min_count` table is a count-min sketch over all
of the shard's ids, which cannot be split by bucket; the source's sketch is added to the
destination's (it never under-counts an id, so an id is admitted no later than before, possibly
earlier), as a restore into another shard count does (`psrec.ps.reshard`). A `probability`
admission's draws depend on each shard's pull counter, which stays with its shard. In-memory
snapshots (the best model under early stopping) move their rows of the buckets too. After a move a
shard's next checkpoint must be full (`ParameterShard.needs_full_checkpoint`): a delta holds only
the rows changed since the last checkpoint, not the rows that arrived.

    plan = balanced_map(old_map, 3)                      # the target: 3 shards, fewest moves
    for round in move_rounds(old_map, plan, max_buckets=64):
        for move in round: add_bucket_rows(dst, bucket_rows(src, move.buckets, 1024))
        ...switch every trainer's map...
        for move in round: drop_buckets(src, move.buckets, 1024)
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from psrec.embedding import TableDelta, TableState
from psrec.embedding.state import CONFIG_KEY
from psrec.ps.reshard import arrays_for_shard
from psrec.ps.routing import bucket_of
from psrec.ps.shard import ParameterShard


class MoveError(ValueError):
    """A bucket move that cannot be done (a bad shard count, a shard in the middle of a step)."""


@dataclass(frozen=True)
class BucketMove:
    """Buckets that go from one shard to another in one round."""

    source: int
    destination: int
    buckets: tuple[int, ...]


# -- the plan (pure) ---------------------------------------------------------------------------
def target_counts(num_buckets: int, num_shards: int) -> np.ndarray:
    """Buckets each of `num_shards` shards holds when balanced: the first ``num_buckets % num_shards``
    shards one more than the others. Shape (num_shards,)."""
    check_shard_count(num_shards, num_buckets)
    counts = np.full(num_shards, num_buckets // num_shards, dtype=np.int64)
    counts[: num_buckets % num_shards] += 1
    return counts


def check_shard_count(num_shards: object, num_buckets: int) -> int:
    """`num_shards` as an int in [1, num_buckets], or a `MoveError` that says what to choose."""
    if isinstance(num_shards, bool) or not isinstance(num_shards, int | np.integer):
        raise MoveError(f"the shard count must be an integer, got {num_shards!r}")
    if not 1 <= num_shards <= num_buckets:
        raise MoveError(
            f"the shard count must be between 1 and the number of virtual buckets ({num_buckets}), "
            f"got {num_shards}: every shard owns at least one bucket (ps.num_buckets)"
        )
    return int(num_shards)


def balanced_map(bucket_map: np.ndarray, num_shards: int) -> np.ndarray:
    """The bucket map of `num_shards` shards, balanced (`target_counts`), that moves the fewest buckets
    from `bucket_map`: a shard keeps its buckets up to its target count (its lowest ones), shards at or
    beyond `num_shards` give all of theirs, and the buckets given go, in bucket order, to the shards
    below their target, in shard order."""
    bucket_map = np.asarray(bucket_map, dtype=np.int64)
    targets = target_counts(bucket_map.size, num_shards)
    new_map = bucket_map.copy()
    for shard in range(int(bucket_map.max()) + 1 if bucket_map.size else 0):
        owned = np.flatnonzero(bucket_map == shard)
        keep = int(targets[shard]) if shard < num_shards else 0
        new_map[owned[keep:]] = -1  # given away
    free = np.flatnonzero(new_map < 0)  # in bucket order
    kept = np.bincount(new_map[new_map >= 0], minlength=num_shards)[:num_shards]
    position = 0
    for shard in range(num_shards):
        missing = int(targets[shard] - kept[shard])
        new_map[free[position : position + missing]] = shard
        position += missing
    return new_map


def move_rounds(old_map: np.ndarray, new_map: np.ndarray, *, max_buckets: int) -> list[list[BucketMove]]:
    """The moves from `old_map` to `new_map` in rounds of at most `max_buckets` buckets (in bucket
    order), each round's moves grouped by (source, destination)."""
    if max_buckets < 1:
        raise MoveError(f"max_buckets must be >= 1, got {max_buckets}")
    old_map, new_map = np.asarray(old_map), np.asarray(new_map)
    if old_map.shape != new_map.shape:
        raise MoveError(f"bucket maps of {old_map.size} and {new_map.size} buckets")
    moving = np.flatnonzero(old_map != new_map)
    rounds = []
    for start in range(0, moving.size, max_buckets):
        chunk = moving[start : start + max_buckets]
        pairs: dict[tuple[int, int], list[int]] = {}
        for bucket in chunk.tolist():
            pairs.setdefault((int(old_map[bucket]), int(new_map[bucket])), []).append(bucket)
        rounds.append([BucketMove(s, d, tuple(b)) for (s, d), b in sorted(pairs.items())])
    return rounds


def apply_round(bucket_map: np.ndarray, moves: list[BucketMove]) -> np.ndarray:
    """`bucket_map` after `moves` (a new array); a move whose source does not own its buckets fails."""
    out = np.asarray(bucket_map, dtype=np.int64).copy()
    for move in moves:
        buckets = np.asarray(move.buckets, dtype=np.int64)
        owners = out[buckets]
        if np.any(owners != move.source):
            raise MoveError(
                f"buckets {buckets[owners != move.source].tolist()} are not on shard {move.source}"
            )
        out[buckets] = move.destination
    return out


# -- the shard side ------------------------------------------------------------------------------
def _in_buckets(ids: np.ndarray, buckets: np.ndarray, num_buckets: int) -> np.ndarray:
    member = np.zeros(num_buckets, dtype=bool)
    member[buckets] = True
    return member[bucket_of(ids, num_buckets)]


def _check_between_steps(shard: ParameterShard, action: str) -> None:
    if shard.pending_step is not None:
        raise MoveError(
            f"shard {shard.shard_index}: cannot {action} in the middle of step {shard.pending_step}; "
            "buckets move between steps"
        )


def bucket_rows(
    shard: ParameterShard, buckets: tuple[int, ...] | list[int], num_buckets: int
) -> dict[str, np.ndarray]:
    """Every table's rows of `buckets` (ids, payload, optimizer state, counts, last steps), as flat
    {"table/field": array} of a `TableDelta`, with each table's clock and, for a `min_count` table,
    its admission sketch; and each in-memory snapshot's rows of the buckets under "@tag/table/field"."""
    _check_between_steps(shard, "export buckets")
    chosen = np.asarray(buckets, dtype=np.int64)
    out: dict[str, np.ndarray] = {}
    for name, table in shard.tables.items():
        state = table.export_state()
        out.update({f"{name}/{key}": value for key, value in _part(state, chosen, num_buckets).items()})
    for tag in shard.snapshot_tags():
        arrays = shard.snapshot_arrays(tag)
        part = arrays_for_shard([arrays], owns=lambda ids: _in_buckets(ids, chosen, num_buckets))
        out.update({f"@{tag}/{key}": _moved_field(key, value) for key, value in part.items()})
    return out


def _moved_field(key: str, value: np.ndarray) -> np.ndarray:
    """A snapshot's field as it moves: its config without the source's own pull counter."""
    if not key.endswith("/" + CONFIG_KEY):
        return value
    config = json.loads(str(np.asarray(value)[()]))
    config["admission_pull_counter"] = 0
    return np.array(json.dumps(config, sort_keys=True))


def _part(state: TableState, buckets: np.ndarray, num_buckets: int) -> dict[str, np.ndarray]:
    """The delta that adds `state`'s rows of `buckets` to another shard's table."""
    mask = _in_buckets(state.ids, buckets, num_buckets)
    config = {k: v for k, v in state.config.items() if k != "admission_pull_counter"}
    delta = TableDelta(
        config=config,
        ids=state.ids[mask],
        rows=state.rows[mask],
        counts=state.counts[mask],
        last_step=state.last_step[mask],
        removed_ids=np.zeros(0, dtype=np.int64),
        optimizer_state={key: value[mask] for key, value in state.optimizer_state.items()},
        row_scale=None if state.row_scale is None else state.row_scale[mask],
        row_offset=None if state.row_offset is None else state.row_offset[mask],
        admission_sketch=state.admission_sketch,
    )
    return delta.to_arrays()


def _split(
    arrays: dict[str, np.ndarray],
) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, dict[str, np.ndarray]]]:
    tables: dict[str, dict[str, np.ndarray]] = {}
    snapshots: dict[str, dict[str, np.ndarray]] = {}
    for key, value in arrays.items():
        if key.startswith("@"):
            tag, _, rest = key[1:].partition("/")
            snapshots.setdefault(tag, {})[rest] = value
        else:
            name, _, field = key.partition("/")
            tables.setdefault(name, {})[field] = value
    return tables, snapshots


def add_bucket_rows(shard: ParameterShard, arrays: dict[str, np.ndarray], *, num_buckets: int) -> int:
    """Add the rows `bucket_rows` exported from another shard to this shard's tables (and
    snapshots); returns the rows added. The rows' ids must be new to this shard."""
    _check_between_steps(shard, "import buckets")
    tables, snapshots = _split(arrays)
    for name in tables:
        shard._table(name)  # every table named before anything changes
    added = 0
    for name, fields in tables.items():
        table = shard.tables[name]
        delta = TableDelta.from_arrays(fields)
        if delta.admission_sketch is not None:  # a min_count sketch: the sum of both shards'
            own = table.export_state().admission_sketch
            assert own is not None
            total = own.astype(np.uint64) + delta.admission_sketch.astype(np.uint64)
            delta.admission_sketch = np.minimum(total, np.iinfo(np.uint32).max).astype(np.uint32)
        table.apply_delta(delta)
        added += int(delta.ids.shape[0])
    for tag, fields in snapshots.items():
        mine = shard.snapshot_arrays(tag) if tag in shard.snapshot_tags() else None
        merged = fields if mine is None else _merged_snapshot(mine, fields)
        shard.load_snapshot_arrays(tag, merged)
    shard.needs_full_checkpoint = True
    return added


def _merged_snapshot(mine: dict[str, np.ndarray], theirs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A snapshot's full states plus rows of other buckets (their config's clock: the larger)."""
    theirs = {key: value for key, value in theirs.items() if not key.endswith("/removed_ids")}
    return arrays_for_shard([mine, theirs], owns=lambda ids: np.ones(ids.shape, dtype=bool))


def drop_buckets(shard: ParameterShard, buckets: tuple[int, ...] | list[int], num_buckets: int) -> int:
    """Remove every row of `buckets` from this shard's tables and snapshots (they live on another
    shard now); returns the rows removed."""
    _check_between_steps(shard, "drop buckets")
    chosen = np.asarray(buckets, dtype=np.int64)
    removed = 0
    for table in shard.tables.values():
        ids = table.export_state().ids
        removed += table.remove(ids[_in_buckets(ids, chosen, num_buckets)])
    for tag in shard.snapshot_tags():
        arrays = shard.snapshot_arrays(tag)
        shard.load_snapshot_arrays(
            tag, arrays_for_shard([arrays], owns=lambda ids: ~_in_buckets(ids, chosen, num_buckets))
        )
    shard.needs_full_checkpoint = True
    return removed


def start_at(shard: ParameterShard, step: int) -> None:
    """A new shard joining at `step`: it expects that step's pushes next (earlier ones are retries)."""
    shard.applied_step = step - 1
    shard.last_request = {trainer: step - 1 for trainer in range(shard.num_trainers)}
