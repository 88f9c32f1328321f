"""`psrec export`: every model round-trips through torch.export; served scores equal the trainer's
evaluation scores for the same checkpoint (1e-5 at fp32, AUC within 0.0005 at fp16/int8); an HSTU
export's top-k over the catalogue is the trainer's own full ranking."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from psrec import checkpoint
from psrec.data.sequences import evaluation_batches, full_ranking_batches, load_interactions
from psrec.serve.export import ProgramInput, example_inputs, export_programs, export_run, servable_config
from psrec.serve.model_dir import MODEL_FILE, ExportContents, ExportError, load_program, read_model_dir
from psrec.serve.requests import parse_request
from psrec.serve.scoring import ServingModel
from psrec.serve.tables import ServingTable, TableSource
from psrec.train.runtime import LocalRuntime
from psrec.trainer import builders
from psrec.trainer.metrics import auc
from tests.conftest import small_run_config

MODELS: list[dict[str, Any]] = [
    {"name": "lr"},
    {"name": "fm"},
    {"name": "wide_deep", "hidden_sizes": [8]},
    {"name": "deepfm", "hidden_sizes": [8]},
    {"name": "dcn_v2", "hidden_sizes": [8], "num_cross_layers": 2},
    {"name": "dlrm", "bottom_hidden_sizes": [8], "top_hidden_sizes": [8]},
    {"name": "bst", "target_feature_index": 0, "max_length": 4, "hidden_sizes": [8], "num_heads": 2},
    {"name": "sasrec", "max_length": 6, "num_heads": 2},
    {"name": "hstu", "max_length": 6, "num_heads": 2, "attention_dim": 2, "linear_dim": 3},
]
NEXT_ITEM_MODELS = ("sasrec", "hstu")


def _config_for(model: dict[str, Any], tmp_path: Path) -> Any:
    sources = {"train": {"format": "parquet", "paths": ["unused.parquet"]}}
    overrides: dict[str, Any] = {"model": model}
    if model["name"] == "bst":
        overrides["data.schema.sequences"] = [{"name": "history", "table": "C1", "max_length": 4}]
    if model["name"] in NEXT_ITEM_MODELS:
        sequence = {"table": "items", "max_length": 6, "hashed": False, "namespace": "item"}
        targets = ("seq", "pos", "neg") if model["name"] == "sasrec" else ("seq", "pos", "negatives")
        overrides["data.schema"] = {
            "label": "label",
            "sequences": [{"name": n, **sequence} for n in targets],
        }
    return small_run_config(sources, tmp_path, **overrides)


@pytest.mark.parametrize("model", MODELS, ids=[m["name"] for m in MODELS])
def test_every_model_round_trips_through_torch_export(model: dict[str, Any], tmp_path: Path) -> None:
    """The loaded program (torch alone, no psrec model class) equals the eager model's predict,
    at batch sizes other than the traced one (1 and 5). HSTU is exported on its padded path; the
    program also equals the packed (jagged) model it was trained as, within float rounding."""
    config = _config_for(model, tmp_path)
    torch.manual_seed(0)
    eager = builders.build_model_for(servable_config(config)).eval()
    trained = builders.build_model_for(config).eval()
    trained.load_state_dict(eager.state_dict())
    programs = export_programs(eager, config, dim=4)
    loaded = {name: load_program(data, where=name) for name, data in programs.items()}
    reference = ProgramInput(eager).eval()
    for batch in (1, 5):
        torch.manual_seed(batch)
        arguments, _ = example_inputs(config, dim=4)
        arguments = _resized(arguments, batch)
        with torch.no_grad():
            expected = reference(*arguments)
            got = loaded[MODEL_FILE](*arguments)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
        if model["name"] != "hstu":
            continue
        dense, pooled, linear, sequences, masks = arguments
        lengths = torch.arange(batch) % 6 + 1  # histories as the trainer packs them: right-aligned
        aligned = {name: torch.arange(6) >= 6 - lengths[:, None] for name in masks}
        with torch.no_grad():
            torch.testing.assert_close(
                ProgramInput(trained)(dense, pooled, linear, sequences, aligned),
                loaded[MODEL_FILE](dense, pooled, linear, sequences, aligned),
                rtol=0,
                atol=1e-5,
            )
    if model["name"] in NEXT_ITEM_MODELS:
        arguments, _ = example_inputs(config, dim=4, catalogue=True)
        with torch.no_grad():
            torch.testing.assert_close(
                loaded["catalogue.pt2"](*arguments), reference(*arguments), rtol=0, atol=1e-6
            )


def _resized(arguments: tuple[Any, ...], batch: int) -> tuple[Any, ...]:
    dense, pooled, linear, sequences, masks = arguments

    def new(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.bool:
            mask = torch.rand(batch, *t.shape[1:]) > 0.4
            mask[:, -1] = True
            return mask
        return torch.randn(batch, *t.shape[1:])

    return (
        new(dense),
        new(pooled),
        None if linear is None else new(linear),
        {k: new(v) for k, v in sequences.items()},
        {k: new(v) for k, v in masks.items()},
    )


def _raw_rows(paths: list[str]) -> list[dict[str, Any]]:
    import glob

    files = sorted(f for pattern in paths for f in glob.glob(pattern))
    rows: list[dict[str, Any]] = []
    for file in files:
        table = pq.read_table(file)
        rows.extend(table.drop_columns(["label"]).to_pylist())
    return rows


def _trainer_scores(run: dict[str, Any], ref: Any, split: str = "validation") -> dict[str, np.ndarray]:
    """The trainer's evaluation of ``split`` after restoring the chain of checkpoint ``ref``."""
    config = run["config"]
    runtime = LocalRuntime(config, base_dir=".", data_sources=run["sources"])
    try:
        runtime.restore(_chain(run["run_dir"], ref))
        return runtime.evaluate(split)
    finally:
        runtime.shutdown()


def _chain(run_dir: Path, ref: Any) -> list[Any]:
    from psrec.serve.export import chain_to

    return chain_to(ref, checkpoint.list_checkpoints(run_dir))


def _served_scores(model: ServingModel, rows: list[dict[str, Any]], chunk: int = 1000) -> np.ndarray:
    parts = []
    for start in range(0, len(rows), chunk):
        request = parse_request({"rows": rows[start : start + chunk]}, model.request_spec)
        parts.append(np.asarray(model.score_requests([request])[0]["scores"], dtype=np.float64))
    return np.concatenate(parts)


def test_deepfm_served_scores_equal_the_trainers_evaluation(
    deepfm_run: dict[str, Any], exported: Any
) -> None:
    refs = checkpoint.list_checkpoints(deepfm_run["run_dir"])
    kinds = [ref.kind for ref in refs]
    assert "delta" in kinds, kinds  # the chain applies deltas
    delta = next(ref for ref in reversed(refs) if ref.kind == "delta")
    rows = _raw_rows(deepfm_run["sources"]["validation"]["paths"])
    expected = _trainer_scores(deepfm_run, delta)
    results = {}
    for precision in ("fp32", "fp16", "int8"):
        model = ServingModel.load(exported(deepfm_run["run_dir"], precision=precision, checkpoint=delta.name))
        assert model.version.info["checkpoint"] == delta.name
        results[precision] = _served_scores(model, rows)
    labels = expected["labels"]
    assert results["fp32"].shape == expected["scores"].shape
    np.testing.assert_allclose(results["fp32"], expected["scores"], rtol=0, atol=1e-5)
    trainer_auc = auc(labels, expected["scores"])
    assert trainer_auc > 0.6
    for precision in ("fp16", "int8"):
        assert abs(auc(labels, results[precision]) - trainer_auc) < 5e-4, precision
        assert not np.array_equal(results[precision], results["fp32"])  # really rounded


def test_sasrec_served_logits_equal_the_trainers_evaluation(
    sasrec_run: dict[str, Any], exported: Any
) -> None:
    config = sasrec_run["config"]
    refs = checkpoint.list_checkpoints(sasrec_run["run_dir"])
    ref = refs[-1]
    sources = {"train": {"format": "interactions", "paths": [str(sasrec_run["data"])]}}
    runtime = LocalRuntime(config, base_dir=".", data_sources=sources)
    try:
        runtime.restore(_chain(sasrec_run["run_dir"], ref))
        batches = list(
            evaluation_batches(
                load_interactions([str(sasrec_run["data"])]),
                split="valid",
                max_length=12,
                batch_size=64,
                seed=config.training.seed,
            )
        )
        expected = np.concatenate([runtime.trainer.runner.predict(b) for b in batches])
    finally:
        runtime.shutdown()
    rows = []
    for batch in batches:
        seq = batch.sequences["seq"]
        for i in range(batch.batch_size):
            rows.append(
                {
                    "seq": seq.ids[i][seq.mask[i]].tolist(),
                    "candidates": batch.sequences["candidates"].ids[i].tolist(),
                }
            )
    aucs = {}
    for precision in ("fp32", "fp16", "int8"):
        model = _at_precision(exported(sasrec_run["run_dir"]), precision)
        request = parse_request({"rows": rows, "k": 101}, model.request_spec)
        logits = model.candidate_logits(request.batch, np.stack(request.candidates or []))
        if precision == "fp32":
            np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5)
        aucs[precision] = _ranking_auc(logits)
    reference = _ranking_auc(expected)
    assert reference > 0.6
    for precision in ("fp16", "int8"):
        assert abs(aucs[precision] - reference) < 5e-4, (precision, aucs, reference)


def test_hstu_served_top_k_is_the_trainers_full_ranking(hstu_run: dict[str, Any], exported: Any) -> None:
    """`psrec serve`'s answer to a history without candidates (top-k over the catalogue, the item
    table's rows) is the top-k of the trainer's own scores over all items for the same checkpoint."""
    config = hstu_run["config"]
    ref = checkpoint.list_checkpoints(hstu_run["run_dir"])[-1]
    sources = {"train": config.data.train.model_dump()}
    data = load_interactions([str(hstu_run["data"])])
    batches = list(full_ranking_batches(data, split="test", max_length=12, batch_size=64, holdout="last"))
    runtime = LocalRuntime(config, base_dir=".", data_sources=sources)
    try:
        runtime.restore(_chain(hstu_run["run_dir"], ref))
        expected = np.concatenate([runtime.trainer.runner.predict(b.batch) for b in batches])  # (U, N)
    finally:
        runtime.shutdown()
    k = 10
    want_items = np.argsort(-expected, axis=1, kind="stable")[:, :k] + 1  # column j is item j + 1
    want_scores = np.take_along_axis(expected, want_items - 1, axis=1)
    model = ServingModel.load(exported(hstu_run["run_dir"]))
    assert model.kind == "next_item"
    catalogue = model.version.tables["items"].ids
    np.testing.assert_array_equal(np.sort(catalogue), np.arange(1, data.num_items + 1))
    rows = [
        {"seq": b.batch.sequences["seq"].ids[i][b.batch.sequences["seq"].mask[i]].tolist()}
        for b in batches
        for i in range(b.batch.batch_size)
    ]
    served = model.score_requests([parse_request({"rows": rows, "k": k}, model.request_spec)])[0]
    assert served["version"] == model.version.label
    np.testing.assert_array_equal(np.array(served["items"]), want_items)
    np.testing.assert_allclose(np.array(served["scores"]), want_scores, rtol=0, atol=1e-4)
    hits = (want_items == (np.concatenate([b.targets for b in batches]) + 1)[:, None]).any(axis=1)
    assert hits.mean() > 0.2  # it learned the cycles (a random ranking hits 10 / 120)


def _at_precision(model_dir: Path, precision: str) -> ServingModel:
    """The export's model with its tables rounded to ``precision`` as `psrec export --precision`
    rounds them (`ServingTable.from_values`), without exporting the programs again."""
    contents = read_model_dir(model_dir)
    tables = {}
    for name, arrays in contents.tables.items():
        source = TableSource(
            **{k: contents.serving["tables"][name][k] for k in ("dim", "seed", "initializer", "precision")}
        )
        table = ServingTable.from_arrays(name, arrays, source=source, precision="fp32")
        tables[name] = ServingTable.from_values(
            name, table.ids, table.values(), source=source, precision=precision
        )
    serving = {**contents.serving, "precision": precision}
    return ServingModel(
        ExportContents(serving, contents.programs, {n: t.to_arrays() for n, t in tables.items()})
    )


def _ranking_auc(logits: np.ndarray) -> float:
    """Mean over users of the fraction of negatives the target (column 0) beats."""
    return float(((logits[:, :1] > logits[:, 1:]).mean(axis=1)).mean())


def test_export_refuses_a_directory_that_is_not_an_export(deepfm_run: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="not a psrec export"):
        export_run(deepfm_run["run_dir"], tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_export_of_an_unknown_checkpoint_names_the_committed_ones(
    deepfm_run: dict[str, Any], tmp_path: Path
) -> None:
    with pytest.raises(ExportError, match="no committed checkpoint 'ckpt-x'.*ckpt-"):
        export_run(deepfm_run["run_dir"], tmp_path / "out", checkpoint="ckpt-x")
