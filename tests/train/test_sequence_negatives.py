"""The sampled softmax's negatives: what the interactions reader draws, and the config checks around them.

pytest tests/train/test_sequence_negatives.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from psrec.config import parse_config
from psrec.data.reader import open_reader
from psrec.data.schema import DataSource, Schema
from psrec.data.sequences import load_interactions, sasrec_schema

NUM_ITEMS, LENGTH, NEGATIVES = 50, 5, 16


@pytest.fixture(scope="module")
def interactions(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("interactions") / "interactions.txt"
    rng = np.random.default_rng(2)
    lines = [
        f"{user} {item}\n"
        for user in range(1, 31)
        for item in rng.choice(np.arange(1, NUM_ITEMS + 1), size=rng.integers(4, 30), replace=False).tolist()
    ]
    path.write_text("".join(lines))
    return path


def read(path: Path, schema: Schema, seed: int, **source_options: Any) -> dict[int, dict[str, np.ndarray]]:
    """user -> {sequence name: its real ids} over one reader pass."""
    source = DataSource(format="interactions", paths=[str(path)], **source_options)
    out: dict[int, dict[str, np.ndarray]] = {}
    with open_reader(source, schema, batch_size=7, seed=seed) as reader:
        for batch in reader:
            for row, user in enumerate(batch.row_ids.tolist()):
                out[user] = {
                    name: sequence.ids[row][sequence.mask[row]] for name, sequence in batch.sequences.items()
                }
    return out


def test_each_user_gets_its_count_of_unseen_negatives_fresh_every_epoch(interactions: Path) -> None:
    data = load_interactions([interactions])
    schema = sasrec_schema(LENGTH, num_negatives=NEGATIVES)
    first, again, later = (
        read(interactions, schema, 7),
        read(interactions, schema, 7),
        read(interactions, schema, 8),
    )
    plain = read(interactions, sasrec_schema(LENGTH), 7)
    assert set(first) == set(plain) == set(data.users.tolist())
    changed = []
    for user, rows in first.items():
        train = data.split(int(np.searchsorted(data.users, user)))[0]
        negatives = rows["negatives"]
        assert negatives.shape == (NEGATIVES,)
        assert not np.isin(negatives, train).any() and ((negatives >= 1) & (negatives <= NUM_ITEMS)).all()
        np.testing.assert_array_equal(again[user]["negatives"], negatives)  # a reopened epoch: the same
        np.testing.assert_array_equal(rows["neg"], plain[user]["neg"])  # "neg" does not move
        changed.append(np.mean(later[user]["negatives"] != negatives))
    assert np.mean(changed) > 0.9
    # Uniform over the unseen items: every item of some user's unseen set shows up over the epoch.
    drawn = np.concatenate([rows["negatives"] for rows in first.values()])
    assert np.unique(drawn).size == NUM_ITEMS


def test_negatives_from_all_draws_uniformly_over_every_item(interactions: Path) -> None:
    """Oracle: uniform draws over all items hit the user's own training items at the rate of their
    share of the items (binomial), while the "unseen" draws never do; "neg" does not move."""
    data = load_interactions([interactions])
    schema = sasrec_schema(LENGTH, num_negatives=NEGATIVES)
    unseen, every = read(interactions, schema, 7), read(interactions, schema, 7, negatives_from="all")
    hits, expected, variance = 0, 0.0, 0.0
    for user, rows in every.items():
        train = data.split(int(np.searchsorted(data.users, user)))[0]
        negatives = rows["negatives"]
        assert negatives.shape == (NEGATIVES,) and ((negatives >= 1) & (negatives <= NUM_ITEMS)).all()
        np.testing.assert_array_equal(rows["neg"], unseen[user]["neg"])
        share = np.unique(train).size / NUM_ITEMS
        hits += int(np.isin(negatives, train).sum())
        expected += NEGATIVES * share
        variance += NEGATIVES * share * (1 - share)
    assert abs(hits - expected) < 5 * variance**0.5 and hits > 0
    with pytest.raises(ValueError, match="negatives_from applies to format 'interactions' only"):
        DataSource(format="csv", paths=["x.csv"], negatives_from="all")


def sasrec_config(schema: Schema, **model: Any) -> dict[str, Any]:
    return {
        "data": {"schema": schema.model_dump(), "train": {"format": "interactions", "paths": ["x.txt"]}},
        "model": {"name": "sasrec", "max_length": LENGTH, **model},
    }


def test_the_config_pairs_the_sampled_softmax_with_its_negatives() -> None:
    config = parse_config(
        sasrec_config(sasrec_schema(LENGTH, num_negatives=NEGATIVES), loss="sampled_softmax")
    )
    assert config.model.loss == "sampled_softmax"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"add \{name: negatives, table: items, max_length: N"):
        parse_config(sasrec_config(sasrec_schema(LENGTH), loss="sampled_softmax"))
    with pytest.raises(ValueError, match="only model.loss 'sampled_softmax' uses"):
        parse_config(sasrec_config(sasrec_schema(LENGTH, num_negatives=NEGATIVES)))
    other_table = sasrec_schema(LENGTH, num_negatives=NEGATIVES).model_dump()
    other_table["sequences"][-1]["table"] = "other"
    with pytest.raises(ValueError, match="must use the item table of 'seq'"):
        parse_config(
            {
                **sasrec_config(sasrec_schema(LENGTH), loss="sampled_softmax"),
                "data": {"schema": other_table, "train": {"format": "interactions", "paths": ["x.txt"]}},
            }
        )
    piped = parse_config(  # the pipeline's last stage computes the sampled softmax too
        {
            **sasrec_config(sasrec_schema(LENGTH, num_negatives=NEGATIVES), loss="sampled_softmax"),
            "ps": {"num_trainers": 2, "pipeline": {"stages": 2}},
        }
    )
    assert piped.ps.pipeline is not None
