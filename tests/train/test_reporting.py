"""TensorBoard summaries: the writer writes scalars into RUN_DIR/tensorboard that TensorBoard reads
back, and creating it imports neither torch nor TensorBoard's S3 layer (boto3), which a later
`import boto3` still finds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def test_the_writer_starts_without_boto3_and_leaves_it_importable(tmp_path: Path) -> None:
    pytest.importorskip("boto3")
    code = (
        "import sys; from pathlib import Path; from psrec.train.reporting import summary_writer, write_scalars; "
        f"writer = summary_writer(Path({str(tmp_path)!r})); "
        "assert 'boto3' not in sys.modules, 'creating the writer imported boto3'; "
        "write_scalars(writer, 'train', {'loss': 0.5, 'auc': 0.75, 'step': 1, 'note': 'x'}, 1); "
        "write_scalars(writer, 'train', {'loss': 0.25, 'auc': float('nan')}, 7); writer.close(); "
        "assert 'torch' not in sys.modules, 'the writer imported torch'; "
        "import boto3; assert boto3.__name__ == 'boto3'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["train/auc", "train/loss"]
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 0.5), (7, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("train/auc")] == [(1, 0.75)]
