"""`psrec export`: a run's checkpoint as a self-contained serving export (`psrec.serve.model_dir`).

What goes in, from the checkpoint chain that ends at the chosen checkpoint (the newest valid one
by default): every table's rows, the full checkpoint with each delta applied in order, merged over
the PS shards and rounded once to the export precision (no optimizer state, counts or clocks);
the dense model with the checkpoint's weights, in eval mode, as `torch.export` programs with a
dynamic batch dimension (`export_programs`); the feature schema (hashing namespaces, dense
transforms), the feature -> table maps, and the version: the checkpoint's step, name and id.

    psrec export runs/frappe_deepfm --out models/frappe --precision int8

The programs take the model input as plain tensors (``dense`` (B, num_dense), ``pooled``
(B, F, D), ``linear`` (B, F) or None, ``sequences`` / ``masks`` dicts) and return what the
model's ``predict`` returns: click probabilities (B,) for CTR models and BST, candidate logits
(B, C) for the next-item models SASRec and HSTU (``catalogue.pt2``: (B, N) against one shared
(N, D) matrix). HSTU is exported on its padded path (``jagged: false``, the same weights; the
packed path's lengths decide its shapes, which `torch.export` cannot trace).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from datetime import UTC, datetime
from typing import Any

import numpy as np
import torch
from torch import nn

from psrec.checkpoint import files
from psrec.checkpoint.format import CheckpointError
from psrec.checkpoint.load import load_chain, load_checkpoint, verify
from psrec.checkpoint.manifest import read_manifest, scan
from psrec.checkpoint.policy import CheckpointRef
from psrec.config import ConfigError, RunConfig, parse_config
from psrec.embedding.state import TableDelta, TableState
from psrec.models.base import ModelInput
from psrec.models.config import HSTUConfig
from psrec.serve.model_dir import (
    CATALOGUE_FILE,
    MODEL_FILE,
    NEXT_ITEM,
    ExportContents,
    ExportError,
    program_bytes,
    write_model_dir,
)
from psrec.serve.tables import PRECISIONS, ServingTable, TableSource, decode_rows
from psrec.storage import Location, StoragePath, location
from psrec.trainer import builders

logger = logging.getLogger(__name__)

EXAMPLE_BATCH = 3  # the example inputs' batch size (the exported batch dimension is dynamic)


class ProgramInput(nn.Module):
    """The model behind plain tensor inputs: what `torch.export` traces."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        dense: torch.Tensor,
        pooled: torch.Tensor,
        linear: torch.Tensor | None,
        sequences: dict[str, torch.Tensor],
        masks: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        predict: Any = self.model.predict
        return predict(ModelInput(dense, pooled, linear, sequences, masks))


def model_kind(config: RunConfig) -> str:
    """ "next_item" (SASRec, HSTU: ranking items after a history), "bst" (CTR over a behaviour
    sequence) or "ctr"."""
    if config.model.ranks_items:
        return NEXT_ITEM
    return "bst" if config.model.name == "bst" else "ctr"


def servable_config(config: RunConfig) -> RunConfig:
    """The config whose model `torch.export` can trace: HSTU on its padded path (same weights)."""
    if isinstance(config.model, HSTUConfig) and config.model.jagged:
        return config.model_copy(update={"model": config.model.model_copy(update={"jagged": False})})
    return config


def example_inputs(
    config: RunConfig, *, dim: int, catalogue: bool = False
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(example arguments, dynamic shapes) of the program of ``config``'s model."""
    schema = config.feature_schema()
    b = EXAMPLE_BATCH
    batch = torch.export.Dim.DYNAMIC
    kind = model_kind(config)
    generator = torch.Generator().manual_seed(0)
    num_sparse = 0 if kind == NEXT_ITEM else len(schema.sparse)
    num_dense = 0 if kind == NEXT_ITEM else len(schema.dense)
    dense = torch.randn(b, num_dense, generator=generator)
    pooled = torch.randn(b, num_sparse, dim, generator=generator)
    linear = torch.randn(b, num_sparse, generator=generator) if builders.uses_linear_terms(config) else None
    sequences: dict[str, torch.Tensor] = {}
    masks: dict[str, torch.Tensor] = {}
    sequence_shapes: dict[str, Any] = {}
    if kind == NEXT_ITEM:
        length = config.model.max_length  # type: ignore[union-attr]
        sequences["seq"] = torch.randn(b, length, dim, generator=generator)
        masks["seq"] = torch.ones(b, length, dtype=torch.bool)
        sequence_shapes["seq"] = {0: batch}
        if catalogue:
            sequences["candidates"] = torch.randn(7, dim, generator=generator)
            sequence_shapes["candidates"] = {0: torch.export.Dim.DYNAMIC}
        else:
            sequences["candidates"] = torch.randn(b, 7, dim, generator=generator)
            sequence_shapes["candidates"] = {0: batch, 1: torch.export.Dim.DYNAMIC}
    elif kind == "bst":
        name = config.model.sequence_name  # type: ignore[union-attr]
        length = config.model.max_length  # type: ignore[union-attr]
        sequences[name] = torch.randn(b, length, dim, generator=generator)
        masks[name] = torch.ones(b, length, dtype=torch.bool)
        sequence_shapes[name] = {0: batch}
    arguments = (dense, pooled, linear, sequences, masks)
    shapes = (
        {0: batch},
        {0: batch},
        None if linear is None else {0: batch},
        sequence_shapes,
        {name: {0: batch} for name in masks},
    )
    return arguments, shapes


def export_programs(model: nn.Module, config: RunConfig, *, dim: int) -> dict[str, bytes]:
    """`torch.export` programs of ``model`` (eval mode; built from `servable_config`): ``model.pt2``
    (+ ``catalogue.pt2`` for next-item models)."""
    model.eval()
    wrapper = ProgramInput(model).eval()
    variants = [(MODEL_FILE, False)] + ([(CATALOGUE_FILE, True)] if model_kind(config) == NEXT_ITEM else [])
    out = {}
    for name, catalogue in variants:
        arguments, shapes = example_inputs(config, dim=dim, catalogue=catalogue)
        with torch.no_grad():
            program = torch.export.export(wrapper, arguments, dynamic_shapes=shapes).run_decompositions()
        out[name] = program_bytes(program)
    return out


# -- the checkpoint side ----------------------------------------------------------------------------
def read_run_config(run_dir: Location) -> RunConfig:
    path = run_dir / "config.json"
    try:
        data = files.read_json(path)
    except FileNotFoundError:
        raise ExportError(f"{run_dir} is not a psrec run directory (no config.json)") from None
    except (OSError, ValueError) as error:
        raise ExportError(f"{path} is unreadable: {error}") from None
    try:
        return parse_config(data, source=str(path))
    except ConfigError as error:
        raise ExportError(f"{path}: {error}") from None


def chain_to(target: CheckpointRef, refs: list[CheckpointRef]) -> list[CheckpointRef]:
    """[full, delta, ..., target]: ``target`` and its parents back to the full checkpoint."""
    by_id = {ref.checkpoint_id: ref for ref in refs}
    chain = [target]
    while chain[0].kind != "full":
        parent = by_id.get(chain[0].parent_id or "")
        if parent is None:
            raise ExportError(
                f"{target.name}: its chain is broken at {chain[0].name} (parent {chain[0].parent_id} "
                "is gone); export a full checkpoint or a newer one"
            )
        chain.insert(0, parent)
    return chain


def choose_chain(run_dir: Location, name: str | None) -> list[CheckpointRef]:
    """The chain of checkpoint ``name`` (every file verified), or of the newest that verifies."""
    try:
        refs, broken = scan(run_dir)
    except CheckpointError as error:
        raise ExportError(str(error)) from None
    for path, reason in broken:
        logger.warning("skipping checkpoint %s: %s", path.name, reason)
    if name is not None:
        named = [ref for ref in refs if ref.name == name]
        if not named:
            listed = ", ".join(ref.name for ref in refs) or "none"
            raise ExportError(f"{run_dir}: no committed checkpoint {name!r} (committed: {listed})")
        candidates = named
    else:
        candidates = list(reversed(refs))
    for target in candidates:
        try:
            chain = chain_to(target, refs)
            for ref in chain:
                verify(ref)
            return chain
        except (ExportError, CheckpointError) as error:
            if name is not None:
                raise ExportError(f"checkpoint {name} cannot be exported: {error}") from None
            logger.warning("skipping checkpoint %s: %s", target.name, error)
    raise ExportError(f"{run_dir}: no valid checkpoint to export (train first, or check the warnings)")


def split_tables(arrays: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """A shard file's flat ``{"table/field": array}`` -> ``{table: {field: array}}``."""
    per_table: dict[str, dict[str, np.ndarray]] = {}
    for key, value in arrays.items():
        table, _, field = key.partition("/")
        per_table.setdefault(table, {})[field] = value
    return per_table


def tables_from_full(shards: dict[int, dict[str, np.ndarray]], *, precision: str) -> dict[str, ServingTable]:
    """Every table of a full checkpoint's shard files, merged over the shards, at ``precision``."""
    parts: dict[str, list[TableState]] = {}
    for _, arrays in sorted(shards.items()):
        for table, fields in split_tables(arrays).items():
            parts.setdefault(table, []).append(TableState.from_arrays(fields))
    out = {}
    for table, states in sorted(parts.items()):
        source = TableSource.from_config(states[0].config)
        ids = np.concatenate([state.ids for state in states])
        values = np.concatenate([decode_rows(state, source.precision, source.dim) for state in states])
        out[table] = ServingTable.from_values(table, ids, values, source=source, precision=precision)
    return out


def apply_delta_files(
    tables: dict[str, ServingTable], shards: dict[int, dict[str, np.ndarray]]
) -> dict[str, ServingTable]:
    """New tables: ``tables`` with a delta checkpoint's shard files applied (the input is unchanged)."""
    out = dict(tables)
    for _, arrays in sorted(shards.items()):
        for table, fields in split_tables(arrays).items():
            if table not in out:
                raise ExportError(f"a delta holds table {table!r}, which the full checkpoint does not")
            out[table] = out[table].apply_delta(TableDelta.from_arrays(fields))
    return out


def load_tables(
    chain: list[CheckpointRef], *, precision: str, names: Collection[str] | None = None
) -> dict[str, ServingTable]:
    """The tables at the end of ``chain`` (only ``names``, when given), rounded once to ``precision``."""
    shard_ids = read_manifest(chain[0])["shards"]
    loaded = load_chain(chain, shards=shard_ids)
    chain_files = [{s: only_tables(arrays, names) for s, arrays in data.shards.items()} for data in loaded]
    return tables_of_chain(chain_files, precision=precision)


def only_tables(arrays: dict[str, np.ndarray], names: Collection[str] | None) -> dict[str, np.ndarray]:
    """A shard file's arrays of the tables ``names`` (all of them for None)."""
    if names is None:
        return arrays
    return {key: value for key, value in arrays.items() if key.partition("/")[0] in names}


def tables_of_chain(
    chain_files: list[dict[int, dict[str, np.ndarray]]], *, precision: str
) -> dict[str, ServingTable]:
    """The tables of a chain's shard files (a full checkpoint's, then each delta's), rounded once to
    ``precision``."""
    tables = tables_from_full(chain_files[0], precision="fp32")
    for delta_files in chain_files[1:]:
        tables = apply_delta_files(tables, delta_files)
    if precision == "fp32":
        return tables
    return {
        name: ServingTable.from_values(name, t.ids, t.values(), source=t.source, precision=precision)
        for name, t in tables.items()
    }


def version_of(ref: CheckpointRef) -> dict[str, Any]:
    """The model version a response names: the checkpoint's step, name and id."""
    return {
        "label": f"step-{ref.step}.{ref.checkpoint_id[:8]}",
        "step": ref.step,
        "checkpoint": ref.name,
        "checkpoint_id": ref.checkpoint_id,
    }


def serving_description(
    config: RunConfig, ref: CheckpointRef, tables: dict[str, ServingTable], *, precision: str, run_dir: str
) -> dict[str, Any]:
    """What serving.json holds (see `psrec.serve.model_dir`)."""
    return {
        "version": version_of(ref),
        "precision": precision,
        "kind": model_kind(config),
        "model": config.model.model_dump(mode="json"),
        "schema": config.feature_schema().model_dump(mode="json"),
        "feature_tables": builders.feature_tables(config),
        "sequence_tables": builders.sequence_tables(config),
        "linear_terms": builders.uses_linear_terms(config),
        "tables": {
            name: {**table.source.as_dict(), "rows": table.num_rows, "bytes": table.nbytes()}
            for name, table in tables.items()
        },
        "run_dir": run_dir,
        "exported_utc": datetime.now(UTC).isoformat(),
    }


def build_contents(
    run_dir: str | os.PathLike[str] | StoragePath,
    *,
    precision: str = "fp32",
    checkpoint: str | None = None,
) -> ExportContents:
    """Everything `export_run` writes, in memory."""
    if precision not in PRECISIONS:
        raise ExportError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    root = location(run_dir)
    config = read_run_config(root)
    chain = choose_chain(root, checkpoint)
    tables = load_tables(chain, precision=precision)
    dense = load_checkpoint(chain[-1], shards=[]).dense
    torch.manual_seed(config.training.seed)
    model = builders.build_model_for(servable_config(config))
    try:
        model.load_state_dict(dense["model"])
    except (KeyError, RuntimeError) as error:
        raise ExportError(
            f"{chain[-1].name}: the dense state does not fit the run's model: {error}"
        ) from None
    dims = {config.table_config(name).dim for name in config.table_names()}
    dim = dims.pop() if dims else 1  # the models take one embedding dim (`builders.build_model_for`)
    programs = export_programs(model, config, dim=dim)
    serving = serving_description(config, chain[-1], tables, precision=precision, run_dir=str(root))
    return ExportContents(
        serving=serving, programs=programs, tables={name: t.to_arrays() for name, t in tables.items()}
    )


def export_run(
    run_dir: str | os.PathLike[str] | StoragePath,
    out: str | os.PathLike[str] | StoragePath,
    *,
    precision: str = "fp32",
    checkpoint: str | None = None,
) -> dict[str, Any]:
    """Export ``run_dir``'s checkpoint (``checkpoint`` by name, else the newest valid) to ``out``;
    returns serving.json's contents."""
    contents = build_contents(run_dir, precision=precision, checkpoint=checkpoint)
    final = write_model_dir(out, contents)
    total = sum(table["bytes"] for table in contents.serving["tables"].values())
    logger.info(
        "exported %s (%s, %d tables, %.1f MiB of rows) to %s",
        contents.serving["version"]["label"],
        precision,
        len(contents.tables),
        total / 2**20,
        final,
    )
    return contents.serving
