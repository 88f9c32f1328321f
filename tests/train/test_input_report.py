"""Bad input reaches the run's summary: a truncated file is a named failed unit with its bytes lost,
apart from skipped rows, and the rows before the cut are trained on."""

from __future__ import annotations

import zlib
from pathlib import Path

from psrec.config import parse_config
from psrec.data.synth import criteo_schema, write_synthetic_criteo
from psrec.train.loop import train


def test_a_truncated_gzip_file_is_a_failed_unit_in_the_summary(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_synthetic_criteo(data, rows=4000, files=2, seed=3, format="tsv.gz", cardinality_scale=0.001)
    files = sorted(data.glob("*.tsv.gz"))
    cut = files[1].read_bytes()
    files[1].write_bytes(cut[: len(cut) // 2])  # cut mid-stream
    config = parse_config(
        {
            "run_dir": str(tmp_path / "run"),
            "data": {
                "schema": criteo_schema().model_dump(),
                "train": {"format": "criteo_tsv", "paths": [str(data / "*.tsv.gz")], "on_error": "skip"},
            },
            "model": {"name": "lr"},
            "embedding": {"default": {"dim": 1, "optimizer": {"name": "sgd", "lr": 0.1}}},
            "training": {"batch_size": 500, "log_every_steps": 2},
            "ps": {"runtime": "local", "num_shards": 1, "num_buckets": 8},
        }
    )
    summary = train(config)
    report = summary["input"]
    assert report["units_failed"] == 1 and report["bytes_lost"] == 0  # nothing stored after the cut
    (failed,) = report["failed_units"]
    assert failed["file"] == str(files[1]) and "cut short" in failed["reason"]
    # the whole first file, and every complete line of the second before the cut (oracle: zlib)
    complete_lines = zlib.decompressobj(wbits=31).decompress(files[1].read_bytes()).count(b"\n")
    assert 0 < complete_lines < 2000
    assert summary["rows_consumed"] == 2000 + complete_lines and summary["rows_skipped"] == 1
