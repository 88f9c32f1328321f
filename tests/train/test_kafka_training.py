"""Training from a Kafka topic (`data.train` of `format: kafka`), against the real test broker.

The oracle is the same rows in a TSV file trained with the file reader: with one trainer, one
partition, sync mode, the same seed and batch size, both runs see the same batches in the same order,
so the Kafka-trained model must equal the file-trained one bit for bit. A run stopped at a checkpoint
and resumed from its run directory starts at the Kafka position the checkpoint recorded and ends with
the undisturbed run's model, every row consumed exactly once.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from psrec.checkpoint import list_checkpoints
from psrec.checkpoint.format import TRAINERS_FILE
from psrec.config import ConfigError, parse_config
from psrec.data.synth import criteo_schema, write_synthetic_criteo
from psrec.train.loop import train as train_run
from psrec.train.runtime import LocalRuntime
from tests.conftest import small_run_config
from tests.train.test_local_resume import FinishedRun

ROWS = 3000  # 12 steps of 256 rows, the last one short
STOP = 6
SETTINGS = {"checkpoint.every_steps": 3, "checkpoint.full_every": 2}


@pytest.fixture(scope="module")
def criteo_lines(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """ROWS synthetic Criteo rows as raw TSV lines (some values missing)."""
    directory = tmp_path_factory.mktemp("kafka_training_rows")
    (path,) = write_synthetic_criteo(directory, rows=ROWS, seed=7, format="tsv", cardinality_scale=0.002)
    return path.read_text().splitlines()


@pytest.fixture(scope="module")
def broker(_kafka_session: Any) -> Any:
    """The session's test broker, running (`kafka_broker` in tests/conftest.py, for a module)."""
    if _kafka_session.pid is None:
        _kafka_session.start()
    return _kafka_session


def _stream(broker: Any, messages: list[bytes], **options: Any) -> dict[str, Any]:
    """A new one-partition topic holding `messages`, as a run config's `data.train`."""
    topic = f"train-{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, partitions=1)
    broker.produce(topic, [(0, message) for message in messages])
    return {
        "format": "kafka",
        "bootstrap_servers": broker.bootstrap_servers,
        "topics": [topic],
        "message_format": "tsv",
        "client": {"fetch.wait.max.ms": 20},
        "poll_timeout_s": 0.1,
        **options,
    }


def _run(
    train: dict[str, Any],
    validation: dict[str, Any],
    run_dir: Path,
    max_steps: int | None = None,
    **kwargs: Any,
) -> FinishedRun:
    """A tiny DLRM run on the in-process runtime, sync, one trainer; no max_steps: the whole stream."""
    settings: dict[str, Any] = dict(SETTINGS)
    if max_steps is not None:
        settings["training.max_steps"] = max_steps
    sources = {"train": train, "validation": validation}
    config = small_run_config(sources, run_dir, **settings)
    runtime = LocalRuntime(config, base_dir=".", data_sources=sources)
    try:
        summary = train_run(config, runtime=runtime, **kwargs)
        return FinishedRun(summary, runtime.dense_states()[0], runtime.table_rows())
    finally:
        runtime.shutdown()


def assert_same_model(run: FinishedRun, reference: FinishedRun) -> None:
    """Bit for bit: the validation metrics, every table's ids and rows, every dense weight."""
    assert run.summary["steps"] == reference.summary["steps"]
    for metric in ("auc", "logloss"):
        assert run.summary["validation"][metric] == reference.summary["validation"][metric], metric
    assert run.rows.keys() == reference.rows.keys()
    for table, (ids, values) in reference.rows.items():
        np.testing.assert_array_equal(run.rows[table][0], ids, err_msg=table)
        np.testing.assert_array_equal(run.rows[table][1], values, err_msg=table)
    assert run.dense.keys() == reference.dense.keys()
    for name, value in reference.dense.items():
        torch.testing.assert_close(run.dense[name], value, rtol=0, atol=0, msg=name)


@pytest.fixture(scope="module")
def stream_run(
    broker: Any,
    criteo_lines: list[str],
    synthetic_sources: dict[str, Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, Any], FinishedRun]:
    train = _stream(broker, [line.encode() for line in criteo_lines])
    return train, _run(train, synthetic_sources["validation"], tmp_path_factory.mktemp("stream"))


def test_a_stream_trains_the_model_its_rows_in_a_file_train(
    stream_run: tuple[dict[str, Any], FinishedRun],
    criteo_lines: list[str],
    synthetic_sources: dict[str, Any],
    tmp_path: Path,
) -> None:
    _, streamed = stream_run
    path = tmp_path / "rows.tsv"
    path.write_text("".join(f"{line}\n" for line in criteo_lines))
    file = {"format": "criteo_tsv", "paths": [str(path)]}
    from_file = _run(file, synthetic_sources["validation"], tmp_path / "file")
    assert streamed.summary["steps"] == from_file.summary["steps"] == -(-ROWS // 256)
    assert streamed.summary["rows_consumed"] == streamed.summary["rows_consumed_unique"] == ROWS
    assert_same_model(streamed, from_file)


def test_a_resumed_stream_run_ends_with_the_undisturbed_model(
    stream_run: tuple[dict[str, Any], FinishedRun], synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    train, undisturbed = stream_run
    validation = synthetic_sources["validation"]
    stopped = _run(train, validation, tmp_path, STOP)
    assert stopped.summary["steps"] == STOP
    (last,) = list_checkpoints(tmp_path)[-1:]
    assert last.step == STOP
    recorded = json.loads((Path(last.path) / TRAINERS_FILE).read_text())
    (position,) = [trainer["position"] for trainer in recorded["trainers"]]
    assert position["format"] == "kafka"
    assert position["offsets"] == {train["topics"][0]: {"0": STOP * 256}}  # exactly where it stood
    (tmp_path / "summary.json").unlink()  # an interrupted run leaves no summary

    resumed = _run(train, validation, tmp_path, resume=True)
    assert resumed.summary["resumed_from"]["step"] == STOP
    assert resumed.summary["rows_consumed"] == resumed.summary["rows_consumed_unique"] == ROWS
    assert_same_model(resumed, undisturbed)


def test_a_bad_message_is_skipped_and_counted(
    broker: Any, criteo_lines: list[str], synthetic_sources: dict[str, Any], tmp_path: Path
) -> None:
    messages = [line.encode() for line in criteo_lines[:600]]
    messages.insert(300, b"1\t2")  # 2 columns of 40
    train = _stream(broker, messages, on_error="skip")
    run = _run(train, synthetic_sources["validation"], tmp_path)
    assert run.summary["rows_skipped"] == 1
    assert run.summary["rows_consumed"] == 600


def test_a_kafka_source_is_validated_naming_the_field(tmp_path: Path) -> None:
    base = {
        "run_dir": str(tmp_path),
        "data": {
            "schema": criteo_schema().model_dump(),
            "train": {"format": "kafka", "bootstrap_servers": "127.0.0.1:9092", "topics": ["clicks"]},
        },
        "model": {"name": "dlrm", "bottom_hidden_sizes": [16], "top_hidden_sizes": [16, 8]},
        "embedding": {"default": {"dim": 4}},
    }
    config = parse_config(base)
    assert config.data.train is not None and config.data.train.format == "kafka"
    for overrides, words in (
        ({"data.train.message_format": "xml"}, ["data.train.kafka.message_format", "'tsv'"]),
        ({"data.train.topics": []}, ["data.train.kafka.topics"]),
        ({"data.train.paths": ["a.tsv"]}, ["data.train.kafka.paths", "xtra"]),
        ({"data.train.columns": ["a"], "data.train.message_format": "json"}, ["data.train.kafka", "json"]),
        ({"data.train.format": "avro"}, ["data.train", "avro", "kafka", "criteo_tsv"]),
        ({"training.epochs": 2}, ["training.epochs", "kafka"]),
    ):
        with pytest.raises(ConfigError) as caught:
            parse_config(base, overrides=overrides)
        for word in words:
            assert word in str(caught.value), (overrides, str(caught.value))
