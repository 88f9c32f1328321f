"""A reader's share of an epoch as explicit parts, and the rest of an epoch dealt to a new reader count.

A reader normally reads the standard share of shard `s` of `N` (`psrec.data.units.shard_units`: unit
i goes to shard i mod N, in an order shuffled by the seed). When the number of readers changes in
the middle of an epoch (trainers added or removed between steps), the rows not read yet are dealt to
the new readers by `redistribute`, a pure function of the old readers' positions. A reader then
reads an explicit share: a list of parts, each part an ordered list of dataset unit indices, the key
that seeds its shuffle windows, and where reading starts in it::

    {"units": [7, 3, 11], "key": [seed, shard], "generation": 0,
     "start": {"window": 4, "unit": 0, "after": 1023, "consumed": 96, "end_unit": 1}}

Every position of such a reader carries the share (``"share"``) and the part it stands in
(``"part"``), so a checkpoint resumes it exactly.

How the rest of one part is split, exactly: its position says where the current shuffle window
starts (unit `u`, offset `after`), how many of its rows were delivered (`consumed`) and the unit its
window ends in (`end_unit` `e`). Rows of units after `e` belong to no window yet: those units are
free, dealt to the new readers whole. Units `u..e` stay together as a head part that starts where
the old reader stood: re-read from the same start with the same key, its first window is the same
rows in the same order, so dropping the `consumed` rows drops exactly the rows already read (the
reader's ordinary resume). With nothing consumed (`consumed` 0), `e` is `u`. A position without
`end_unit` keeps the whole rest of its part as the head. So every row of the epoch is read exactly
once, whatever the sequence of changes; only the order of the rows after a change differs.

Heads go to new reader `i mod M` in the old readers' order; free units are dealt round robin (then
shuffled per reader when the reader shuffles), so the new shares differ by at most a unit or so.
"""

from __future__ import annotations

from typing import Any

import numpy as np

START_KEYS = ("window", "unit", "after", "consumed", "end_unit")
IDENTITY_KEYS = ("version", "format", "seed", "shuffle_buffer")
_FREE_KEY = 1 << 33  # first element of a free part's shuffle key (a standard key starts with the seed)


def zero_start() -> dict[str, Any]:
    return {"window": 0, "unit": 0, "after": None, "consumed": 0, "end_unit": 0}


def standard_units(shard: int, num_shards: int, num_units: int, *, seed: int, shuffled: bool) -> list[int]:
    """Dataset unit indices of the standard share of shard `shard` of `num_shards`, in reading order
    (`num_units`: how many it holds)."""
    units = [shard + k * num_shards for k in range(num_units)]
    if shuffled:
        order = np.random.default_rng([seed, shard, 1 << 32]).permutation(num_units)
        units = [units[i] for i in order]
    return units


def share_of(position: dict[str, Any]) -> list[dict[str, Any]]:
    """The parts a reader at `position` reads in the epoch (the standard share as one part)."""
    if "share" in position:
        return [dict(part) for part in position["share"]]
    seed, shard = int(position["seed"]), int(position["shard"])
    units = standard_units(
        shard,
        int(position["num_shards"]),
        int(position["num_units"]),
        seed=seed,
        shuffled=int(position["shuffle_buffer"]) > 0,
    )
    return [{"units": units, "key": [seed, shard], "generation": 0, "start": zero_start()}]


def _split(part: dict[str, Any], start: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
    """The head of `part` read from `start` (the units the current window may span) and its free units."""
    units = list(part["units"])
    first = int(start.get("unit") or 0)
    consumed = int(start.get("consumed") or 0)
    if consumed == 0:
        last = first
    elif start.get("end_unit") is None:
        last = len(units) - 1  # the window's end is unknown: keep the whole rest together
    else:
        last = int(start["end_unit"])
    last = min(max(last, first), len(units) - 1)
    head_start = {
        "window": int(start.get("window") or 0),
        "unit": 0,
        "after": start.get("after"),
        "consumed": consumed,
        "end_unit": last - first,
    }
    head = {**part, "units": units[first : last + 1], "start": head_start}
    return head, units[last + 1 :]


def redistribute(positions: list[dict[str, Any]], num_shards: int) -> list[dict[str, Any]]:
    """Positions of `num_shards` readers that together read exactly the rows the readers at
    `positions` (one per old reader, same epoch) had not read yet; see the module docstring."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if not positions:
        raise ValueError("redistribute needs the positions of the old readers")
    identity = {key: positions[0].get(key) for key in IDENTITY_KEYS}
    for position in positions[1:]:
        other = {key: position.get(key) for key in IDENTITY_KEYS}
        if other != identity:
            raise ValueError(f"the readers' positions are of different epochs or data: {identity} vs {other}")
    heads: list[dict[str, Any]] = []
    free: list[int] = []
    generation = 0
    for position in positions:
        parts = share_of(position)
        current = int(position.get("part") or 0)
        for index in range(current, len(parts)):
            part = parts[index]
            generation = max(generation, int(part.get("generation") or 0))
            start = {key: position.get(key) for key in START_KEYS} if index == current else part["start"]
            head, rest = _split(part, start)
            if head["units"]:
                heads.append(head)
            free.extend(rest)
    generation += 1
    seed, shuffled = int(identity["seed"] or 0), int(identity["shuffle_buffer"] or 0) > 0
    shares: list[list[dict[str, Any]]] = [[] for _ in range(num_shards)]
    for index, head in enumerate(heads):
        shares[index % num_shards].append(head)
    offset = len(heads) % num_shards  # free units go first to the readers with fewer heads
    for reader in range(num_shards):
        units = free[(reader - offset) % num_shards :: num_shards]
        if not units:
            continue
        key = [_FREE_KEY, seed, generation, reader]
        if shuffled:
            order = np.random.default_rng(key).permutation(len(units))
            units = [units[i] for i in order]
        shares[reader].append({"units": units, "key": key, "generation": generation, "start": zero_start()})
    return [
        {
            **identity,
            "shard": reader,
            "num_shards": num_shards,
            "num_units": sum(len(part["units"]) for part in share),
            "share": share,
            "part": 0,
            **(share[0]["start"] if share else zero_start()),
        }
        for reader, share in enumerate(shares)
    ]
