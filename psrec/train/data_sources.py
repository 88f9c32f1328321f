"""The data sources of a run, by split: the config's own, or a cached synthetic Criteo-shaped set.

`start_preparing_data(config, base_dir=...)` is what `psrec.train.loop.train` calls before it starts
the runtime: its `sources` are plain dicts (one `DataSource` each) by split, known at once. With
``data.synthetic`` it generates the rows once into `synthetic_cache_dir()` (``$PSREC_CACHE``,
default ``~/.cache/psrec``), keyed by scale, seed and row count, and with ``synthetic.prepared``
also writes a prepared Parquet copy for the run's schema beside it (`psrec data convert
--prepared`). Rows not cached yet are generated on a thread while the runtime starts (its actors'
processes boot meanwhile); `wait()` returns once they are written and raises what failed. A
``_SUCCESS`` file marks a finished copy; an interrupted one is written again. `prepare_data` does
both at once.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from psrec import storage
from psrec.config import ConfigError, RunConfig

logger = logging.getLogger(__name__)


def synthetic_cache_dir() -> Path:
    """Where generated data is cached: ``$PSREC_CACHE``, default ``~/.cache/psrec``."""
    return Path(os.environ.get("PSREC_CACHE", Path.home() / ".cache" / "psrec")).expanduser()


class DataPreparation:
    """A run's data sources by split (`sources`) and the writing of the rows they name that are not
    cached yet, on a thread of its own (a daemon: a run that fails meanwhile does not wait for it)."""

    def __init__(self, sources: dict[str, dict[str, Any]], work: list[Callable[[], None]]) -> None:
        self.sources = sources
        self._failed: list[BaseException] = []
        self._thread: threading.Thread | None = None
        if work:
            self._thread = threading.Thread(
                target=self._run, args=(work,), name="psrec data preparation", daemon=True
            )
            self._thread.start()

    def _run(self, work: list[Callable[[], None]]) -> None:
        try:
            for step in work:
                step()
        except BaseException as error:  # noqa: BLE001 - raised again by wait()
            self._failed.append(error)

    def wait(self) -> dict[str, dict[str, Any]]:
        """The sources, once every row they name is written; the writing's error, if it failed."""
        if self._thread is not None:
            self._thread.join()
        if self._failed:
            raise self._failed[0]
        return self.sources


def prepare_data(config: RunConfig, *, base_dir: Path) -> dict[str, dict[str, Any]]:
    """Data sources by split, as plain dicts (paths relative to `base_dir` unless absolute), with
    every row they name written."""
    return start_preparing_data(config, base_dir=base_dir).wait()


def start_preparing_data(config: RunConfig, *, base_dir: Path) -> DataPreparation:
    """The run's data sources at once; synthetic rows not cached yet are written on a thread."""
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
        return DataPreparation(sources, [])
    synthetic = data.synthetic
    key = f"criteo-scale{synthetic.cardinality_scale}-seed{synthetic.seed}"
    sources = {}
    work: list[Callable[[], None]] = []
    for index, (split, rows) in enumerate(
        (("train", synthetic.train_rows), ("validation", synthetic.validation_rows))
    ):
        if rows == 0:
            continue
        target = synthetic_cache_dir() / "synthetic" / f"{key}-{split}-{rows}"
        if not (target / "_SUCCESS").exists():
            work.append(_generation(target, rows, synthetic.seed + index, synthetic.cardinality_scale))
        source = {"format": "parquet", "paths": [str(target / "*.parquet")]}
        if synthetic.prepared:
            prepared = _prepared_target(config, target)
            if not (prepared / "_SUCCESS").exists():
                work.append(_conversion(config, target, source, prepared))
            source = {"format": "parquet", "paths": [str(prepared / "*.parquet")]}
        sources[split] = source
    return DataPreparation(sources, work)


def _generation(target: Path, rows: int, seed: int, cardinality_scale: float) -> Callable[[], None]:
    def generate() -> None:
        from psrec.data.synth import write_synthetic_criteo

        logger.info("generating %d synthetic Criteo-shaped rows into %s", rows, target)
        write_synthetic_criteo(target, rows=rows, seed=seed, cardinality_scale=cardinality_scale)
        (target / "_SUCCESS").write_text("ok\n")

    return generate


def _prepared_target(config: RunConfig, raw: Path) -> Path:
    """Where `raw`'s rows prepared for the run's schema are cached, beside them."""
    from psrec.data.features import schema_fingerprint

    return raw.with_name(f"{raw.name}-prepared-{schema_fingerprint(config.feature_schema())}")


def _conversion(config: RunConfig, raw: Path, source: dict[str, Any], target: Path) -> Callable[[], None]:
    def convert() -> None:
        from psrec.data.convert import convert_to_parquet
        from psrec.data.schema import DataSource

        logger.info("preparing %s into %s", raw, target)
        convert_to_parquet(DataSource.model_validate(source), config.feature_schema(), target, prepared=True)
        (target / "_SUCCESS").write_text("ok\n")

    return convert


def check_stored_sources(sources: dict[str, dict[str, Any]]) -> None:
    """List every data path that is a store URI once, so that an unreachable store or a missing
    file is a ConfigError naming the URI before training starts."""
    from psrec.data.units import expand_paths

    for split, source in sources.items():
        for pattern in source.get("paths") or []:
            if storage.is_uri(pattern):
                try:
                    expand_paths([pattern])
                except (OSError, ValueError) as error:
                    raise ConfigError(f"data.{split}.paths: {pattern!r}: {error}") from None
