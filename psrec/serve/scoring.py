"""Scoring with an export: look rows up in the serving tables, build the model input, run the program.

`ServingModel` is one loaded export. Its `ModelVersion` (tables + programs + version label) is
replaced whole by `swap` (the delta follower builds the next one aside), and every call reads the
version once at its start, so a request is scored entirely by one version, never by half a delta.

The model input is built as the trainer builds it (`psrec.trainer.lookup`): a single-valued
feature's row, the sum of a multi-valued feature's rows (``embedding_bag``), sequences padded with
zero rows, linear terms from the ``<table>__linear`` companions; ids a table does not hold read
as the trainer's evaluation reads them (`psrec.serve.tables`).

    model = ServingModel.load("models/frappe")
    out = model.score_requests([parse_request({"rows": rows}, model.request_spec)])
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from psrec.data.batch import Batch, PaddedSequence, SparseBatch, concat_batches
from psrec.data.schema import Schema
from psrec.serve.model_dir import (
    CATALOGUE_FILE,
    MODEL_FILE,
    NEXT_ITEM,
    ExportContents,
    load_program,
    read_model_dir,
)
from psrec.serve.requests import ParsedRequest, RequestSpec, finite_or_none, serving_schema
from psrec.serve.tables import ServingTable, TableSource
from psrec.storage import StoragePath

CATALOGUE_CHUNK = 4096  # BST catalogue ranking: expanded rows per forward pass
LINEAR_SUFFIX = "__linear"  # psrec.ps.client.LINEAR_SUFFIX: the dim-1 companion of a table


@dataclass(frozen=True)
class ModelVersion:
    """Everything one version scores with; replaced whole, never changed."""

    label: str
    info: dict[str, Any]  # serving.json's "version"
    tables: dict[str, ServingTable]
    programs: dict[str, torch.nn.Module]


def tables_of(contents: ExportContents) -> dict[str, ServingTable]:
    precision = contents.serving["precision"]
    out = {}
    for name, arrays in contents.tables.items():
        source = TableSource(
            **{
                k: v
                for k, v in contents.serving["tables"][name].items()
                if k in ("dim", "seed", "initializer", "precision")
            }
        )
        out[name] = ServingTable.from_arrays(name, arrays, source=source, precision=precision)
    return out


def request_spec_of(serving: dict[str, Any], *, max_rows: int | None = None) -> RequestSpec:
    """What a request to this export carries (from serving.json alone: no tables or programs)."""
    kind = serving["kind"]
    schema = serving_schema(
        Schema.model_validate(serving["schema"]), kind, sequence_name=serving["model"].get("sequence_name")
    )
    candidate_feature: Any = None
    if kind == NEXT_ITEM:
        candidate_feature = next(f for f in schema.sequences if f.name == "seq")
    elif kind == "bst":  # candidates replace the target item feature
        candidate_feature = schema.sparse[serving["model"]["target_feature_index"]]
    if max_rows is None:
        return RequestSpec(schema=schema, kind=kind, candidate_feature=candidate_feature)
    return RequestSpec(schema=schema, kind=kind, candidate_feature=candidate_feature, max_rows=max_rows)


class ServingModel:
    """A loaded export (see the module docstring)."""

    def __init__(
        self,
        contents: ExportContents,
        *,
        max_rows: int | None = None,
        remote_tables: dict[str, Any] | None = None,
    ) -> None:
        serving = contents.serving
        self.serving = serving
        self.kind: str = serving["kind"]
        self.precision: str = serving["precision"]
        self.model_config: dict[str, Any] = serving["model"]
        self.schema = Schema.model_validate(serving["schema"])
        self.feature_tables: dict[str, str] = serving["feature_tables"]
        self.sequence_tables: dict[str, str] = serving["sequence_tables"]
        self.linear_terms: bool = serving["linear_terms"]
        self.request_spec = request_spec_of(serving, max_rows=max_rows)
        programs = {name: load_program(data, where=name) for name, data in contents.programs.items()}
        self._version = ModelVersion(
            label=serving["version"]["label"],
            info=dict(serving["version"]),
            tables={**tables_of(contents), **(remote_tables or {})},
            programs=programs,
        )
        self._swap_lock = threading.Lock()

    @classmethod
    def load(
        cls,
        model_dir: str | os.PathLike[str] | StoragePath,
        *,
        max_rows: int | None = None,
        remote_tables: dict[str, Any] | None = None,
    ) -> ServingModel:
        """Verify and load an export directory (`psrec.serve.model_dir.read_model_dir`); the tables
        in ``remote_tables`` (`psrec.serve.sharded.ShardedTable`) are looked up there instead."""
        skip = frozenset(remote_tables or ())
        return cls(
            read_model_dir(model_dir, skip_tables=skip), max_rows=max_rows, remote_tables=remote_tables
        )

    @property
    def version(self) -> ModelVersion:
        return self._version

    def swap(self, version: ModelVersion) -> None:
        """Serve ``version`` from the next request on (requests under way finish on the old one)."""
        with self._swap_lock:
            self._version = version

    def table_bytes(self) -> int:
        return sum(table.nbytes() for table in self._version.tables.values())

    # -- model input -------------------------------------------------------------------------------
    def _pooled(self, version: ModelVersion, batch: Batch, suffix: str) -> torch.Tensor:
        b = batch.batch_size
        pooled = []
        for feature in self.request_spec.schema.sparse:
            table = version.tables[self.feature_tables[feature.name] + suffix]
            ids, lengths = batch.sparse.feature(feature.name)
            unique, inverse = np.unique(ids, return_inverse=True)
            weight = torch.from_numpy(table.lookup(unique))
            index = torch.from_numpy(inverse.reshape(-1).astype(np.int64))
            if ids.size == b and bool((lengths == 1).all()):
                pooled.append(weight.index_select(0, index))
            else:
                offsets = np.zeros(b, dtype=np.int64)
                np.cumsum(lengths[:-1], out=offsets[1:])
                pooled.append(F.embedding_bag(index, weight, torch.from_numpy(offsets), mode="sum"))
        if not pooled:
            return torch.zeros(b, 0, self._dim(version))
        return torch.stack(pooled, dim=1)  # (B, F, D)

    def _dim(self, version: ModelVersion) -> int:
        return next((t.dim for name, t in version.tables.items() if not name.endswith(LINEAR_SUFFIX)), 1)

    def _sequence(self, version: ModelVersion, table: str, ids: np.ndarray, mask: np.ndarray) -> torch.Tensor:
        """(B, L, D) rows of ``ids`` where ``mask``, zero rows at padding."""
        rows = version.tables[table]
        out = np.zeros((*ids.shape, rows.dim), dtype=np.float32)
        real = ids[mask]
        unique, inverse = np.unique(real, return_inverse=True)
        out[mask] = rows.lookup(unique)[inverse.reshape(-1)]
        return torch.from_numpy(out)

    def model_input(self, version: ModelVersion, batch: Batch) -> tuple[Any, ...]:
        """(dense, pooled, linear, sequences, masks) for the program."""
        dense = torch.from_numpy(np.ascontiguousarray(batch.dense))
        pooled = self._pooled(version, batch, "")
        linear = self._pooled(version, batch, LINEAR_SUFFIX).squeeze(-1) if self.linear_terms else None
        sequences, masks = {}, {}
        for name, padded in batch.sequences.items():
            sequences[name] = self._sequence(version, self.sequence_tables[name], padded.ids, padded.mask)
            masks[name] = torch.from_numpy(padded.mask)
        return dense, pooled, linear, sequences, masks

    # -- scoring -----------------------------------------------------------------------------------
    def score_batch(self, batch: Batch, *, version: ModelVersion | None = None) -> np.ndarray:
        """CTR probabilities (B,) of a featurized batch."""
        version = version or self._version
        with torch.no_grad():
            return version.programs[MODEL_FILE](*self.model_input(version, batch)).numpy()

    def candidate_logits(
        self, batch: Batch, candidates: np.ndarray, *, version: ModelVersion | None = None
    ) -> np.ndarray:
        """Next-item logits (B, C) of per-row candidate ids (B, C)."""
        version = version or self._version
        dense, pooled, linear, sequences, masks = self.model_input(version, batch)
        table = self.sequence_tables["candidates"]
        sequences["candidates"] = self._sequence(version, table, candidates, np.ones(candidates.shape, bool))
        with torch.no_grad():
            return version.programs[MODEL_FILE](dense, pooled, linear, sequences, masks).numpy()

    def catalogue_logits(
        self, batch: Batch, *, version: ModelVersion | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(catalogue ids (N,), next-item logits (B, N)) against every item the item table holds."""
        version = version or self._version
        dense, pooled, linear, sequences, masks = self.model_input(version, batch)
        table = version.tables[self.sequence_tables["candidates"]]
        sequences["candidates"] = torch.from_numpy(table.values())
        with torch.no_grad():
            logits = version.programs[CATALOGUE_FILE](dense, pooled, linear, sequences, masks).numpy()
        return table.ids, logits

    def _ranked_by_target(
        self,
        requests: list[ParsedRequest],
        probabilities: np.ndarray,
        starts: np.ndarray,
        base: dict[str, Any],
    ) -> list[dict[str, Any]]:
        """BST responses: top-k candidates per row where candidates were given, else scores."""
        out = []
        for i, request in enumerate(requests):
            own = probabilities[starts[i] : starts[i + 1]]
            if request.groups and request.candidate_values is not None:
                out.append({**base, **_ranked_rows(own, request.groups, request.candidate_values, request.k)})
            else:
                out.append({**base, "scores": [finite_or_none(float(p)) for p in own]})
        return out

    def _catalogue_ranked(self, request: ParsedRequest, version: ModelVersion) -> dict[str, Any]:
        """BST: the top-k items of the target feature's table for each row, every item scored as the
        row with its target set to it (in chunks of at most ``CATALOGUE_CHUNK`` rows)."""
        target = self.request_spec.candidate_feature
        assert target is not None
        catalogue = version.tables[self.feature_tables[target.name]].ids
        items, scores = [], []
        for row in range(request.batch.batch_size):
            probabilities = np.concatenate(
                [
                    self.score_batch(
                        _row_with_targets(
                            request.batch, row, target.name, catalogue[start : start + CATALOGUE_CHUNK]
                        ),
                        version=version,
                    )
                    for start in range(0, catalogue.size, CATALOGUE_CHUNK)
                ]
            )
            top = _top_k(probabilities, request.k)
            items.append([_plain(catalogue[i]) for i in top])
            scores.append([finite_or_none(float(probabilities[i])) for i in top])
        return {"items": items, "scores": scores}

    def score_requests(self, requests: list[ParsedRequest]) -> list[dict[str, Any]]:
        """Responses of validated requests, scored together in one batch by one version."""
        return self.score_requests_with(requests, self._version)  # one version for the whole batch

    def score_requests_with(
        self, requests: list[ParsedRequest], version: ModelVersion
    ) -> list[dict[str, Any]]:
        """`score_requests` by the given ``version``."""
        batch = concat_batches([request.batch for request in requests])
        sizes = [request.batch.batch_size for request in requests]
        starts = np.concatenate([[0], np.cumsum(sizes)])
        base = {"version": version.label}
        if self.kind == "bst" and any(request.catalogue for request in requests):
            return [
                {**base, **self._catalogue_ranked(request, version)}
                if request.catalogue
                else self.score_requests_with([request], version)[0]
                for request in requests
            ]
        if self.kind == "bst" and any(request.groups for request in requests):
            return self._ranked_by_target(requests, self.score_batch(batch, version=version), starts, base)
        if self.kind != NEXT_ITEM:
            probabilities = self.score_batch(batch, version=version)
            return [
                {
                    **base,
                    "scores": [finite_or_none(float(s)) for s in probabilities[starts[i] : starts[i + 1]]],
                }
                for i in range(len(requests))
            ]
        out: list[dict[str, Any]] = []
        given = [r for r in requests if r.candidates is not None]
        logits_given: np.ndarray | None = None
        if given:
            flat = [ids for r in given for ids in (r.candidates or [])]
            width = max(ids.size for ids in flat)
            padded = np.zeros((len(flat), width), dtype=np.int64)
            for row, ids in enumerate(flat):
                padded[row, : ids.size] = ids
            seqs = concat_batches([r.batch for r in given])
            logits_given = self.candidate_logits(seqs, padded, version=version)
        catalogue: tuple[np.ndarray, np.ndarray] | None = None
        rest = [r for r in requests if r.candidates is None]
        if rest:
            catalogue = self.catalogue_logits(concat_batches([r.batch for r in rest]), version=version)
        given_row = rest_row = 0
        for request in requests:
            items: list[list[Any]] = []
            scores: list[list[float | None]] = []
            for row in range(request.batch.batch_size):
                if request.candidates is not None and logits_given is not None:
                    values = request.candidate_values[row] if request.candidate_values else []
                    logits = logits_given[given_row, : len(values)]
                    given_row += 1
                    labels: Any = values
                else:
                    assert catalogue is not None
                    logits = catalogue[1][rest_row]
                    labels = catalogue[0]
                    rest_row += 1
                top = _top_k(logits, request.k)
                items.append([_plain(labels[i]) for i in top])
                scores.append([finite_or_none(float(logits[i])) for i in top])
            out.append({**base, "items": items, "scores": scores})
        return out


def _row_with_targets(batch: Batch, row: int, target: str, ids: np.ndarray) -> Batch:
    """``ids.size`` copies of ``batch``'s row ``row``, the single-valued ``target`` feature set to ``ids``."""
    count = ids.size
    offsets = batch.sparse.offsets
    features = {}
    for k, key in enumerate(batch.sparse.keys):
        if key == target:
            features[key] = (ids, np.ones(count, np.int32))
            continue
        slot = k * batch.batch_size + row
        own = batch.sparse.ids[offsets[slot] : offsets[slot + 1]]
        features[key] = (np.tile(own, count), np.full(count, own.size, np.int32))
    sequences = {
        name: PaddedSequence(
            np.repeat(padded.ids[row : row + 1], count, axis=0),
            np.repeat(padded.mask[row : row + 1], count, axis=0),
        )
        for name, padded in batch.sequences.items()
    }
    return Batch(
        labels=np.zeros(count, np.float32),
        dense=np.repeat(batch.dense[row : row + 1], count, axis=0),
        sparse=SparseBatch.from_features(features),
        sequences=sequences,
    )


def _ranked_rows(
    probabilities: np.ndarray, groups: list[int], values: list[list[Any]], k: int
) -> dict[str, Any]:
    """Top-k candidates of each row from the probabilities of its expanded rows."""
    items, scores, start = [], [], 0
    for size, candidates in zip(groups, values, strict=True):
        own = probabilities[start : start + size]
        start += size
        top = _top_k(own, k)
        items.append([_plain(candidates[i]) for i in top])
        scores.append([finite_or_none(float(own[i])) for i in top])
    return {"items": items, "scores": scores}


def _top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest logits, largest first (ties: the earlier index first)."""
    k = min(k, logits.size)
    order = np.argsort(-logits, kind="stable")
    return order[:k]


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value
