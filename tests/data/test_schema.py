"""Schema and DataSource validation: clear messages for bad configs, namespace tag clashes."""

import pytest
from pydantic import ValidationError

from psrec.data.feature_hashing import namespace_tag
from psrec.data.schema import DataSource, DenseFeature, Schema, SequenceFeature, SparseFeature
from psrec.data.synth import criteo_schema


def test_criteo_schema_shape() -> None:
    schema = criteo_schema()
    assert schema.label_names == ["label"]
    assert [f.name for f in schema.dense] == [f"I{i}" for i in range(1, 14)]
    assert all(f.log1p for f in schema.dense)
    assert [f.table for f in schema.sparse] == [f"C{i}" for i in range(1, 27)]
    assert criteo_schema(table_per_feature=False).sparse[3].table == "criteo"


def test_schema_round_trips_through_plain_data() -> None:
    schema = Schema(
        label=["click", "like"],
        dense=[DenseFeature(name="age", clip=(0, 100), log1p=True)],
        sparse=[
            SparseFeature(name="item", table="items"),
            SparseFeature(name="tags", table="tags", multi_valued=True),
        ],
        sequences=[SequenceFeature(name="history", table="items", max_length=5, namespace="item")],
    )
    assert Schema.model_validate(schema.model_dump()) == schema
    assert schema.sequences[0].id_namespace == schema.sparse[0].id_namespace == "item"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"label": "y", "dense": [{"name": "a", "fil": 1}]}, "fil"),
        ({"label": "y", "dense": [{"name": "a", "clip": [2, 1]}]}, "clip low"),
        ({"label": "y", "dense": [{"name": "y"}]}, "used twice"),
        ({"label": "y", "sequences": [{"name": "s", "table": "t", "max_length": 0}]}, "max_length"),
        ({"label": [], "dense": []}, "at least one label"),
    ],
)
def test_schema_rejects_bad_config_with_a_clear_message(data: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Schema.model_validate(data)


def test_schema_rejects_namespace_tag_clash_in_a_shared_table() -> None:
    tags: dict[int, str] = {}
    clash = None
    for index in range(100000):
        name = f"n{index}"
        other = tags.setdefault(namespace_tag(name), name)
        if other != name:
            clash = (other, name)
            break
    assert clash is not None
    sparse = [{"name": clash[0], "table": "shared"}, {"name": clash[1], "table": "shared"}]
    with pytest.raises(ValidationError, match="rename one"):
        Schema.model_validate({"label": "y", "sparse": sparse})
    sparse[1]["table"] = "other"  # different tables never share ids: fine
    Schema.model_validate({"label": "y", "sparse": sparse})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"format": "orc", "paths": ["a"]}, "format"),
        ({"format": "parquet", "paths": []}, "paths"),
        ({"format": "libfm", "paths": ["a"]}, "field_ranges"),
        ({"format": "libfm", "paths": ["a"], "field_ranges": {"a": [0, 5], "b": [5, 9]}}, "overlap"),
        ({"format": "parquet", "paths": ["a"], "delimiter": ";"}, "apply to csv"),
        ({"format": "csv", "paths": ["a"], "header": False}, "columns"),
        ({"format": "csv", "paths": ["a"], "on_error": "ignore"}, "on_error"),
    ],
)
def test_data_source_validation(data: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        DataSource.model_validate(data)


def test_data_source_defaults() -> None:
    tsv = DataSource(format="criteo_tsv", paths=["x"])
    assert tsv.text_delimiter == "\t" and not tsv.has_header and tsv.column_names[:2] == ["label", "I1"]
    csv = DataSource(format="csv", paths=["x"])
    assert csv.text_delimiter == "," and csv.has_header and csv.column_names is None
