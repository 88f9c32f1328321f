"""The export directory: corrupt or torn exports are refused with the file named, an interrupted
export leaves nothing behind, exports go to object stores, and SASRec ranks through the export."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from psrec.serve import model_dir as model_files
from psrec.serve.export import export_run
from psrec.serve.model_dir import ExportError, read_model_dir
from psrec.serve.requests import RequestError, parse_request
from psrec.serve.scoring import ServingModel


def test_a_corrupt_or_torn_export_is_refused_naming_the_file(
    deepfm_run: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "model"
    export_run(deepfm_run["run_dir"], out)
    table = out / "tables" / "C1.npz"
    data = bytearray(table.read_bytes())
    data[-10] ^= 0x01
    table.write_bytes(bytes(data))
    with pytest.raises(ExportError, match="tables/C1.npz is corrupt"):
        read_model_dir(out)
    (out / "manifest.json").unlink()
    with pytest.raises(ExportError, match="not a psrec export"):
        read_model_dir(out)


def test_an_interrupted_export_leaves_the_previous_one(
    deepfm_run: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "model"
    first = export_run(deepfm_run["run_dir"], out, precision="int8")
    calls = {"n": 0}
    original = model_files.files.write_arrays

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full")
        return original(*args, **kwargs)

    monkeypatch.setattr(model_files.files, "write_arrays", failing)
    with pytest.raises(OSError, match="disk full"):
        export_run(deepfm_run["run_dir"], out, precision="fp32")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temporary directory left
    assert read_model_dir(out).serving["precision"] == first["precision"] == "int8"


def test_export_to_an_object_store(deepfm_run: dict[str, Any], s3_bucket: str) -> None:
    uri = f"s3://{s3_bucket}/exports/deepfm"
    info = export_run(deepfm_run["run_dir"], uri, precision="fp16")
    model = ServingModel.load(uri)
    assert model.version.label == info["version"]["label"]
    assert model.precision == "fp16"


def test_sasrec_ranks_given_candidates_and_the_whole_catalogue(
    sasrec_run: dict[str, Any], tmp_path: Path
) -> None:
    export_run(sasrec_run["run_dir"], tmp_path / "model")
    model = ServingModel.load(tmp_path / "model")
    rows = [{"seq": [3, 6, 9, 12]}, {"seq": "5|8"}]
    catalogue = model.score_requests([parse_request({"rows": rows, "k": 5}, model.request_spec)])[0]
    table = model.version.tables["items"]
    request = parse_request({"rows": rows}, model.request_spec)
    everything = model.candidate_logits(request.batch, np.stack([table.ids, table.ids]))
    for row in range(2):
        best = np.argsort(-everything[row], kind="stable")[:5]
        assert catalogue["items"][row] == table.ids[best].tolist()
        np.testing.assert_allclose(catalogue["scores"][row], everything[row][best], rtol=0, atol=1e-5)
    with pytest.raises(RequestError, match=r"rows\[1\]\.seq: is empty"):
        parse_request({"rows": [rows[0], {"seq": []}]}, model.request_spec)
    with pytest.raises(RequestError, match=r"rows\[0\]\.candidates: missing"):
        parse_request({"rows": [rows[0], {**rows[1], "candidates": [3]}]}, model.request_spec)
    given = [{**row, "candidates": [7, 1, 15]} for row in rows]
    answer = model.score_requests([parse_request({"rows": given, "k": 2}, model.request_spec)])[0]
    for row in range(2):
        logits = everything[row][np.searchsorted(table.ids, [7, 1, 15])]
        order = np.argsort(-logits, kind="stable")[:2]
        assert answer["items"][row] == [[7, 1, 15][i] for i in order]


def _bst_model(tmp_path: Path, item_values: list[str]) -> ServingModel:
    """A BST export (random rows) whose target table C1 holds exactly the hashes of ``item_values``."""
    import torch

    from psrec.checkpoint.policy import CheckpointRef
    from psrec.data.feature_hashing import hash_values
    from psrec.serve.export import export_programs, serving_description
    from psrec.serve.model_dir import ExportContents
    from psrec.serve.tables import ServingTable, TableSource
    from psrec.trainer import builders
    from tests.serve.test_export import MODELS, _config_for

    config = _config_for(next(m for m in MODELS if m["name"] == "bst"), tmp_path)
    torch.manual_seed(0)
    programs = export_programs(builders.build_model_for(config).eval(), config, dim=4)
    rng = np.random.default_rng(0)
    c1 = next(f for f in config.feature_schema().sparse if f.name == "C1")
    tables = {}
    for spec in builders.shard_table_specs(config):
        source = TableSource(dim=4, seed=spec.seed, initializer=spec.initializer.as_dict(), precision="fp32")
        ids = rng.choice(2**40, size=50, replace=False).astype(np.int64)
        if spec.name == "C1":
            ids = np.asarray(hash_values(c1.id_namespace, item_values), dtype=np.int64)
        values = rng.normal(size=(ids.size, 4)).astype(np.float32)
        tables[spec.name] = ServingTable.from_values(spec.name, ids, values, source=source, precision="fp32")
    ref = CheckpointRef(
        path=tmp_path, step=7, kind="full", checkpoint_id="0" * 32, parent_id=None, base_id=None, created=0.0
    )
    serving = serving_description(config, ref, tables, precision="fp32", run_dir=str(tmp_path))
    return ServingModel(ExportContents(serving, programs, {n: t.to_arrays() for n, t in tables.items()}))


def _bst_row() -> dict[str, Any]:
    row: dict[str, Any] = {f"I{i}": i for i in range(1, 14)} | {f"C{i}": f"v{i}" for i in range(1, 27)}
    row["history"] = ["a", "b", "c"]
    return row


def test_bst_ranks_candidates_as_the_rows_they_stand_for(tmp_path: Path) -> None:
    """BST with candidates: each candidate scored as the row with its target feature set to it."""
    model = _bst_model(tmp_path, [f"item{i}" for i in range(50)])
    row = _bst_row()
    candidates = ["x", "y", "z", "w"]
    ranked = model.score_requests(
        [parse_request({"rows": [{**row, "candidates": candidates}], "k": 3}, model.request_spec)]
    )[0]
    plain = [{**row, "C1": c} for c in candidates]
    scores = model.score_requests([parse_request({"rows": plain}, model.request_spec)])[0]["scores"]
    order = np.argsort(-np.asarray(scores), kind="stable")[:3]
    assert ranked["items"] == [[candidates[i] for i in order]]
    np.testing.assert_allclose(ranked["scores"][0], np.asarray(scores)[order], rtol=0, atol=1e-7)
    assert len(set(scores)) == 4  # the candidates really score differently
    with pytest.raises(RequestError, match=r"rows\[0\]\.candidates\[1\]"):
        parse_request({"rows": [{**row, "candidates": ["x", 1.5]}]}, model.request_spec)


def test_bst_ranks_the_catalogue_as_its_items_given_as_candidates(tmp_path: Path) -> None:
    """BST with "catalogue": true: the top-k of every item the target table holds, equal to the
    ranking of those same items given as candidates (itself checked against plain rows above)."""
    from psrec.data.feature_hashing import hash_values
    from psrec.serve import scoring

    values = [f"item{i}" for i in range(50)]
    model = _bst_model(tmp_path, values)
    c1 = model.request_spec.candidate_feature
    assert c1 is not None
    by_id = dict(zip(hash_values(c1.id_namespace, values).tolist(), values, strict=True))
    rows = [_bst_row(), {**_bst_row(), "history": ["q"], "I3": 9}]
    expected = model.score_requests(
        [parse_request({"rows": [{**r, "candidates": values} for r in rows], "k": 5}, model.request_spec)]
    )[0]
    catalogue_rows = [{k: v for k, v in r.items() if k != "C1"} for r in rows]
    for chunk in (4096, 7):  # one forward pass per row, and several
        scoring.CATALOGUE_CHUNK = chunk
        try:
            got = model.score_requests(
                [parse_request({"rows": catalogue_rows, "k": 5, "catalogue": True}, model.request_spec)]
            )[0]
        finally:
            scoring.CATALOGUE_CHUNK = 4096
        assert [[by_id[item] for item in items] for items in got["items"]] == expected["items"]
        np.testing.assert_allclose(got["scores"], expected["scores"], rtol=0, atol=1e-6)
    assert expected["items"][0] != expected["items"][1]  # the rows really rank differently
    bad: list[tuple[dict[str, Any], str]] = [
        ({"rows": rows, "catalogue": True}, "rows[0].C1"),
        ({"rows": catalogue_rows, "catalogue": "yes"}, "catalogue"),
        ({"rows": [{**catalogue_rows[0], "candidates": ["x"]}], "catalogue": True}, "rows[0].candidates"),
        (
            {"rows": [{k: v for k, v in catalogue_rows[0].items() if k != "C2"}], "catalogue": True},
            "rows[0].C2",
        ),
    ]
    for body, field in bad:
        with pytest.raises(RequestError, match=re.escape(field)):
            parse_request(body, model.request_spec)
