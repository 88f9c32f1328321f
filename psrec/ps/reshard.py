"""One shard's part of a checkpoint written with another shard count (or another bucket map).

A checkpoint holds a file per shard of the layout that wrote it. A shard of a different layout
restores from it by reading every old file and keeping the rows whose virtual bucket it owns now:
`arrays_for_shard` merges the old shards' full states (or deltas) of each table into the arrays
this shard would have written itself. Rows, optimizer state, counts and last steps move with their
ids (each id lived in exactly one old shard), so a resumed run in sync mode trains exactly as it
would have with the old shard count. Per-table counters that each shard kept on its own are
combined: the clock is the largest, the `probability` admission pull counter the sum, and a
`min_count` admission sketch the element-wise sum of the old shards' sketches (a count-min sketch
that still never under-counts an id, so an id is admitted no later than before, possibly earlier).

    arrays = arrays_for_shard(old_files, owns=lambda ids: new_map[bucket_of(ids, 1024)] == 2)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import numpy as np

from psrec.embedding.state import CONFIG_KEY, OPTIMIZER_PREFIX

# Per-row fields of a TableState / TableDelta (row i of each belongs to ids[i]).
PER_ROW = frozenset({"ids", "rows", "counts", "last_step", "row_scale", "row_offset"})


def arrays_for_shard(
    old_shards: Sequence[dict[str, np.ndarray]], *, owns: Callable[[np.ndarray], np.ndarray]
) -> dict[str, np.ndarray]:
    """Flat {"table/field": array} of one new shard, from every old shard's flat arrays of one
    checkpoint (all full or all delta). ``owns(ids)`` is a boolean mask: the ids this shard owns."""
    if not old_shards:
        raise ValueError("arrays_for_shard: no old shard files")
    tables = sorted({key.partition("/")[0] for key in old_shards[0]})
    out: dict[str, np.ndarray] = {}
    for table in tables:
        parts = [_fields(arrays, table) for arrays in old_shards]
        fields = set(parts[0])
        for index, part in enumerate(parts[1:], start=1):
            if set(part) != fields:
                raise ValueError(
                    f"table {table!r}: old shard {index} has fields {sorted(part)}, shard 0 {sorted(fields)}"
                )
        masks = [owns(np.asarray(part["ids"])) for part in parts]
        order = np.argsort(
            np.concatenate([part["ids"][mask] for part, mask in zip(parts, masks, strict=True)])
        )
        for name in sorted(fields):
            values = [part[name] for part in parts]
            if name == CONFIG_KEY:
                merged = _merged_config(values)
            elif name == "admission_sketch":
                total = np.sum([value.astype(np.uint64) for value in values], axis=0)
                merged = np.minimum(total, np.iinfo(np.uint32).max).astype(np.uint32)
            elif name == "removed_ids":
                merged = np.concatenate([value[owns(np.asarray(value))] for value in values])
            elif name in PER_ROW or name.startswith(OPTIMIZER_PREFIX):
                merged = np.concatenate([value[mask] for value, mask in zip(values, masks, strict=True)])[
                    order
                ]
            else:
                raise ValueError(f"table {table!r}: unknown checkpoint field {name!r}")
            out[f"{table}/{name}"] = merged
    return out


def _fields(arrays: dict[str, np.ndarray], table: str) -> dict[str, np.ndarray]:
    prefix = table + "/"
    return {key[len(prefix) :]: value for key, value in arrays.items() if key.startswith(prefix)}


def _merged_config(values: list[np.ndarray]) -> np.ndarray:
    configs = [json.loads(str(np.asarray(value)[()])) for value in values]
    merged = dict(configs[0])
    merged["clock"] = max(int(config.get("clock", 0)) for config in configs)
    merged["admission_pull_counter"] = sum(int(config.get("admission_pull_counter", 0)) for config in configs)
    return np.array(json.dumps(merged, sort_keys=True))
