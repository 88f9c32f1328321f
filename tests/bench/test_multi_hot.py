"""`psrec bench --multi-hot`: the bag features' data, and every system training on the same bags.

Run: `python -m pytest tests/bench/test_multi_hot.py -q` (about a minute; no timing asserts).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from psrec.bench import cli as commands
from psrec.bench.harness import run_bench
from psrec.bench.psrec_systems import PsrecLayout, PsrecOptions, bench_config
from psrec.bench.torch_systems import torchrec_unavailable
from psrec.bench.workload import Workload, bench_schema, load_batches, parse_multi_hot, prepare_sources
from psrec.cli import build_parser, main
from psrec.config import parse_config


def tiny_multi_hot(cache: Path, *, pooling: int = 5, lengths: str = "variable") -> Workload:
    return Workload(
        dim=16,
        batch_size=128,
        train_rows=512,
        validation_rows=256,
        cardinality_scale=0.001,
        warmup_steps=1,
        steps=2,
        threads=1,
        cache_dir=str(cache),
        multi_hot_features=2,
        pooling_factor=pooling,
        bag_lengths=lengths,
    )


def test_parse_multi_hot_and_its_errors() -> None:
    assert parse_multi_hot("8:50") == (8, 50, "fixed")
    assert parse_multi_hot("3:10:variable") == (3, 10, "variable")
    for bad in ("8", "8:x", "0:10", "8:0", "8:10:sometimes", "1:2:fixed:4"):
        with pytest.raises(ValueError, match="--multi-hot"):
            parse_multi_hot(bad)
    with pytest.raises(SystemExit):  # argparse's error, naming the option
        main(["bench", "--multi-hot", "8:x"])


def test_sparse_lr_reaches_every_systems_tables(capsys: pytest.CaptureFixture[str]) -> None:
    parse = build_parser().parse_args
    assert commands.workload_from_args(parse(["bench", "--multi-hot", "8:50"])).sparse_lr == 0.05
    workload = commands.workload_from_args(parse(["bench", "--multi-hot", "8:50", "--sparse-lr", "0.005"]))
    assert workload.sparse_lr == 0.005 and workload.multi_hot_features == 8
    config = bench_config(workload, "run", PsrecLayout(), sources={"train": {}, "validation": {}})
    assert config["embedding"]["default"]["optimizer"] == {"name": "rowwise_adagrad", "lr": 0.005}
    for bad in ("0", "-1", "fast"):
        with pytest.raises(SystemExit):
            parse(["bench", "--sparse-lr", bad])
        assert f"expected a number > 0, got {bad!r}" in capsys.readouterr().err


@pytest.mark.parametrize("lengths", ["fixed", "variable"])
def test_bags_have_the_lengths_asked_for_and_every_system_reads_them(tmp_path: Path, lengths: str) -> None:
    workload = tiny_multi_hot(tmp_path / "cache", pooling=6, lengths=lengths)
    sources = prepare_sources(workload)
    table = pq.read_table(sorted(Path(sources["train"]["paths"][0]).parent.glob("*.parquet")))
    for name in ("M1", "M2"):
        bags = table.column(name).to_pylist()
        counts = np.array([len(bag) for bag in bags])
        if lengths == "fixed":
            assert (counts == 6).all()
        else:
            assert counts.min() == 0 and counts.max() == 12 and abs(counts.mean() - 6) < 0.6
        assert max(max(bag) for bag in bags if bag) < workload.multi_hot_cardinality()
    # a noisy label is in the bags: odd ids are more frequent in positive rows, not all of them
    labels = table.column("label").to_numpy()
    odd = np.array([np.mean(np.array(bag) % 2) if bag else np.nan for bag in table.column("M1").to_pylist()])
    assert 0.08 < np.nanmean(odd[labels == 1]) - np.nanmean(odd[labels == 0]) < 0.25
    # the batches the PyTorch, TorchRec and TensorFlow systems train on hold exactly these bags
    batches = load_batches(sources["train"], workload, batch_size=128, max_batches=2)
    assert len(batches[0].ids) == 28
    first = table.slice(0, 256)
    for f, name in ((26, "M1"), (27, "M2")):
        bags = first.column(name).to_pylist()
        ids = np.concatenate([batch.ids[f].numpy() for batch in batches])
        np.testing.assert_array_equal(ids, np.concatenate([np.array(bag, np.int64) for bag in bags]))
        got = np.concatenate([batch.lengths[f].numpy() for batch in batches])
        np.testing.assert_array_equal(got, [len(bag) for bag in bags])
    # and psrec reads the same files with the same schema
    config = parse_config(
        bench_config(workload, str(tmp_path / "run"), PsrecLayout(), sources=sources), source="<test>"
    )
    assert config.feature_schema() == bench_schema(workload)
    assert config.data.train is not None and config.data.train.paths == sources["train"]["paths"]
    with pytest.raises(ValueError, match="Criteo-shaped workload only"):
        bench_config(workload, "run", PsrecLayout(), PsrecOptions(prepared=True), sources=sources)


def test_every_system_trains_on_bags(tmp_path: Path) -> None:
    workload = tiny_multi_hot(tmp_path / "cache")
    systems = ["pytorch", "pytorch-bf16", "torchrec", "torchrec-bf16", "psrec", "psrec-bf16", "ceiling"]
    report = run_bench(workload, systems, rounds=1, isolate=False)
    rows = {row["system"]: row for row in report["rows"]}
    for name, row in rows.items():
        if name.startswith("torchrec") and torchrec_unavailable() is not None:
            assert row["status"].startswith("skipped")
            continue
        assert row["status"] == "ok", (name, row["status"])
        assert row["samples_per_second"] > 0 and math.isfinite(row["samples_per_second"])
        if name != "ceiling":
            assert 0.0 <= row["auc"] <= 1.0
    assert "2 multi-hot x 5 (variable)" in commands.format_table(report)


def test_psrec_on_ray_trains_on_bags(tmp_path: Path, ray_cluster: None) -> None:
    report = run_bench(tiny_multi_hot(tmp_path / "cache"), ["psrec-ray"], rounds=1, isolate=False)
    (row,) = report["rows"]
    assert row["status"] == "ok" and row["samples_per_second"] > 0 and 0.0 <= row["auc"] <= 1.0
