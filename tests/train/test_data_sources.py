"""A run's synthetic data: the rows not cached yet are generated while the runtime starts, the run
trains on them as on rows generated beforehand, and a failed generation stops the run before its
run directory is touched and leaves no copy marked finished."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from psrec.config import RunConfig, parse_config
from psrec.data import synth
from psrec.train import loop
from psrec.train.data_sources import prepare_data, start_preparing_data, synthetic_cache_dir
from psrec.train.loop import train


def _config(run_dir: Path, **synthetic: Any) -> RunConfig:
    data = {
        "run_dir": str(run_dir),
        "data": {
            "synthetic": {"train_rows": 1200, "validation_rows": 300, "cardinality_scale": 0.001, **synthetic}
        },
        "model": {"name": "dlrm", "bottom_hidden_sizes": [8], "top_hidden_sizes": [8]},
        "embedding": {"default": {"dim": 4}},
        "training": {"batch_size": 200, "log_every_steps": 3},
        "ps": {"runtime": "local", "num_shards": 2, "num_buckets": 16},
        "checkpoint": {"enabled": False},
    }
    return parse_config(data, source="<test>")


def test_the_runtime_starts_while_the_rows_are_generated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PSREC_CACHE", str(tmp_path / "cache"))
    runtime_started = threading.Event()
    generated_before_the_runtime: list[bool] = []
    write, make_runtime = synth.write_synthetic_criteo, loop.make_runtime

    def slow_write(*args: Any, **kwargs: Any) -> Any:
        # The sequential order (the rows, then the runtime) would wait here in vain.
        generated_before_the_runtime.append(not runtime_started.wait(timeout=60))
        return write(*args, **kwargs)

    def starting_runtime(*args: Any, **kwargs: Any) -> Any:
        runtime_started.set()
        return make_runtime(*args, **kwargs)

    monkeypatch.setattr(synth, "write_synthetic_criteo", slow_write)
    monkeypatch.setattr(loop, "make_runtime", starting_runtime)
    summary = train(_config(tmp_path / "overlapped"))
    assert generated_before_the_runtime == [False, False]  # train and validation, both after the start

    # The same run on the rows now cached (generated beforehand, nothing on a thread) is identical.
    monkeypatch.setattr(synth, "write_synthetic_criteo", write)
    again = train(_config(tmp_path / "cached"))
    assert summary["steps"] == again["steps"] == 6
    assert summary["validation"] == again["validation"]
    assert summary["history"] == again["history"]


def test_a_failed_generation_stops_the_run_before_it_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PSREC_CACHE", str(tmp_path / "cache"))

    def failing_write(path: Any, **kwargs: Any) -> Any:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "part-00000.parquet").write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(synth, "write_synthetic_criteo", failing_write)
    with pytest.raises(OSError, match="No space left"):
        train(_config(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    assert not list(synthetic_cache_dir().rglob("_SUCCESS"))
    monkeypatch.undo()
    monkeypatch.setenv("PSREC_CACHE", str(tmp_path / "cache"))
    assert train(_config(tmp_path / "run"))["steps"] == 6  # the half-written copy is written again


def test_sources_are_known_before_the_rows_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PSREC_CACHE", str(tmp_path / "cache"))
    config = _config(tmp_path / "run", prepared=True)
    preparation = start_preparing_data(config, base_dir=tmp_path)
    sources = dict(preparation.sources)
    assert preparation.wait() == sources == prepare_data(config, base_dir=tmp_path)
    assert "-prepared-" in sources["train"]["paths"][0] and set(sources) == {"train", "validation"}
    for source in sources.values():
        assert list(Path(source["paths"][0]).parent.glob("*.parquet"))
