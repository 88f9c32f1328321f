"""Continuous training (`training.mode: continuous`) from a Kafka topic, against the real test broker.

Oracles: the same rows in a TSV file trained by the file reader (one trainer, one partition, sync,
full batches: the same batches in the same order, so the same model bit for bit), and the Kafka
offsets themselves (every message trained exactly once: rows consumed == distinct rows == messages).
Runs are stopped as a user stops them: `stop` (what SIGTERM sets), SIGKILL of the `psrec train`
process, the stream going quiet (`stop_after_idle_s`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from psrec.checkpoint import list_checkpoints
from psrec.config import ConfigError, parse_config
from psrec.data.synth import criteo_schema
from psrec.train.loop import train as train_run
from psrec.train.runtime import LocalRuntime
from tests.conftest import small_run_config
from tests.train.test_kafka_training import (
    ROWS,
    _stream,
    assert_same_model,
    broker,  # noqa: F401 - fixture
    criteo_lines,  # noqa: F401 - fixture
)
from tests.train.test_local_resume import FinishedRun

CONTINUOUS = {
    "training.mode": "continuous",
    "training.stream.wait_seconds": 0.3,
    "training.stream.batch_timeout_s": None,  # full batches: the file oracle's batches
    "training.stream.stop_after_idle_s": 2.0,
    "checkpoint.full_every": 2,
}
DEADLINE_S = 120.0


def _run(
    train: dict[str, Any],
    validation: dict[str, Any],
    run_dir: Path,
    *,
    stop: Any = None,
    progress: Any = None,
    **settings: Any,
) -> FinishedRun:
    sources = {"train": train, "validation": validation}
    config = small_run_config(sources, run_dir, **(CONTINUOUS | settings))
    runtime = LocalRuntime(config, base_dir=".", data_sources=sources)
    try:
        summary = train_run(config, runtime=runtime, stop=stop, progress=progress)
        return FinishedRun(summary, runtime.dense_states()[0], runtime.table_rows())
    finally:
        runtime.shutdown()


@pytest.fixture(scope="module")
def file_run(
    criteo_lines: list[str],  # noqa: F811
    synthetic_sources: dict[str, Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> FinishedRun:
    """The oracle: the stream's rows as one TSV file, trained in epochs mode."""
    directory = tmp_path_factory.mktemp("continuous_oracle")
    path = directory / "rows.tsv"
    path.write_text("".join(f"{line}\n" for line in criteo_lines))
    sources = {
        "train": {"format": "criteo_tsv", "paths": [str(path)]},
        "validation": synthetic_sources["validation"],
    }
    config = small_run_config(sources, directory / "run", **{"checkpoint.full_every": 2})
    runtime = LocalRuntime(config, base_dir=".", data_sources=sources)
    try:
        summary = train_run(config, runtime=runtime)
        return FinishedRun(summary, runtime.dense_states()[0], runtime.table_rows())
    finally:
        runtime.shutdown()


def test_a_continuous_run_trains_the_model_its_rows_in_a_file_train(
    broker: Any,  # noqa: F811
    criteo_lines: list[str],  # noqa: F811
    synthetic_sources: dict[str, Any],
    file_run: FinishedRun,
    tmp_path: Path,
) -> None:
    train = _stream(broker, [line.encode() for line in criteo_lines])
    run = _run(train, synthetic_sources["validation"], tmp_path)
    summary = run.summary
    assert summary["mode"] == "continuous"
    assert summary["rows_consumed"] == summary["rows_consumed_unique"] == ROWS
    assert summary["stream"]["events_behind"] == 0
    (position,) = summary["stream"]["positions"]
    assert position["offsets"] == {train["topics"][0]: {"0": ROWS}}
    assert 0.5 < summary["stream"]["progressive_auc"] < 1
    assert list_checkpoints(tmp_path)[-1].step == summary["steps"]
    assert_same_model(run, file_run)


def test_a_live_stream_is_trained_once_with_checkpoints_by_time_until_stopped(
    broker: Any,  # noqa: F811
    criteo_lines: list[str],  # noqa: F811
    synthetic_sources: dict[str, Any],
    tmp_path: Path,
) -> None:
    """Messages produced while the run trains, in bursts with pauses: short batches after
    batch_timeout_s, checkpoints every second, lag reported; `stop` ends it with a checkpoint."""
    train = _stream(broker, [])
    topic = train["topics"][0]
    messages = [line.encode() for line in criteo_lines[:1500]]

    def produce() -> None:
        for start in range(0, len(messages), 300):
            broker.produce(topic, [(0, m) for m in messages[start : start + 300]])
            time.sleep(0.7)

    stop = threading.Event()
    points: list[dict[str, Any]] = []

    def watch(report: dict[str, Any]) -> None:
        points.append(report)
        if report["samples"] >= len(messages) and report["events_behind"] == 0:
            stop.set()

    producer = threading.Thread(target=produce)
    producer.start()
    timer = threading.Timer(DEADLINE_S, stop.set)  # bounded: the assertions below then fail
    timer.start()
    try:
        run = _run(
            train,
            synthetic_sources["validation"],
            tmp_path,
            stop=stop,
            progress=watch,
            **{
                "training.stream.batch_timeout_s": 0.2,
                "training.stream.stop_after_idle_s": None,
                "checkpoint.every_seconds": 1.0,
            },
        )
    finally:
        timer.cancel()
        producer.join()
    summary = run.summary
    assert summary["rows_consumed"] == summary["rows_consumed_unique"] == len(messages)
    assert summary["stream"]["positions"][0]["offsets"] == {topic: {"0": len(messages)}}
    assert summary["stream"]["events_behind"] == 0
    assert all(p["samples"] <= len(messages) for p in points)
    assert summary["steps"] > len(messages) // 256 + 1  # short batches: the stream paused between bursts
    by_time = [c for c in summary["checkpoints"] if c["step"] > 0]
    assert len(by_time) >= 2, summary["checkpoints"]
    assert list_checkpoints(tmp_path)[-1].step == summary["steps"]  # the stop's checkpoint
    newest = summary["stream"]["newest_event_ms"]
    assert abs(newest / 1000 - time.time()) < DEADLINE_S  # broker timestamps: the produce time


def _cli_config(train: dict[str, Any], validation: dict[str, Any], run_dir: Path) -> Path:
    config = small_run_config({"train": train, "validation": validation}, run_dir, **CONTINUOUS)
    data = config.model_dump(mode="json", by_alias=True)
    path = run_dir.parent / "stream.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _psrec(*args: str) -> list[str]:
    return [sys.executable, "-m", "psrec.cli", *args]


def test_a_killed_continuous_run_started_again_trains_every_event_once(
    broker: Any,  # noqa: F811
    criteo_lines: list[str],  # noqa: F811
    synthetic_sources: dict[str, Any],
    file_run: FinishedRun,
    tmp_path: Path,
) -> None:
    """SIGKILL of `psrec train` mid-stream, then the same command again: it resumes from the last
    checkpoint's Kafka position and ends with the model of the undisturbed run (the file oracle)."""
    train = _stream(broker, [line.encode() for line in criteo_lines], poll_timeout_s=0.1)
    run_dir = tmp_path / "run"
    config = _cli_config(train, synthetic_sources["validation"], run_dir)
    command = _psrec(
        "train",
        str(config),
        "--no-progress",
        "--set",
        "checkpoint.every_steps=2",
        "--set",
        "training.log_every_steps=1",
        "--set",
        "training.stream.stop_after_idle_s=30",
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            steps = [ref.step for ref in list_checkpoints(run_dir)] if run_dir.is_dir() else []
            if steps and max(steps) >= 4:
                break
            assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.wait(timeout=30)
    killed_at = max(ref.step for ref in list_checkpoints(run_dir))
    assert 4 <= killed_at < -(-ROWS // 256)
    assert not (run_dir / "summary.json").exists()

    command[-1] = "training.stream.stop_after_idle_s=2"  # the same run, ending once the stream is read
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=DEADLINE_S)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"]["step"] == killed_at
    assert summary["rows_consumed"] == summary["rows_consumed_unique"] == ROWS
    for metric in ("auc", "logloss"):
        assert summary["validation"][metric] == file_run.summary["validation"][metric], metric


@pytest.mark.ray
@pytest.mark.parametrize("victim", ["trainer", "shard"])
def test_a_killed_trainer_or_shard_mid_stream_loses_no_event_and_repeats_none(
    ray_cluster: None,
    broker: Any,  # noqa: F811
    criteo_lines: list[str],  # noqa: F811
    synthetic_sources: dict[str, Any],
    file_run: FinishedRun,
    tmp_path: Path,
    victim: str,
) -> None:
    """SIGKILL of the Ray trainer (the job rolls back to its last checkpoint and re-reads the stream
    from the checkpoint's offsets) or of a shard (rebuilt alone from its checkpoint and log): the
    run ends with the undisturbed model, every message trained once."""
    import ray

    from psrec.train.runtime import RayRuntime

    train = _stream(broker, [line.encode() for line in criteo_lines])
    sources = {"train": train, "validation": synthetic_sources["validation"]}
    settings = CONTINUOUS | {
        "ps.runtime": "ray",
        "checkpoint.every_steps": 2,
        "training.log_every_steps": 1,
    }
    config = small_run_config(sources, tmp_path, **settings)
    runtime = RayRuntime(config, base_dir=".", data_sources=sources)
    killed: list[int] = []

    def kill_once(report: dict[str, Any]) -> None:
        if report["step"] >= 5 and not killed:  # after the step-4 checkpoint, before step 6's
            actor = runtime.trainers[0] if victim == "trainer" else runtime.shards[1]
            pid = ray.get(actor.pid.remote())
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    try:
        summary = train_run(config, runtime=runtime, progress=kill_once)
        run = FinishedRun(summary, runtime.dense_states()[0], runtime.table_rows())
    finally:
        runtime.shutdown()
    assert killed, "the victim was never killed"
    if victim == "trainer":
        assert [r["restored_step"] for r in summary["recoveries"]] == [4]
    else:
        assert len(summary["failovers"]) == 1 and not summary["recoveries"]
    assert summary["rows_consumed"] == summary["rows_consumed_unique"] == ROWS
    assert summary["stream"]["positions"][0]["offsets"] == {train["topics"][0]: {"0": ROWS}}
    assert_same_model(run, file_run)


def test_sigterm_ends_a_continuous_run_with_a_checkpoint_and_its_summary(
    broker: Any,  # noqa: F811
    synthetic_sources: dict[str, Any],
    criteo_lines: list[str],  # noqa: F811
    tmp_path: Path,
) -> None:
    train = _stream(broker, [line.encode() for line in criteo_lines[:600]])
    run_dir = tmp_path / "run"
    config = _cli_config(train, synthetic_sources["validation"], run_dir)
    command = _psrec(
        "train",
        str(config),
        "--no-progress",
        "--set",
        "training.stream.stop_after_idle_s=null",
        "--set",
        "training.stream.batch_timeout_s=0.2",  # the last 88 rows train as a short batch
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + DEADLINE_S
        assert process.stdout is not None
        for line in process.stdout:  # progress lines: wait until the 600 rows are trained
            if "samples 600 " in line or time.monotonic() > deadline:
                break
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0, stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rows_consumed"] == 600
    assert list_checkpoints(run_dir)[-1].step == summary["steps"] == 3
    assert summary["stream"]["events_behind"] == 0


def test_continuous_mode_is_validated_naming_the_field(tmp_path: Path) -> None:
    base = {
        "run_dir": str(tmp_path),
        "data": {
            "schema": criteo_schema().model_dump(),
            "train": {"format": "kafka", "bootstrap_servers": "127.0.0.1:9092", "topics": ["clicks"]},
        },
        "model": {"name": "dlrm", "bottom_hidden_sizes": [16], "top_hidden_sizes": [16, 8]},
        "embedding": {"default": {"dim": 4}},
        "training": {"mode": "continuous"},
    }
    assert parse_config(base).training.mode == "continuous"
    for overrides, words in (
        ({"data.train": {"format": "parquet", "paths": ["a.parquet"]}}, ["continuous", "kafka", "parquet"]),
        ({"training.early_stopping": {"metric": "auc"}}, ["training.early_stopping", "continuous"]),
        ({"ps.strategy": "collective", "ps.runtime": "ray"}, ["continuous", "collective"]),
        ({"training.stream.wait_seconds": 0}, ["training.stream.wait_seconds"]),
        ({"training.mode": "forever"}, ["training.mode", "continuous"]),
    ):
        with pytest.raises(ConfigError) as caught:
            parse_config(base, overrides=overrides)
        for word in words:
            assert word in str(caught.value), (overrides, str(caught.value))


@pytest.mark.ray
def test_a_stream_run_of_two_trainers_resumes_with_one_and_trains_every_event_once(
    ray_cluster: None,
    broker: Any,  # noqa: F811
    criteo_lines: list[str],  # noqa: F811
    synthetic_sources: dict[str, Any],
    tmp_path: Path,
) -> None:
    """Two trainers read one partition each; stopped at a checkpoint, the run resumes with one
    trainer, which reads both partitions from the offsets the two had reached."""
    from psrec.train.runtime import RayRuntime

    topic = f"two-{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, partitions=2)
    broker.produce(topic, [(index % 2, line.encode()) for index, line in enumerate(criteo_lines)])
    train = {
        "format": "kafka",
        "bootstrap_servers": broker.bootstrap_servers,
        "topics": [topic],
        "message_format": "tsv",
        "client": {"fetch.wait.max.ms": 20},
        "poll_timeout_s": 0.1,
    }
    sources = {"train": train, "validation": synthetic_sources["validation"]}
    two = small_run_config(
        sources,
        tmp_path,
        **(CONTINUOUS | {"ps.runtime": "ray", "ps.num_trainers": 2, "training.max_steps": 3}),
    )
    runtime = RayRuntime(two, base_dir=".", data_sources=sources)
    try:
        first = train_run(two, runtime=runtime)
    finally:
        runtime.shutdown()
    assert first["steps"] == 3
    # each trainer stood in its own partition, after the rows it trained (a trainer whose stream was
    # slower to start ran empty steps meanwhile: its share may be smaller)
    (zero,), (one,) = [position["offsets"][topic].items() for position in first["stream"]["positions"]]
    assert zero[0] == "0" and one[0] == "1"
    assert zero[1] + one[1] == first["rows_consumed"] == first["rows_consumed_unique"] >= 3 * 256
    (tmp_path / "summary.json").unlink()

    resumed = _run(train, synthetic_sources["validation"], tmp_path)  # one in-process trainer
    summary = resumed.summary
    assert summary["resumed_from"]["step"] == 3
    assert summary["rows_consumed"] == summary["rows_consumed_unique"] == ROWS
    (position,) = summary["stream"]["positions"]
    assert position["offsets"] == {topic: {"0": ROWS // 2, "1": ROWS // 2}}


def test_tables_of_a_drifting_stream_stay_bounded_in_training_and_in_serving(
    broker: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Items live 20 s of event time over 240 s of stream: with a time-to-live the trainer's item
    table holds only the items of the last steps, and each delta's tombstones take the evicted ones
    out of a following serving replica: both stay within the oracle's bound (the distinct items of the
    events of the last ttl + every steps, counted in NumPy), far below the items the stream had, and
    the replica ends with exactly the trainer's ids."""
    from psrec.data.stream_synth import DriftingCtrStream, drifting_ctr_schema, encode_messages
    from psrec.serve.export import export_run
    from psrec.serve.follow import DeltaFollower
    from psrec.serve.scoring import ServingModel

    batch, ttl, every, events = 256, 6, 3, 12_288
    stream = DriftingCtrStream(3, events_per_second=50, items_per_second=2.0, item_lifetime_s=20.0)
    rows = stream.table(0, events)
    topic = f"drift-{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, partitions=1)
    broker.produce(topic, [(0, message) for message in encode_messages(rows, "tsv")])
    config = parse_config(
        {
            "run_dir": str(tmp_path / "run"),
            "data": {
                "schema": drifting_ctr_schema().model_dump(),
                "train": {
                    "format": "kafka",
                    "bootstrap_servers": broker.bootstrap_servers,
                    "topics": [topic],
                    "message_format": "tsv",
                    "client": {"fetch.wait.max.ms": 20},
                    "poll_timeout_s": 0.1,
                },
            },
            "model": {"name": "dlrm", "bottom_hidden_sizes": [8], "top_hidden_sizes": [8]},
            "embedding": {"default": {"dim": 4, "eviction": {"ttl_steps": ttl, "every_steps": every}}},
            "training": {"batch_size": batch, "log_every_steps": every} | _nested(CONTINUOUS, "training."),
            "checkpoint": {"every_steps": every, "full_every": 1000, "keep_last": 2},
            "ps": {"runtime": "local", "num_shards": 2},
        }
    )
    runtime = LocalRuntime(config, base_dir=".", data_sources={"train": config.data.train.model_dump()})
    served: list[int] = []
    trained: list[int] = []
    follower: list[DeltaFollower] = []

    def follow(report: dict[str, Any]) -> None:
        if not follower:
            export_run(
                config.run_dir, tmp_path / "model", checkpoint=list_checkpoints(config.run_dir)[0].name
            )
            follower.append(DeltaFollower(ServingModel.load(tmp_path / "model"), config.run_dir))
        while follower[0].poll() is not None:
            pass
        served.append(follower[0].model.version.tables["item"].num_rows)
        trained.append(int(runtime.table_stats()["item"]["rows"]))

    try:
        summary = train_run(config, runtime=runtime, progress=follow)
        while follower[0].poll() is not None:  # the last checkpoint
            pass
        final_ids = runtime.table_rows()["item"][0]
    finally:
        runtime.shutdown()
    items = rows.column("item").to_numpy()
    window = (ttl + 2 * every) * batch  # a row stays at most ttl steps unused, plus one eviction period
    bound = max(np.unique(items[start : start + window]).size for start in range(0, events, batch))
    everything = np.unique(items).size
    assert summary["rows_consumed"] == events
    steps = [c["step"] for c in summary["checkpoints"]]
    assert len(steps) == len(set(steps)), steps  # quiet chunks at the end wrote nothing again
    assert summary["rows_evicted"]["item"] > 0
    assert bound < everything / 3, (bound, everything)  # the ids moved on: a bound is a real claim
    assert 0 < max(trained) <= bound and 0 < max(served) <= bound, (max(trained), max(served), bound)
    serving_ids = follower[0].model.version.tables["item"].ids
    np.testing.assert_array_equal(np.sort(serving_ids), np.sort(final_ids))


def _nested(settings: dict[str, Any], prefix: str) -> dict[str, Any]:
    """{"training.stream.x": v} -> {"stream": {"x": v}} for the keys under `prefix`."""
    nested: dict[str, Any] = {}
    for key, value in settings.items():
        if key.startswith(prefix):
            parts = key[len(prefix) :].split(".")
            into = nested
            for part in parts[:-1]:
                into = into.setdefault(part, {})
            into[parts[-1]] = value
    return nested


def test_files_landing_in_a_directory_train_as_the_same_files_finished_would(
    criteo_lines: list[str],  # noqa: F811
    synthetic_sources: dict[str, Any],
    tmp_path: Path,
) -> None:
    """`data.train.growing`: files written while a continuous run trains are each read once, in name
    order; the model equals an epochs run over the finished files (full batches, one trainer)."""
    landing = tmp_path / "landing"
    landing.mkdir()
    parts = [criteo_lines[start : start + 700] for start in range(0, len(criteo_lines), 700)]

    def land() -> None:
        for index, part in enumerate(parts):
            staged = tmp_path / f"part-{index:03d}.tsv"
            staged.write_text("".join(f"{line}\n" for line in part))
            staged.rename(landing / staged.name)  # whole files appear (write, then rename)
            time.sleep(0.4)

    growing = {
        "format": "criteo_tsv",
        "paths": [str(landing)],
        "growing": {"poll_seconds": 0.1},
    }
    writer = threading.Thread(target=land)
    writer.start()
    try:
        streamed = _run(growing, synthetic_sources["validation"], tmp_path / "stream")
    finally:
        writer.join()
    finished = {"format": "criteo_tsv", "paths": [str(landing / "*.tsv")]}
    sources = {"train": finished, "validation": synthetic_sources["validation"]}
    config = small_run_config(sources, tmp_path / "files", **{"checkpoint.full_every": 2})
    runtime = LocalRuntime(config, base_dir=".", data_sources=sources)
    try:
        summary = train_run(config, runtime=runtime)
        from_files = FinishedRun(summary, runtime.dense_states()[0], runtime.table_rows())
    finally:
        runtime.shutdown()
    assert streamed.summary["rows_consumed"] == streamed.summary["rows_consumed_unique"] == ROWS
    assert streamed.summary["stream"]["files_behind"] == 0
    assert_same_model(streamed, from_files)
