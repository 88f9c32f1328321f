"""The data sources of a run, by split: the config's own, or a cached synthetic Criteo-shaped set.

`prepare_data(config, base_dir=...)` is what `psrec.train.loop.train` calls before it starts the
runtime: plain dicts (one `DataSource` each) by split. With ``data.synthetic`` it generates the
rows once into `synthetic_cache_dir()` (``$PSREC_CACHE``, default ``~/.cache/psrec``), keyed by
scale, seed and row count, and with ``synthetic.prepared`` also writes a prepared Parquet copy
for the run's schema beside it (`psrec data convert --prepared`). A ``_SUCCESS`` file marks a
finished copy; an interrupted one is written again.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from psrec.config import RunConfig

logger = logging.getLogger(__name__)


def synthetic_cache_dir() -> Path:
    """Where generated data is cached: ``$PSREC_CACHE``, default ``~/.cache/psrec``."""
    return Path(os.environ.get("PSREC_CACHE", Path.home() / ".cache" / "psrec")).expanduser()


def prepare_data(config: RunConfig, *, base_dir: Path) -> dict[str, dict[str, Any]]:
    """Data sources by split, as plain dicts (paths relative to `base_dir` unless absolute)."""
    data = config.data
    sources: dict[str, dict[str, Any]]
    if data.synthetic is None:
        sources = {
            split: getattr(data, split).model_dump(mode="json")
            for split in ("train", "validation", "test")
            if getattr(data, split) is not None
        }
        if sources["train"]["format"] == "interactions":  # leave-one-out: held-out items of the same file
            sources.setdefault("validation", sources["train"])
            sources.setdefault("test", sources["train"])
        return sources
    from psrec.data.synth import write_synthetic_criteo

    synthetic = data.synthetic
    key = f"criteo-scale{synthetic.cardinality_scale}-seed{synthetic.seed}"
    sources = {}
    for index, (split, rows) in enumerate(
        (("train", synthetic.train_rows), ("validation", synthetic.validation_rows))
    ):
        if rows == 0:
            continue
        target = synthetic_cache_dir() / "synthetic" / f"{key}-{split}-{rows}"
        if not (target / "_SUCCESS").exists():
            logger.info("generating %d synthetic Criteo-shaped rows into %s", rows, target)
            write_synthetic_criteo(
                target, rows=rows, seed=synthetic.seed + index, cardinality_scale=synthetic.cardinality_scale
            )
            (target / "_SUCCESS").write_text("ok\n")
        source = {"format": "parquet", "paths": [str(target / "*.parquet")]}
        if synthetic.prepared:
            source = _prepared_copy(config, target, source)
        sources[split] = source
    return sources


def _prepared_copy(config: RunConfig, raw: Path, source: dict[str, Any]) -> dict[str, Any]:
    """The source of `raw`'s rows prepared for the run's schema (written once, cached beside it)."""
    from psrec.data.convert import convert_to_parquet
    from psrec.data.features import schema_fingerprint
    from psrec.data.schema import DataSource

    schema = config.feature_schema()
    target = raw.with_name(f"{raw.name}-prepared-{schema_fingerprint(schema)}")
    if not (target / "_SUCCESS").exists():
        logger.info("preparing %s into %s", raw, target)
        convert_to_parquet(DataSource.model_validate(source), schema, target, prepared=True)
        (target / "_SUCCESS").write_text("ok\n")
    return {"format": "parquet", "paths": [str(target / "*.parquet")]}
