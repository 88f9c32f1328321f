"""Request validation and featurization: rows featurize exactly as the training reader does, and
every kind of bad input is a RequestError naming the field."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from psrec.data.features import ROW_ID, prepare_table, table_to_batch
from psrec.data.schema import Schema
from psrec.serve.requests import RequestError, RequestSpec, decode_body, parse_request

SCHEMA = Schema.model_validate(
    {
        "label": "label",
        "dense": [{"name": "age", "log1p": True, "fill": 2.0}, {"name": "price", "clip": [0, 10]}],
        "sparse": [
            {"name": "city", "table": "city"},
            {"name": "item", "table": "item", "hashed": False},
            {"name": "tags", "table": "tags", "multi_valued": True},
        ],
    }
)
SPEC = RequestSpec(schema=SCHEMA, kind="ctr", candidate_feature=None, max_rows=8)
ROW = {"age": 30, "price": 12.5, "city": "paris", "item": 17, "tags": ["a", "b"]}


def test_rows_featurize_as_the_training_reader_does() -> None:
    rows = [ROW, {"age": None, "price": -1, "city": 75, "item": 0, "tags": "c|d|"}, {**ROW, "tags": []}]
    batch = parse_request({"rows": rows}, SPEC).batch
    # the oracle: the same values as a training table (text columns, as a CSV reader gives them)
    table = pa.table(
        {
            "label": pa.array([0.0, 0.0, 0.0]),
            "age": pa.array([30.0, None, 30.0]),
            "price": pa.array([12.5, -1.0, 12.5]),
            "city": pa.array(["paris", "75", "paris"]),
            "item": pa.array([17, 0, 17]),
            "tags": pa.array(["a|b", "c|d|", ""]),
            ROW_ID: pa.array(np.arange(3, dtype=np.int64)),
        }
    )
    expected = table_to_batch(SCHEMA, prepare_table(SCHEMA, table))
    np.testing.assert_array_equal(batch.dense, expected.dense)
    np.testing.assert_array_equal(batch.sparse.ids, expected.sparse.ids)
    np.testing.assert_array_equal(batch.sparse.lengths, expected.sparse.lengths)
    assert batch.dense[1, 0] == np.float32(np.log1p(2.0)) and batch.dense[0, 1] == 10.0


@pytest.mark.parametrize(
    ("body", "field", "status"),
    [
        ({}, "rows", 400),
        ({"rows": {}}, "rows", 400),
        ({"rows": []}, "rows", 400),
        ({"rows": [ROW] * 9}, "rows", 413),
        ({"rows": [ROW], "extra": 1}, "extra", 400),
        ({"rows": [ROW], "k": 5}, "k", 400),
        ({"rows": [ROW, 3]}, "rows[1]", 400),
        ({"rows": [{**ROW, "colour": 1}]}, "rows[0].colour", 400),
        ({"rows": [{k: v for k, v in ROW.items() if k != "price"}]}, "rows[0].price", 400),
        ({"rows": [{**ROW, "age": "old"}]}, "rows[0].age", 400),
        ({"rows": [{**ROW, "age": True}]}, "rows[0].age", 400),
        ({"rows": [{**ROW, "city": 1.5}]}, "rows[0].city", 400),
        ({"rows": [{**ROW, "city": ["x"]}]}, "rows[0].city", 400),
        ({"rows": [{**ROW, "item": "17"}]}, "rows[0].item", 400),
        ({"rows": [{**ROW, "item": None}]}, "rows[0].item", 400),
        ({"rows": [{**ROW, "item": 2**48}]}, "rows[0].item", 400),
        ({"rows": [{**ROW, "item": -1}]}, "rows[0].item", 400),
        ({"rows": [{**ROW, "tags": 5}]}, "rows[0].tags", 400),
        ({"rows": [{**ROW, "tags": ["a", {"b": 1}]}]}, "rows[0].tags[1]", 400),
    ],
)
def test_bad_input_names_the_field(body: dict[str, Any], field: str, status: int) -> None:
    with pytest.raises(RequestError) as caught:
        parse_request(body, SPEC)
    assert caught.value.field == field
    assert caught.value.status == status
    assert str(caught.value).startswith(f"{field}: ")


@pytest.mark.parametrize("raw", [b"{", b"\xff", b"[]", b"3", b'"rows"'])
def test_a_body_that_is_not_a_json_object_is_refused(raw: bytes) -> None:
    with pytest.raises(RequestError) as caught:
        decode_body(raw)
    assert caught.value.field == "body" and caught.value.status == 400
